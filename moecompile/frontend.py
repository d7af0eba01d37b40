"""The frontend: a dense ``nn.Module`` in, a ``torch.fx.GraphModule`` out.

Default path: ``torch.export.export(strict=False)`` (ATen training IR), which traces
Hugging Face models and keeps ``nn_module_stack`` on every node; the result is
unlifted (``ExportedProgram.module()``) so parameters keep the dense model's names
as ``get_attr`` targets. ``method="symbolic_trace"`` is the plain-module path.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Iterator, Literal

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from .errors import MoecompileError, TraceError

log = logging.getLogger(__name__)


def example_kwargs_for(model: nn.Module, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Add ``use_cache=False`` for models that take it: a KV cache is not a training input. Taken by name, or
    through ``**kwargs`` by a model whose config caches (Granite-MoE's forward names no ``use_cache``)."""
    kwargs = dict(kwargs or {})
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    through_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) and bool(
        getattr(getattr(model, "config", None), "use_cache", False))
    if ("use_cache" in params or through_kwargs) and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    return kwargs


def flat_inputs(args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """The graph's placeholders, in order, for example inputs given as (args, kwargs)."""
    return pytree.tree_leaves((tuple(args), dict(kwargs)))


def trace(
    model: nn.Module,
    example_inputs: tuple,
    example_kwargs: dict[str, Any] | None = None,
    *,
    method: Literal["export", "symbolic_trace"] = "export",
    dynamic: bool = False,
) -> fx.GraphModule:
    """Trace ``model`` into a GraphModule that is called exactly like the model.

    ``dynamic=True`` marks every dimension of every tensor input as dynamic
    (``Dim.AUTO``), so the graph accepts other batch sizes and sequence lengths.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"expected an nn.Module, got {type(model).__name__}; pass the model itself")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    kwargs = example_kwargs_for(model, example_kwargs)
    name = type(model).__name__
    if method == "symbolic_trace":
        try:
            gm = _symbolic_trace_aten(model)
        except Exception as e:  # symbolic tracing fails in many user-specific ways
            raise TraceError(
                f"torch.fx.symbolic_trace could not trace {name}: {e}. Hint: data-dependent Python control "
                "flow can't be traced symbolically; use method='export' (the default)."
            ) from e
        _propagate_example_meta(gm, flat_inputs(example_inputs, kwargs))
        return gm
    if method != "export":
        raise TraceError(f"unknown trace method {method!r}; use 'export' or 'symbolic_trace'")

    dynamic_shapes = None
    if dynamic:
        def spec(x: Any) -> Any:
            return {i: torch.export.Dim.AUTO for i in range(x.dim())} if isinstance(x, torch.Tensor) else None

        names = _positional_names(model, len(example_inputs))
        dynamic_shapes = {n: spec(x) for n, x in zip(names, example_inputs)} | {k: spec(v) for k, v in kwargs.items()}
    was_training = model.training
    try:
        with _fused_experts(model):
            exported = torch.export.export(model, tuple(example_inputs), kwargs, strict=False,
                                           dynamic_shapes=dynamic_shapes)
    except Exception as e:
        raise TraceError(
            f"torch.export could not trace {name}: {type(e).__name__}: {_first_line(e)}. "
            f"Module: {_failing_module(e) or name}. Hint: make the forward free of data-dependent Python "
            "control flow and non-tensor outputs torch.export can't flatten (disable caches: use_cache=False), "
            "or try method='symbolic_trace' for a plain module."
        ) from e
    finally:
        model.train(was_training)
    # The graph is fixed to the mode it was traced in (dropout is baked in as an op), and
    # ExportedProgram.module() refuses .train()/.eval(): trace in the mode you will run.
    return drop_dtype_asserts(inline_grad_regions(exported.module()))


def inline_grad_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Inline the submodules torch 2.11's export makes of a model's ``no_grad`` blocks (a rotary embedding's).

    Export there keeps each block as ``wrap_with_set_grad_enabled(False, submod, *args)``; torch 2.13 traces
    the same model flat. Passes read one flat graph, so the block's nodes are copied in place of the call, and
    a block that disabled gradients has its outputs detached: no gradient reaches its inputs, as before.
    """
    wrap = torch.ops.higher_order.wrap_with_set_grad_enabled
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is wrap]
    for call in calls:
        enabled, body_node, *args = call.args
        body = gm.get_submodule(body_node.target)
        inline_grad_regions(body)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        with gm.graph.inserting_before(call):
            outputs = gm.graph.graph_copy(body.graph, dict(zip(placeholders, args)))
            outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
            if not enabled:
                outputs = [_detached(gm.graph, out) for out in outputs]
        for user in list(call.users):  # the call returns a tuple, read by getitem
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(call)
        if not body_node.users:
            gm.graph.erase_node(body_node)
            gm.delete_submodule(body_node.target)
    if calls:
        gm.recompile()
    return gm


def _detached(graph: fx.Graph, node: fx.Node) -> fx.Node:
    detached = graph.call_function(torch.ops.aten.detach.default, (node,))
    detached.meta = dict(node.meta)
    return detached


def drop_dtype_asserts(gm: fx.GraphModule) -> fx.GraphModule:
    """Erase export's ``_assert_tensor_metadata`` checks. Export asserts, before each ``.to()`` a model makes
    (Qwen3's q/k norms, DeepSeek-V3's MLA), that its input still has the traced dtype; under bf16 autocast the
    linear before it returns bf16 and the step would fail on a cast that is the model's own upcast."""
    asserts = [n for n in gm.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    for n in asserts:
        gm.graph.erase_node(n)
    if asserts:
        gm.recompile()
    return gm


@contextlib.contextmanager
def _fused_experts(model: nn.Module) -> Iterator[None]:
    """Trace a Hugging Face MoE's experts as one grouped GEMM, however the model runs them.

    ``experts_implementation="eager"`` loops over the experts that got tokens, a data-dependent
    loop export cannot trace; ``grouped_mm`` computes the same function, and it is what
    ``import_moe`` adopts. The model's own setting is restored after tracing.
    """
    impl = getattr(getattr(model, "config", None), "_experts_implementation", None)
    switched = impl not in (None, "grouped_mm") and hasattr(model, "set_experts_implementation")
    if switched:
        try:
            model.set_experts_implementation("grouped_mm")
        except ValueError:  # a model without experts: transformers refuses
            switched = False
    try:
        yield
    finally:
        if switched:
            model.set_experts_implementation(impl)


class _ThroughModulesTracer(fx.Tracer):
    """Traces into every module (nn.Linear included) so weights appear as get_attr nodes."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False


def _aten_targets() -> dict[Any, Any]:
    import operator

    aten = torch.ops.aten
    return {
        torch._C._nn.linear: aten.linear.default, torch._C._nn.gelu: aten.gelu.default,
        torch._C._nn.silu: aten.silu.default, torch.relu: aten.relu.default, torch.nn.functional.relu: aten.relu.default,
        torch.nn.functional.silu: aten.silu.default, torch.nn.functional.gelu: aten.gelu.default,
        torch.addmm: aten.addmm.default, torch.tanh: aten.tanh.default, torch.square: aten.square.default,
        operator.mul: aten.mul.Tensor, operator.add: aten.add.Tensor, torch.mul: aten.mul.Tensor, torch.add: aten.add.Tensor,
    }


def _symbolic_trace_aten(model: nn.Module) -> fx.GraphModule:
    """``symbolic_trace``, then the torch-level calls the passes look for renamed to their ATen ops.

    Passes pattern-match ATen (the export IR); this keeps one vocabulary for both frontends.
    """
    tracer = _ThroughModulesTracer()
    graph = tracer.trace(model)
    targets = _aten_targets()
    for node in graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.target = targets[node.target]
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "inplace"}
        elif node.op == "call_method" and node.target in ("relu", "square"):  # x.relu().square(): ReLU squared
            node.op, node.target = "call_function", getattr(torch.ops.aten, node.target).default
        elif node.op == "call_method" and node.target in ("view", "reshape"):
            node.op, node.target = "call_function", torch.ops.aten.view.default if node.target == "view" else torch.ops.aten.reshape.default
            node.args = (node.args[0], list(node.args[1:]) if not isinstance(node.args[1], (list, tuple)) else list(node.args[1]))
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _positional_names(model: nn.Module, n: int) -> list[str]:
    params = [p for p in inspect.signature(model.forward).parameters.values() if p.kind != p.VAR_KEYWORD]
    return [p.name for p in params[:n]]


def _propagate_example_meta(gm: fx.GraphModule, inputs: list[Any]) -> None:
    from .shapes import propagate_fake

    propagate_fake(gm, inputs)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else repr(e)


def _failing_module(e: BaseException) -> str | None:
    """Best effort: the innermost user module frame in the traceback."""
    tb = e.__traceback__
    found = None
    while tb is not None:
        self_obj = tb.tb_frame.f_locals.get("self")
        if isinstance(self_obj, nn.Module) and tb.tb_frame.f_code.co_name == "forward":
            found = type(self_obj).__name__
        tb = tb.tb_next
    return found


def accept_missing_constant_kwargs(gm: fx.GraphModule, example_kwargs: dict[str, Any]) -> None:
    """Let callers omit the non-tensor kwargs the trace fixed (``use_cache=False``), as with the model."""
    constants = {k: v for k, v in example_kwargs.items() if not isinstance(v, torch.Tensor)}
    if not constants:
        return

    def fill(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return args, {**constants, **kwargs}

    gm.register_forward_pre_hook(fill, prepend=True, with_kwargs=True)


def positional_names(model: nn.Module, positional: int) -> list[str]:
    """The names of ``model.forward``'s first ``positional`` parameters (the inputs traced by position)."""
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params[:positional]]


def accept_positional_by_name(gm: nn.Module, names: list[str]) -> None:
    """Let callers name the inputs the trace took positionally (``module(input_ids=x)``, as with the model):
    the exported module otherwise only takes them in their traced positions."""
    if not names:
        return

    def move(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        missing = names[len(args):]
        if not missing or missing[0] not in kwargs:
            return None
        args, kwargs = list(args), dict(kwargs)
        for name in missing:
            if name not in kwargs:
                raise MoecompileError(f"missing input {name!r}: the graph was traced with {names} as its inputs")
            args.append(kwargs.pop(name))
        return tuple(args), kwargs

    gm.register_forward_pre_hook(move, prepend=True, with_kwargs=True)


def check_input_shapes(gm: fx.GraphModule) -> None:
    """Name a call whose tensor inputs differ from the traced (static) shapes, instead of torch's guard
    assertion (for a graph converted with ``dynamic=False``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    traced = {n.name: n.meta["val"].shape for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)}
    if not traced:
        return
    order = [n.name for n in placeholders]

    def check(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        for name, t in [*zip(order, args), *kwargs.items()]:
            want = traced.get(name)
            if want is None or not isinstance(t, torch.Tensor):
                continue
            if tuple(t.shape) != tuple(want):
                raise MoecompileError(
                    f"input {name!r} has shape {tuple(t.shape)} but the graph was traced at {tuple(want)}: convert with "
                    "example inputs of the shape you call it with (or dynamic=True for a symbolic batch and "
                    "sequence); the training step runs a batch of several traced batches as micro-batches")

    gm.register_forward_pre_hook(check, prepend=True, with_kwargs=True)  # before export's own guard


def install_call_hooks(gm: fx.GraphModule, model: nn.Module, positional: int, example_kwargs: dict[str, Any],
                       dynamic: bool) -> None:
    """Make the converted module callable as the model was: inputs by position or name, the constant
    kwargs optional, and a clear error for a shape a static trace cannot take."""
    accept_missing_constant_kwargs(gm, example_kwargs)
    gm.meta["dynamic"] = dynamic  # the passes' shapes are the example's: only the trace knows what may vary
    if not dynamic:
        check_input_shapes(gm)
    gm.meta["input_names"] = positional_names(model, positional)
    accept_positional_by_name(gm, gm.meta["input_names"])  # runs first: the checks see positions
