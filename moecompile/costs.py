"""What a graph costs, read off ``meta["val"]`` FakeTensors without running anything.

    costs = graph_costs(result.history[-1].graph)
    costs.flops / costs.tokens          # forward FLOPs per token (matmul-class ops, like FlopCounterMode)
    costs.activation_bytes              # what the forward materialises and keeps (views and recompute excluded)
    costs.comm_bytes_step               # functional-collective payload per training step (forward x2)

FLOPs use ``torch.utils.flop_counter``'s formulas: an op with a formula is counted from
its shapes; a composite op (``aten.linear``, ``aten.matmul``) is decomposed under
``FlopCounterMode`` on its fake inputs. This module registers formulas for the
moecompile ops (``grouped_mm``, ``grouped_mm_wgrad``), so ``FlopCounterMode`` on a real
training step counts expert GEMMs too. Attention (``scaled_dot_product_attention``)
decomposes on CPU into a kernel without a formula, so it is counted here directly.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import operator
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, bmm_flop, flop_registry, register_flop_formula, shape_wrapper

import moecompile.kernels  # noqa: F401  (defines torch.ops.moecompile.*)

from .meta import Role

log = logging.getLogger(__name__)
aten = torch.ops.aten

COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
# Ops that neither move bytes themselves nor start a transfer.
_NOT_TRANSFERS = {"wait_tensor", "a2a_wait"}
_MOE_COLLECTIVES = {"a2a_start", "a2a_wait", "wait_tensor"}  # torch.ops.moecompile.*
# Collectives whose payload is their output (the gathered buffer), not their input.
_OUTPUT_PAYLOAD = {"all_gather_into_tensor", "all_gather_into_tensor_coalesced"}


def _grouped_mm_flop(x_shape, w_shape, sizes_shape, bias_shape=None, out_shape=None, **kwargs) -> int:
    """y_NO = x_NI @ w_EOI[e].T per expert block: 2*N*O*I, however the rows split."""
    n, i = x_shape
    _e, o, _i = w_shape
    return 2 * n * o * i


def _grouped_mm_wgrad_flop(grad_shape, x_shape, sizes_shape, out_shape=None, **kwargs) -> int:
    """dw_EOI[e] = dy[rows of e].T @ x[rows of e]: 2*N*O*I in total."""
    n, o = grad_shape
    return 2 * n * o * x_shape[1]


def _hf_grouped_mm_flop(x_shape, w_shape, *args, **kwargs) -> int:
    """transformers' grouped_mm: y_NO = x_NI @ w_EIO[e] per expert block, 2*N*I*O in all."""
    n, i = x_shape
    return 2 * n * i * w_shape[-1]


def _fp8_linear_flop(x_shape, w_shape, *args, **kwargs) -> int:
    """fp8_linear's y = x_MK @ w_NK.T (any leading dims on x): 2*M*N*K, as the GEMM it replaces."""
    m = 1
    for d in x_shape[:-1]:
        m *= d
    return 2 * m * w_shape[0] * w_shape[1]


def _fp8_grouped_linear_flop(x_shape, w_shape, *args, **kwargs) -> int:
    """fp8_grouped_linear's y_NO = x_NI @ w_EOI[e].T per expert block: 2*N*O*I, as grouped_mm's."""
    n, i = x_shape
    return 2 * n * w_shape[1] * i


def _grouped_mm_fp8_flop(x_shape, x_scale_shape, w_shape, *args, **kwargs) -> int:
    """grouped_mm_fp8 on quantized operands: the same 2*N*O*I (its scales are not GEMM work)."""
    return _fp8_grouped_linear_flop(x_shape, w_shape)


_MOE_FORMULAS = {"grouped_mm": _grouped_mm_flop, "grouped_mm_wgrad": _grouped_mm_wgrad_flop,
                 "fp8_linear": _fp8_linear_flop, "fp8_grouped_linear": _fp8_grouped_linear_flop,
                 "grouped_mm_fp8": _grouped_mm_fp8_flop}


def register_moe_formulas() -> None:
    """Teach ``torch.utils.flop_counter`` the moecompile GEMMs (idempotent).

    Checked again before counting: if the ops were defined a second time (the repo's
    ``kernels/`` imported as a top-level package), torch holds new op objects that
    need their own entry.
    """
    for name, formula in _MOE_FORMULAS.items():
        packet = getattr(torch.ops.moecompile, name, None)  # the FP8 ops are defined when fp8_linear is imported
        if packet is not None and packet not in flop_registry:
            register_flop_formula(packet)(formula)


register_moe_formulas()


def _sdpa_flop(q, k, v, *args: Any, **kwargs: Any) -> int:
    """QK^T and PV of attention (shapes in); key/value heads broadcast to the query heads (GQA)."""
    *batch, heads, s_q, d_q = q
    s_k, d_v = k[-2], v[-1]
    bh = heads
    for b in batch:
        bh = bh * b
    return bmm_flop((bh, s_q, d_q), (bh, d_q, s_k)) + bmm_flop((bh, s_q, s_k), (bh, s_k, d_v))


# Counted here rather than registered with torch: registering an aten op globally would change
# what FlopCounterMode reports for everyone else's code.
_LOCAL_FORMULAS = {
    aten.scaled_dot_product_attention: _sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flop,
}


@dataclasses.dataclass
class GraphCosts:
    """Totals for one forward graph, plus where they come from."""

    tokens: int  # tokens in the example batch (numel of the token-id input)
    flops: int  # forward FLOPs of the whole batch
    activation_bytes: int  # forward outputs kept (non-view, not recomputed)
    recomputed_bytes: int  # outputs of nodes marked for recompute (not kept)
    param_bytes: int  # bytes of the get_attr tensors the graph reads
    comm_bytes_fwd: int  # collective payload in the forward graph
    flops_by_op: dict[str, int] = dataclasses.field(default_factory=dict)
    flops_by_role: dict[str, int] = dataclasses.field(default_factory=dict)
    comm_by_op: dict[str, int] = dataclasses.field(default_factory=dict)
    collectives: int = 0  # collective nodes (waits excluded)
    approximate: bool = False  # some op or size could not be counted
    estimated: bool = False  # data-dependent expert rows taken as the rows the layer sends (balanced routing)

    @property
    def comm_bytes_step(self) -> int:
        """Forward collectives x2: autograd runs each one's mirror (a2a -> a2a, gather -> scatter) in backward."""
        return 2 * self.comm_bytes_fwd

    @property
    def flops_per_token(self) -> float:
        return self.flops / self.tokens if self.tokens else float(self.flops)


def _concrete(x: Any) -> int | None:
    """An int for an int or a SymInt with a hint; None when the size is unknown (unbacked)."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        hint = getattr(x.node, "hint", None)
        if hint is not None:
            return int(hint)
        try:
            return int(x)
        except Exception:
            return None
    try:
        return int(x)
    except Exception:
        return None


def shape_of(t: torch.Tensor, rows: int | None = None) -> tuple[int, ...] | None:
    """The tensor's sizes as ints; an unknown (data-dependent) leading size becomes ``rows`` if given."""
    dims = [_concrete(d) for d in t.shape]
    if dims and dims[0] is None and rows is not None:
        dims[0] = rows
    return None if any(d is None for d in dims) else tuple(dims)  # type: ignore[return-value]


def tensor_bytes(value: Any, rows: int | None = None) -> int | None:
    """Bytes of a tensor, or of every tensor in a tuple/list; None when a size is unknown.

    ``rows`` stands in for an unknown leading size (see :func:`graph_costs`)."""
    if isinstance(value, torch.Tensor):
        numel = _concrete(value.numel())
        if numel is None:
            shape = shape_of(value, rows)
            numel = None if shape is None else int(torch.Size(shape).numel())
        return None if numel is None else numel * value.element_size()
    if isinstance(value, (tuple, list)):
        parts = [tensor_bytes(v, rows) for v in value if isinstance(v, (torch.Tensor, tuple, list))]
        return None if any(p is None for p in parts) else sum(p for p in parts if p is not None)
    return 0


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _arg_vals(node: fx.Node) -> tuple[tuple, dict]:
    return fx.node.map_aggregate(node.args, _val), fx.node.map_aggregate(node.kwargs, _val)  # type: ignore[return-value]


def _fake_mode(values: Iterable[Any]) -> Any:
    for v in torch.utils._pytree.tree_leaves(list(values)):
        mode = getattr(v, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def _formula_by_name(qualname: str) -> Any:
    """A formula for an op whose object is not the registered one (the op was defined again)."""
    namespace, _, name = qualname.partition(".")
    if namespace == "moecompile" and name in _MOE_FORMULAS:
        return shape_wrapper(_MOE_FORMULAS[name])
    if qualname == "transformers.grouped_mm_fallback":  # a Hugging Face MoE block before import_moe adopts it
        return _hf_grouped_mm_flop
    if len(_REGISTRY_BY_NAME) != len(flop_registry):
        _REGISTRY_BY_NAME.clear()
        _REGISTRY_BY_NAME.update({str(k): f for k, f in flop_registry.items()})
    return _REGISTRY_BY_NAME.get(qualname)


_REGISTRY_BY_NAME: dict[str, Any] = {}


def _shapes(values: Any, rows: int | None) -> Any:
    """Every tensor in ``values`` as a tuple of ints (None anywhere if one can't be resolved)."""
    failed = []

    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            shape = shape_of(v, rows)
            failed.extend([v] if shape is None else [])
            return shape
        return v

    out = torch.utils._pytree.tree_map(one, values)
    return None if failed else out


def node_flops(node: fx.Node, rows: int | None = None) -> int | None:
    """Forward FLOPs of one node (0 for ops without matmul work); None if it could not be counted.

    ``rows`` stands in for an unknown leading size of the node's tensors (see :func:`graph_costs`)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or _is_wait(node):
        return 0
    packet = target.overloadpacket
    args, kwargs = _arg_vals(node)
    try:
        formula = _LOCAL_FORMULAS.get(packet) or flop_registry.get(packet) or _formula_by_name(str(packet))
        if formula is not None:
            shapes = _shapes((args, kwargs, node.meta.get("val")), rows)
            if shapes is None:
                return None
            (a, k, out) = shapes
            return _concrete(formula(*a, **k, out_val=out))
        if not torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"):
            return 0
        return _composite_flops(target, args, kwargs)
    except Exception as e:  # a formula or decomposition that can't take these values
        log.debug("could not count FLOPs of %s: %s", node.format_node(), e)
        return None


_COMPOSITE_CACHE: dict[Any, int | None] = {}  # (op, input signature) -> FLOPs; repeated layers hit it


def _signature(values: Any) -> Any:
    """A hashable stand-in for op inputs (tensors by shape, dtype and strides), or None."""
    leaves, spec = torch.utils._pytree.tree_flatten(values)
    out = []
    for v in leaves:
        if isinstance(v, torch.Tensor):
            shape, stride = [_concrete(d) for d in v.shape], [_concrete(d) for d in v.stride()]
            if None in shape or None in stride:
                return None
            out.append(("T", tuple(shape), tuple(stride), v.dtype))
        elif v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
            out.append(v)
        else:
            return None
    return (tuple(out), str(spec))


def _composite_flops(target: Any, args: tuple, kwargs: dict) -> int | None:
    """Decompose a composite op (``aten.linear``...) under FlopCounterMode on its fake inputs."""
    sig = _signature((args, kwargs))
    key = None if sig is None else (target, sig)
    if key is not None and key in _COMPOSITE_CACHE:
        return _COMPOSITE_CACHE[key]
    mode = _fake_mode([args, kwargs])
    if mode is None:
        return None
    with mode, FlopCounterMode(display=False) as counter:
        target(*args, **kwargs)
    flops = _concrete(counter.get_total_flops())
    if key is not None:
        if len(_COMPOSITE_CACHE) > 4096:
            _COMPOSITE_CACHE.clear()
        _COMPOSITE_CACHE[key] = flops
    return flops


def _is_wait(node: fx.Node) -> bool:
    """A collective's wait (torch's or moecompile's named one): the same buffer, no work of its own."""
    name = node.target.name() if isinstance(node.target, torch._ops.OpOverload) else ""
    return name.endswith(("::wait_tensor", "::a2a_wait")) or _role(node) == Role.COLLECTIVE_WAIT.value


def layer_rows(graph: fx.Graph) -> dict[str, int]:
    """Rows each MoE layer's ``permute`` hands on: the estimate for rows an expert rank receives in
    dropless dispatch (data-dependent; with balanced routing a rank receives what it sends)."""
    out = {}
    for node in graph.nodes:
        routed = (node.meta.get("moe") or {}).get("routed_rows")  # a dispatcher without a permute (ep_dedup)
        if routed is not None and node.meta["moe"].get("layer"):
            out[node.meta["moe"]["layer"]] = int(routed)
        elif str(node.target) == "moecompile.permute.default":
            val = node.meta.get("val")
            layer = (node.meta.get("moe") or {}).get("layer")
            if isinstance(val, (tuple, list)) and isinstance(val[0], torch.Tensor) and layer:
                rows = _concrete(val[0].shape[0])
                if rows is not None:
                    out[layer] = rows
    return out


def _role(node: fx.Node) -> str:
    role = node.meta.get("moe", {}).get("role")
    return str(role) if role is not None else ""


def is_recomputed(node: fx.Node) -> bool:
    """Marked for recompute: moecompile's role, or torch's partitioner policy in ``meta["recompute"]``."""
    if _role(node) == Role.RECOMPUTE.value:
        return True
    policy = node.meta.get("recompute")
    name = getattr(policy, "name", str(policy or ""))
    return name in ("MUST_RECOMPUTE", "PREFER_RECOMPUTE")


def _is_view(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem or _is_wait(node):
        return True  # an element of a tuple output (counted with its op), or a collective's own buffer
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def collective_kind(node: fx.Node) -> str | None:
    """The op name (``all_to_all_single``, ``a2a_start``, ``wait_tensor``...) of a collective node or
    its wait: torch's functional collectives, moecompile's own, or any op a pass gave a collective role."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    name = target.name().split("::")[1]
    if target.namespace in COLLECTIVE_NAMESPACES:
        return name
    if target.namespace == "moecompile" and name in _MOE_COLLECTIVES:
        return name
    role = _role(node)
    return name if role in (Role.COLLECTIVE_START.value, Role.COLLECTIVE_WAIT.value) else None


def comm_bytes(node: fx.Node, rows: int | None = None) -> int | None:
    """The collective's payload: its input buffer, or the gathered output for all-gathers."""
    kind = collective_kind(node)
    if kind is None or kind in _NOT_TRANSFERS or _is_wait(node):
        return 0
    if kind in _OUTPUT_PAYLOAD:
        return tensor_bytes(node.meta.get("val"), rows)
    first = node.args[0] if node.args else None
    return tensor_bytes(_val(first), rows) if first is not None else 0


def count_tokens(graph: fx.Graph) -> int:
    """Tokens in the example batch: numel of the first integer tensor input (token ids), else the
    leading dims of the first floating input."""
    floats = None
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        v = node.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            continue
        if not v.is_floating_point():
            return _concrete(v.numel()) or 0
        if floats is None:  # math.prod keeps an unbacked size symbolic (torch.Size.numel guards on it)
            floats = _concrete(math.prod(v.shape[:-1])) or 0
    return floats or 0


def graph_costs(graph: fx.Graph | fx.GraphModule, subgraphs: dict[str, tuple[str, dict[str, fx.Graph]]] | None = None,
                outer_rows: dict[str, int] | None = None) -> GraphCosts:
    """FLOPs, activation, parameter and communication bytes of one forward graph.

    ``subgraphs`` (``PassRecord.subgraphs``; found on the module itself for a GraphModule) lets
    a ``call_module`` node be counted by the graphs inside it; in a recompute region
    (``memory_region == "recompute"``) the outputs of its ``recompute`` graph count as recomputed.
    ``outer_rows``: the routed rows of the MoE layers of the graph holding this one (a region around the
    experts holds no permute, so only its caller knows how many rows they receive).
    """
    if isinstance(graph, fx.GraphModule):
        if subgraphs is None:
            from .history import _subgraphs

            subgraphs = _subgraphs(graph)
        graph = graph.graph
    subgraphs = subgraphs or {}
    register_moe_formulas()
    flops_by_op: collections.Counter[str] = collections.Counter()
    flops_by_role: collections.Counter[str] = collections.Counter()
    comm_by_op: collections.Counter[str] = collections.Counter()
    act = recomputed = params = collectives = 0
    approximate = estimated = False
    seen_attrs: set[str] = set()
    rows_of = {**(outer_rows or {}), **layer_rows(graph)}

    def measure(fn: Any, *args: Any) -> int | None:
        """``fn`` on the node's sizes; failing that, with its layer's rows for an unknown row count."""
        nonlocal approximate, estimated
        value = fn(*args)
        if value is None and rows is not None:
            value = fn(*args, rows)
            estimated |= value is not None
        approximate |= value is None
        return value

    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "get_attr":
            if node.target not in seen_attrs:
                seen_attrs.add(str(node.target))
                params += tensor_bytes(val) or 0
            continue
        if node.op == "call_module" and str(node.target) in subgraphs:
            kind, graphs = subgraphs[str(node.target)]
            for path, inner_graph in graphs.items():
                inner = graph_costs(inner_graph, outer_rows=rows_of)
                flops_by_op.update(inner.flops_by_op)
                flops_by_role.update(inner.flops_by_role)
                comm_by_op.update(inner.comm_by_op)
                collectives += inner.collectives
                approximate |= inner.approximate
                estimated |= inner.estimated
                if kind == "recompute" and path.split(".")[-1] == "recompute":
                    recomputed += inner.activation_bytes + inner.recomputed_bytes
                else:
                    act, recomputed = act + inner.activation_bytes, recomputed + inner.recomputed_bytes
            continue  # its outputs are the inner graphs' outputs, counted there
        if node.op != "call_function":
            continue
        rows = rows_of.get((node.meta.get("moe") or {}).get("layer"))  # type: ignore[arg-type]
        flops = measure(node_flops, node)
        if flops:
            flops_by_op[str(node.target.overloadpacket)] += flops  # type: ignore[union-attr]
            flops_by_role[_role(node) or "dense"] += flops
        kind = collective_kind(node)
        if kind is not None and kind not in _NOT_TRANSFERS and not _is_wait(node):
            collectives += 1
            comm_by_op[kind] += measure(comm_bytes, node) or 0
        if _is_view(node):
            continue
        size = measure(tensor_bytes, val)
        if size is None:
            continue
        if is_recomputed(node):
            recomputed += size
        else:
            act += size
    return GraphCosts(
        tokens=count_tokens(graph),
        flops=sum(flops_by_op.values()),
        activation_bytes=act,
        recomputed_bytes=recomputed,
        param_bytes=params,
        comm_bytes_fwd=sum(comm_by_op.values()),
        flops_by_op=dict(flops_by_op),
        flops_by_role=dict(flops_by_role),
        comm_by_op=dict(comm_by_op),
        collectives=collectives,
        approximate=approximate,
        estimated=estimated,
    )


def human(n: float, unit: str = "", base: int = 1000) -> str:
    """1234567 -> '1.23 M' (base 1000) or '1.18 Mi' (base 1024), followed by ``unit``."""
    prefixes = ["", "K", "M", "G", "T", "P"]
    value, i = float(n), 0
    while abs(value) >= base and i < len(prefixes) - 1:
        value, i = value / base, i + 1
    prefix = prefixes[i] + ("i" if base == 1024 and i else "")
    text = f"{value:.0f}" if i == 0 else f"{value:.3g}" if abs(value) >= 100 else f"{value:.2f}"
    return f"{text} {prefix}{unit}".rstrip()
