"""What a rank keeps of the trainable state under ZeRO sharding, for ``moecompile.memory_estimate.estimate_memory``.

``parallel.shard_optimizer`` (ZeRO-1) gives each rank a range of every gradient bucket: dense buckets
split over the dp ranks, expert buckets over the edp = dp / ep ranks holding the same experts; the
rank keeps optimizer states, fp32 masters and their grads for that range only.
``parallel.shard_gradients`` (ZeRO-2) keeps the model-dtype gradients of the range too, plus the
whole bucket buffers in flight: the runtime's own code (moecompile/grad_shards.py) run here on meta
tensors over the buckets' layout (moecompile/bucket_layout.py), nothing allocated.
``parallel.shard_parameters`` (ZeRO-3) keeps the parameters of the range only too, plus the whole
sharded buckets gathered while forward or backward reads them (moecompile/param_shards.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from .bucket_layout import backward_order, bucket_offsets, cut_buckets
from .errors import MoecompileError
from .grad_shards import GradientShards
from .grad_sync import Bucket, GradBuckets, Shard

# Whole sharded parameter buckets the planner prices as gathered at once under ZeRO-3 where it has no parameter
# layout to simulate (pipeline stages; planner/whole_buckets.py): a layer's two expert weight tensors read together
# (each a bucket of its own at scale) and the next bucket, prefetched (param_shards.py).
IN_FLIGHT_PARAM_BUCKETS = 3


def optimizer_ranks(result: Any, shard: bool | None, dp: int | None, ep: int) -> tuple[bool, int, int]:
    """(shard the optimizer?, dp, edp) of the run ``estimate_memory`` estimates."""
    if dp is None:
        world = getattr(getattr(result, "context", None), "world", None)
        dp = world.world_size if world is not None else 1
    elif not isinstance(dp, int) or isinstance(dp, bool) or dp < 1 or dp % ep:
        group = "parallel.ep" if result.plan.parallel.etp == 1 else "parallel.ep x parallel.etp"
        raise MoecompileError(f"estimate_memory: dp={dp!r} must be the run's number of data-parallel ranks, a whole "
                              f"multiple of {group}={ep} (each ep group of ranks holds every expert once)")
    shard = result.plan.parallel.shard_optimizer if shard is None else bool(shard)
    return shard, dp, dp // ep


def optimizer_rank(result: Any, rank: int | None, dp: int) -> int:
    """The data-parallel rank ``estimate_memory`` estimates: ``rank``, or the result's own (its world's), else 0."""
    if rank is None:
        world = getattr(getattr(result, "context", None), "world", None)
        rank = world.rank if world is not None else 0
        if rank >= dp:
            raise MoecompileError(f"estimate_memory: the result was converted on rank {rank}, outside the dp={dp} "
                                  f"ranks estimated; pass rank= (0 to {dp - 1}) to say which of them to estimate")
    elif not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < dp:
        raise MoecompileError(f"estimate_memory: rank={rank!r} must be one of the run's data-parallel ranks, 0 to "
                              f"{dp - 1} (dp={dp}); pass dp= too to estimate a rank of a larger run")
    return rank


@dataclasses.dataclass(frozen=True)
class BucketShape:
    """One bucket GradBuckets will build, without its memory."""

    names: tuple[str, ...]
    ranks: int  # the ranks it is split over (1: kept whole)
    numel: int  # elements, with ALIGN_BYTES alignment and the padding to whole ranges when split
    elem: int  # bytes per element
    kind: str = "dense"  # "dense" (split over dp) | "expert" (over edp)

    @property
    def nbytes(self) -> int:
        return self.numel * self.elem


def bucket_layout(trainable: dict[str, torch.nn.Parameter], experts: set[str], dp: int, edp: int, bucket_mb: float,
                  first_use: dict[str, int] | None = None) -> list[BucketShape]:
    """The buckets of a sharded step, as GradBuckets lays them out (bucket_layout.cut_buckets in backward_order of the
    graph's ``first_use``; bucket_layout.bucket_offsets): dense ones split over ``dp`` ranks, experts over ``edp``."""
    named = backward_order(list(trainable.items()), first_use or {})
    out = []
    for kind, chunk in cut_buckets(named, experts, bucket_mb):
        d = dp if kind == "dense" else edp
        _, numel = bucket_offsets([p for _, p in chunk], d)
        out.append(BucketShape(tuple(n for n, _ in chunk), d, numel, chunk[0][1].element_size(), kind))
    return out


class _Laid:
    """GradBuckets' part its ``shards()`` reads: the buckets, here on meta tensors."""

    shards = GradBuckets.shards  # the runtime's own: a rank's part of each parameter, from its buckets' ranges

    def __init__(self, buckets: list[Bucket]):
        self.buckets = buckets


def rank_shards(trainable: dict[str, nn.Parameter], layout: list[BucketShape], rank: int, ep: int) -> list[Shard]:
    """What build_train_step's optimizer updates on data-parallel rank ``rank`` (its Shards: [lo, hi) of each
    parameter, padding excluded), in parameter order as train_step sorts them: GradBuckets.shards run over
    ``layout`` on meta tensors. The rank's index is ``rank`` in a dense bucket's group (dp: every rank) and
    ``rank // ep`` in an expert bucket's (edp; distributed.World's edp_rank). ``Shard.param`` is a meta stand-in:
    the parameter is ``trainable[shard.name]``."""
    buckets = []
    for shape in layout:
        params = [nn.Parameter(torch.empty(trainable[n].shape, dtype=trainable[n].dtype, device="meta"))
                  for n in shape.names]
        offsets, numel = bucket_offsets(params, shape.ranks)
        flat = torch.empty(numel, dtype=params[0].dtype, device="meta")
        views = [flat[o : o + p.numel()].view_as(p) for o, p in zip(offsets, params)]
        split = shape.ranks > 1
        buckets.append(Bucket(shape.kind, None, flat, params, views, list(shape.names), offsets, shards=shape.ranks,
                              rank=(rank if shape.kind == "dense" else rank // ep) if split else 0,
                              param_flat=flat if split else None))
    order = {name: i for i, name in enumerate(trainable)}
    return sorted(_Laid(buckets).shards(), key=lambda s: order[s.name])


def gathered_peak(buckets: list[BucketShape], reads: dict[str, tuple[int, int]]) -> int:
    """Most bytes of whole parameter buckets ZeRO-3 holds at once (param_shards.py): a bucket is gathered before
    the graph's first read of it, with the next one not yet done prefetched, and released after its last read;
    backward does the same in reverse. ``reads``: each parameter's first and last read (bucket_layout.param_reads)."""
    spans = []
    for b in buckets:
        at = [reads[n] for n in b.names if n in reads]
        if at:
            spans.append((min(f for f, _ in at), max(last for _, last in at), b.nbytes))
    peak = 0
    for forward in (True, False):
        seen = spans if forward else [(-last, -first, size) for first, last, size in spans]
        order = sorted(range(len(seen)), key=lambda k: seen[k][0])
        events = sorted([(seen[k][0], 0, k) for k in order] + [(seen[k][1], 1, k) for k in order])
        whole: set[int] = set()
        pending: set[int] = set()
        done: set[int] = set()
        for _, release, k in events:
            if release:
                whole.discard(k)
                done.add(k)
                continue
            pending.discard(k)
            whole.add(k)
            nxt = next((j for j in order[order.index(k) + 1 :] if j not in done), None)
            if nxt is not None and nxt not in whole:
                pending.add(nxt)
            peak = max(peak, sum(seen[j][2] for j in whole | pending))
    return peak


class _Done:
    """A collective that has finished: what the simulated buckets wait for."""

    def wait(self) -> bool:
        return True


class _Launcher:
    """GradBuckets' part GradientShards needs: its sharded buckets, and starting one's reduce-scatter."""

    def __init__(self, buckets: list[Bucket], exchange: bool):
        self.buckets, self.exchange = buckets, exchange

    def launch(self, b: Bucket, out: torch.Tensor) -> Any:
        return None if self.exchange else _Done()  # gloo's exchange is done on return; NCCL's is left in flight


def in_flight_peak(trainable: dict[str, nn.Parameter], layout: list[BucketShape], first_use: dict[str, int],
                   exchange: bool) -> int:
    """Most bytes of whole gradient buckets ZeRO-2 holds at once (GradientShards.peak_bytes): the runtime's
    GradientShards run on meta tensors for one backward, gradients arriving in backward_order.
    ``exchange``: gloo's blocking reduce-scatter (one bucket sent at a time) instead of NCCL's in flight."""
    named = backward_order(list(trainable.items()), first_use)
    stand_in = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta")) for n, p in named}
    buckets = []
    for shape in layout:
        if shape.ranks > 1:
            params = [stand_in[n] for n in shape.names]
            offsets, numel = bucket_offsets(params, shape.ranks)
            flat = torch.empty(numel, dtype=params[0].dtype, device="meta")  # also its parameters' (numel)
            buckets.append(Bucket("", None, flat, params, [], list(shape.names), offsets, shards=shape.ranks,
                                  param_flat=flat))
    if not buckets:
        return 0
    shards = GradientShards(_Launcher(buckets, exchange), first_use, exchange=exchange, hooks=False)
    shards.prepare()
    sharded = {n for b in buckets for n in b.names}
    for n, p in named:
        if n in sharded:
            stand_in[n].grad = torch.empty(p.shape, dtype=p.dtype, device="meta")
            shards.arrived(stand_in[n])
    shards.finish_backward()
    return shards.peak_bytes


def sharded_state(trainable: dict[str, torch.nn.Parameter], experts: set[str], dp: int, edp: int, bucket_mb: float,
                  *, grads: bool, params: bool, reads: dict[str, tuple[int, int]] | None = None,
                  exchange: bool = False) -> tuple[int, int, int, int]:
    """Bytes a rank keeps of the trainable parameters and their model-dtype gradients: (parameters, gradients,
    ZeRO-2's whole gradient buckets in flight, ZeRO-3's whole parameter buckets gathered at most).

    ``grads`` (ZeRO-2): the gradients are this rank's range of each split bucket (padding included), + the most
    whole buckets in flight at once (:func:`in_flight_peak`; ``exchange``: gloo's). ``params`` (ZeRO-3, needs
    ``grads``): the parameters are that range too, + the most whole buckets gathered at once as the graph reads
    them (``reads``, see :func:`gathered_peak`).
    """
    whole = sum(p.numel() * p.element_size() for p in trainable.values())
    if not grads:
        return whole, whole, 0, 0
    reads = reads or {}
    layout = bucket_layout(trainable, experts, dp, edp, bucket_mb, {n: f for n, (f, _) in reads.items()})
    split = [b for b in layout if b.ranks > 1]
    mine = sum(b.nbytes // b.ranks for b in split)
    mine += sum(trainable[n].numel() * trainable[n].element_size() for b in layout if b.ranks == 1 for n in b.names)
    first_use = {n: f for n, (f, _) in reads.items()}
    in_flight = in_flight_peak(trainable, layout, first_use, exchange)
    gathered = gathered_peak(split, reads) if params else 0
    return (mine if params else whole), mine, in_flight, gathered
