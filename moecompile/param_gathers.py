"""``parallel.overlap_param_gather``: ZeRO-1/2's all-gather of the updated parameters runs behind the next forward.

After the optimizer, each sharded bucket's ranges are all-gathered into its parameters
(``GradBuckets.gather_params``). Waiting for them there leaves every rank idle for the whole exchange.
Here the step launches them and returns, and the graph waits for bucket k where the forward first
reads one of its parameters::

    wait_for_bucket(key, k)      # inserted before the first node reading a parameter of bucket k
    linear = torch.ops.aten.linear.default(x, w_q) ...

so bucket k's exchange overlaps the forward of everything before that read. Megatron-Core waits in
per-module forward pre-hooks; the graph knows each bucket's first read exactly (buckets are cut in
the graph's read order, so they are waited for one after another). A bucket no node reads is waited
for at the graph's start. Whatever reads the parameters outside the graph waits for all of them first:
the module's ``state_dict`` and ``load_state_dict`` (so ``step.save``, ``step.load``, ``export_hf``),
``step.gathered()``, a later step built on the module, and the step itself when it is freed.
Waiting is local (every rank launched the same collectives), so a read on one rank is safe.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .bucket_layout import param_reads, runtime_only
from .grad_sync import start_all_gather

_OWNERS: "weakref.WeakValueDictionary[int, InFlightGathers]" = weakref.WeakValueDictionary()
_BY_MODULE: "weakref.WeakKeyDictionary[nn.Module, InFlightGathers]" = weakref.WeakKeyDictionary()
_KEYS = itertools.count()


def wait_for_bucket(key: int, k: int) -> None:
    """The graph's wait for bucket k's all-gather, before its first read (see the module docstring)."""
    owner = _OWNERS.get(key)
    if owner is not None:  # a step that is gone waited for its gathers as it went
        owner.wait(k)


torch.fx.node.has_side_effect(wait_for_bucket)
runtime_only(wait_for_bucket)


def settle(module: nn.Module) -> None:
    """Wait for every all-gather still running into ``module``'s parameters (nothing if none is)."""
    owner = _BY_MODULE.get(module)
    if owner is not None:
        owner.settle()


def take_over(module: nn.Module) -> None:
    """A new step on ``module``: the earlier step's gathers are waited for and its wait nodes leave the graph."""
    owner = _BY_MODULE.pop(module, None)
    if owner is not None:
        owner.remove()


def _settle_hook(module: nn.Module, *args: Any, **kwargs: Any) -> None:
    settle(module)


def _wait_all(handles: dict[int, list]) -> None:
    for k in list(handles):
        for h in handles.pop(k):
            h.wait()


class InFlightGathers:
    """The sharded buckets' all-gathers, launched after the optimizer and waited for where the graph reads."""

    def __init__(self, buckets: list[Any]):
        self.key = next(_KEYS)
        _OWNERS[self.key] = self
        self.buckets = buckets
        self.handles: dict[int, list] = {}  # bucket -> its collectives still running
        self.order = list(range(len(buckets)))  # launched in the order the forward reads them (instrument)
        self._finalizer = weakref.finalize(self, _wait_all, self.handles)  # a freed step leaves none running
        self.module: weakref.ref | None = None
        self._hooks: list[Any] = []

    def start(self) -> None:
        """Launch every bucket's all-gather (this rank's updated range to every rank); nothing waits here."""
        self.settle()
        for k in self.order:  # a group runs its collectives in the order they were issued: the first read first
            self.handles[k] = start_all_gather(self.buckets[k], self.buckets[k].param_flat)

    def wait(self, k: int) -> None:
        for h in self.handles.pop(k, ()):
            self.buckets[k].wait(h, "parameter all-gather")

    def settle(self) -> None:
        for k in list(self.handles):
            self.wait(k)

    @property
    def running(self) -> list[int]:
        """The buckets whose all-gather has not been waited for."""
        return sorted(self.handles)

    def instrument(self, gm: fx.GraphModule) -> None:
        """Put bucket k's wait before the first node that reads any of its parameters (views of them read later
        need nothing: the parameter is whole once waited for)."""
        take_over(gm)
        _BY_MODULE[gm] = self
        self.module = weakref.ref(gm)
        first = {name: lo for name, (lo, _) in param_reads(gm).items()}
        nodes = list(gm.graph.nodes)
        top = next(n for n in nodes if n.op != "placeholder")
        at = {}
        for k, b in enumerate(self.buckets):
            reads = [first[name] for name in b.names if name in first]
            at[k] = min(reads, default=-1)
            with gm.graph.inserting_before(nodes[at[k]] if reads else top):
                gm.graph.call_function(wait_for_bucket, (self.key, k))
        self.order = sorted(at, key=at.__getitem__)  # buckets are cut in backward's order: this reverses it
        gm.graph.lint()
        gm.recompile()
        self._hooks = [gm.register_state_dict_pre_hook(_settle_hook), gm.register_load_state_dict_pre_hook(_settle_hook)]

    def remove(self) -> None:
        """Wait for everything, and take the wait nodes and hooks out of the module."""
        self.settle()
        module = self.module() if self.module is not None else None
        if module is None:
            return
        for h in self._hooks:
            h.remove()
        for n in list(module.graph.nodes):
            if n.op == "call_function" and n.target is wait_for_bucket:
                module.graph.erase_node(n)
        module.recompile()
