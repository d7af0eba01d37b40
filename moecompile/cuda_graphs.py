"""CUDA graphs for the emitted step, and the CPU-checkable proof that capture is legal.

Capture is legal when the captured region never waits on the host and never changes
shape: no ``.item()`` / ``tolist`` / ``nonzero`` / ``_local_scalar_dense``, no split sizes
read from a tensor, no output whose size is a data-dependent (unbacked) symbol.
:func:`check_capture_safety` proves it two ways, both on CPU:

1. it scans ``result.module``'s graph (nodes named with their layer and role), and
2. it traces forward + loss + backward with ``make_fx`` under fake tensors with static
   shapes, where any host read becomes an unbacked symbol or a data-dependent error.

Runners (``cuda_graph.mode``)::

    none     eager
    full     warm-up steps on a side stream, then the whole step (forward, backward,
             gradient sync, optimizer, expert-bias update) captured once into a
             torch.cuda.CUDAGraph over static input buffers and replayed
    partial  the graph split into static regions (attention, router, dense parts),
             each captured with make_graphed_callables (forward under the step's autocast,
             backward outside it, as the eager step runs them), and
             dynamic expert regions (permute .. combine) run eagerly between them

A replay runs no Python, so what the step computed in Python at capture time is frozen:
``full`` makes Adam(W)'s lr a device tensor (lr schedulers fill it in place) and refuses
to replay once any other Python-valued optimizer hyperparameter has changed. All captures
share one memory pool. On CPU every mode runs eagerly and says so once; the runners
themselves are tested on CPU against emulated graphs (tests/_graph_emulator.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .errors import MoecompileError
from .meta import Role

log = logging.getLogger(__name__)
aten = torch.ops.aten

# ATen ops that read a tensor on the host or give an output whose size depends on values.
HOST_SYNC_OPS = {
    aten._local_scalar_dense.default: "reads a tensor value on the host (.item())",
    aten.item.default: "reads a tensor value on the host (.item())",
    aten.equal.default: "returns a Python bool computed on the device",
    aten.is_nonzero.default: "returns a Python bool computed on the device",
    aten.nonzero.default: "output size depends on the data (nonzero)",
    aten.masked_select.default: "output size depends on the data (masked_select)",
    aten.unique_consecutive.default: "output size depends on the data (unique)",
    aten._unique2.default: "output size depends on the data (unique)",
    aten.unique_dim.default: "output size depends on the data (unique)",
    aten.bincount.default: "output size depends on the data (bincount)",
    aten.repeat_interleave.Tensor: "output size depends on the data unless output_size is given",
}
HOST_SYNC_METHODS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "nonzero"}
# The expert path: variable work per expert; partial capture leaves it eager.
DYNAMIC_ROLES = {Role.PERMUTE, Role.DISPATCH, Role.EXPERTS, Role.EXPERT_ACT, Role.COMBINE_COMM, Role.COMBINE,
                 Role.COLLECTIVE_START, Role.COLLECTIVE_WAIT}


@dataclasses.dataclass(frozen=True)
class Finding:
    node: str
    op: str
    reason: str
    layer: str = ""
    role: str = ""

    def __str__(self) -> str:
        where = f" ({self.layer or '<root>'}, role {self.role})" if (self.layer or self.role) else ""
        return f"{self.node}{where}: {self.op} {self.reason}"


@dataclasses.dataclass
class CaptureReport:
    """What the capture-safety check found; ``safe`` means no finding at all."""

    region: str
    findings: list[Finding]
    backward_checked: bool

    @property
    def safe(self) -> bool:
        return not self.findings

    def __str__(self) -> str:
        scope = {"all": "whole step", "static": "static regions"}[self.region]
        scope += " (forward + backward)" if self.backward_checked else " (forward)"
        if self.safe:
            return f"capture-safe ({scope}): nothing is read on the host and no shape depends on data"
        return f"not capture-safe ({scope}), {len(self.findings)} problem(s):\n  " + "\n  ".join(map(str, self.findings))

    def raise_if_unsafe(self, what: str = "CUDA-graph capture") -> None:
        if not self.safe:
            raise MoecompileError(
                f"{what} is not legal here. {self}\nUse parallel.dispatch_mode: static (fixed capacity, no count "
                "exchange) or cuda_graph.mode: partial (experts stay eager)."
            )


def _unbacked(val: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    try:
        return bool(free_unbacked_symbols(val))
    except Exception:  # values free_unbacked_symbols cannot walk are not shapes
        return False


def _data_dependent(a: Any) -> bool:
    """An argument (a size, a split list) whose value only exists at run time."""
    if isinstance(a, fx.Node):
        v = a.meta.get("val")
        if isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v):
            return False  # a multi-output op's results, not a size: the getitem that picks one is judged by its own
        return not isinstance(v, torch.Tensor) and _unbacked(v)
    if isinstance(a, torch.SymInt):
        return _unbacked(a)
    if isinstance(a, (list, tuple)):
        return any(_data_dependent(x) for x in a)
    return False


def scan_graph(graph: fx.Graph, nodes: Callable[[fx.Node], bool] = lambda n: True) -> list[Finding]:
    """Host syncs and data-dependent shapes among the selected nodes of ``graph``."""
    found = []
    for n in graph.nodes:
        if n.op not in ("call_function", "call_method") or not nodes(n):
            continue
        meta = n.meta.get("moe", {})
        layer, role = meta.get("layer", ""), str(meta.get("role", ""))
        op = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        if n.op == "call_method" and n.target in HOST_SYNC_METHODS:
            found.append(Finding(n.name, f".{n.target}()", "reads a tensor on the host", layer, role))
        elif n.target is aten.repeat_interleave.Tensor and n.kwargs.get("output_size") is not None:
            continue  # the output size is given: nothing to read back
        elif n.target in HOST_SYNC_OPS:
            found.append(Finding(n.name, str(n.target), HOST_SYNC_OPS[n.target], layer, role))
        elif any(_data_dependent(a) for a in (*n.args, *n.kwargs.values())):
            found.append(Finding(n.name, str(op), "takes sizes computed at run time (dynamic splits)", layer, role))
        elif _unbacked(n.meta.get("val")):
            found.append(Finding(n.name, str(op), f"has a data-dependent shape {_shape(n.meta['val'])}", layer, role))
    return found


def _shape(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return str(tuple(val.shape))
    return str(val)


def is_dynamic_node(n: fx.Node) -> bool:
    """Nodes ``partial`` mode keeps eager: the expert path."""
    return n.meta.get("moe", {}).get("role") in DYNAMIC_ROLES


def check_capture_safety(result: Any, region: str = "all", backward: bool = True, loss_fn: Callable | None = None,
                         example: tuple | None = None) -> CaptureReport:
    """Prove (or refute) on CPU that ``region`` of the step may be captured in a CUDA graph.

    ``region``: "all" (what ``full`` captures) or "static" (what ``partial`` captures: every
    node outside the expert path). ``backward`` also traces forward + loss + backward under
    fake tensors (``region="all"`` only), catching syncs inside autograd formulas too.
    """
    if region not in ("all", "static"):
        raise MoecompileError(f"region must be 'all' or 'static', got {region!r}")
    gm = result.module
    select = (lambda n: True) if region == "all" else (lambda n: not is_dynamic_node(n))
    findings = scan_graph(gm.graph, select)
    traced = False
    if backward and region == "all":
        findings += _scan_joint(result, loss_fn, example)
        traced = True
    return CaptureReport(region, _dedupe(findings), traced)


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        if (f.op, f.reason, f.layer) not in seen:
            seen.add((f.op, f.reason, f.layer))
            out.append(f)
    return out


def _scan_joint(result: Any, loss_fn: Callable | None, example: tuple | None) -> list[Finding]:
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    from .train_step import causal_lm_loss

    gm = result.module
    loss_fn = loss_fn or causal_lm_loss
    args = example if example is not None else tuple(result.example_inputs)
    pnames, params = zip(*[(n, p) for n, p in gm.named_parameters()])
    bnames, buffers = zip(*gm.named_buffers()) if list(gm.named_buffers()) else ((), ())
    targets = _example_targets(args)

    def joint(params: tuple, buffers: tuple, args: tuple, targets: Any) -> tuple:
        state = {**dict(zip(pnames, params)), **dict(zip(bnames, buffers))}
        out = torch.func.functional_call(gm, state, args, dict(result.example_kwargs))
        loss = loss_fn(out, targets) + result.router_loss()
        grads = torch.autograd.grad(loss, [p for p in params if p.requires_grad], allow_unused=True)
        return (loss, *[g for g in grads if g is not None])

    saved = gm.moe_stats
    try:
        traced = make_fx(joint, tracing_mode="fake")(params, buffers, args, targets)
    except (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return [Finding("<forward+backward trace>", type(e).__name__, f"control flow or shapes depend on data: {first}")]
    except Exception as e:  # what cannot be traced under fake tensors cannot be proven capturable
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return [Finding("<forward+backward trace>", type(e).__name__, f"could not be traced with static shapes: {first}")]
    finally:
        gm.moe_stats = saved
    return scan_graph(traced.graph)


def _example_targets(args: tuple) -> Any:
    ids = next((a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor) and not a.is_floating_point()), None)
    if ids is None:
        raise MoecompileError("check_capture_safety needs token-id example inputs, or pass example= and loss_fn=")
    return ids


# ---------------------------------------------------------------- partial: split into regions


def split_static_regions(gm: fx.GraphModule, dynamic: Callable[[fx.Node], bool] = is_dynamic_node) -> fx.GraphModule:
    """``gm`` as a chain of submodules ``static_i`` / ``dynamic_i``, called like ``gm``.

    Parameters stay the same objects (read by get_attr inside each submodule), so the
    optimizer and checkpoints see no difference. A layer's dynamic region spans its first to
    its last dynamic node (with any unsafe node the scan finds); the rest is static.
    """
    from torch.fx.passes.split_module import split_module

    unsafe = {f.node for f in scan_graph(gm.graph)}
    order = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    spans: dict[str, list[int]] = {}  # per layer: first and last dynamic node; all between stays eager
    for i, n in enumerate(order):
        if dynamic(n) or n.name in unsafe:
            span = spans.setdefault(n.meta.get("moe", {}).get("layer", n.name), [i, i])
            span[1] = i
    eager = {i for lo, hi in spans.values() for i in range(lo, hi + 1)}
    part: dict[fx.Node, int] = {}
    kinds: dict[int, str] = {}
    index, prev = -1, None
    for i, n in enumerate(order):
        kind = "dynamic" if i in eager else "static"
        if kind != prev:
            index, prev = index + 1, kind
            kinds[index] = kind
        part[n] = index
    split = split_module(gm, gm, lambda n: part[n], keep_original_order=True, keep_original_input_name=True)
    _params_inside(split, gm)
    split.graph._codegen = copy.deepcopy(gm.graph._codegen)
    split.meta.update(gm.meta)
    for name, sub in list(split.named_children()):
        if not name.startswith("submod_"):
            continue
        i = int(name.split("_")[-1])
        split.add_module(f"{kinds[i]}_{i}", sub)
        delattr(split, name)
        for node in split.graph.nodes:
            if node.op == "call_module" and node.target == name:
                node.target = f"{kinds[i]}_{i}"
    split.recompile()
    split.delete_all_unused_submodules()  # the root's own modules: every parameter now lives in a region
    return split


def _params_inside(split: fx.GraphModule, root: fx.GraphModule) -> None:
    """Turn parameters passed into submodules back into get_attr reads of the same tensors."""
    for node in list(split.graph.nodes):
        if node.op != "call_module":
            continue
        sub: fx.GraphModule = getattr(split, node.target)
        placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
        keep_args = []
        for arg, ph in zip(node.args, placeholders):
            if isinstance(arg, fx.Node) and arg.op == "get_attr":
                attr = arg.target.replace(".", "_")
                value = _resolve(root, arg.target)
                if isinstance(value, torch.nn.Parameter):
                    sub.register_parameter(attr, value)
                else:
                    sub.register_buffer(attr, value)
                with sub.graph.inserting_before(ph):
                    got = sub.graph.get_attr(attr)
                got.meta = dict(ph.meta)
                ph.replace_all_uses_with(got)
                sub.graph.erase_node(ph)
            else:
                keep_args.append(arg)
        node.args = tuple(keep_args)
        sub.recompile()
    split.graph.eliminate_dead_code()


def _resolve(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# ---------------------------------------------------------------- runners

_SAID: set[str] = set()


def _say_once(key: str, text: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        log.warning(text)
        warnings.warn(text, stacklevel=3)


def make_runner(step: Any, mode: str) -> Callable[[Any, Any], dict]:
    if mode not in ("none", "partial", "full"):
        raise MoecompileError(f"cuda_graph mode {mode!r} is not one of none, partial, full")
    if mode == "none":
        return EagerRunner(step)
    if step.device.type != "cuda":
        _say_once(f"cpu-{mode}", f"cuda_graph.mode={mode!r}: the parameters are on {step.device.type}, where there is "
                                 "nothing to capture; the training step runs eagerly")
        return EagerRunner(step)
    return FullGraphRunner(step) if mode == "full" else PartialGraphRunner(step)


class EagerRunner:
    def __init__(self, step: Any):
        self.step = step

    def __call__(self, inputs: Any, targets: Any) -> dict:
        return self.step.compute(inputs, targets)


def _copy_into(dst: Any, src: Any) -> None:
    for d, s in zip(pytree.tree_leaves(dst), pytree.tree_leaves(src)):
        if isinstance(d, torch.Tensor):
            if d.shape != s.shape or d.dtype != s.dtype:
                raise MoecompileError(f"a captured step needs inputs of one shape: captured {tuple(d.shape)} "
                                      f"{d.dtype}, got {tuple(s.shape)} {s.dtype}")
            d.copy_(s, non_blocking=True)


def _static_clone(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def _make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Device-side optimizer state, and for Adam(W) a tensor lr that schedulers update in place."""
    if "capturable" in optimizer.defaults:
        for group in optimizer.param_groups:
            group["capturable"] = True
            if isinstance(optimizer, torch.optim.Adam) and not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), device=device)
    elif not isinstance(optimizer, torch.optim.SGD):  # SGD has no host reads to avoid
        log.warning("%s has no capturable mode; capture fails if its step reads state on the host",
                    type(optimizer).__name__)


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """What a captured optimizer step froze: each group's values (tensors: the objects themselves)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _check_unchanged(captured: list[dict], optimizer: torch.optim.Optimizer) -> None:
    for i, (then, now) in enumerate(zip(captured, _hyperparameters(optimizer))):
        for key, was in then.items():
            value = now.get(key)
            tensor = isinstance(was, torch.Tensor)
            if value is was or (not tensor and value == was):
                continue
            change = "was replaced by another object" if tensor else f"changed from {was} to {value}"
            raise MoecompileError(
                f"optimizer param_groups[{i}][{key!r}] {change} after the step was captured into a CUDA graph, "
                "and a replay uses the captured value. Keep it fixed, or make it a tensor updated in place "
                "(torch.optim.lr_scheduler fills a tensor lr in place; the step makes Adam/AdamW's lr a tensor "
                "when it captures)")


class FullGraphRunner:
    """The whole step as one CUDA graph, replayed on static input buffers."""

    def __init__(self, step: Any):
        self.step = step
        self.warmup = step.plan.cuda_graph.warmup_steps
        self.pool = torch.cuda.graph_pool_handle()
        self.calls = 0
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any, Any, dict]] = {}
        _make_capturable(step.optimizer, step.device)
        self.frozen: list[dict] | None = None  # the optimizer hyperparameters the captures baked in
        step.autocast_cache = False
        self.side = torch.cuda.Stream()

    def _key(self, inputs: Any, targets: Any) -> tuple:
        return tuple((tuple(t.shape), t.dtype) for t in pytree.tree_leaves((inputs, targets)) if isinstance(t, torch.Tensor))

    def __call__(self, inputs: Any, targets: Any) -> dict:
        key = self._key(inputs, targets)
        if key not in self.graphs and self.calls < self.warmup:
            self.calls += 1
            return self._eager(inputs, targets, check_sync=self.calls == self.warmup)
        if key not in self.graphs:
            self.frozen = self.frozen or _hyperparameters(self.step.optimizer)
            self.graphs[key] = self._capture(inputs, targets)
        _check_unchanged(self.frozen, self.step.optimizer)
        graph, static_in, static_tg, static_out = self.graphs[key]
        _copy_into(static_in, inputs)
        _copy_into(static_tg, targets)
        graph.replay()
        return static_out

    def _eager(self, inputs: Any, targets: Any, check_sync: bool) -> dict:
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            if check_sync:  # the last warm-up proves the step never waits on the host
                torch.cuda.set_sync_debug_mode("error")
            try:
                out = self.step.compute(inputs, targets)
            except RuntimeError as e:
                if check_sync and "synchroniz" in str(e):
                    raise MoecompileError(f"cuda_graph.mode=full: the step synchronises with the host ({e}); "
                                          "see moecompile.cuda_graphs.check_capture_safety(result)") from e
                raise
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.current_stream().wait_stream(self.side)
        return out

    def _capture(self, inputs: Any, targets: Any) -> tuple:
        static_in, static_tg = _static_clone(inputs), _static_clone(targets)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = self.step.compute(static_in, static_tg)
        log.info("captured the whole training step into a CUDA graph (inputs %s)", self._key(inputs, targets))
        return graph, static_in, static_tg, static_out


class PartialGraphRunner:
    """Static regions graphed with make_graphed_callables; the expert path eager between them."""

    def __init__(self, step: Any):
        self.step = step
        self.warmup = step.plan.cuda_graph.warmup_steps
        self.calls = 0
        self.pool = torch.cuda.graph_pool_handle()
        self.split = split_static_regions(step.module)
        self._install_hooks()
        step.forward_module = self.split
        step.autocast_cache = False  # graphed callables must not see weight casts cached outside them
        self.graphed = False

    def _install_hooks(self) -> None:
        from .frontend import accept_missing_constant_kwargs, accept_positional_by_name
        from .stats import _split_hook

        original = self.step.module

        def stats_hook(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
            return _split_hook(original, args, kwargs, output)  # stats land where result.router_loss() reads

        self.split.register_forward_hook(stats_hook, with_kwargs=True)
        accept_missing_constant_kwargs(self.split, self.step.result.example_kwargs)
        accept_positional_by_name(self.split, getattr(original, "meta", {}).get("input_names", []))

    def __call__(self, inputs: Any, targets: Any) -> dict:
        if not self.graphed and self.calls >= self.warmup:
            self._graph_static_regions(self.step.micro_batches(inputs, targets)[0][0])  # the traced batch
        self.calls += 1
        return self.step.compute(inputs, targets)

    def _graph_static_regions(self, inputs: Any) -> None:
        samples: dict[str, tuple] = {}

        def keep(name: str) -> Callable:
            def hook(module: Any, args: tuple, out: Any) -> None:
                samples.setdefault(name, (tuple(args), out))
            return hook

        hooks = [sub.register_forward_hook(keep(name)) for name, sub in self.split.named_children()
                 if name.startswith("static_")]
        with self.step._autocast():  # with grad, so each sample's requires_grad is what training sees
            self.step._forward(inputs)
        for h in hooks:
            h.remove()
        names = list(samples)
        regions = [_TensorRegion(getattr(self.split, n), *samples[n], self.step._autocast) for n in names]
        args = tuple(r.sample_tensors() for r in regions)
        # each forward captures under the step's autocast (cache off), each backward without, as training runs
        graphed = torch.cuda.make_graphed_callables(tuple(regions), args, allow_unused_input=True, pool=self.pool)
        for name, region in zip(names, graphed):
            setattr(self.split, name, _GraphedRegion(name, region))
        self.graphed = True
        log.info("partial CUDA graphs: %d static regions captured, %d expert regions eager", len(names),
                 sum(1 for n, _ in self.split.named_children() if n.startswith("dynamic_")))


class _TensorRegion(torch.nn.Module):
    """A static region as make_graphed_callables needs it: tensors in, tensors out.

    Its other inputs (constant flags) and outputs (sizes, which a graph of fixed shapes
    fixes too) keep the values of the sample run; :class:`_GraphedRegion` puts them back.
    Autocast is entered here, in the forward, not around make_graphed_callables: its backward
    capture calls autograd there, and a backward under autocast runs an fp32 op's gradient in
    bf16 (an imported DeepSeek-V3's fp32 attention ``bmm``), where the eager step's backward,
    outside autocast, does not.
    """

    def __init__(self, region: torch.nn.Module, sample_args: tuple, sample_out: Any,
                 autocast: Callable[[], contextlib.AbstractContextManager]):
        super().__init__()
        self.region, self.autocast = region, autocast
        self.args = list(sample_args)
        self.arg_slots = [i for i, a in enumerate(sample_args) if isinstance(a, torch.Tensor)]
        self.outs, self.out_spec = pytree.tree_flatten(sample_out)
        self.out_slots = [i for i, o in enumerate(self.outs) if isinstance(o, torch.Tensor)]

    def sample_tensors(self) -> tuple:
        return tuple(self.args[i].detach().clone().requires_grad_(self.args[i].requires_grad) for i in self.arg_slots)

    def forward(self, *tensors: torch.Tensor) -> tuple:
        args = list(self.args)
        for i, t in zip(self.arg_slots, tensors):
            args[i] = t
        with self.autocast():
            flat = pytree.tree_leaves(self.region(*args))
        return tuple(flat[i] for i in self.out_slots)


class _GraphedRegion(torch.nn.Module):
    """A graphed :class:`_TensorRegion`, called like the region it replaced."""

    def __init__(self, name: str, graphed: _TensorRegion):
        super().__init__()
        self.name, self.graphed = name, graphed

    def forward(self, *args: Any) -> Any:
        g = self.graphed
        for i, (want, got) in enumerate(zip(g.args, args)):
            same = (got.shape == want.shape and got.dtype == want.dtype) if isinstance(want, torch.Tensor) else got == want
            if not same:
                what = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else repr(got)
                was = f"{tuple(want.shape)} {want.dtype}" if isinstance(want, torch.Tensor) else repr(want)
                raise MoecompileError(f"cuda_graph.mode=partial: region {self.name} was captured with argument {i} "
                                      f"= {was}, got {what}; a captured region needs inputs of one shape")
        outs = list(g.outs)
        for i, o in zip(g.out_slots, g(*(args[i] for i in g.arg_slots))):
            outs[i] = o
        return pytree.tree_unflatten(outs, g.out_spec)
