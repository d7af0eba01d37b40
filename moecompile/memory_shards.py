"""What a rank keeps of the trainable state under ZeRO sharding, for ``moecompile.memory.estimate_memory``.

``parallel.shard_optimizer`` (ZeRO-1) gives each rank a range of every gradient bucket: dense buckets
split over the dp ranks, expert buckets over the edp = dp / ep ranks holding the same experts; the
rank keeps optimizer states, fp32 masters and their grads for that range only.
``parallel.shard_gradients`` (ZeRO-2) keeps the model-dtype gradients of the range too, plus a pool
of whole bucket buffers in flight (moecompile/grad_shards.py), whose size is the buckets' layout
(moecompile/grad_sync.py), computed here without allocating them.
``parallel.shard_parameters`` (ZeRO-3) keeps the parameters of the range only too, plus the whole
sharded buckets gathered while forward or backward reads them (moecompile/param_shards.py).
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch

from .errors import MoecompileError
from .grad_shards import IN_FLIGHT
from .grad_sync import ALIGN_BYTES

# Whole sharded parameter buckets a rank holds gathered at once under ZeRO-3: the one forward (or backward)
# reads and the next, prefetched. Mirrors the runtime's prefetch depth of one bucket (param_shards.py).
IN_FLIGHT_PARAM_BUCKETS = 2


def optimizer_ranks(result: Any, shard: bool | None, dp: int | None, ep: int) -> tuple[bool, int, int]:
    """(shard the optimizer?, dp, edp) of the run ``estimate_memory`` estimates."""
    if dp is None:
        world = getattr(getattr(result, "context", None), "world", None)
        dp = world.world_size if world is not None else 1
    elif not isinstance(dp, int) or isinstance(dp, bool) or dp < 1 or dp % ep:
        raise MoecompileError(f"estimate_memory: dp={dp!r} must be the run's number of data-parallel ranks, a whole "
                              f"multiple of parallel.ep={ep} (each ep group of ranks holds every expert once)")
    shard = result.plan.parallel.shard_optimizer if shard is None else bool(shard)
    return shard, dp, dp // ep


def ranged_bytes(trainable: dict[str, torch.nn.Parameter], experts: set[str], dp: int,
                 edp: int) -> Callable[[Callable], int]:
    """Bytes of a per-element cost over the trainable parameters, for this rank's range: every (kind, dtype)
    bucket is split into equal ranges, dense ones over ``dp`` ranks and expert ones over ``edp`` (1, 1: whole)."""

    def total(nbytes: Callable[[torch.nn.Parameter], int]) -> int:
        groups: collections.Counter[tuple[bool, torch.dtype, int]] = collections.Counter()
        for name, p in trainable.items():
            groups[(name in experts, p.dtype, nbytes(p))] += p.numel()
        return sum(size * -(-count // (edp if expert else dp)) for (expert, _, size), count in groups.items())

    return total


def sharded_buckets(trainable: dict[str, torch.nn.Parameter], experts: set[str], dp: int, edp: int,
                    bucket_mb: float) -> tuple[int, int]:
    """(bytes of the largest, how many) gradient buckets split over more than one rank, as GradBuckets lays
    them out: per kind and dtype in reverse registration order, up to ``bucket_mb`` (or one larger
    parameter), each parameter ALIGN_BYTES-aligned and the bucket padded to whole ranges."""
    limit, largest, count = max(1, int(bucket_mb * 2**20)), 0, 0
    for kind, d in (("dense", dp), ("expert", edp)):
        chunks: dict[torch.dtype, list[list[int]]] = {}  # per dtype: the buckets, as [bytes, aligned elements]
        for name, p in reversed(trainable.items()):
            if d > 1 and (name in experts) == (kind == "expert"):
                size, align = p.element_size(), max(1, ALIGN_BYTES // p.element_size())
                if p.dtype not in chunks:
                    chunks[p.dtype], count = [[0, 0]], count + 1
                bucket = chunks[p.dtype][-1]
                if bucket[0] and bucket[0] + p.numel() * size > limit:
                    bucket, count = [0, 0], count + 1
                    chunks[p.dtype].append(bucket)
                bucket[0] += p.numel() * size
                bucket[1] += -(-p.numel() // align) * align
                largest = max(largest, -(-bucket[1] // (d * align)) * d * align * size)
    return largest, count


def sharded_state(trainable: dict[str, torch.nn.Parameter], experts: set[str], dp: int, edp: int, bucket_mb: float,
                  *, grads: bool, params: bool) -> tuple[int, int, int, int]:
    """Bytes a rank keeps of the trainable parameters and their model-dtype gradients: (parameters, gradients,
    ZeRO-2's whole gradient buckets in flight, ZeRO-3's whole parameter buckets gathered).

    ``grads`` (ZeRO-2): the gradients are this rank's range, + min(IN_FLIGHT + 1, sharded buckets) x the
    largest. ``params`` (ZeRO-3, needs ``grads``): the parameters are the range too, + min(IN_FLIGHT_PARAM_BUCKETS,
    sharded buckets) x the largest, in the model dtype (a bucket's parameters and gradients share its layout).
    """
    whole = sum(p.numel() * p.element_size() for p in trainable.values())
    if not grads:
        return whole, whole, 0, 0
    mine = ranged_bytes(trainable, experts, dp, edp)(lambda p: p.element_size())
    largest, count = sharded_buckets(trainable, experts, dp, edp, bucket_mb)
    gathered = min(IN_FLIGHT_PARAM_BUCKETS, count) * largest if params else 0
    return (mine if params else whole), mine, min(IN_FLIGHT + 1, count) * largest, gathered
