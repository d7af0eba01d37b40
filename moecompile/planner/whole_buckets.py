"""ZeRO-2/3's whole buckets at their peak, priced by the runtime's own code over a model's parameter layout.

A profile keeps each layer kind's parameters in forward read order (``LayerProfile.tensors``), so
the whole model's order is the base's leading tensors (the embedding), the layers in model order,
and the base's tail (final norm, head). A rank's share of it (dense / tp, experts / ep) is laid out
in gradient buckets exactly as build_train_step lays them out (memory_shards.bucket_layout), and
then:

- ZeRO-2's whole gradient buffers in flight: GradientShards itself, run on meta tensors for one
  backward (memory_shards.in_flight_peak), in NCCL's form: up to two reduce-scatters in flight;
- ZeRO-3's whole parameter buckets gathered: the runtime's gather / release order simulated over
  the reads (memory_shards.gathered_peak), a parameter read where the forward first reads it.

The layout decides these, not the largest bucket alone: DeepSeek-V3's 1.85 GB embedding and head
are each a bucket of their own, but backward fills the head's first and the embedding's last,
with nothing else that size in between.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..memory_shards import bucket_layout, gathered_peak, in_flight_peak
from .profile import ModelProfile

_DTYPES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}
_CACHE: dict[tuple, int] = {}  # the simulations' results, by layout, rank grid and element size


def model_order(profile: ModelProfile) -> list[tuple[float, bool]]:
    """Every parameter of the model as (elements, routed expert?) in forward read order; [] when the profile
    does not record its layers' parameters."""
    body = sorted((lp for lp in profile.layers if lp.kind != "base"), key=lambda lp: lp.first)
    if any(lp.count and not lp.tensors for lp in body):
        return []
    base = [lp for lp in profile.layers if lp.kind == "base"]
    order = [t for lp in base for t in lp.tensors]
    for lp in body:
        order += list(lp.tensors) * lp.count
    return order + [t for lp in base for t in lp.tail]


def in_flight(profile: ModelProfile, cand: Any, dp: int, edp: int, grad_bytes: float) -> int | None:
    """ZeRO-2's whole gradient buffers in flight at their peak, bytes, for one rank of ``cand`` over dp / edp
    ranks; None where this cannot say (see :func:`simulated`)."""
    return _simulated("grads", profile, cand, dp, edp, grad_bytes)


def gathered(profile: ModelProfile, cand: Any, dp: int, edp: int, param_bytes: float) -> int | None:
    """ZeRO-3's whole parameter buckets gathered at their peak, bytes, for one rank (as :func:`in_flight`)."""
    return _simulated("params", profile, cand, dp, edp, param_bytes)


def simulated(profile: ModelProfile, cand: Any, nbytes: float) -> bool:
    """Can these be simulated? Not for pipeline stages (a stage holds part of the order), a profile without its
    parameter layout, or an element size no dtype has (an estimator's average)."""
    return cand.pp == 1 and nbytes in _DTYPES and bool(model_order(profile))


def _simulated(what: str, profile: ModelProfile, cand: Any, dp: int, edp: int, nbytes: float) -> int | None:
    if not simulated(profile, cand, nbytes):
        return None
    layout = (tuple((lp.kind, lp.count, lp.first, lp.tensors, lp.tail) for lp in profile.layers), cand.tp, cand.expert_ranks,
              dp, edp, cand.bucket_mb, nbytes)
    if (what, *layout) not in _CACHE:  # the gathered peak is cheap: priced too while the layout is at hand
        trainable, experts, first = _rank_share(model_order(profile), cand, _DTYPES[int(nbytes)])
        shapes = bucket_layout(trainable, experts, dp, edp, cand.bucket_mb, first)
        reads = {n: (i, i) for n, i in first.items()}
        _CACHE["params", *layout] = gathered_peak([b for b in shapes if b.ranks > 1], reads)
        if what == "grads":
            _CACHE["grads", *layout] = in_flight_peak(trainable, shapes, first, exchange=False)
    return _CACHE[(what, *layout)]


def _rank_share(order: list[tuple[float, bool]], cand: Any, dtype: torch.dtype
                ) -> tuple[dict[str, nn.Parameter], set[str], dict[str, int]]:
    """A rank's parameters as meta tensors (experts / ep x etp, dense / tp), the experts' names, and where each is
    read."""
    trainable, experts, first = {}, set(), {}
    for i, (elements, expert) in enumerate(order):
        name = f"p{i}"
        numel = max(1, -(-int(elements) // (cand.expert_ranks if expert else cand.tp)))
        trainable[name] = nn.Parameter(torch.empty(numel, dtype=dtype, device="meta"))
        first[name] = i
        if expert:
            experts.add(name)
    return trainable, experts, first
