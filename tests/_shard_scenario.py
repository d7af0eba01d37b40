"""Sharded optimizer runs shared by tests/test_shard_optimizer.py (spawned once per session, cached).

``two_ranks()``: on 2 gloo ranks, each setting in SETTINGS trains STEPS steps unsharded and then
sharded (parallel.shard_optimizer, and shard_gradients where it says zero2) from the same init on the
same batches; the sharded ep=2 run saves a checkpoint and takes STEPS more steps. ``four_ranks()``: on
4 ranks at ep=2 (edp=2, so expert ranges are sharded too) the same comparison with gradients sharded,
then that checkpoint loaded there.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from _ep_scenario import GLOBAL_BATCH, SEQ, data
from _dist import spawn
from moecompile.grad_sync import _is_gloo

STEPS = 3
EXPERTS = {"num_experts": 4, "top_k": 2, "z_loss_coeff": 1e-3, "router_noise": 0.02}
# name: (ep, dtype, sequences a forward, more parallel fields of the sharded run); "nccl_forms*" run the
# reduce-scatter / all-gather a GPU runs (gloo gets exchanges instead); zero2: parallel.shard_gradients
ZERO2 = {"shard_gradients": True}
ZERO3 = {"shard_gradients": True, "shard_parameters": True}
SETTINGS = {"dp2": (1, None, 2, {}), "ep2": (2, None, 2, {}), "dp2_bf16": (1, "bfloat16", 2, {}),
            "nccl_forms": (1, None, 2, {}), "dp2_zero2_micro": (1, None, 1, ZERO2),
            "ep2_zero2_bf16": (2, "bfloat16", 2, ZERO2), "nccl_forms_zero2_micro": (1, None, 1, ZERO2)}


@contextlib.contextmanager
def collective_forms(setting: str) -> Iterator[None]:
    """For a setting named nccl_forms*, the reduce-scatter / all-gather forms a GPU runs (gloo gets exchanges and
    broadcasts instead)."""
    import moecompile.grad_sync as grad_sync

    grad_sync._is_gloo = (lambda group: False) if setting.startswith("nccl_forms") else _is_gloo
    try:
        yield
    finally:
        grad_sync._is_gloo = _is_gloo


def off_and_on(settings: dict[str, Any], run: Any) -> dict[str, dict[bool, Any]]:
    """``run(name, setting, on)`` for every setting, an option off then on, in the setting's collective forms."""
    out = {}
    for name, setting in settings.items():
        with collective_forms(name):
            out[name] = {on: run(name, setting, on) for on in (False, True)}
    return out


def grouped_adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Two param groups built from the parameters (no decay on vectors), as users write them."""
    vectors = [p for p in params if p.dim() < 2]
    matrices = [p for p in params if p.dim() >= 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                             lr=3e-3)


def make_step(world_size: int, ep: int, shard: bool, dtype: str | None = None, batch: int | None = None,
              compile: Any = False, **parallel: Any) -> tuple[Any, Any]:
    import moecompile as mc
    from moecompile.models import build_model

    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=batch or GLOBAL_BATCH // world_size,
                                seq_len=SEQ, dtype=dtype)
    recompute = parallel.pop("recompute", None)
    plan = {"experts": parallel.pop("experts", EXPERTS), "parallel": {"ep": ep, "shard_optimizer": shard, **parallel}}
    if recompute:
        plan["recompute"] = {"modules": recompute}
    result = mc.convert(dense, plan, (ids,))
    return result, mc.build_train_step(result, optimizer=grouped_adamw, clip_grad_norm=1.0, bucket_mb=0.05,
                                       compile=compile)


def _train(step: Any, rank: int, world_size: int, first: int, count: int) -> list[dict]:
    stream = data()
    out = []
    for i in range(first, first + count):
        m = step(stream.shard(i, rank, world_size))
        out.append({"loss": m.loss, "grad_norm": m.grad_norm, "load": m.expert_load})
    return out


def _compare(rank: int, world_size: int, ep: int, dtype: str | None, batch: int | None = None,
             extra: dict | None = None) -> dict:
    out: dict[str, Any] = {}
    for shard in (False, True):
        both = {k: v for k, v in (extra or {}).items() if k in ("recompute", "experts")}
        result, step = make_step(world_size, ep, shard, dtype, batch, **(dict(extra or {}) if shard else both))
        metrics = _train(step, rank, world_size, 0, STEPS)
        gathered, pool = step.buckets.param_shards, step.buckets.grad_shards
        out[shard] = {
            "in_flight_peak": pool.peak_bytes if pool else None,  # what the estimator simulates, on this backend
            "in_flight_estimate": _in_flight_estimate(result) if pool else None,
            "param_bytes": step.param_bytes(), "gathered_peak": gathered.peak_bytes if gathered else None,
            "whole_bytes": sum(b.numel * b.dtype.itemsize for b in step.buckets.buckets if b.shards > 1),
            "metrics": metrics, "bytes": step.optimizer_bytes(), "collectives": step.buckets.collectives_per_step(),
            "grad_bytes": step.buckets.grad_bytes(), "micro_batches": step.parts,
            "bucket_bytes": max(b.numel * b.params[0].element_size() for b in step.buckets.buckets),
            "params": _whole_params(step, result),
            "misaligned": [n for b in step.buckets.buckets if b.shards > 1 and b.param_flat is not None
                           for n, p in zip(b.names, b.params)
                           if (p.data_ptr() - b.param_flat.data_ptr()) % 256],  # the buffer: CPU aligns to 64
            "groups": [len(g["params"]) for g in step.optimizer.param_groups],
            "decay": [g["weight_decay"] for g in step.optimizer.param_groups],
        }
    return out


def _in_flight_estimate(result: Any) -> int:
    """The estimator's whole gradient buckets in flight, for the collective forms this run uses."""
    import moecompile as mc
    import moecompile.grad_sync as grad_sync

    backend = "gloo" if grad_sync._is_gloo(None) else "nccl"
    return mc.estimate_memory(result, by_pass=False, bucket_mb=0.05, backend=backend).in_flight_grads


def _whole_params(step: Any, result: Any) -> dict[str, torch.Tensor]:
    with step.gathered():  # ZeRO-3 keeps a range of each; this gathers them on every rank
        return {n: p.detach().float().clone() for n, p in result.module.named_parameters()}


def two_ranks_worker(rank: int, world_size: int, out: str) -> dict:
    import moecompile.grad_sync as grad_sync
    import moecompile.torch_compat as torch_compat

    calls = []
    reduce_scatter = torch_compat.reduce_scatter_single
    torch_compat.reduce_scatter_single = lambda *a, **k: calls.append(1) or reduce_scatter(*a, **k)
    res = {}
    for name, (ep, dtype, batch, extra) in SETTINGS.items():
        grad_sync._is_gloo = (lambda group: False) if name.startswith("nccl_forms") else _is_gloo
        calls.clear()
        res[name] = _compare(rank, world_size, ep, dtype, batch, extra)
        res[name]["reduce_scatters"] = len(calls)
    grad_sync._is_gloo, torch_compat.reduce_scatter_single = _is_gloo, reduce_scatter
    _, step = make_step(world_size, 2, True)
    _train(step, rank, world_size, 0, STEPS)
    step.save(Path(out) / "ckpt")
    res["continued"] = _train(step, rank, world_size, STEPS, STEPS)
    _, again = make_step(world_size, 2, True)
    again.load(Path(out) / "ckpt")
    res["resumed"] = _train(again, rank, world_size, STEPS, STEPS)
    return res


def _on_two_ranks(worker: Any) -> tuple[Path, list[dict]]:
    """``worker(rank, world_size, out)`` on 2 ranks, with a directory for them that lives as long as the tests."""
    out = Path(tempfile.mkdtemp(prefix="moecompile-zero-"))
    atexit.register(shutil.rmtree, out, True)
    return out, spawn(worker, 2, (str(out),), timeout=400)


@functools.lru_cache(maxsize=None)
def two_ranks() -> tuple[Path, list[dict]]:
    return _on_two_ranks(two_ranks_worker)


def four_ranks_worker(rank: int, world_size: int, ckpt: str) -> dict:
    res = {"ep2": _compare(rank, world_size, 2, None, extra=ZERO2),  # dense grads / 4, expert grads / 2
           "ep2_zero3": _compare(rank, world_size, 2, None, extra=ZERO3)}  # and parameters
    _, step = make_step(world_size, 2, True, **ZERO2)
    step.load(ckpt)
    res["loaded"] = _train(step, rank, world_size, STEPS, 1)
    return res


@functools.lru_cache(maxsize=None)
def four_ranks() -> list[dict]:
    out, _ = two_ranks()
    return spawn(four_ranks_worker, 4, (str(out / "ckpt"),), timeout=500)


@functools.lru_cache(maxsize=None)
def one_process_from_checkpoint() -> list[dict]:
    """The 2-rank sharded checkpoint loaded by one unsharded process, and its next steps on the whole batch."""
    out, _ = two_ranks()
    _, step = make_step(1, 1, False)
    step.load(out / "ckpt")
    return _train(step, 0, 1, STEPS, STEPS)


def rebuilt_worker(rank: int, world_size: int) -> dict[bool, list[float]]:
    """One step, then a second step object built on the same converted module (a fresh optimizer) for two
    more: with gradients sharded (the second takes the gradient hooks over) and unsharded, the oracle."""
    import moecompile as mc

    out = {}
    for shard in (False, True):
        result, first = make_step(world_size, 1, shard, **(ZERO2 if shard else {}))
        losses = [m["loss"] for m in _train(first, rank, world_size, 0, 1)]
        second = mc.build_train_step(result, optimizer=grouped_adamw, clip_grad_norm=1.0, bucket_mb=0.05)
        out[shard] = losses + [m["loss"] for m in _train(second, rank, world_size, 1, 2)]
    return out


# ZeRO-3 (parallel.shard_parameters): name -> (ep, dtype, sequences a forward, parallel fields of the sharded run)
ZERO3_SETTINGS = {"dp2": (1, None, 2, ZERO3), "ep2_bf16": (2, "bfloat16", 2, ZERO3), "dp2_micro": (1, None, 1, ZERO3),
                  "dp2_recompute": (1, None, 2, {**ZERO3, "recompute": ["layernorm", "attention", "moe"]}),
                  # a region whose inputs hold a size (an int) next to gathered parameters held as handles
                  "dp2_recompute_shared": (1, None, 2, {**ZERO3, "recompute": ["shared_experts"],
                                                        "experts": {**EXPERTS, "shared_experts": 1}}),
                  "nccl_forms": (1, None, 2, ZERO3)}


def zero3_worker(rank: int, world_size: int, out: str) -> dict:
    """Every ZERO3_SETTINGS comparison; a ZeRO-3 checkpoint resumed; the module's guards; a later step's takeover."""
    import moecompile as mc
    import moecompile.grad_sync as grad_sync

    res: dict[str, Any] = {}
    for name, (ep, dtype, batch, extra) in ZERO3_SETTINGS.items():
        grad_sync._is_gloo = (lambda group: False) if name.startswith("nccl_forms") else _is_gloo
        res[name] = _compare(rank, world_size, ep, dtype, batch, extra)
    grad_sync._is_gloo = _is_gloo
    result, step = make_step(world_size, 1, True, **ZERO3)
    shards = step.buckets.param_shards
    _train(step, rank, world_size, 0, STEPS - 1)
    before = shards.gathers
    _train(step, rank, world_size, STEPS - 1, 1)
    res["gathers_a_step"], res["buckets"] = shards.gathers - before, len(shards.buckets)
    x = data().shard(STEPS, rank, world_size)[0]
    result.module(x)  # grad mode: the bucket read last stays whole for a backward
    res["whole_after_forward"] = sorted(shards.whole)
    res["first_in_backward"] = shards.order[True][0]
    shards.release_all()
    with torch.no_grad():  # no backward can follow: every bucket is released
        result.module(x)
    res["whole_after_no_grad_forward"] = sorted(shards.whole)
    try:
        result.module.state_dict()
        res["state_dict_outside"] = None
    except mc.MoecompileError as e:
        res["state_dict_outside"] = str(e)
    from moecompile.export_hf import hf_state_dict

    try:
        hf_state_dict(result)
        res["export_outside"] = None
    except mc.MoecompileError as e:
        res["export_outside"] = str(e)
    with step.gathered():
        res["state_dict"] = {k: v.clone() for k, v in result.module.state_dict().items()}
    step.save(Path(out) / "ckpt")
    res["continued"] = _train(step, rank, world_size, STEPS, STEPS)
    _, again = make_step(world_size, 1, True, **ZERO3)
    again.load(Path(out) / "ckpt")
    res["resumed"] = _train(again, rank, world_size, STEPS, STEPS)
    with again.gathered():
        before = {n: p.detach().clone() for n, p in again.result.module.named_parameters()}
    later = mc.build_train_step(again.result, optimizer=grouped_adamw, clip_grad_norm=1.0, bucket_mb=0.05)
    with later.gathered():  # the plan shards them again: the new step's ranges hold the same values
        res["taken_over"] = all(torch.equal(p, before[n]) for n, p in again.result.module.named_parameters())
    res["after_takeover"] = _train(later, rank, world_size, 2 * STEPS, 1)
    # compiled, with recompute regions packing gathered parameters: the packing is eager, and was a frame dynamo
    # compiled once per saved tensor's rank (and per step's gathered buffers) until its recompile limit
    import torch._dynamo as dynamo

    with dynamo.config.patch(fail_on_recompile_limit_hit=True):
        _, compiled = make_step(world_size, 1, True, compile={"backend": "aot_eager"},
                                **{**ZERO3, "recompute": ["layernorm", "attention", "moe"]})
        res["compiled_recompute"] = _train(compiled, rank, world_size, 0, STEPS)
    return res


@functools.lru_cache(maxsize=None)
def zero3_two_ranks() -> tuple[Path, list[dict]]:
    return _on_two_ranks(zero3_worker)
