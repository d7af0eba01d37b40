"""estimate_memory's offload_optimizer figures under ZeRO sharding: exactly what build_train_step keeps on a rank.

Every rank of a fake world (4 ranks at ep=2: dense buckets split over 4, expert buckets over 2; 2 ranks under
ZeRO-3) builds the step in this one process (the fake group moves no data; the figures are real allocations):
rank r's estimate, made on rank r or named from rank 0, equals what rank r's runtime keeps on host and device.
"""

from __future__ import annotations

import pytest
import torch

import moecompile as mc
from moecompile.optimizer_offload import HostUpdate

from _dist import fake_rank
from conftest import tiny_hf

WORLD, BUCKET_MB = 4, 0.01
SETTINGS = {  # name: (ranks, model dtype, parallel section)
    "ep2_zero2_bf16": (4, torch.bfloat16, {"ep": 2, "shard_optimizer": True, "shard_gradients": True}),
    "dp2_zero3_fp32": (2, torch.float32, {"shard_optimizer": True, "shard_gradients": True, "shard_parameters": True}),
}


def convert(dtype: torch.dtype, parallel: dict, offload: float = 0.6) -> mc.ConversionResult:
    batch = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    plan = {"experts": {"num_experts": 4, "top_k": 2}, "parallel": {**parallel, "offload_optimizer": offload}}
    return mc.convert(tiny_hf("llama").to(dtype), plan, (batch,))


def runtime_figures(result: mc.ConversionResult) -> dict:
    """What the step keeps after its first step (the optimizer's state exists then)."""
    step = mc.build_train_step(result, keep_host_memory=False, bucket_mb=BUCKET_MB)
    batch = result.example_inputs[0]
    step(batch, batch)
    host = [u for u in step.updates if isinstance(u, HostUpdate)]
    return {"host": step.host_optimizer_bytes(), "device": step.optimizer_bytes(),
            "master_grads": sum(u.tensor.grad.numel() * 4 for u in step.updates if u.is_copy and u not in host),
            "share": sum(u.tensor.numel() for u in host) / sum(u.tensor.numel() for u in step.updates)}


def estimated(est: mc.MemoryEstimate) -> dict:
    return {"host": est.host_optimizer, "device": est.optimizer + est.masters, "master_grads": est.master_grads,
            "share": est.offload_optimizer}


@pytest.mark.parametrize("name", SETTINGS)
def test_each_ranks_estimate_is_what_its_runtime_keeps(name):
    world, dtype, parallel = SETTINGS[name]
    runtime, own, named = {}, {}, {}
    for rank in range(world):
        with fake_rank(rank, world, ep_step=parallel.get("ep", 1) > 1):
            result = convert(dtype, parallel)
            own[rank] = estimated(mc.estimate_memory(result, by_pass=False, bucket_mb=BUCKET_MB))  # its own rank
            if rank == 0:  # rank 0 names every rank
                named = {r: estimated(mc.estimate_memory(result, by_pass=False, bucket_mb=BUCKET_MB, rank=r))
                         for r in range(world)}
            runtime[rank] = runtime_figures(result)
    for rank in range(world):
        print(name, "rank", rank, "runtime", runtime[rank], "estimate", named[rank])
        assert runtime[rank]["host"] > 0 and runtime[rank]["device"] > 0
        assert own[rank] == named[rank] == runtime[rank], rank
    # the ranges are cut at aligned offsets: ranks keep different amounts, so the rank named matters
    assert len({(runtime[r]["host"], runtime[r]["device"]) for r in range(world)}) > 1


def test_a_rank_outside_the_world_estimated_is_refused():
    result = convert(torch.float32, {"shard_optimizer": True})
    est = mc.estimate_memory(result, by_pass=False, dp=4, rank=3, bucket_mb=BUCKET_MB)
    assert est.host_optimizer > 0 and est.dp == 4
    for bad in (4, -1, True, 1.0):
        with pytest.raises(mc.MoecompileError, match=r"rank=.* must be one of the run's data-parallel ranks, 0 to 3"):
            mc.estimate_memory(result, by_pass=False, dp=4, rank=bad)
    with pytest.raises(mc.MoecompileError, match="0 to 0"):
        mc.estimate_memory(result, by_pass=False, rank=1)  # a single process: dp = 1
    with fake_rank(3, WORLD):  # the result's own rank, outside a smaller run asked for
        result = convert(torch.float32, {"shard_optimizer": True})
        with pytest.raises(mc.MoecompileError, match="converted on rank 3, outside the dp=2 .*pass rank="):
            mc.estimate_memory(result, by_pass=False, dp=2)
        assert mc.estimate_memory(result, by_pass=False, dp=2, rank=1).dp == 2
