"""Activation memory from fake tensors before anything runs (``profile_activations``), and measured.

The recompute and fp8 passes plan with ``profile_activations``; ``estimate_memory``
(moecompile/memory_estimate.py) adds parameters, gradients and optimizer state per rank.

**Peak activation memory**, precisely: the bytes of distinct tensor storages the
forward pass leaves alive for backward, on this rank, at the moment forward
ends — every tensor autograd saved (for a recompute region: only its inputs),
plus the graph's outputs; each storage counted
once however many views or ops share it; parameters and buffers excluded. This
is the high-water mark of activation memory in a training step up to transient
workspace: one op's scratch, one recompute region re-materialised in backward,
and activation gradients. Saved tensors an offload region moves to host count
as ``offloaded`` (host bytes), not as device activations.

How: the graph runs under ``FakeTensorMode`` with autograd on and a
``saved_tensors_hooks`` pack hook that records each saved storage, the node
that made it (its layer and category: attention, router, experts, permutation,
layernorm, mlp, embedding, other) and the node that saved it. No real compute.
``measure_memory`` measures the same quantity on a real run (CPU: allocator
events from ``torch.profiler``; CUDA: ``torch.cuda`` allocator stats), which
``tests/test_memory.py`` compares with the estimate.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses import FakeTensorMode

from .bucket_layout import analysed_value
from .costs import node_flops
from .errors import MoecompileError
from .graph import module_path
from .meta import Role, moe

CATEGORIES = ("attention", "router", "experts", "permutation", "layernorm", "mlp", "embedding", "other")
_ROLE_CATEGORY = {
    Role.ROUTER: "router", Role.ROUTE: "router", Role.ROUTER_LOSS: "router",
    Role.EXPERTS: "experts", Role.EXPERT_ACT: "experts", Role.SHARED_EXPERTS: "experts",
    Role.PERMUTE: "permutation", Role.COMBINE: "permutation", Role.DISPATCH: "permutation",
    Role.COMBINE_COMM: "permutation", Role.COLLECTIVE_START: "permutation", Role.COLLECTIVE_WAIT: "permutation",
    Role.FFN: "mlp",
}


# ---------------------------------------------------------------- where a tensor comes from


def category(node: fx.Node) -> str:
    """Which bucket a node's activations go in: its MoE role, else the module it was traced from."""
    role = moe(node).get("role")
    if role in _ROLE_CATEGORY:
        return _ROLE_CATEGORY[role]
    stack = node.meta.get("nn_module_stack") or {}
    types = [str(t).rsplit(".", 1)[-1] for _p, t in stack.values()]
    if node.op == "placeholder":
        return "other"
    if any("Attention" in t for t in types):
        return "attention"
    if types and "Norm" in types[-1]:
        return "layernorm"
    if types and types[-1].endswith("Embedding") and "Rotary" not in types[-1]:
        return "embedding"
    if any(t.endswith("MLP") for t in types):
        return "mlp"
    return "other"


def layer_of(node: fx.Node) -> str:
    """The transformer layer (``model.layers.3``) or top-level module (``lm_head``) a node belongs to."""
    path = moe(node).get("layer") or module_path(node)
    m = re.match(r"(.*?\.\d+)(?:\.|$)", path)
    return m.group(1) if m else (path or "(model)")


# ---------------------------------------------------------------- the fake run


@dataclasses.dataclass
class SavedTensor:
    """One storage autograd keeps until backward."""

    nbytes: int
    producer: str  # node that made the storage (or, made inside an op, the node that saved it)
    layer: str
    category: str
    savers: set[str] = dataclasses.field(default_factory=set)  # nodes keeping it on the device
    host_savers: set[str] = dataclasses.field(default_factory=set)  # nodes that offloaded it

    @property
    def on_device(self) -> bool:
        return bool(self.savers)


@dataclasses.dataclass
class ActivationProfile:
    """What one forward keeps for backward, storage by storage, plus every node's cost."""

    tensors: dict[int, SavedTensor]
    outputs: set[int]  # storages the graph returns
    uses: dict[str, set[int]]  # node -> storages of its tensor inputs (parameters excluded)
    produced: dict[str, set[int]]  # node -> storages it made
    flops: dict[str, int]  # node -> forward FLOPs (one per output element where torch has no formula)
    sizes: dict[int, int] = dataclasses.field(default_factory=dict)  # storage -> bytes, every storage seen

    @property
    def device_bytes(self) -> int:
        return sum(t.nbytes for k, t in self.tensors.items() if t.on_device or k in self.outputs)

    @property
    def host_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values() if t.host_savers)

    def split(self, by: str) -> dict[str, int]:
        out: collections.Counter[str] = collections.Counter()
        for k, t in self.tensors.items():
            if t.on_device or k in self.outputs:
                out[getattr(t, by)] += t.nbytes
        return dict(out)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _FakeRun:
    """Runs a graph on fake tensors, node by node, recording what autograd saves."""

    def __init__(self, root: torch.nn.Module, mode: FakeTensorMode | None, ep: int = 1):
        self.root, self.mode, self.ep = root, mode, ep
        self.tensors: dict[int, SavedTensor] = {}
        self.keep: list[torch.Tensor] = []  # fake storages stay alive, so their ids stay unique
        self.params: set[int] = set()
        self.producer: dict[int, fx.Node] = {}
        self.uses: dict[str, set[int]] = {}
        self.produced: dict[str, set[int]] = {}
        self.flops: dict[str, int] = {}
        self.sizes: dict[int, int] = {}
        self.saving: fx.Node | None = None
        self.where = "device"  # "device" | "host" (offload region) | "drop" (recompute region)
        self.min_host_bytes = 0
        self.skip: set[int] = set()  # storages a recompute boundary keeps a handle to, not the tensor

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.saving is not None and isinstance(t, torch.Tensor) and self.where != "drop":
            key = _storage(t)
            if key not in self.params and key not in self.skip:
                nbytes = t.untyped_storage().nbytes()
                self.record(key, t, self.saving, "host" if self.where == "host" and nbytes >= self.min_host_bytes else "device")
        return t

    def record(self, key: int, t: torch.Tensor, saver: fx.Node, where: str) -> None:
        if key not in self.tensors:
            src = self.producer.get(key, saver)
            self.tensors[key] = SavedTensor(t.untyped_storage().nbytes(), src.name, layer_of(src), category(src))
            self.keep.append(t)
        (self.tensors[key].host_savers if where == "host" else self.tensors[key].savers).add(saver.name)

    def attr(self, node: fx.Node) -> Any:
        target = str(node.target)
        if self.mode is None:  # a real run: the module's own tensors
            obj: Any = self.root
            for part in target.split("."):
                obj = getattr(obj, part)
            if isinstance(obj, torch.Tensor):
                self.params.add(_storage(obj))
            return obj
        val = node.meta.get("val")
        try:
            is_param: bool | None = self.root.get_parameter(target).requires_grad
        except AttributeError:
            is_param = None
        if not isinstance(val, torch.Tensor):
            obj = self.root
            for part in target.split("."):
                obj = getattr(obj, part)
            if not isinstance(obj, torch.Tensor):
                return obj
            val = obj
        if is_param is None:  # not on the final module (an earlier pass's snapshot): a weight if float
            is_param = val.is_floating_point() and not target.endswith(("_history", "inv_freq"))
        with self.mode:
            t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        t.requires_grad_(bool(is_param))
        self.params.add(_storage(t))
        return t

    def run(self, graph: fx.Graph, args: list[Any], root: torch.nn.Module | None = None) -> Any:
        root = root or self.root
        env: dict[fx.Node, Any] = {}
        args_iter = iter(args)
        for node in graph.nodes:
            if node.op == "placeholder":
                value = next(args_iter)
                fake = self.mode is not None and isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor)
                env[node] = self.mode.from_tensor(value) if fake else value
            elif node.op == "get_attr":
                env[node] = self.attr(node) if root is self.root else getattr(root, str(node.target))
            elif node.op == "output":
                return fx.node.map_arg(node.args[0], lambda n: env[n])
            elif (rows := self.balanced_rows(node, env)) is not None:
                env[node] = rows
            else:
                a = fx.node.map_arg(node.args, lambda n: env[n])
                kw = fx.node.map_arg(node.kwargs, lambda n: env[n])
                self.uses[node.name] = {_storage(t) for t in pytree.tree_leaves((a, kw)) if isinstance(t, torch.Tensor)} - self.params
                self.saving, outer = node, self.saving
                try:
                    env[node] = self.call(node, root, a, kw)
                finally:
                    self.saving = outer
            self.note(node, env[node])
        raise MoecompileError("graph has no output node")

    def balanced_rows(self, node: fx.Node, env: dict[fx.Node, Any]) -> int | None:
        """A dropless expert-parallel split read to the host (``_local_scalar_dense``) has no value on
        fake tensors: take balanced routing, the layer's permuted rows N over ep (rows to/from each rank)."""
        if self.mode is None or self.ep <= 1 or node.target is not torch.ops.aten._local_scalar_dense.default:
            return None
        if "balanced" in node.meta.get("moe", {}):  # the dispatcher said what balance means for it (ep_dedup)
            return int(node.meta["moe"]["balanced"])
        seen, stack = set(), list(node.all_input_nodes)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.target is torch.ops.moecompile.permute.default and isinstance(env.get(n), (tuple, list)):
                return int(env[n][0].shape[0]) // self.ep
            stack.extend(n.all_input_nodes)
        return None

    def call(self, node: fx.Node, root: torch.nn.Module, a: tuple, kw: dict) -> Any:
        inserted, value = analysed_value(node.target, a)  # a training step's own nodes (ZeRO-3's gathers...)
        if inserted:
            return value
        if node.op == "call_function":
            saving, self.saving = self.saving, None  # node_flops may run the op on meta["val"]s
            try:
                self.flops[node.name] = node_flops(node) or 0
            finally:
                self.saving = saving
            return node.target(*a, **kw)  # type: ignore[operator]
        module = root.get_submodule(str(node.target))
        kind = getattr(module, "memory_region", None)
        if kind == "recompute":  # passes/regions.py RecomputeRegion: checkpointed R, then its consumers
            return module.run_parts(
                a, lambda gm, args: self.inside(gm, args, "drop", inputs_saved_by=node),
                lambda gm, args, gm_r, r_args, rng, r_out: self.inside(gm, args, "device", skip=r_out),
            )
        if kind == "offload":
            return self.inside(module.graph_module, list(a), "host", min_bytes=module.min_bytes)
        return module(*a, **kw)

    def inside(self, gm: fx.GraphModule, args: list[Any], where: str, *, inputs_saved_by: fx.Node | None = None,
               skip: tuple = (), min_bytes: int = 0) -> Any:
        """Run a region's graph: "drop" (recomputed: only its inputs stay, saved by checkpoint), "host"
        (offloaded), or "device" with the storages in ``skip`` not kept (the recompute boundary)."""
        if inputs_saved_by is not None:
            for t in args:
                if isinstance(t, torch.Tensor) and _storage(t) not in self.params:
                    self.record(_storage(t), t, inputs_saved_by, "device")
        outer = self.where, self.min_host_bytes, self.skip
        self.where, self.min_host_bytes = where, min_bytes
        self.skip = self.skip | {_storage(t) for t in skip if isinstance(t, torch.Tensor)}
        try:
            return self.run(gm.graph, list(args), root=gm)
        finally:
            self.where, self.min_host_bytes, self.skip = outer

    def note(self, node: fx.Node, value: Any) -> None:
        made: set[int] = set()
        size = 0
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                key = _storage(t)
                if key not in self.producer and key not in self.params:
                    self.producer[key] = node
                    self.keep.append(t)  # a freed fake storage's id could be reused by a later one
                    self.sizes[key] = t.untyped_storage().nbytes()
                    made.add(key)
                    size += t.untyped_storage().nbytes()
        self.produced[node.name] = made
        if node.op == "call_function" and not self.flops.get(node.name):
            self.flops[node.name] = sum(t.numel() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def profile_activations(graph: fx.Graph, root: torch.nn.Module, inputs: list[Any], *, real: bool = False,
                        ep: int = 1) -> ActivationProfile:
    """Run ``graph`` (nodes resolved against ``root``) on fake ``inputs``; see the module doc.

    ``real=True`` runs it for real instead (same accounting): a measurement, node by node.
    ``ep``: the graph's expert-parallel degree; a dropless dispatch's data-dependent splits are
    then taken as balanced (each rank sends and receives N/ep of a layer's N permuted rows).
    """
    mode = None if real else FakeTensorMode(allow_non_fake_inputs=True)
    run = _FakeRun(root, mode, ep)  # type: ignore[arg-type]
    with mode or contextlib.nullcontext(), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(run.pack, lambda t: t):
        out = run.run(graph, list(inputs))
    outputs = {_storage(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)} - run.params
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and _storage(t) in outputs and _storage(t) not in run.tensors:
            src = run.producer.get(_storage(t))
            run.tensors[_storage(t)] = SavedTensor(t.untyped_storage().nbytes(), src.name if src else "output",
                                                   layer_of(src) if src else "(model)", category(src) if src else "other")
    return ActivationProfile(run.tensors, outputs, run.uses, run.produced, run.flops, run.sizes)


# ---------------------------------------------------------------- the measurement


@dataclasses.dataclass
class MeasuredMemory:
    """Real bytes of one step: ``retained`` is the quantity ``estimate_memory().activations`` predicts."""

    retained: int  # allocated during forward and still alive when it ends
    peak: int  # highest allocation above the start, forward and backward
    forward_s: float
    backward_s: float


def measure_memory(forward: Callable[[], Any], backward: Callable[[Any], None] | None = None,
                   device: torch.device | str = "cpu") -> MeasuredMemory:
    """Run ``forward()`` (then ``backward(out)``) and measure what forward leaves alive, and the peak."""
    import time

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        out = forward()
        torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        retained = torch.cuda.memory_allocated(device) - base
        if backward is not None:
            backward(out)
            torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        return MeasuredMemory(retained, torch.cuda.max_memory_allocated(device) - base, t1 - t0, t2 - t1)
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter()
        with record_function("moecompile.measure.forward"):
            out = forward()
        t1 = time.perf_counter()
        if backward is not None:
            backward(out)
        t2 = time.perf_counter()
    events = list(prof.profiler.kineto_results.events())  # type: ignore[union-attr]
    fwd_end = max(e.end_ns() for e in events if e.name() == "moecompile.measure.forward")
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    current = peak = retained = 0
    for t, n in mem:
        current += n
        peak = max(peak, current)
        if t <= fwd_end:
            retained = current
    return MeasuredMemory(retained, peak, t1 - t0, t2 - t1)
