"""Pass ``fp8``: run the chosen GEMMs in FP8; the router and the model's ends stay high precision.

Before / after, per GEMM the plan selects (``fp8.modules``)::

    y = aten.linear(x, W, b)                        # dense, attention_proj, shared_experts
    f = moecompile.fp8_linear(x, W, b, hist, recipe, fmt, block);  y = f[0]

    y = aten.addmm(b, x, W_KN)                      # GPT-2 Conv1D layout
    f = moecompile.fp8_linear(x, aten.t(W_KN), b, hist, ...);       y = f[0]

    y = moecompile.grouped_mm(x, W_EOI, sizes, b)   # role experts
    f = moecompile.fp8_grouped_linear(x, W_EOI, sizes, b, hist, ...); y = f[0]

Each op quantizes its operands to float8 (scales per ``fp8.recipe``), runs an FP8
GEMM, and saves the float8 activation for backward (kernels/fp8_linear.py).
``delayed`` adds a buffer ``<weight>_fp8_amax_history`` [3, amax_history_len] per
GEMM, so checkpoints carry the scaling state. Never converted: the router (role
``router``), the embedding and output head (outside the transformer layers), and
the first / last N layers if ``fp8.keep_high_precision`` says so.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

import moecompile.kernels  # noqa: F401  (registers torch.ops.moecompile.*)
import moecompile.kernels.fp8_linear  # noqa: F401  (fp8_linear, fp8_grouped_linear)
from moecompile.costs import human
from moecompile.graph import add_parameter, module_chain, module_path
from moecompile.memory import profile_activations
from moecompile.meta import Role, copy_moe, moe
from moecompile.pass_manager import PassContext, register_pass, register_verifier

aten, mc = torch.ops.aten, torch.ops.moecompile
FP8_OPS = (mc.fp8_linear.default, mc.fp8_grouped_linear.default)
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")  # the first ModuleList index: layers.3, h.3, blocks.3
_VIEWS = {aten.view.default, aten.reshape.default, aten.t.default, aten.permute.default, aten.transpose.int,
          aten._unsafe_view.default, aten.alias.default}


def layer_index(node: fx.Node) -> int | None:
    """The transformer layer a node belongs to (``model.layers.3...``, ``transformer.h.3...`` -> 3), if any."""
    for path in [moe(node).get("layer", ""), module_path(node)]:
        m = _LAYER.search(path or "")
        if m:
            return int(m.group(1))
    return None


def _in_attention(node: fx.Node) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any("Attention" in str(t).rsplit(".", 1)[-1] for _p, t in stack.values()) or any(
        p.rsplit(".", 1)[-1] in ("self_attn", "attn", "attention") for p in module_chain(node)
    )


def gemm_kind(node: fx.Node) -> str | None:
    """Which ``fp8.modules`` entry a GEMM node falls under; None for what always stays high precision."""
    if node.op != "call_function":
        return None
    role = moe(node).get("role")
    if node.target is mc.grouped_mm.default:
        return "experts" if role == Role.EXPERTS else None
    if node.target not in (aten.linear.default, aten.addmm.default):
        return None
    if node.target is aten.addmm.default and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
        return None
    if role in (Role.ROUTER, Role.ROUTE):
        return None
    if role == Role.SHARED_EXPERTS:
        return "shared_experts"
    if layer_index(node) is None:
        return None  # embedding, output head, anything outside the transformer layers
    return "attention_proj" if _in_attention(node) else "dense"


def _weight_name(w: fx.Node) -> str | None:
    """The parameter a GEMM's weight operand is a view of."""
    while w.op == "call_function" and w.target in _VIEWS:
        w = w.args[0]  # type: ignore[assignment]
    return str(w.target) if w.op == "get_attr" else None


@register_pass("fp8", after="upcycle")
def fp8(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    cfg = ctx.plan.fp8
    if not cfg.enabled:
        ctx.decide("fp8.recipe is 'none' (or fp8.modules empty): every GEMM stays in high precision")
        ctx.record(fp8={"recipe": cfg.recipe, "converted": {}, "kept": {}})
        return PassResult(gm, False)
    ep = ctx.plan.parallel.expert_ranks  # a dropless dispatch's splits are data-dependent: profiled as balanced
    before = profile_activations(gm.graph, gm, ctx.example_inputs, ep=ep).device_bytes
    layers = [i for n in gm.graph.nodes if (i := layer_index(n)) is not None]
    kept_layers = cfg.kept_layers(max(layers) + 1) if layers else set()
    converted: dict[str, list[str]] = {}
    kept: dict[str, list[str]] = {"router": [], "layers": [], "not selected": []}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and moe(node).get("role") == Role.ROUTER and node.target is aten.linear.default:
            kept["router"].append(node.name)
        kind = gemm_kind(node)
        if kind is None:
            continue
        if kind not in cfg.modules:
            kept["not selected"].append(node.name)
            continue
        if layer_index(node) in kept_layers:
            kept["layers"].append(node.name)
            continue
        _rewrite(gm, node, cfg)
        converted.setdefault(kind, []).append(node.name)
    total = sum(len(v) for v in converted.values())
    ctx.decide(
        f"fp8 {cfg.recipe} ({cfg.format}): {total} GEMMs -> FP8 ("
        + ", ".join(f"{len(v)} {k}" for k, v in converted.items())
        + f"); high precision: {len(kept['router'])} router GEMMs"
        + (f", layers {sorted(kept_layers)}" if kept_layers else "")
        + (f", {len(kept['not selected'])} GEMMs not in fp8.modules" if kept["not selected"] else "")
    )
    after = profile_activations(gm.graph, gm, ctx.example_inputs, ep=ep).device_bytes
    ctx.decide(f"activations per rank {human(before, 'B', 1024)} -> {human(after, 'B', 1024)} (float8 copies saved for backward)")
    ctx.record(fp8={"recipe": cfg.recipe, "format": cfg.format, "converted": converted, "kept": kept,
                    "activation_bytes": {"before": before, "after": after}})
    return PassResult(gm, bool(total))


def _rewrite(gm: fx.GraphModule, node: fx.Node, cfg) -> None:
    g = gm.graph
    with g.inserting_before(node):
        if node.target is mc.grouped_mm.default:
            x, w, sizes, bias = (list(node.args) + [None] * 4)[:4]
            weight = w
        elif node.target is aten.addmm.default:
            bias, x, w_kn = node.args[:3]
            weight = w_kn
            w = g.call_function(aten.t.default, (w_kn,))
            copy_moe(node, w)
        else:
            x, w, bias = (list(node.args) + [None] * 3)[:3]
            weight = w
        hist = None
        if cfg.recipe == "delayed":
            name = f"{_weight_name(weight) or node.name}_fp8_amax_history"
            device = x.meta["val"].device  # a model converted on a GPU keeps its history there
            add_parameter(gm, name, torch.zeros(3, cfg.amax_history_len, device=device), requires_grad=False)
            hist = g.get_attr(name)
        block = cfg.block_size
        if node.target is mc.grouped_mm.default:
            f = g.call_function(mc.fp8_grouped_linear.default, (x, w, sizes, bias, hist, cfg.recipe, cfg.format, block))
        else:
            f = g.call_function(mc.fp8_linear.default, (x, w, bias, hist, cfg.recipe, cfg.format, block))
        y = g.call_function(operator.getitem, (f, 0))
    for new in (f, y):
        copy_moe(node, new)
        new.meta.setdefault("moe", {})["fp8"] = cfg.recipe
    node.replace_all_uses_with(y)
    g.erase_node(node)


def _router_stays_high_precision(gm: fx.GraphModule, ctx: PassContext) -> None:
    for n in gm.graph.nodes:
        if n.target in FP8_OPS:
            assert moe(n).get("role") not in (Role.ROUTER, Role.ROUTE), f"router GEMM {n.name} was cast to FP8"


register_verifier("fp8", _router_stays_high_precision)
