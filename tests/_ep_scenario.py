"""One expert-parallel run shared by the test files (spawned once per session, cached).

ep = 2 on 2 gloo ranks: train STEPS steps on each rank's shard of the global batch, save a
checkpoint, take one more step, export to Hugging Face (experts gathered), scan capture
safety of the dropless graph, then a static-capacity run with the expert bias on; the aux-loss runs
are repeated at ep = 1 on the same 2 ranks (pure data parallelism).
``four_ranks_from_checkpoint`` loads that checkpoint on 4 ranks at ep = 4 or at ep = 2 (edp = 2).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from _dist import spawn

GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3
EXPERTS = {"num_experts": 4, "top_k": 2, "z_loss_coeff": 1e-3, "router_noise": 0.02}
STATIC = {**EXPERTS, "expert_bias": True, "expert_bias_rate": 0.01, "capacity_factor": 1.0}


def data():
    from moecompile.data import ByteBatches, stdlib_bytes

    return ByteBatches(stdlib_bytes(300_000), GLOBAL_BATCH, SEQ, seed=0)


def make_step(plan: dict, batch: int, capturable: bool = False, **options: Any) -> tuple[Any, Any, Any]:
    import moecompile as mc
    from moecompile.models import build_model

    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=batch, seq_len=SEQ)
    result = mc.convert(dense, plan, (ids,))
    step = mc.build_train_step(result, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3, capturable=capturable),
                               clip_grad_norm=1.0, **options)
    return dense, result, step


def _metrics(m: Any) -> dict:
    return {"loss": m.loss, "load": m.expert_load, "grad_norm": m.grad_norm, "tokens": m.tokens,
            "router_losses": m.router_losses}


AUX_STEPS = 2


def aux_runs(rank: int = 0, world_size: int = 1, ep: int = 1) -> dict[str, list[dict]]:
    """AUX_STEPS steps with each Switch-style aux loss; ep = 1 is the one-process reference."""
    stream, out = data(), {}
    for kind in ("aux", "global_aux"):
        plan = {"experts": {**EXPERTS, "aux_loss": kind}, "parallel": {"ep": ep}}
        _, _, step = make_step(plan, GLOBAL_BATCH // world_size)
        out[kind] = [_metrics(step(stream.shard(i, rank, world_size))) for i in range(AUX_STEPS)]
    return out


def ep2_worker(rank: int, world_size: int, out: str) -> dict:
    from moecompile.cuda_graphs import check_capture_safety
    from moecompile.export_hf import export_hf

    stream = data()
    dense, result, step = make_step({"experts": EXPERTS, "parallel": {"ep": 2}}, GLOBAL_BATCH // world_size)
    metrics = [_metrics(step(stream.shard(i, rank, world_size))) for i in range(STEPS)]
    step.save(Path(out) / "ckpt")
    after = _metrics(step(stream.shard(STEPS, rank, world_size)))
    export_hf(result, Path(out) / "hf", arch="mixtral", config=dense.config)
    full, static_region = check_capture_safety(result), check_capture_safety(result, region="static")
    _, static_result, static_step = make_step(
        {"experts": STATIC, "parallel": {"ep": 2, "dispatch_mode": "static"}}, GLOBAL_BATCH // world_size)
    static_full = check_capture_safety(static_result)
    static_metrics = [_metrics(static_step(stream.shard(i, rank, world_size))) for i in range(2)]
    _, _, micro_step = make_step({"experts": EXPERTS, "parallel": {"ep": 2}}, 1)  # 1 sequence a forward
    micro_metrics = [_metrics(micro_step(stream.shard(i, rank, world_size))) for i in range(STEPS)]
    import torch._dynamo as dynamo

    dynamo.utils.counters.clear()
    _, _, compiled_step = make_step({"experts": EXPERTS, "parallel": {"ep": 2}}, GLOBAL_BATCH // world_size,
                                    compile=True)
    compiled_metrics = [_metrics(compiled_step(stream.shard(i, rank, world_size))) for i in range(STEPS)]
    compiled_breaks = sum(dynamo.utils.counters["graph_break"].values())
    return {
        "compiled_metrics": compiled_metrics, "compiled_breaks": compiled_breaks, "micro_metrics": micro_metrics,
        "micro_parts": len(micro_step.micro_batches(*stream.shard(0, rank, world_size))),
        "aux": aux_runs(rank, world_size, ep=2), "aux_dp": aux_runs(rank, world_size, ep=1),
        "metrics": metrics, "after": after, "collectives": step.buckets.collectives_per_step(),
        "expert_shapes": {n: tuple(p.shape) for n, p in result.module.named_parameters() if ".experts." in n},
        "dropless_full": (full.safe, str(full)), "dropless_static_region": (static_region.safe, str(static_region)),
        "static_full": (static_full.safe, str(static_full)),
        "static_metrics": static_metrics, "static_biases": {k: v.clone() for k, v in static_step.biases.items()},
    }


@functools.lru_cache(maxsize=None)
def ep2_results() -> tuple[Path, list[dict]]:
    out = Path(tempfile.mkdtemp(prefix="moecompile-ep2-"))
    atexit.register(shutil.rmtree, out, True)
    return out, spawn(ep2_worker, 2, (str(out),), timeout=300)


def ep4_worker(rank: int, world_size: int, ckpt: str, eps: tuple[int, ...]) -> dict:
    stream = data()
    out = {}
    for ep in eps:  # ep = 2 on 4 ranks: edp groups of 2 reduce the expert grads
        _, result, step = make_step({"experts": EXPERTS, "parallel": {"ep": ep}}, GLOBAL_BATCH // world_size)
        step.load(ckpt)
        out[ep] = {"step_count": step.step_count, **_metrics(step(stream.shard(STEPS, rank, world_size))),
                   "collectives": step.buckets.collectives_per_step()}
    return out


def four_ranks_from_checkpoint(ckpt: Path, eps: tuple[int, ...]) -> list[dict]:
    """Load ``ckpt`` on 4 ranks at each ep in ``eps`` and take one step."""
    return spawn(ep4_worker, 4, (str(ckpt), tuple(eps)), timeout=400)


@functools.lru_cache(maxsize=None)
def ep1_reference() -> tuple[Any, Any, list[dict]]:
    """The same run in one process on the whole global batch: (dense, result, metrics of STEPS + 1 steps)."""
    stream = data()
    dense, result, step = make_step({"experts": EXPERTS}, GLOBAL_BATCH)
    return dense, result, [_metrics(step(stream[i])) for i in range(STEPS + 1)]
