"""parallel.overlap_grad_reduce runs for tests/test_grad_overlap.py (spawned once per session, cached).

On 2 gloo ranks each setting trains STEPS steps with every bucket summed after backward and with each
launched from backward as it completes, from the same init on the same batches: the same collectives on the
same buffers, so the oracle is bitwise equality.
"""

from __future__ import annotations

import functools

import torch

from _shard_scenario import STEPS, _on_two_ranks, _train, grouped_adamw, make_step, off_and_on

# name: (ep, sequences a forward, more parallel fields); "nccl_forms": NCCL's reduce_scatter (gloo: an exchange)
SETTINGS = {"dp2": (1, 2, {}), "ep2": (2, 2, {}), "dp2_micro": (1, 1, {}), "zero1": (1, 2, {"shard_optimizer": True}),
            "nccl_forms_zero1_micro": (1, 1, {"shard_optimizer": True}), "dp2_unused": (1, 2, {}),
            "zero2_micro": (1, 1, {"shard_optimizer": True, "shard_gradients": True})}


def grad_overlap_worker(rank: int, world_size: int, out: str) -> dict:
    res: dict = off_and_on(SETTINGS, lambda name, setting, on: _run(name, rank, world_size, *setting, on))
    _, step = make_step(world_size, 1, False)  # the plan's default (null) on gloo: summed after backward
    res["default_overlaps"] = step.buckets.overlapped is not None
    return res


def _run(name: str, rank: int, world_size: int, ep: int, batch: int, extra: dict, overlap: bool) -> dict:
    import moecompile as mc

    result, step = make_step(world_size, ep, False, None, batch, **extra, overlap_grad_reduce=overlap)  # explicit
    if name.endswith("unused"):  # a parameter the graph never reads: its bucket is complete only at sync
        result.module.register_parameter("unused", torch.nn.Parameter(torch.ones(5)))
        step = mc.build_train_step(result, optimizer=grouped_adamw, clip_grad_norm=1.0, bucket_mb=0.05)
    shards = step.buckets.grad_shards
    if overlap and shards is not None:  # ZeRO-2 mid-backward, as a step that raised there leaves it
        shards.sent = 1
        shards.received[id(shards.buckets[0])].add(0)
    elif overlap and name.endswith("micro"):  # as a step that raised in its last backward leaves it: the next
        step.buckets.overlapped.arm()          # step's first micro-batch must still not launch anything
    launched = []  # buckets launched by the end of each backward
    after_backward = step.buckets.after_backward

    def record() -> None:
        launched.append(step.buckets.overlapped.sent if step.buckets.overlapped else None)
        after_backward()

    step.buckets.after_backward = record
    metrics = _train(step, rank, world_size, 0, STEPS)
    return {"metrics": metrics, "launched": launched[:step.parts], "micro_batches": step.parts,
            "reduced": len(step.buckets.overlapped.buckets) if step.buckets.overlapped else None,
            "params": {n: p.detach().clone() for n, p in result.module.named_parameters()}}


@functools.lru_cache(maxsize=None)
def grad_overlap_two_ranks() -> list[dict]:
    return _on_two_ranks(grad_overlap_worker)[1]
