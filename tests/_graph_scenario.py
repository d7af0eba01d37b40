"""Expert parallel (ep = 2, gloo) through the CUDA-graph runners on emulated graphs (spawned ranks)."""

from __future__ import annotations

import torch

from _ep_scenario import EXPERTS, GLOBAL_BATCH, SEQ, STATIC, data

STEPS = 5


def _losses(plan: dict, runner: str | None, rank: int, world_size: int) -> list[float]:
    import moecompile as mc
    import moecompile.cuda_graphs as cg
    from moecompile.models import build_model

    torch.manual_seed(0)
    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=GLOBAL_BATCH // world_size, seq_len=SEQ)
    result = mc.convert(dense, {**plan, "cuda_graph": {"warmup_steps": 2}}, (ids,))
    step = mc.build_train_step(result, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3, capturable=True),
                               clip_grad_norm=1.0)
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
    return out
