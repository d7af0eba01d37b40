"""Bucketed gradient synchronisation for the emitted training step.

Two kinds of parameter, two groups ("parallel folding"):

    dense  (attention, norms, embeddings, routers, shared experts)  replicated on every rank
           -> all-reduce over world.dp_group
    expert (experts.w_*, experts.b_*)  rank r holds experts [r*E/ep, (r+1)*E/ep)
           -> all-reduce over world.edp_group (the ranks holding the same experts)

Both are divided by the data-parallel size, so the result is the gradient of the
mean loss over the global batch: an expert shard's backward already sums the
contributions of its whole expert-parallel group (the transposed all-to-all).

Gradients live in flat buckets (``param.grad`` is a view into one), so a bucket
is one collective and nothing is copied: ``buckets.prepare()`` before backward,
``buckets.sync()`` after it. With ``world=None`` there is nothing to sync.

Sharded (``parallel.shard_optimizer``, ZeRO-1): a bucket reduced over d > 1 ranks is split into d
equal ranges, and the parameters move into one flat buffer laid out like the gradients::

    grads   [ p0 | p1 ... | p2 ... ]     reduce-scatter: rank k gets range k, summed
    params  [ p0 | p1 ... | p2 ... ]     rank k's optimizer updates range k; all-gather
             <--- k=0 ---><--- k=1 --->

so the step moves the bytes of the all-reduce it replaces and rank k keeps optimizer state
only for range k (:meth:`GradBuckets.shards`). Every parameter starts ``bucket_layout.ALIGN_BYTES``-aligned,
as kernels want their weights. With ``parallel.shard_gradients`` (ZeRO-2) the whole gradient
buckets exist only while backward fills them, and rank k keeps range k (moecompile.grad_shards).
With ``parallel.shard_parameters`` (ZeRO-3) the parameters too: rank k keeps range k of them, and
the whole bucket is gathered only while forward or backward reads it (moecompile.param_shards).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from . import torch_compat
from .bucket_layout import backward_order, bucket_offsets, completion_order, cut_buckets
from .distributed import wait_work


def start_all_gather(b: "Bucket", flat: torch.Tensor) -> list:
    """Launch the all-gather of a sharded bucket's ranges into ``flat`` (this rank's range is in place already).

    On gloo, as one broadcast from each range's owner: gloo's all_gather_single took 2.0-5.5x as long
    as these broadcasts (2 ranks, 1-70 MiB; benchmarks/shard_optimizer.py --collectives).
    """
    if _is_gloo(b.group):
        return [dist.broadcast(flat[lo:hi], group=b.group, group_src=k, async_op=True)
                for k in range(b.shards) for lo, hi in [b.range_of(k)]]
    lo, hi = b.own
    return [torch_compat.all_gather_single(flat, flat[lo:hi], group=b.group, async_op=True)]


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _is_gloo(group: Any) -> bool:
    return dist.get_backend(group) == "gloo"


@dataclasses.dataclass
class Bucket:
    kind: str  # "dense" | "expert"
    group: Any  # process group, or None (nothing to reduce)
    flat: torch.Tensor  # the gradients
    params: list[nn.Parameter]
    views: list[torch.Tensor]
    names: list[str]
    offsets: list[int]  # where each parameter starts in flat
    shards: int = 1  # ranks the bucket is split over (1: every rank updates all of it)
    rank: int = 0  # this rank's range, when sharded
    param_flat: torch.Tensor | None = None  # sharded: the parameters' storage, laid out as flat
    grad: torch.Tensor | None = None  # gradients sharded (ZeRO-2): this rank's range, the only one kept
    param_own: torch.Tensor | None = None  # parameters sharded (ZeRO-3): this rank's range, the only one kept

    def wait(self, handle: Any, kind: str) -> None:
        """Wait for one of this bucket's collectives; a failure (a peer died or hung) names the bucket."""
        wait_work(handle, kind, f"{self.kind} bucket of {len(self.names)} parameter(s) from {self.names[0]}",
                  self.group)

    @property
    def numel(self) -> int:
        if self.param_flat is not None:
            return self.param_flat.numel()
        return self.param_own.numel() * self.shards if self.param_own is not None else self.flat.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    def range_of(self, k: int) -> tuple[int, int]:
        """Rank k's range of the flat buffers."""
        size = self.numel // self.shards
        return k * size, (k + 1) * size

    def own_grad(self) -> torch.Tensor:
        """This rank's range of the reduced gradients."""
        lo, hi = self.own
        return self.grad if self.grad is not None else self.flat[lo:hi]

    @property
    def own(self) -> tuple[int, int]:
        return self.range_of(self.rank)

    def part(self, i: int, k: int) -> tuple[int, int]:
        """Rank k's part of parameter i, as flattened elements [lo, hi) of it (empty: lo == hi)."""
        start, end = self.range_of(k)
        off, n = self.offsets[i], self.params[i].numel()
        lo, hi = max(start - off, 0), min(end - off, n)
        return (lo, hi) if lo < hi else (0, 0)


@dataclasses.dataclass
class Shard:
    """The part of one trainable parameter this rank's optimizer updates: flattened elements [lo, hi).

    ``grad`` is that part of the reduced gradient (a view into its bucket); ``parts`` lists every
    rank's part of the parameter (by index in the bucket's group), which a checkpoint needs to
    describe the whole tensor.
    """

    name: str
    param: nn.Parameter
    lo: int
    hi: int
    grad: torch.Tensor
    parts: tuple[tuple[int, int], ...]  # every rank's [lo, hi) of the parameter, by index in the group
    rank: int = 0  # this rank's index in parts
    store: torch.Tensor | None = None  # parameters sharded (ZeRO-3): the part's own storage, in the bucket's range

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.param.numel()

    def values(self) -> torch.Tensor:
        """The parameter's part, sharing its storage (the parameter itself when whole and not sharded)."""
        if self.store is not None:
            return self.store.view(self.param.shape) if self.whole else self.store
        return self.param if self.whole else self.param.detach().view(-1)[self.lo : self.hi]


class GradBuckets:
    """Gradients as views into flat buffers, reduced one bucket per collective."""

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], expert_names: set[str], world: Any = None,
                 bucket_mb: float = 25.0, shard: bool = False, shard_grads: bool = False,
                 first_use: dict[str, int] | None = None, shard_params: bool = False, overlap_gather: bool = False,
                 overlap_reduce: bool = False):
        self.world = world
        self._scratch: torch.Tensor | None = None  # gloo's reduce-scatter by exchange receives here
        dp = getattr(world, "dp_group", None) if world is not None else None
        edp = getattr(world, "edp_group", None) if world is not None else None
        self.dp_size = _group_size(dp) if world is not None else 1
        groups = {"dense": dp, "expert": edp}
        named = backward_order([(n, p) for n, p in named_params if p.requires_grad], first_use or {})
        d = {kind: _group_size(groups[kind]) if shard and world is not None else 1 for kind in groups}
        self.buckets = [self._bucket(kind, groups[kind], chunk, d[kind])
                        for kind, chunk in cut_buckets(named, expert_names, bucket_mb)]
        self.grad_shards = None
        if shard_grads and any(b.shards > 1 for b in self.buckets):
            from .grad_shards import GradientShards

            self.grad_shards = GradientShards(self, first_use or {})
        self.param_shards = None
        if shard_params and self.grad_shards is not None:
            from .param_shards import ParameterShards

            self.param_shards = ParameterShards(self)
            self.grad_shards.on_bucket_done = self.param_shards.gradients_in
        self.overlapped = None
        summed = [b for b in self.buckets if b.grad is None and b.group is not None and _group_size(b.group) > 1]
        # gloo's reduce-scatter by exchange blocks: launched from backward it would only stall backward (+2 % a
        # step in an early A/B), so it stays after backward; everything asynchronous goes as backward completes it
        early = [b for b in summed if overlap_reduce and not (b.shards > 1 and _is_gloo(b.group))]
        if early:
            from .grad_overlap import OverlappedReduce

            self.overlapped = OverlappedReduce(self, completion_order(early, first_use or {}))
        self.summed_after = [b for b in summed if all(b is not e for e in early)]  # by sync, after backward
        self.param_gathers = None
        gathered = [b for b in self.buckets if b.shards > 1 and b.param_flat is not None]
        if overlap_gather and gathered:
            from .param_gathers import InFlightGathers

            self.param_gathers = InFlightGathers(gathered)

    def _bucket(self, kind: str, group: Any, named: list[tuple[str, nn.Parameter]], d: int) -> Bucket:
        params = [p for _, p in named]
        offsets, numel = bucket_offsets(params, d)
        flat = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        views = [flat[o : o + p.numel()].view_as(p) for o, p in zip(offsets, params)]
        bucket = Bucket(kind, group, flat, params, views, [n for n, _ in named], offsets)
        if d > 1:  # the parameters move into a buffer laid out like the gradients, for the all-gather
            bucket.shards, bucket.rank = d, dist.get_rank(group)
            bucket.param_flat = torch.zeros_like(flat)
            with torch.no_grad():
                for o, p in zip(offsets, params):
                    view = bucket.param_flat[o : o + p.numel()].view_as(p)
                    view.copy_(p)
                    p.data = view
        return bucket

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for b in self.buckets for p in b.params]

    def grad_bytes(self) -> int:
        """Bytes this rank holds for gradients between steps: whole buckets, own ranges, gloo's exchange buffer."""
        held = [b.flat for b in self.buckets if b.flat is not None] + [b.grad for b in self.buckets if b.grad is not None]
        held += [self._scratch] if self._scratch is not None else []
        return sum(t.numel() * t.element_size() for t in held)

    def collectives_per_step(self) -> int:
        """Gradient collectives a step launches (a sharded bucket's all-gather of parameters counts too)."""
        if not self.world:
            return 0
        return sum((2 if b.shards > 1 else 1) for b in self.buckets
                   if b.group is not None and _group_size(b.group) > 1)

    def shards(self) -> list[Shard]:
        """This rank's part of every trainable parameter it updates (all of each one when not sharded)."""
        out = []
        for b in self.buckets:
            for i, (name, p) in enumerate(zip(b.names, b.params)):
                lo, hi = b.part(i, b.rank) if b.shards > 1 else (0, p.numel())
                if lo == hi:
                    continue
                parts = tuple(b.part(i, k) for k in range(b.shards)) if b.shards > 1 else ((0, p.numel()),)
                start = b.offsets[i] - b.own[0]  # where the parameter starts in this rank's range
                if b.grad is not None:
                    grad = b.grad[start + lo : start + hi]
                    grad = grad.view_as(p) if hi - lo == p.numel() else grad
                else:
                    grad = b.views[i] if hi - lo == p.numel() else b.flat[b.offsets[i] + lo : b.offsets[i] + hi]
                store = b.param_own[start + lo : start + hi] if b.param_own is not None else None
                out.append(Shard(name, p, lo, hi, grad, parts, b.rank, store))
        return out

    def prepare(self) -> None:
        """Zero the buckets and point every ``param.grad`` at its view (backward accumulates in place).

        With gradients sharded, backward's gradients go through :class:`GradientShards` instead.
        """
        if self.grad_shards is not None:
            self.grad_shards.prepare()
        if self.overlapped is not None:
            self.overlapped.reset()
        for b in self.buckets:
            if b.grad is None:
                b.flat.zero_()
                for p, v in zip(b.params, b.views):
                    if p.grad is not v:
                        p.grad = v

    def after_backward(self) -> None:
        """The end of one backward (of each micro-batch): gradients sharded, the last buckets are sent."""
        if self.grad_shards is not None:
            self.grad_shards.finish_backward()
        if self.param_shards is not None:  # buckets whose parameters got no gradient, or prefetched in vain
            self.param_shards.release_all()

    def last_backward(self) -> None:
        """The next backward is the step's last (of its micro-batches): with overlap_grad_reduce, it launches
        each bucket's collective as it completes it."""
        if self.overlapped is not None:
            self.overlapped.arm()

    def sync(self) -> None:
        """Sum each bucket over its group (all launched before any is waited on), then divide by dp size.

        A sharded bucket is reduce-scattered: only this rank's range holds the reduced gradient.
        With overlap_grad_reduce backward has launched most of them (moecompile.grad_overlap); ZeRO-2's
        buckets were reduce-scattered during backward (moecompile.grad_shards).
        """
        if self.world is None:
            return
        handles = self.overlapped.finish() if self.overlapped is not None else []
        handles += [(b, h) for b in self.summed_after for h in [self.launch(b)] if h is not None]
        for b, h in handles:
            b.wait(h, "gradient reduce-scatter" if b.shards > 1 else "gradient sum")
        if self.dp_size > 1:
            for flat in self._reduced():
                flat.div_(self.dp_size)

    def launch(self, b: Bucket, out: torch.Tensor | None = None) -> Any:
        """Start summing bucket ``b`` over its group (sharded: reduce-scattered into ``out``, by default this
        rank's range of ``b.flat``); a handle to wait for, or None (nothing to do, or gloo's reduce-scatter by
        exchange, done on return). The one place a bucket's collective starts, from sync or from backward."""
        if b.shards > 1:
            lo, hi = b.own
            out = b.flat[lo:hi] if out is None else out
            if _is_gloo(b.group):
                self.reduce_scatter_by_exchange(b, b.flat, out)
                return None
            return torch_compat.reduce_scatter_single(out, b.flat, group=b.group, async_op=True)
        if b.group is not None and _group_size(b.group) > 1:
            return dist.all_reduce(b.flat, group=b.group, async_op=True)
        return None

    def gather_params(self) -> None:
        """Sharded buckets: every rank's updated range of the parameters, to every rank (all-gather).

        Sharded parameters (ZeRO-3) stay in their ranges: the next forward gathers them. With
        ``overlap_param_gather`` the gathers are left running: the next forward waits for each bucket.
        """
        if self.param_gathers is not None:
            self.param_gathers.start()
            return
        handles = [(b, h) for b in self.buckets if b.param_flat is not None and b.shards > 1
                   for h in start_all_gather(b, b.param_flat)]
        for b, h in handles:
            b.wait(h, "parameter all-gather")

    def param_bytes(self) -> int:
        """Bytes of parameters this rank keeps between steps (sharded ones: its range only)."""
        own = {id(p) for b in self.buckets if b.param_own is not None for p in b.params}
        ranges = sum(b.param_own.numel() * b.param_own.element_size() for b in self.buckets if b.param_own is not None)
        return ranges + sum(p.numel() * p.element_size() for b in self.buckets for p in b.params if id(p) not in own)

    def reduce_scatter_by_exchange(self, b: Bucket, flat: torch.Tensor, out: torch.Tensor) -> None:
        """gloo: reduce-scatter ``flat`` into ``out`` as one all-to-all and a local sum of the d ranges received.

        gloo's reduce_scatter_single took 1.2-1.6x its all-reduce of the bucket and 2.4-5.3x this (2 ranks,
        1-70 MiB; benchmarks/shard_optimizer.py --collectives). The receive buffer is one bucket, kept.
        """
        if self._scratch is None or self._scratch.numel() < flat.numel() or self._scratch.dtype != flat.dtype:
            self._scratch = torch.empty(max(x.numel for x in self.buckets if x.shards > 1 and x.dtype == flat.dtype),
                                        dtype=flat.dtype, device=flat.device)
        received = self._scratch[: flat.numel()]
        b.wait(dist.all_to_all_single(received, flat, group=b.group, async_op=True), "gradient reduce-scatter")
        torch.sum(received.view(b.shards, out.numel()), dim=0, out=out)

    def _reduced(self, kind: str | None = None) -> list[torch.Tensor]:
        """The reduced part of each bucket: its own range when sharded, else all of it."""
        return [b.own_grad() for b in self.buckets if kind is None or b.kind == kind]

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm: dense grads are replicated, expert shards summed over the expert-parallel group.

        Sharded, every element's reduced value lives on exactly one rank: one sum over all ranks.
        """
        sq = {}
        for kind in ("dense", "expert"):
            sq[kind] = sum((f.float().square().sum() for f in self._reduced(kind)), torch.zeros((), device=self._device()))
        if any(b.shards > 1 for b in self.buckets):
            total = sq["dense"] + sq["expert"]
            dist.all_reduce(total, group=self.world.dp_group)
            return total.sqrt()
        ep_group = getattr(self.world, "ep_group", None) if self.world is not None else None
        if ep_group is not None and _group_size(ep_group) > 1:
            dist.all_reduce(sq["expert"], group=ep_group)
        return (sq["dense"] + sq["expert"]).sqrt()

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale all grads so the global norm is at most ``max_norm``; returns the norm before (no host sync)."""
        norm = self.grad_norm()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for flat in self._reduced():
            flat.mul_(scale.to(flat.dtype))
        return norm

    def _device(self) -> torch.device:
        return self.buckets[0].params[0].device if self.buckets else torch.device("cpu")
