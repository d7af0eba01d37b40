"""Expert parallel (ep = 2, gloo) through the CUDA-graph runners on emulated graphs (spawned ranks); ZeRO-1 too."""

from __future__ import annotations

import torch

from _ep_scenario import EXPERTS, GLOBAL_BATCH, STATIC, data, make_step

STEPS = 5


def _losses(plan: dict, runner: str | None, rank: int, world_size: int) -> list[float]:
    import moecompile.cuda_graphs as cg

    torch.manual_seed(0)
    _, _, step = make_step({**plan, "cuda_graph": {"warmup_steps": 2}}, GLOBAL_BATCH // world_size, capturable=True)
    if runner is not None:
        step.runner = {"full": cg.FullGraphRunner, "partial": cg.PartialGraphRunner}[runner](step)
    stream = data()
    return [step(stream.shard(i, rank, world_size)).loss for i in range(STEPS)]


def ep2_graphs_worker(rank: int, world_size: int) -> dict:
    from _graph_emulator import emulated_cuda_graphs

    static = {"experts": {**STATIC, "aux_loss": "global_aux"}, "parallel": {"ep": 2, "dispatch_mode": "static"}}
    dropless = {"experts": EXPERTS, "parallel": {"ep": 2}}
    out = {}
    with emulated_cuda_graphs() as graphs:
        out["static_eager"], out["full"] = _losses(static, None, rank, world_size), _losses(static, "full", rank, world_size)
        out["full_replays"] = [g.replays for g in graphs]
        graphs.clear()
        out["dropless_eager"] = _losses(dropless, None, rank, world_size)
        out["partial"] = _losses(dropless, "partial", rank, world_size)
        out["partial_replays"] = [g.replays for g in graphs]
        # ZeRO-1: the optimizer steps this rank's range, then the ranges are all-gathered (gloo: broadcast), all
        # inside the capture; the capture must leave every rank's parameters as they were
        zero1 = {**static, "parallel": {**static["parallel"], "shard_optimizer": True}}
        out["zero1_eager"], out["zero1_full"] = _losses(zero1, None, rank, world_size), _losses(zero1, "full", rank,
                                                                                                 world_size)
    return out
