"""The modules the ``recompute`` pass outlines graph regions into: recompute and offload.

``RecomputeRegion``: a region R recomputed in backward, and its consumers C (the
nodes outside R that save one of R's outputs for backward)::

    outs_R = checkpoint(R, *inputs_R, use_reentrant=False)     # R keeps only its inputs
    with saved_tensors_hooks(pack=handle for R's outputs, unpack=recompute R):
        outs_C = C(*outs_R, ...)                                # C runs as before

so neither R's internals nor R's outputs stay alive until backward (Megatron's
"checkpoint without output"): R runs again, under no_grad with the forward's
RNG state, the first time backward unpacks one of R's outputs, and inside
``checkpoint`` for R's own backward. Values are bit-identical, so gradients are.

``OffloadRegion``: the region runs under ``saved_tensors_hooks`` that copy each
saved tensor (at least ``min_bytes``, not a parameter) to host memory — pinned,
on a side stream, on CUDA — and copy it back when backward needs it.

Both expose ``memory_region`` ("recompute" | "offload") so ``moecompile.memory``
can account for them without running anything.
"""

from __future__ import annotations

import contextlib
import operator
import re
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.utils.fuser_utils import fuse_as_graphmodule
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from moecompile import tensor_handles
from moecompile.meta import copy_moe


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _seeded(gm: fx.GraphModule) -> bool:
    """Does the region draw random numbers (dropout)? Then its recompute must replay the RNG."""
    return any(
        n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
        for n in gm.graph.nodes
    )


class _Boundary:
    """Saved-tensor hooks that keep a handle instead of R's outputs, and recompute R to unpack one.

    Every saved-tensor hook here runs eagerly (dynamo-disabled): autograd calls it from C++ inside a compiled
    forward's eager parts, where dynamo compiled it as a frame of its own once per tensor rank, up to its
    recompile limit, for hooks that read storage pointers anyway."""

    def __init__(self, fn: Callable, args: list[Any], rng: Any, outs: tuple):
        self.fn, self.args, self.rng = fn, tensor_handles.pack_all(args), rng
        self.keys = {_storage(o): i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)}
        self.values: tuple | None = None

    @torch._disable_dynamo
    def pack(self, t: torch.Tensor) -> Any:
        i = self.keys.get(_storage(t))
        return tensor_handles.pack(t) if i is None else (i, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    @torch._disable_dynamo
    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return tensor_handles.unpack(packed)
        i, size, stride, offset = packed
        if self.values is None:
            with torch.no_grad(), _replay(self.rng):
                self.values = self.fn(*[tensor_handles.unpack(a) for a in self.args])
        return self.values[i].as_strided(size, stride, offset)


def _rng_state(args: list[Any]) -> Any:
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices]


@contextlib.contextmanager
def _replay(rng: Any):
    if rng is None:
        yield
        return
    cpu, cuda = rng
    with torch.random.fork_rng(devices=[d for d, _ in cuda]):
        torch.set_rng_state(cpu)
        for d, state in cuda:
            torch.cuda.set_rng_state(state, d)
        yield


class RecomputeRegion(nn.Module):
    """A recomputed region and its consumers, outlined from the graph (see the module doc)."""

    memory_region = "recompute"

    def __init__(self, unit: fx.GraphModule, recompute: set[str], kinds: list[str]):
        super().__init__()
        self.kinds = list(kinds)
        nodes = [n for n in unit.graph.nodes if n.op not in ("placeholder", "output")]
        r_nodes = [n for n in nodes if n.name in recompute]
        c_nodes = [n for n in nodes if n.name not in recompute]
        self.recompute, r_in, r_out = fuse_as_graphmodule(unit, r_nodes, "Recompute", always_return_tuple=True)
        self._in = [n.name for n in unit.graph.nodes if n.op == "placeholder"]
        self._r_in, self._r_out = [n.name for n in r_in], [n.name for n in r_out]
        self.consumers = None
        self._c_in: list[str] = []
        self._c_out: list[str] = []
        if c_nodes:
            self.consumers, c_in, c_out = fuse_as_graphmodule(unit, c_nodes, "Consumers", always_return_tuple=True)
            self._c_in, self._c_out = [n.name for n in c_in], [n.name for n in c_out]
        out = unit.graph.output_node().args[0]
        self._out = [n.name for n in (out if isinstance(out, (tuple, list)) else (out,))]
        self._seeded = _seeded(self.recompute)

    def run_parts(self, args: tuple, run_r: Callable, run_c: Callable) -> tuple:
        """Wire the two parts; ``run_r(gm_r, args)`` and ``run_c(gm_c, args, gm_r, r_args, rng, r_outs)`` run them."""
        env = dict(zip(self._in, args))
        r_args = [env[n] for n in self._r_in]
        rng = _rng_state(r_args) if self._seeded and self.consumers is not None else None
        r_out = run_r(self.recompute, r_args)
        env.update(zip(self._r_out, r_out))
        if self.consumers is not None:
            c_args = [env[n] for n in self._c_in]
            env.update(zip(self._c_out, run_c(self.consumers, c_args, self.recompute, r_args, rng, r_out)))
        return tuple(env[n] for n in self._out)

    def forward(self, *args: Any) -> tuple:
        return self.run_parts(args, _checkpointed, _bounded)


def _checkpointed(gm: fx.GraphModule, args: list[Any]) -> tuple:
    """``checkpoint(gm, *args)``, holding tensors a runtime frees (ZeRO-3's gathered parameters) as handles until
    the recompute."""
    held = tensor_handles.pack_all(args)
    kept = [i for i, (h, a) in enumerate(zip(held, args)) if h is a]
    if len(kept) == len(args):
        return checkpoint(gm, *args, use_reentrant=False)
    first = [list(args)]  # the forward's own tensors, used once
    grads = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]

    def run(*rest: Any) -> tuple:
        if first:
            return gm(*first.pop())
        full = list(held)
        for i, t in zip(kept, rest):
            full[i] = t
        for i in sorted(set(range(len(held))) - set(kept)):  # recomputing must save what the forward saved
            full[i] = tensor_handles.unpack(held[i]).requires_grad_(grads[i])
        return gm(*full)

    return checkpoint(run, *[args[i] for i in kept], use_reentrant=False)


def _bounded(gm: fx.GraphModule, args: list[Any], gm_r: fx.GraphModule, r_args: list[Any], rng: Any, r_out: tuple) -> tuple:
    boundary = _Boundary(gm_r, r_args, rng, r_out)
    with torch.autograd.graph.saved_tensors_hooks(boundary.pack, boundary.unpack):
        return gm(*args)


class OffloadRegion(nn.Module):
    """A region whose saved activations live in host memory between forward and backward."""

    memory_region = "offload"

    def __init__(self, graph_module: fx.GraphModule, min_bytes: int, kinds: list[str]):
        super().__init__()
        self.graph_module, self.min_bytes, self.kinds = graph_module, min_bytes, list(kinds)

    def forward(self, *args: Any) -> Any:
        # one host copy per saved view, however many ops save it; a storage freed in the region may be
        # allocated again at the same address, so a copy is reused only while its storage is alive
        packed: dict[tuple, tuple[StorageWeakRef, Any]] = {}

        @torch._disable_dynamo  # a saved-tensor hook: eager (see _Boundary)
        def pack(t: torch.Tensor) -> Any:
            held = tensor_handles.pack(t)
            if held is not t or t.numel() * t.element_size() < self.min_bytes or _is_parameter(t):
                return held
            key = (_storage(t), t.storage_offset(), tuple(t.size()), tuple(t.stride()))
            if key not in packed or packed[key][0].expired():
                packed[key] = (StorageWeakRef(t.untyped_storage()), _to_host(t))
            return packed[key][1]

        with torch.autograd.graph.saved_tensors_hooks(pack, _from_host):
            return self.graph_module(*args)


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


_STREAMS: dict[int, Any] = {}


def _to_host(t: torch.Tensor) -> Any:
    if not t.is_cuda:  # on CPU "host" is the same memory: a copy keeps the code path honest
        return ("host", t.device, t.detach().clone(), None)
    stream = _STREAMS.setdefault(t.device.index or 0, torch.cuda.Stream(t.device))
    host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the allocator must not reuse t's memory before the copy ends
        done = stream.record_event()
    return ("host", t.device, host, done)


@torch._disable_dynamo
def _from_host(packed: Any) -> torch.Tensor:
    if not isinstance(packed, tuple):
        return tensor_handles.unpack(packed)
    _tag, device, host, done = packed
    if done is None:
        return host
    torch.cuda.current_stream(device).wait_event(done)
    return host.to(device, non_blocking=True)


# ---------------------------------------------------------------- outlining


def outline(gm: fx.GraphModule, nodes: set[fx.Node], make, name: str, meta: dict) -> fx.Node:
    """Replace ``nodes`` (convex) by one call_module of ``make(fused GraphModule)``."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    ordered = sorted(nodes, key=order.__getitem__)
    sub, inputs, outputs = fuse_as_graphmodule(gm, ordered, "Unit", always_return_tuple=True)
    name = re.sub(r"\W", "_", name)
    while hasattr(gm, name):
        name += "_"
    gm.add_submodule(name, make(sub))
    users = [u for o in outputs for u in o.users if u not in nodes]
    first_user = min(users, key=order.__getitem__) if users else ordered[-1].next
    with gm.graph.inserting_before(first_user):
        call = gm.graph.call_module(name, tuple(inputs))
        outs = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    call.meta.update({k: ordered[0].meta[k] for k in ("nn_module_stack", "stack_trace") if k in ordered[0].meta})
    call.meta["moe"] = meta
    for orig, new in zip(outputs, outs):
        orig.replace_all_uses_with(new)
        new.meta.update({k: v for k, v in orig.meta.items() if k != "moe"})
        copy_moe(orig, new)
    for n in reversed(ordered):
        gm.graph.erase_node(n)
    return call


def stable_toposort(graph: fx.Graph) -> None:
    """Move each node just after its inputs where an outlined call landed before one of them."""
    emitted: set[fx.Node] = set()
    order: list[fx.Node] = []
    for root in list(graph.nodes):
        stack = [(root, False)]
        while stack:
            n, ready = stack.pop()
            if n in emitted:
                continue
            if ready:
                emitted.add(n)
                order.append(n)
                continue
            stack.append((n, True))
            stack.extend((a, False) for a in reversed(n.all_input_nodes) if a not in emitted)
    out = graph.output_node()
    for n in order:
        if n is not out:
            out.prepend(n)
