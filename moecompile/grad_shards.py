"""ZeRO-2 (``parallel.shard_gradients``): a rank keeps the gradients of its own range only.

ZeRO-1 (``parallel.shard_optimizer``) still accumulates every gradient whole in the flat
buckets. Here backward's gradients pass through instead::

    backward: grad of p  ->  post-accumulate hook: copy into p's bucket (a whole buffer, allocated
              when its first gradient arrives), free p.grad
    bucket complete (and every bucket before it sent: all ranks send in one order)
              ->  reduce-scatter into this rank's range, which accumulates over micro-batches;
                  the buffer goes back to the allocator once the collective is done
    end of backward: buckets whose parameters got no gradient are sent as they are (zeros)

so a rank holds 1/d of the gradients plus the buckets in flight: those backward fills side by
side and up to ``in_flight`` being reduce-scattered, with the ranges they receive (``peak_bytes``,
which moecompile.memory_shards.in_flight_peak reproduces on meta tensors), where ZeRO-1 holds all
of them. The allocator is the pool: CUDA's caching allocator, or glibc keeping freed blocks
(build_train_step's keep_host_memory). A pool of bucket buffers of our own costs memory: a buffer
it keeps idle for a later bucket is alive, where a freed block serves any allocation, and one it
hands to a smaller bucket is busy when the big bucket comes (the embedding, after the layers).
The optimizer, its state and the all-gather of the parameters are ZeRO-1's. Reduce-scattering per
micro-batch rounds the sum over micro-batches per rank range rather than per element of a whole
bucket, the one difference from ZeRO-1's numbers.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.nn as nn

from . import grad_hooks

IN_FLIGHT = 2  # buckets whose reduce-scatter may still be running while backward fills the next


class GradientShards:
    """Backward's gradients, reduce-scattered bucket by bucket into each sharded bucket's own range."""

    def __init__(self, buckets: Any, first_use: dict[str, int], in_flight: int = IN_FLIGHT,
                 exchange: bool | None = None, hooks: bool = True):
        """``exchange``: every collective is gloo's blocking exchange (None: ask each bucket's group).
        ``hooks``: backward calls :meth:`arrived` (False: the caller does, as memory_shards' simulation)."""
        from .bucket_layout import completion_order
        from .grad_sync import _is_gloo

        self.owner = buckets
        self.buckets = completion_order([b for b in buckets.buckets if b.shards > 1], first_use)  # sent in it
        self.in_flight = in_flight
        self.where: dict[int, tuple[Any, int]] = {}
        self.gaps: dict[int, list[tuple[int, int]]] = {}  # per bucket: the alignment padding, summed as zeros
        for b in self.buckets:
            ends = [(o, o + p.numel()) for o, p in zip(b.offsets, b.params)] + [(b.numel, b.numel)]
            self.gaps[id(b)] = [(end, nxt) for (_, end), (nxt, _) in zip(ends, ends[1:]) if nxt > end]
            lo, hi = b.own
            b.grad = torch.zeros(hi - lo, dtype=b.flat.dtype, device=b.flat.device)
            b.flat = None  # the whole bucket exists only while backward fills it
            b.views = []
            for i, p in enumerate(b.params):
                self.where[id(p)] = (b, i)
            if hooks:
                grad_hooks.watch(self, b.params)
        self.exchange = {id(b): _is_gloo(b.group) if exchange is None else exchange for b in self.buckets}
        self.pending: collections.deque = collections.deque()
        self.received: dict[int, set[int]] = {id(b): set() for b in self.buckets}
        self.sent = 0  # buckets sent this backward, in order
        self.on_bucket_done: Any = None  # called with a bucket once all its gradients arrived (ZeRO-3 releases it)
        self.peak_bytes = 0  # most bytes of whole buckets alive at once: filling, or in a collective

    def prepare(self) -> None:
        """Before a step: no gradient kept yet, nothing sent (whatever a step that raised midway left behind)."""
        self.sent = 0
        self.pending.clear()
        for b in self.buckets:
            b.grad.zero_()
            b.flat = None
            self.received[id(b)].clear()
            for p in b.params:
                p.grad = None

    def arrived(self, p: nn.Parameter) -> None:
        b, i = self.where[id(p)]
        if b.flat is None:
            b.flat = self._new(b)
        off = b.offsets[i]
        b.flat[off : off + p.numel()].view_as(p).copy_(p.grad)
        p.grad = None  # the whole gradient lives on only in the bucket
        self.received[id(b)].add(i)
        if self.on_bucket_done is not None and len(self.received[id(b)]) == len(b.params):
            self.on_bucket_done(b)
        while self.sent < len(self.buckets) and len(self.received[id(self.buckets[self.sent])]) == \
                len(self.buckets[self.sent].params):
            self._send(self.buckets[self.sent])

    def finish_backward(self) -> None:
        """After a backward: send what is left in order (parameters without a gradient are zeros), wait for all."""
        while self.sent < len(self.buckets):
            self._send(self.buckets[self.sent])
        while self.pending:
            self._finish_one()
        self.sent = 0
        for b in self.buckets:
            self.received[id(b)].clear()

    def _send(self, b: Any) -> None:
        if b.flat is None:
            b.flat = self._new(b)
        for i, p in enumerate(b.params):  # no gradient this backward: it contributes zeros
            if i not in self.received[id(b)]:
                b.flat[b.offsets[i] : b.offsets[i] + p.numel()].zero_()
        for lo, hi in self.gaps[id(b)]:  # a new buffer holds anything there
            b.flat[lo:hi].zero_()
        out = torch.empty_like(b.grad)
        self._note_peak(out)
        handle = self.owner.launch(b, out)
        self.pending.append((b, handle, out, b.flat))
        b.flat = None
        self.sent += 1
        if handle is None or len(self.pending) > self.in_flight:  # an exchange has finished already
            self._finish_one()

    def _finish_one(self) -> None:
        b, handle, out, _ = self.pending.popleft()  # its whole buffer goes with it, the collective done
        if handle is not None:
            b.wait(handle, "gradient reduce-scatter")
        b.grad.add_(out)

    def _new(self, b: Any) -> torch.Tensor:
        """A whole buffer for bucket ``b``, from the allocator."""
        buffer = torch.empty(b.numel, dtype=b.grad.dtype, device=b.grad.device)
        self._note_peak(buffer)
        return buffer

    def in_flight_bytes(self, new: torch.Tensor | None = None) -> int:
        """Bytes of whole bucket buffers alive now (and ``new``, just allocated): those backward is filling, and
        those of collectives in flight with the ranges they receive."""
        held = [*(b.flat for b in self.buckets if b.flat is not None),
                *(t for entry in self.pending for t in entry[2:])] + ([] if new is None else [new])
        return sum(t.numel() * t.element_size() for t in held)

    def _note_peak(self, new: torch.Tensor) -> None:
        self.peak_bytes = max(self.peak_bytes, self.in_flight_bytes(new))
