"""Pass ``find_ffn`` (analysis): find every dense FFN by graph pattern.

Nothing in the graph changes; each match is annotated so ``upcycle`` can replace it::

    linear(x, Wg) -> silu -> mul(., linear(x, Wu)) -> linear(., Wd)     kind="glu", act="silu"
    linear(x, Wgu) -> chunk(2) -> silu(gate) * up -> linear(., Wd)       kind="glu" (Phi-3's fused gate_up)
    [view] -> addmm(b1, ., W1) -> [view] -> gelu_new -> [view] -> addmm -> [view]   kind="mlp"

Patterns are matched with torch.fx's ``SubgraphMatcher`` over the ATen graph: SwiGLU /
GeGLU / ReGLU (both operand orders), and GELU / tanh-GELU / ReLU / ReLU² / SiLU MLPs, with
or without biases, as ``linear`` or as GPT-2's ``Conv1D`` (``addmm`` between views).
The FFN output node gets ``meta["moe"] = {"layer", "role": "ffn", "ffn": FFNInfo}``.
An FFN inside a model's own MoE block that ``import_moe`` left as it is (``experts.adopt: false``) is
part of that block, a shared expert, not a dense FFN: it is not reported.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher

from moecompile.errors import PassError
from moecompile.graph import common_module, get_attr_value
from moecompile.meta import FFNInfo, Role, moe, set_moe
from moecompile.pass_manager import PassContext, register_pass

from .import_moe import find_blocks

aten = torch.ops.aten

_ACTS: dict[str, Callable] = {
    "silu": lambda h: aten.silu.default(h),
    "gelu": lambda h: aten.gelu.default(h),
    "gelu_tanh": lambda h: aten.gelu.default(h, approximate="tanh"),
    "relu": lambda h: aten.relu.default(h),
    "relu2": lambda h: aten.square.default(aten.relu.default(h)),  # Nemotron, Arcee: ReLU squared
    # transformers' NewGELUActivation (GPT-2's "gelu_new"), as export writes it out
    "gelu_tanh_expanded": lambda h: aten.mul.Tensor(
        aten.mul.Tensor(h, 0.5),
        aten.add.Tensor(
            aten.tanh.default(aten.mul.Tensor(aten.add.Tensor(h, aten.mul.Tensor(aten.pow.Tensor_Scalar(h, 3.0), 0.044715)), 0.7978845608028654)),
            1.0,
        ),
    ),
}
_GLU_ACTS = ("silu", "gelu", "gelu_tanh", "relu")
_MLP_ACTS = ("gelu", "gelu_tanh", "relu", "relu2", "silu", "gelu_tanh_expanded")


def _linear(x, w, b):
    return aten.linear.default(x, w) if b is None else aten.linear.default(x, w, b)


def _pattern(kind: str, act: str, bias: bool, swap: bool, conv1d: bool) -> fx.GraphModule:
    """Trace one FFN shape into a pattern graph; placeholder names say what they bind to."""
    f = _ACTS[act]
    if kind == "glu_fused":  # Phi-3: one gate_up GEMM, then chunk
        def fn(x, w_gate_up, w_down):
            h = aten.chunk.default(_linear(x, w_gate_up, None), 2, -1)
            g, u = f(h[0]), h[1]
            return _linear(aten.mul.Tensor(u, g) if swap else aten.mul.Tensor(g, u), w_down, None)
    elif kind == "glu":
        if bias:
            def fn(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
                g, u = f(_linear(x, w_gate, b_gate)), _linear(x, w_up, b_up)
                return _linear(aten.mul.Tensor(u, g) if swap else aten.mul.Tensor(g, u), w_down, b_down)
        else:
            def fn(x, w_gate, w_up, w_down):
                g, u = f(_linear(x, w_gate, None)), _linear(x, w_up, None)
                return _linear(aten.mul.Tensor(u, g) if swap else aten.mul.Tensor(g, u), w_down, None)
    elif conv1d:  # GPT-2 Conv1D: addmm over flattened rows, weights stored [in, out]
        def fn(x, w_up, w_down, b_up, b_down, s0, s1, s2, s3):
            h = aten.view.default(aten.addmm.default(b_up, aten.view.default(x, s0), w_up), s1)
            h = aten.view.default(f(h), s2)
            return aten.view.default(aten.addmm.default(b_down, h, w_down), s3)
    elif bias:
        def fn(x, w_up, w_down, b_up, b_down):
            return _linear(f(_linear(x, w_up, b_up)), w_down, b_down)
    else:
        def fn(x, w_up, w_down):
            return _linear(f(_linear(x, w_up, None)), w_down, None)
    return fx.symbolic_trace(fn)


@functools.cache
def _patterns() -> list[tuple[str, str, bool, fx.GraphModule]]:
    """(kind, act, transposed, pattern), most specific first so a GLU is never read as an MLP."""
    out = []
    for act, bias, swap in itertools.product(_GLU_ACTS, (True, False), (False, True)):
        out.append(("glu", act, False, _pattern("glu", act, bias, swap, False)))
    for act, swap in itertools.product(_GLU_ACTS, (False, True)):
        out.append(("glu", act, False, _pattern("glu_fused", act, False, swap, False)))
    for act, bias in itertools.product(_MLP_ACTS, (True, False)):
        out.append(("mlp", act, False, _pattern("mlp", act, bias, False, False)))
    for act in _MLP_ACTS:
        out.append(("mlp", act, True, _pattern("mlp", act, True, False, True)))
    return out


def _bind(pattern: fx.GraphModule, match: InternalMatch) -> dict[str, object]:
    return {pn.target: match.nodes_map[pn] for pn in pattern.graph.nodes if pn.op == "placeholder"}


@register_pass("find_ffn", provides=("ffn",))
def find_ffn(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    taken: set[fx.Node] = set()
    found = []
    moe_blocks = find_blocks(gm)  # the model's own MoE blocks still in the graph
    in_blocks: set[str] = set()
    for kind, act, transposed, pattern in _patterns():
        matcher = SubgraphMatcher(pattern.graph, ignore_literals=False, remove_overlapping_matches=True)
        for match in matcher.match(gm.graph):
            inner = [gn for pn, gn in match.nodes_map.items() if pn.op not in ("placeholder", "output")]
            if taken.intersection(inner):
                continue
            bound = _bind(pattern, match)
            params = {k: v for k, v in bound.items() if k[:2] in ("w_", "b_")}
            if not all(isinstance(v, fx.Node) and v.op == "get_attr" for v in params.values()):
                continue  # weights computed in the graph: not an FFN we can copy into experts
            taken.update(inner)
            layer = common_module(inner)
            block = next((b for b in moe_blocks if layer == b or layer.startswith(b + ".")), None)
            if block is not None:
                in_blocks.add(f"{layer} (in {block})")
                continue
            out = match.returning_nodes[0]
            x = bound["x"]
            w_down = get_attr_value(gm, params["w_down"].target)
            info = FFNInfo(
                kind=kind,
                act="gelu_tanh" if act == "gelu_tanh_expanded" else act,
                input=x.name,
                output=out.name,
                nodes=[n.name for n in inner],
                weights={k[2:]: v.target for k, v in params.items() if k.startswith("w_")},
                biases={k[2:]: v.target for k, v in params.items() if k.startswith("b_")},
                transposed=transposed,
                hidden=w_down.shape[1] if transposed else w_down.shape[0],
                intermediate=w_down.shape[0] if transposed else w_down.shape[1],
            )
            found.append((out, inner, info, layer))
    if in_blocks:
        ctx.decide(f"not dense FFNs, part of the model's MoE blocks: {', '.join(sorted(in_blocks))}")
    if not found and not moe_blocks and not any("moe" in moe(n) for n in gm.graph.nodes):  # no FFN, no MoE block
        raise PassError(
            "find_ffn",
            ctx.passes_run,
            "no FFN in the model matches a known pattern. Looked for: SwiGLU/GeGLU/ReGLU "
            "(act(x Wg) * (x Wu) -> Wd) and GELU/tanh-GELU/ReLU/ReLU²/SiLU MLPs (x W1 -> act -> W2), with or "
            "without biases, as linear or addmm (Conv1D). Register a pattern or a custom pass for other FFNs.",
        )
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for index, (out, inner, info, layer) in enumerate(sorted(found, key=lambda t: order[t[0]])):
        for n in inner:
            set_moe(n, layer=layer, role=Role.FFN)
        set_moe(out, ffn=info, ffn_index=index)
        ctx.decide(f"{layer}: {info['kind']} FFN, act={info['act']}, H={info['hidden']}, F={info['intermediate']}")
    ctx.record(ffns=[layer for *_, layer in found])
    return gm
