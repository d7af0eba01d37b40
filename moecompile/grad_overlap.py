"""``parallel.overlap_grad_reduce``: each gradient bucket's collective launched from backward, once it is complete.

Without it the step sums every bucket over its group after backward (``GradBuckets.sync``), while the
network idles through backward and the GPU through the sync. Here a post-accumulate hook per parameter
(moecompile.grad_hooks) counts the gradients backward has written into their bucket's flat buffer::

    backward: grad of p accumulated into its view of bucket b  ->  b complete, and every bucket before
              it launched (all ranks launch in one order: bucket_layout.completion_order)
              ->  all-reduce b (sharded: reduce-scatter it) asynchronously; backward goes on
    sync:     launch the buckets whose parameters got no gradient, wait for all, divide by dp

With micro-batches the gradients accumulate over every backward and only the last one's launch
(``arm`` before it), as DDP's ``no_sync`` does. The collectives, their inputs and their order
of results are the ones ``sync`` would launch, so the step computes the same numbers bitwise.
ZeRO-2's buckets (moecompile.grad_shards) are reduce-scattered from backward already and are not
counted here; nor is a ZeRO-1 bucket on gloo, whose reduce-scatter is a blocking exchange: launched from
backward it only stalls backward (+2 % a step in an early A/B), so ``sync`` runs it after backward.
The plan's default (null) turns all of this on for NCCL and off on gloo, where it measured as noise.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from . import grad_hooks


class OverlappedReduce:
    """The buckets a step sums over their groups, launched as the last backward completes them."""

    def __init__(self, owner: Any, buckets: list[Any]):
        self.owner = owner  # GradBuckets: it launches a bucket's collective
        self.buckets = buckets  # in completion order
        self.where = {id(p): (k, i) for k, b in enumerate(buckets) for i, p in enumerate(b.params)}
        self.received: list[set[int]] = [set() for _ in buckets]
        self.sent = 0
        self.handles: list[tuple[Any, Any]] = []  # (bucket, its collective) launched
        self.armed = False  # only the last micro-batch's backward launches; any other backward only accumulates
        for b in buckets:
            grad_hooks.watch(self, b.params)

    def reset(self) -> None:
        """A step begins: nothing launched, nothing armed, whatever a step that raised midway left behind."""
        self.sent, self.armed, self.handles = 0, False, []
        for got in self.received:
            got.clear()

    def arm(self) -> None:
        """The next backward is the step's last: launch each bucket it completes."""
        self.armed = True

    def arrived(self, p: nn.Parameter) -> None:
        if not self.armed:
            return
        k, i = self.where[id(p)]
        self.received[k].add(i)
        while self.sent < len(self.buckets) and len(self.received[self.sent]) == len(self.buckets[self.sent].params):
            self._launch_next()

    def finish(self) -> list[tuple[Any, Any]]:
        """Launch what backward did not complete (parameters without a gradient: their zeros count), in order;
        (bucket, handle) of every collective still to wait for."""
        while self.sent < len(self.buckets):
            self._launch_next()
        handles = self.handles
        self.reset()
        return handles

    def _launch_next(self) -> None:
        b = self.buckets[self.sent]
        handle = self.owner.launch(b)
        self.sent += 1
        if handle is not None:
            self.handles.append((b, handle))
