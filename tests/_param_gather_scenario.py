"""parallel.overlap_param_gather runs for tests/test_param_gathers.py (spawned once per session, cached).

On 2 gloo ranks each setting trains STEPS steps sharded without and with the overlap, from the same init on
the same batches (the oracle: the same collectives, only waited for later, so the same numbers bitwise).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from _ep_scenario import data
from _shard_scenario import (STEPS, ZERO2, _on_two_ranks, _train, _whole_params, grouped_adamw, make_step,
                             off_and_on)
from moecompile.bucket_layout import param_reads

OVERLAP = {"overlap_param_gather": True}
# name: (dtype, sequences a forward, parallel fields of both runs); "nccl_forms": NCCL's all_gather_single
SETTINGS = {"zero1": (None, 2, {}), "zero1_bf16": ("bfloat16", 2, {}), "zero2_micro": (None, 1, ZERO2),
            "nccl_forms_zero2": (None, 2, ZERO2)}


def _waits_before_reads(step: Any, module: Any) -> list[str]:
    """Parameters read by a node placed before their bucket's wait node (none may be)."""
    reads = param_reads(module)
    position = {n: i for i, n in enumerate(module.graph.nodes)}
    waits = {n.args[1]: position[n] for n in module.graph.nodes if getattr(n.target, "__name__", "") ==
             "wait_for_bucket"}
    gathers = step.buckets.param_gathers
    return [name for k, b in enumerate(gathers.buckets) for name in b.names
            if k not in waits or (name in reads and reads[name][0] < waits[k])]


def _run(rank: int, world_size: int, dtype: str | None, batch: int, extra: dict, overlap: bool) -> dict:
    result, step = make_step(world_size, 1, True, dtype, batch, **extra, **(OVERLAP if overlap else {}))
    metrics = _train(step, rank, world_size, 0, STEPS)
    gathers = step.buckets.param_gathers
    return {"metrics": metrics, "running": gathers.running if gathers else None,
            "buckets": [k for k, b in enumerate(step.buckets.buckets) if b.shards > 1],
            "params": _whole_params(step, result),  # step.gathered() waits for the gathers
            "running_after": gathers.running if gathers else None,
            "misplaced": _waits_before_reads(step, result.module) if gathers else None}


def overlap_worker(rank: int, world_size: int, out: str) -> dict:
    import moecompile as mc

    res: dict[Any, Any] = off_and_on(SETTINGS, lambda name, setting, on: _run(rank, world_size, *setting, on))
    x = data().shard(STEPS, rank, world_size)[0]
    for overlap in (False, True):  # a forward outside a step (evaluation), right after one
        result, step = make_step(world_size, 1, True, **ZERO2, **(OVERLAP if overlap else {}))
        _train(step, rank, world_size, 0, STEPS)
        with torch.no_grad():
            res["eval", overlap] = result.module(x).logits.clone()
    res["running_after_eval"] = step.buckets.param_gathers.running
    _train(step, rank, world_size, STEPS, 1)
    res["running_before_state_dict"] = step.buckets.param_gathers.running
    result.module.state_dict()
    res["running_after_state_dict"] = step.buckets.param_gathers.running
    step.save(Path(out) / "ckpt")
    res["continued"] = _train(step, rank, world_size, STEPS + 1, STEPS)
    _, again = make_step(world_size, 1, True, **ZERO2, **OVERLAP)
    _train(again, rank, world_size, 0, 1)  # its own gathers in flight when the checkpoint loads over them
    again.load(Path(out) / "ckpt")
    res["resumed"] = _train(again, rank, world_size, STEPS + 1, STEPS)
    later = mc.build_train_step(again.result, optimizer=grouped_adamw, clip_grad_norm=1.0, bucket_mb=0.05)
    code = again.result.module.code
    res["waits_after_takeover"] = code.count("wait_for_bucket(")
    res["new_key_waits"] = code.count(f"wait_for_bucket({later.buckets.param_gathers.key},")
    res["new_buckets"] = len(later.buckets.param_gathers.buckets)
    res["after_takeover"] = _train(later, rank, world_size, 2 * STEPS + 1, 1)
    from moecompile.export_hf import hf_state_dict

    gathers, module = later.buckets.param_gathers, again.result.module
    res["running_before_export"] = gathers.running
    hf_state_dict(again.result)  # export reads named_parameters, not state_dict: it waits itself
    res["running_after_export"] = gathers.running
    whole = module.state_dict()
    _train(later, rank, world_size, 2 * STEPS + 2, 1)
    res["running_before_load_state_dict"] = gathers.running
    module.load_state_dict(whole)  # a write into parameters a gather is still writing: waits first
    res["running_after_load_state_dict"] = gathers.running
    return res


@functools.lru_cache(maxsize=None)
def overlap_two_ranks() -> tuple[Path, list[dict]]:
    return _on_two_ranks(overlap_worker)

