"""Memory per rank, estimated from fake tensors before anything runs: ``estimate_memory(result)``.

    est = mc.estimate_memory(result)            # the example batch; batch=8 or batch=(ids,) for another
    print(est)                                  # params / grads / optimizer / activations, by layer and category
    est.activations, est.by_category["experts"], est.by_pass[-1]

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

from .costs import human, node_flops
from .errors import MoecompileError
from .bucket_layout import expert_parameters, param_reads
from .graph import module_path
from .memory_shards import optimizer_ranks, ranged_bytes, sharded_state
from .meta import Role, moe

CATEGORIES = ("attention", "router", "experts", "permutation", "layernorm", "mlp", "embedding", "other")
_ROLE_CATEGORY = {
    Role.ROUTER: "router", Role.ROUTE: "router", Role.ROUTER_LOSS: "router",
    Role.EXPERTS: "experts", Role.EXPERT_ACT: "experts", Role.SHARED_EXPERTS: "experts",
    Role.PERMUTE: "permutation", Role.COMBINE: "permutation", Role.DISPATCH: "permutation",
    Role.COMBINE_COMM: "permutation", Role.COLLECTIVE_START: "permutation", Role.COLLECTIVE_WAIT: "permutation",
    Role.FFN: "mlp",
}
_OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "none": 0}


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


# ---------------------------------------------------------------- the estimate


@dataclasses.dataclass
class PassMemory:
    """Memory after one pass (``result.history``): how the pass changed it."""

    name: str
    params: int | None
    activations: int | None
    offloaded: int | None
    note: str = ""


@dataclasses.dataclass
class MemoryEstimate:
    """Bytes per rank for one training step at ``batch``; ``activations`` is the peak defined in the module doc."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int
    offloaded: int  # host bytes of offloaded activations
    by_category: dict[str, int]
    by_layer: dict[str, dict[str, int]]
    by_pass: list[PassMemory]
    tokens: int
    profile: ActivationProfile = dataclasses.field(repr=False)
    masters: int = 0  # fp32 master copies of low-precision parameters (build_train_step keeps them)
    expert_params: int = 0  # the part of ``params`` that is this rank's routed experts (E/ep of them)
    master_grads: int = 0  # the part of ``grads`` that is the masters' fp32 .grad
    shard_optimizer: bool = False  # optimizer, masters and master grads are this rank's range (ZeRO-1)
    dp: int = 1  # ranks the dense ranges are split over (the data-parallel world) when sharded
    edp: int = 1  # ranks the expert ranges are split over (dp / ep) when sharded
    shard_gradients: bool = False  # model-dtype grads are this rank's range too, + buckets in flight (ZeRO-2)
    in_flight_grads: int = 0  # the part of ``grads`` that is ZeRO-2's whole bucket buffers in flight
    shard_parameters: bool = False  # parameters are this rank's range too, + buckets gathered (ZeRO-3)
    in_flight_params: int = 0  # the part of ``params`` that is ZeRO-3's whole parameter buckets gathered

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.masters + self.buffers + self.activations

    def __str__(self) -> str:
        return self.table()

    def table(self) -> str:
        b = lambda n: "-" if n is None else human(n, "B", 1024)  # noqa: E731
        lines = [f"memory per rank ({self.tokens} tokens)",
                 f"  params {b(self.params)}  grads {b(self.grads)}  optimizer {b(self.optimizer)}  masters {b(self.masters)}  "
                 f"buffers {b(self.buffers)}  activations {b(self.activations)}  (offloaded to host {b(self.offloaded)})"]
        cats = [c for c in CATEGORIES if any(c in d for d in self.by_layer.values())]
        rows = [("layer", *cats, "total")]
        for layer, d in self.by_layer.items():
            rows.append((layer, *(b(d.get(c, 0)) for c in cats), b(sum(d.values()))))
        rows.append(("total", *(b(self.by_category.get(c, 0)) for c in cats), b(self.activations)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        if self.by_pass:
            lines.append("  after pass: " + ", ".join(f"{p.name} {b(p.activations)}" for p in self.by_pass))
        if self.shard_optimizer:
            what = ("params, optimizer, masters and all grads (parallel.shard_parameters)" if self.shard_parameters
                    else "optimizer, masters and all grads (parallel.shard_gradients)" if self.shard_gradients else
                    "optimizer, masters and their grads (parallel.shard_optimizer)")
            lines.append(f"  {what}: this rank's range, dense / dp={self.dp}, experts / edp={self.edp}")
        if self.in_flight_grads:
            lines.append(f"  grads include {b(self.in_flight_grads)} of whole gradient buckets in flight (ZeRO-2)")
        if self.in_flight_params:
            lines.append(f"  params include {b(self.in_flight_params)} of whole parameter buckets gathered (ZeRO-3)")
        return "\n".join(lines)


def _resize(t: Any, b0: int, b: int) -> Any:
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != b0:
        return t
    reps = -(-b // b0)
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:b]


def example_inputs(result: Any, batch: Any = None) -> list[Any]:
    """The graph's flat inputs: the example batch, resized to ``batch`` sequences, or ``batch`` itself."""
    args, kwargs = tuple(result.example_inputs), dict(result.example_kwargs)
    if isinstance(batch, int) and not isinstance(batch, bool):
        b0 = next((t.shape[0] for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor) and t.dim()), None)
        if b0 is not None and batch != b0:
            args, kwargs = pytree.tree_map(lambda t: _resize(t, b0, batch), (args, kwargs))
    elif batch is not None:
        args = batch if isinstance(batch, tuple) else (batch,)
    return pytree.tree_leaves((args, kwargs))


def estimate_memory(result: Any, batch: Any = None, *, optimizer: str = "adamw", state_dtype: torch.dtype | None = None,
                    master_weights: bool | None = None, by_pass: bool = True, shard_optimizer: bool | None = None,
                    dp: int | None = None, shard_gradients: bool | None = None, bucket_mb: float = 25.0,
                    shard_parameters: bool | None = None) -> MemoryEstimate:
    """Per-rank memory of ``result`` (a ConversionResult) for a training step; nothing real runs.

    On an expert-parallel graph (``parallel.ep`` > 1, converted on this rank) every figure is this
    rank's: parameters, gradients and optimizer states of its E/ep local experts plus the dense
    part, activations with the dispatch/combine exchange buffers (dropless splits taken as
    balanced routing). ``batch``: None (the example inputs), an int (that many sequences of the
    example's length), or the inputs themselves. ``optimizer``: adam | adamw (2 states per parameter) | sgd |
    sgd_momentum | none. ``master_weights``: fp32 master copies of the trainable parameters (and
    their fp32 gradients, counted in ``grads``); None does what ``build_train_step`` does: masters
    when any trainable parameter is not fp32. ``state_dtype``: the optimizer states' dtype; None
    is the dtype the optimizer sees (fp32 with masters, else each parameter's own, as torch.optim
    keeps them). ``by_pass``: also estimate activations after every pass in ``result.history``.

    ``shard_optimizer`` (None: ``plan.parallel.shard_optimizer``): ZeRO-1, the optimizer states,
    masters and the masters' grads are this rank's range only: dense parameters' over ``dp`` ranks,
    experts' over ``edp = dp / ep``; parameters and model-dtype grads stay whole (build_train_step's
    ranges also hold alignment padding: within 2 % on a tiny model). ``dp``: the data-parallel world
    size of the run to estimate; None takes the result's world (1 for a single-process conversion,
    where sharding changes nothing). A single-process ``ep=1`` conversion holds what every rank of an
    ``ep=1`` run holds, so ``dp=4`` estimates one rank of 4; for ``ep > 1`` convert under the world
    (or a fake process group) so the graph holds E/ep experts.

    ``shard_gradients`` (None: ``plan.parallel.shard_gradients``, or False when ``shard_optimizer=False``
    is passed): ZeRO-2, the model-dtype grads are this rank's range too, plus the whole bucket
    buffers in flight (``in_flight_grads``): IN_FLIGHT + 1 = 3 (or as many sharded buckets as there are)
    x the largest sharded bucket of ``bucket_mb`` (build_train_step's) or of one larger parameter; the
    bound build_train_step's pool stays under between steps on NCCL (gloo keeps 2). A bucket over a
    group of one rank (experts at edp = 1) stays whole.

    ``shard_parameters`` (None: ``plan.parallel.shard_parameters`` where shard_gradients is on): ZeRO-3, the
    parameters are this rank's range too, plus the whole buckets gathered (``in_flight_params``): the most
    at once as the runtime gathers them, simulated over the graph's reads (a bucket whole from its first read to
    its last, the next one prefetched; memory_shards.gathered_peak).
    """
    if optimizer not in _OPTIMIZER_STATES:
        raise MoecompileError(f"estimate_memory: optimizer {optimizer!r} unknown; use one of {', '.join(_OPTIMIZER_STATES)}")
    if state_dtype is not None and not isinstance(state_dtype, torch.dtype):
        raise MoecompileError(f"estimate_memory: state_dtype must be a torch.dtype (e.g. torch.float32), got {state_dtype!r}")
    gm = result.module
    inputs = example_inputs(result, batch)
    ep = result.plan.parallel.ep  # the graph holds this rank's E/ep experts and its dispatch/combine buffers
    try:
        profile = profile_activations(gm.graph, gm, inputs, ep=ep)
    except Exception as e:
        if batch is None:
            raise
        raise MoecompileError(
            f"estimate_memory: the graph does not run on the inputs for batch={batch!r} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); a graph traced with static shapes only takes its example "
            "batch size: convert with dynamic=True to estimate other batches"
        ) from e
    named = dict(gm.named_parameters())  # shared parameters once
    trainable = {n: p for n, p in named.items() if p.requires_grad}
    experts = set(expert_parameters(gm))
    if master_weights is None:  # build_train_step: bf16 parameters train through fp32 masters
        master_weights = any(p.dtype != torch.float32 for p in trainable.values())
    shard, dp, edp = optimizer_ranks(result, shard_optimizer, dp, ep)
    ranged = ranged_bytes(trainable, experts, dp if shard else 1, edp if shard else 1)
    if shard_gradients is None:
        shard_gradients = result.plan.parallel.shard_gradients and shard_optimizer is not False
    if shard_gradients and not shard:
        raise MoecompileError("estimate_memory: shard_gradients=True needs shard_optimizer (ZeRO-2 keeps the "
                              "gradients of the ranges ZeRO-1 gives each rank): pass shard_optimizer=True too, or "
                              "shard_gradients=False")
    if shard_parameters is None:
        shard_parameters = result.plan.parallel.shard_parameters and bool(shard_gradients)
    if shard_parameters and not shard_gradients:
        raise MoecompileError("estimate_memory: shard_parameters=True needs shard_gradients (ZeRO-3 keeps the "
                              "parameters of the ranges whose gradients ZeRO-2 keeps): pass shard_gradients=True "
                              "and shard_optimizer=True too, or shard_parameters=False")
    # this rank's ranges, the pool of whole gradient buckets backward fills and sends, the parameter buckets gathered
    mine, g_bytes, in_flight, gathered = sharded_state(trainable, experts, dp, edp, bucket_mb,
                                                       grads=bool(shard_gradients), params=bool(shard_parameters),
                                                       reads=param_reads(gm))
    p_bytes = mine + gathered + sum(p.numel() * p.element_size() for p in named.values() if not p.requires_grad)
    m_bytes = ranged(lambda p: 4) if master_weights else 0  # the masters and, as much, their fp32 .grad
    if state_dtype is not None:
        size = torch.empty((), dtype=state_dtype).element_size()
        state_bytes = ranged(lambda p: size)
    else:
        state_bytes = ranged(lambda p: 4 if master_weights else p.element_size())
    buf_bytes = sum(b.numel() * b.element_size() for b in gm.buffers())
    x_bytes = sum(named[n].numel() * named[n].element_size() for n in expert_parameters(gm) if n in named)
    by_layer: dict[str, dict[str, int]] = {}
    for k, t in profile.tensors.items():
        if t.on_device or k in profile.outputs:
            d = by_layer.setdefault(t.layer, {})
            d[t.category] = d.get(t.category, 0) + t.nbytes
    history = []
    if by_pass:
        for rec in result.history:
            history.append(_pass_memory(rec, gm, inputs, ep))
    tokens = next((t.numel() for t in inputs if isinstance(t, torch.Tensor) and not t.is_floating_point()), 0)
    return MemoryEstimate(
        params=p_bytes, grads=g_bytes + in_flight + m_bytes, optimizer=_OPTIMIZER_STATES[optimizer] * state_bytes,
        buffers=buf_bytes,
        activations=profile.device_bytes, offloaded=profile.host_bytes, by_category=profile.split("category"),
        by_layer=dict(sorted(by_layer.items(), key=lambda kv: _layer_order(kv[0]))), by_pass=history,
        tokens=tokens, profile=profile, masters=m_bytes, expert_params=x_bytes, master_grads=m_bytes,
        shard_optimizer=shard, dp=dp, edp=edp, shard_gradients=bool(shard_gradients), in_flight_grads=in_flight,
        shard_parameters=bool(shard_parameters), in_flight_params=gathered,
    )


def _layer_order(layer: str) -> tuple:
    m = re.search(r"\.(\d+)$", layer)
    return (0 if "embed" in layer else 1 if m else 2, int(m.group(1)) if m else 0, layer)


def _pass_memory(rec: Any, gm: fx.GraphModule, inputs: list[Any], ep: int = 1) -> PassMemory:
    if rec.graph is None:
        return PassMemory(rec.name, None, None, None, "no graph snapshot")
    try:
        prof = profile_activations(rec.graph, gm, inputs, ep=ep)
    except Exception as e:  # an old snapshot the inputs don't fit (static shapes)
        return PassMemory(rec.name, None, None, None, f"{type(e).__name__}")
    seen, params = set(), 0
    for n in rec.graph.nodes:
        v = n.meta.get("val")
        if n.op == "get_attr" and isinstance(v, torch.Tensor) and n.target not in seen:
            seen.add(n.target)
            params += v.numel() * v.element_size()
    return PassMemory(rec.name, params, prof.device_bytes, prof.host_bytes)


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
