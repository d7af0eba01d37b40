"""ZeRO-3 (``parallel.shard_parameters``): between uses a rank keeps only its range of the parameters.

On top of ZeRO-2's buckets (moecompile.grad_sync, moecompile.grad_shards), a sharded bucket's
parameters exist whole only while the step needs them. The graph reads them through one node
per bucket, inserted where the forward first needs the bucket::

    w_q, w_k, ... = gather_bucket(key, k, w_q, w_k, ...)   # all-gather (bucket k+1's launched behind
    ...                                                    # it); an autograd op: grads pass to the
    release_bucket(key, k)                                 # parameters as they are; after the last read
                                                           # (the last bucket read: kept for backward)

Whatever would hold a gathered tensor from forward to backward holds a handle instead (``_handle``,
registered with moecompile.tensor_handles): autograd's saved tensors, and a recompute region's
inputs (passes/regions.py). Backward's first read of a bucket k handle gathers it again (the next
one prefetched), and it is released once all its gradients are in (ZeRO-2's hooks call ``gradients_in``). So a
rank holds 1/d of the parameters plus the buckets being read and the next one (a bucket is read
from the first read of its parameters to the last, views of them included: bucket_layout.readers),
and every collective is issued in graph or autograd order, the same on every rank.

A parameter's own ``.data`` is a NaN expanded to its shape (no memory; autograd still sees its
shape); ``step.gathered()`` gathers every bucket into the parameters on every rank, for whatever
reads them outside the graph (``state_dict`` outside it is an error; export runs inside it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
import weakref
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from . import tensor_handles
from .errors import MoecompileError
from .bucket_layout import read_through, readers, runtime_only
from .grad_sync import start_all_gather

_OWNERS: "weakref.WeakValueDictionary[int, ParameterShards]" = weakref.WeakValueDictionary()
_BY_MODULE: "weakref.WeakKeyDictionary[nn.Module, ParameterShards]" = weakref.WeakKeyDictionary()
_KEYS = itertools.count()
_LIVE: dict[int, tuple["ParameterShards", int]] = {}  # storage pointer of a whole bucket -> (owner, bucket)


@dataclasses.dataclass(frozen=True)
class _Saved(tensor_handles.Handle):
    """A gathered tensor, as (bucket, where in it): what a holder keeps instead of the tensor."""

    owner: int
    k: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        """The tensor, its bucket gathered again if it was released."""
        buffer = _owner(self.owner).ensure(self.k, backward=True)
        return buffer.as_strided(self.size, self.stride, self.offset)


def _handle(t: torch.Tensor) -> _Saved | None:
    """A handle for a tensor in a whole bucket (its memory can go); None for anything else."""
    if not _LIVE or t.layout != torch.strided or t.is_meta:
        return None
    hit = _LIVE.get(t.untyped_storage().data_ptr())
    if hit is None or t.dtype != hit[0].buckets[hit[1]].dtype:
        return None
    owner, k = hit
    return _Saved(owner.key, k, t.storage_offset(), tuple(t.size()), tuple(t.stride()))


_ALIVE = 0  # ParameterShards in this process; a plain int, so compiled code guards on it, not on _LIVE's keys


def _any_alive() -> bool:
    return _ALIVE > 0


def _one_fewer() -> None:
    global _ALIVE
    _ALIVE -= 1


tensor_handles.register_packer(_handle, active=_any_alive)


def _owner(key: int) -> "ParameterShards":
    owner = _OWNERS.get(key)
    if owner is None:
        raise MoecompileError("this graph's parameters were sharded by a training step that no longer exists; keep the "
                              "step (build_train_step's result) alive while the module runs")
    return owner


class _GatherBucket(torch.autograd.Function):
    """Bucket k's parameters, whole: views of the gathered buffer. Their gradients pass to the parameters."""

    @staticmethod
    def forward(ctx: Any, key: int, k: int, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _owner(key).views(k)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        return (None, None, *(None if g is None else g.contiguous() for g in grads))


def gather_bucket(key: int, k: int, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The graph's read of bucket k (see the module docstring)."""
    return _GatherBucket.apply(key, k, *params)


def release_bucket(key: int, k: int, into_backward: bool = False) -> None:
    """After the forward's last read of bucket k. The bucket the forward reads last is the one backward needs
    first: when a backward can follow (grad mode), it stays whole for it instead of being gathered again at
    once (FSDP2 keeps its root's parameters the same way); ZeRO-2's hook or the step's end releases it."""
    if into_backward and torch.is_grad_enabled():
        return
    _owner(key).release(k)


torch.fx.node.has_side_effect(gather_bucket)
torch.fx.node.has_side_effect(release_bucket)
read_through(gather_bucket)
runtime_only(release_bucket)


def take_over(module: nn.Module) -> None:
    """A new step on ``module``: the step that sharded its parameters before gives them back whole (all ranks)."""
    earlier = _BY_MODULE.pop(module, None)
    if earlier is not None:
        earlier.unshard()


def require_whole(module: nn.Module, what: str) -> None:
    """An error for ``what`` reading ``module``'s parameters while a step keeps them sharded."""
    owner = _BY_MODULE.get(module)
    if owner is not None and not owner.held:
        raise MoecompileError(
            f"{what}: the module's parameters are sharded across ranks (parallel.shard_parameters), each rank keeps "
            "its range; call it inside `with step.gathered():` on every rank")


class ParameterShards:
    """The sharded buckets' parameters: this rank's range kept, the whole gathered while in use."""

    def __init__(self, owner: Any):
        global _ALIVE
        self.key = next(_KEYS)
        _OWNERS[self.key] = self
        _ALIVE += 1
        weakref.finalize(self, _one_fewer)
        self.buckets = [b for b in owner.buckets if b.shards > 1]
        self.whole: dict[int, torch.Tensor] = {}
        self.pending: dict[int, tuple[torch.Tensor, list]] = {}
        self.order: dict[bool, list[int]] = {False: [], True: []}  # buckets by first use, forward / backward
        self.finished: dict[bool, set[int]] = {False: set(), True: set()}  # done with, this forward / backward
        self.held = False  # inside gathered(): nothing is released
        self.peak_bytes = 0  # most bytes of gathered buckets alive at once, whoever holds them
        self.gathers = 0  # all-gathers of a bucket launched so far
        self._gathered: weakref.WeakSet = weakref.WeakSet()  # every buffer gathered, while anything refers to it
        self.module: weakref.ref | None = None  # weak: _BY_MODULE's key must be free to go
        self.placeholders = {}
        for b in self.buckets:
            lo, hi = b.own
            b.param_own = b.param_flat[lo:hi].clone()
            b.param_flat = None
            for p in b.params:
                self.placeholders[id(p)] = torch.full((1,), float("nan"), dtype=p.dtype, device=p.device).expand(p.shape)
                p.data = self.placeholders[id(p)]

    # ------------------------------------------------------------------ the graph

    def instrument(self, gm: fx.GraphModule) -> None:
        """Read every sharded parameter through its bucket's gather node; release the bucket after its last read
        (of the parameter or of a view of it: a view read later would be saved whole, not as a handle)."""
        take_over(gm)
        _BY_MODULE[gm] = self
        self.module = weakref.ref(gm)
        where = {id(p): (k, i) for k, b in enumerate(self.buckets) for i, p in enumerate(b.params)}
        nodes = list(gm.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        reads: dict[int, list[list[fx.Node]]] = {k: [[] for _ in b.params] for k, b in enumerate(self.buckets)}
        for n in nodes:
            if n.op == "get_attr":
                obj = gm
                for part in n.target.split("."):
                    obj = getattr(obj, part)
                if id(obj) in where:
                    k, i = where[id(obj)]
                    reads[k][i].append(n)
        unread = [name for k, b in enumerate(self.buckets) for i, name in enumerate(b.names) if not reads[k][i]]
        if unread:
            raise MoecompileError(
                f"parallel.shard_parameters: the graph does not read parameter(s) {unread[:3]} itself (a submodule "
                "reads them), so their gathers cannot be placed; set parallel.shard_parameters: false")
        span: dict[int, tuple[int, int]] = {}
        releases = {}
        for k, per_param in reads.items():
            nodes = [g for gs in per_param for g in gs]
            first = min([u for g in nodes for u in g.users] or nodes, key=order.__getitem__)
            last = max([u for g in nodes for u in readers(g)] or nodes, key=order.__getitem__)  # views too
            span[k] = (order[first], order[last])
            for getattrs in per_param:  # a read of a parameter has no inputs: it may move up to the gather
                for g in getattrs:
                    first.prepend(g)
            with gm.graph.inserting_before(first):
                call = gm.graph.call_function(gather_bucket, (self.key, k, *[gs[0] for gs in per_param]))
                call.meta["val"] = tuple(gs[0].meta.get("val") for gs in per_param)
                for i, getattrs in enumerate(per_param):
                    item = gm.graph.call_function(operator.getitem, (call, i))
                    item.meta["val"] = getattrs[0].meta.get("val")  # the parameter's: analyses read shapes here
                    for g in getattrs:
                        for u in list(g.users):
                            if u is not call:
                                u.replace_input_with(g, item)
            with gm.graph.inserting_before(last) if last.op == "output" else gm.graph.inserting_after(last):
                releases[k] = gm.graph.call_function(release_bucket, (self.key, k))
        self.order = {False: sorted(span, key=lambda k: span[k][0]), True: sorted(span, key=lambda k: -span[k][1])}
        if self.order[True]:
            releases[self.order[True][0]].args = (self.key, self.order[True][0], True)
        gm.graph.lint()
        gm.recompile()
        self._guard = gm.register_state_dict_pre_hook(self._check_whole)

    def _check_whole(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        require_whole(module, "state_dict (or step.save(path), which writes each rank's ranges)")

    # ------------------------------------------------------------------ gathers

    def _start(self, k: int) -> None:
        if k in self.whole or k in self.pending:
            return
        b = self.buckets[k]
        buffer = torch.empty(b.numel, dtype=b.dtype, device=b.param_own.device)
        lo, hi = b.own
        buffer[lo:hi].copy_(b.param_own)
        self.pending[k] = (buffer, start_all_gather(b, buffer))
        self.gathers += 1
        self._gathered.add(buffer)
        if not self.held:
            self.peak_bytes = max(self.peak_bytes, self.alive_bytes())

    def ensure(self, k: int, backward: bool = False) -> torch.Tensor:
        """Bucket k whole (gathered now if it is not), and the next bucket this pass will need launched."""
        order, finished = self.order[backward], self.finished[backward]
        if not backward and order and k == order[0]:  # a forward begins
            finished.clear()
        if k not in self.whole:
            self._start(k)
            buffer, handles = self.pending.pop(k)
            for h in handles:
                self.buckets[k].wait(h, "parameter all-gather")
            self.whole[k] = buffer
            _LIVE[buffer.untyped_storage().data_ptr()] = (self, k)
        if not self.held and k in order:
            nxt = next((j for j in order[order.index(k) + 1 :] if j not in finished), None)
            if nxt is not None:
                self._start(nxt)
        return self.whole[k]

    def views(self, k: int) -> tuple[torch.Tensor, ...]:
        buffer = self.ensure(k)
        b = self.buckets[k]
        return tuple(buffer[o : o + p.numel()].view(p.shape) for o, p in zip(b.offsets, b.params))

    def release(self, k: int, backward: bool = False) -> None:
        """Drop this step's hold on bucket k (its memory goes once nothing else refers to it)."""
        if self.held:
            return
        self.finished[backward].add(k)
        if k in self.pending:  # a prefetch in flight: its collective must finish before the buffer can go
            for h in self.pending.pop(k)[1]:
                self.buckets[k].wait(h, "parameter all-gather")
        buffer = self.whole.pop(k, None)
        if buffer is not None:
            _LIVE.pop(buffer.untyped_storage().data_ptr(), None)

    def gradients_in(self, bucket: Any) -> None:
        """ZeRO-2's hook: every gradient of ``bucket`` has arrived, so backward is done with its parameters."""
        for k, b in enumerate(self.buckets):
            if b is bucket:
                self.release(k, backward=True)

    def release_all(self) -> None:
        """The end of a backward (or of ``gathered``): no bucket whole."""
        for k in list(self.whole) + list(self.pending):
            self.release(k)
        for done in self.finished.values():
            done.clear()

    def alive_bytes(self) -> int:
        """Bytes of gathered buckets alive now: held here, being gathered, or still referred to from elsewhere."""
        return sum(t.numel() * t.element_size() for t in self._gathered)

    def own_bytes(self) -> int:
        return sum(b.param_own.numel() * b.param_own.element_size() for b in self.buckets)

    def saving(self) -> contextlib.AbstractContextManager:
        """Autograd's saved tensors as handles while a forward runs (see ``_handle``)."""
        return torch.autograd.graph.saved_tensors_hooks(tensor_handles.pack, tensor_handles.unpack)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every bucket whole and in its parameters, on every rank (all ranks must enter it)."""
        if self.held:
            yield
            return
        self._gather_all()
        self.held = True
        try:
            for k, b in enumerate(self.buckets):
                for p, v in zip(b.params, self.views(k)):
                    p.data = v
            yield
        finally:
            for b in self.buckets:
                for p in b.params:
                    p.data = self.placeholders[id(p)]
            self.held = False
            self.release_all()

    def _gather_all(self) -> None:
        """Every bucket gathered (all launched, then waited on), none released."""
        self.release_all()
        for k in range(len(self.buckets)):
            self._start(k)
        for k in range(len(self.buckets)):
            self.ensure(k)

    def unshard(self) -> None:
        """Give the parameters back whole, for good (a later step on the same module takes them over)."""
        self._gather_all()
        for k, b in enumerate(self.buckets):
            for p, v in zip(b.params, self.views(k)):
                p.data = v.clone()
        self.release_all()
        module = self.module() if self.module is not None else None
        if module is not None:
            self._guard.remove()
            graph = module.graph
            for n in list(graph.nodes):
                if n.op == "call_function" and n.target is gather_bucket:
                    for item in list(n.users):
                        item.replace_all_uses_with(n.args[2 + item.args[1]])
                        graph.erase_node(item)
                    graph.erase_node(n)
                elif n.op == "call_function" and n.target is release_bucket:
                    graph.erase_node(n)
            module.recompile()
