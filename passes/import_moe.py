"""Pass ``import_moe``: adopt the MoE blocks a model already has (Mixtral, Qwen2/3-MoE, OLMoE, ERNIE 4.5, Granite-MoE,
DeepSeek-V3 and the models that reuse its router, Nemotron-H, Llama 4, gpt-oss).

Hugging Face's MoE layers (transformers 5) keep their experts fused, in moecompile's own layout::

    <layer>.gate.weight              [E, H]       router (softmax / sigmoid -> top-k [-> renormalise])
    <layer>.experts.gate_up_proj     [E, 2F, H]   gate rows first
    <layer>.experts.down_proj        [E, H, F]
    <layer>.experts.up_proj          [E, F, H]    instead of gate_up_proj: plain MLP experts (Nemotron-H, ReLU²)

or transposed, [E, H, 2F] / [E, F, H] (Llama 4's, read by ``bmm``), which the adopted block holds in its layout;
gpt-oss's also alternate gate and up columns (read by step-2 slices) and have biases (``experts.gate_up_proj_bias``,
``experts.down_proj_bias``), and its router GEMM has one (``router.bias``).

Each such block is replaced by moecompile's (the one ``upcycle`` builds), holding the same
tensors, so expert parallelism, overlap, FP8, recompute, the train step and ``export_hf``
treat it like an upcycled layer. What the block does is read from its graph and then
checked, not trusted: the new block must reproduce the old one on the activations the
example inputs produce. The router is read backwards from its last top-k: a group mask
(``masked_fill``) before it means group-limited routing, whose group count and kept groups
come from the top-ks that build the mask; a tensor of the block added to the scores is a
selection bias (``gate.e_score_correction_bias``, which becomes ``router.expert_bias`` and
keeps training under ``experts.expert_bias_rate``; ERNIE 4.5 reads its [1, E] bias through a squeeze); the
weights are the top-k scores or the scores gathered at its indices, maybe renormalised (a ``div``), maybe scaled
(a ``mul``), or a softmax over the top-k *logits* (Granite-MoE, whose router's weight is ``router.weight``), which is
the renormalised top-k of the softmax, or a sigmoid of them (Llama 4), the unnormalised top-k of the sigmoid;
routing weights that reach the experts' first GEMM through its input rows weight the input (Llama 4), which the
adopted block's glu does before its activation (``weights_at: "input"``);
casts of the router GEMM's input and weight to fp32 mean ``router_dtype: float32``.
A shared expert is Qwen2-MoE's gated GLU or DeepSeek-V3's ungated one, or, beside plain MLP experts, an MLP.

The plan describes the experts the model has: ``experts.num_experts``, ``top_k``, ``score``,
``normalize``, ``shared_experts``, ``route_groups``, ``route_group_top_k``, ``route_scale``
and ``router_dtype`` must equal the model's, and ``expert_bias`` be on when it has a selection
bias (a :class:`PlanError` says which to set); granularity, which only means something when
upcycling, must be 1. Anything else in a block (jitter noise, router logits used outside
it, another kind of router) is an :class:`UnsupportedMoE` error that names it.
``experts.adopt: false`` leaves every block as the model's own code. The model's dense
FFNs stay dense unless ``experts.layers`` names them (``upcycle``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from moecompile.errors import MoecompileError, PlanError
from moecompile.graph import ancestors_within, clean_path, delete_unused_attrs, get_attr_value, module_chain
from moecompile.kernels.glu import ACTS as GLU_ACTS, SWIGLU_ALPHA, SWIGLU_LIMIT
from moecompile.pass_manager import PassContext, register_pass
from moecompile.plan import ExpertsConfig

from .upcycle import MLP_ACTS, insert_block, moe_block, register_block, weights_at

aten = torch.ops.aten

# block tensor key -> Hugging Face parameter name under the block's module path
HF_NAMES = {"router": "gate.weight", "w_in": "experts.gate_up_proj", "w_out": "experts.down_proj"}
EXPERT_INPUTS = {"experts.gate_up_proj": True, "experts.up_proj": False}  # fused experts' first GEMM -> gated
EXPERT_BIASES = {"b_in": "experts.gate_up_proj_bias", "b_out": "experts.down_proj_bias"}  # gpt-oss's
# the router's weight, by name (Granite-MoE: router.weight, HunYuan-MoE: gate.wg.weight, AFMoE: router.gate.weight)
ROUTER_NAMES = ("gate.weight", "router.weight", "gate.wg.weight", "router.gate.weight")
# the shared experts moecompile's block can be: a GLU beside the routed experts, Qwen2-MoE's behind a
# per-token sigmoid gate, DeepSeek-V3's (n_shared_experts of them fused into one wide GLU) ungated
SHARED_LAYOUTS = (
    {"gate": "shared_expert.gate_proj.weight", "up": "shared_expert.up_proj.weight",
     "down": "shared_expert.down_proj.weight", "shared_gate": "shared_expert_gate.weight"},
    {"gate": "shared_experts.gate_proj.weight", "up": "shared_experts.up_proj.weight",
     "down": "shared_experts.down_proj.weight"},
    {"up": "shared_experts.up_proj.weight", "down": "shared_experts.down_proj.weight"},  # an MLP (Nemotron-H)
    {"gate": "shared_expert.gate_proj.weight", "up": "shared_expert.up_proj.weight",  # Llama 4's, ungated
     "down": "shared_expert.down_proj.weight"},
    {"gate": "shared_mlp.gate_proj.weight", "up": "shared_mlp.up_proj.weight",  # HunYuan-MoE's, ungated
     "down": "shared_mlp.down_proj.weight"},
)
_ACTS = {aten.silu.default: "silu", aten.relu.default: "relu", aten.gelu.default: "gelu"}
_SCORES = {aten.softmax.int: "softmax", aten._softmax.default: "softmax", aten.sigmoid.default: "sigmoid"}
_RANDOM = {aten.uniform_.default, aten.uniform.default, aten.rand_like.default, aten.randn_like.default,
           aten.normal_.default}
_DIV = (aten.div.Tensor, aten.div_.Tensor)


class UnsupportedMoE(MoecompileError):
    """A model's MoE block computes something moecompile's block does not; the message names what."""


@dataclasses.dataclass
class Router:
    """What a block's router computes, in the plan's terms."""

    top_k: int
    score: str
    normalize: bool
    bias: str | None = None  # the selection bias's name, if the scores are shifted before the top-k
    route_groups: int = 1
    route_group_top_k: int = 1
    route_scale: float = 1.0
    router_dtype: str = "model"  # "float32": the router GEMM runs on fp32 casts of its input and weight


@dataclasses.dataclass
class ExistingBlock:
    """One Hugging Face MoE block found in the graph, and what it computes."""

    layer: str  # its module path
    kind: str  # its class name, for messages
    nodes: list[fx.Node]  # every node traced from inside it, in graph order
    x: fx.Node  # its input [..., H]
    out: fx.Node  # its output, the one value used outside it
    params: dict[str, str]  # "router" / "w_in" / "w_out" -> parameter name
    shared: dict[str, str]  # SHARED_LAYOUTS keys -> parameter name, when the block has a shared expert
    num_experts: int
    router: Router
    act: str
    glu: bool  # gated experts (act(x Wg) * x Wu), else plain MLPs (act(x Wu))
    transposed: bool = False  # experts stored [E, H, (2)F] / [E, F, H] (Llama 4)
    interleaved: bool = False  # gate and up columns alternate (gpt-oss)
    weights_input: bool = False  # the routing weights scale the experts' input rows (Llama 4)

    def plan_fields(self) -> dict[str, object]:
        """The ``experts`` plan fields this block fixes, as the model has them."""
        r = self.router
        return {"num_experts": self.num_experts, "top_k": r.top_k, "score": r.score, "normalize": r.normalize,
                "shared_experts": 1 if self.shared else 0, "route_groups": r.route_groups,
                "route_group_top_k": r.route_group_top_k, "route_scale": r.route_scale, "router_dtype": r.router_dtype}

    def hf_names(self) -> list[str]:
        return [*self.params.values(), *self.shared.values(), *([self.router.bias] if self.router.bias else [])]

    def describe(self) -> str:
        r = self.router
        groups = f" within {r.route_group_top_k} of {r.route_groups} groups" if r.route_groups > 1 else ""
        bias = " (biased selection)" if r.bias else ""
        bias += " (a router bias)" if "router_bias" in self.params else ""
        weights = "renormalised" if r.normalize else "unnormalised"
        weights += f" x{r.route_scale:g}" if r.route_scale != 1 else ""
        shared = " + a shared expert" if self.shared else ""
        shared = " + a gated shared expert" if "shared_gate" in self.shared else shared
        kind = "GLUs" if self.glu else "MLPs"
        kind += " weighted at their input" if self.weights_input else ""
        kind += " with biases" if "b_in" in self.params or "b_out" in self.params else ""
        return f"{self.num_experts} experts top-{r.top_k}{groups} {r.score}{bias} {weights} {self.act} {kind}{shared}"

    def tensors(self, gm: fx.GraphModule) -> dict[str, torch.Tensor]:
        """The block's tensors by moecompile's keys (a shared GLU's gate and up fused, as the experts')."""
        out = {k: get_attr_value(gm, n) for k, n in self.params.items()}
        if self.transposed:
            out |= {k: out[k].transpose(1, 2).contiguous() for k in ("w_in", "w_out")}
        if self.interleaved:  # gate rows first, then up, as moecompile's
            out |= {k: torch.cat([out[k][:, 0::2], out[k][:, 1::2]], 1) for k in ("w_in", "b_in") if k in out}
        if self.router.bias:
            out["bias"] = get_attr_value(gm, self.router.bias).reshape(-1)  # [E], from [1, E] too
        if self.shared:
            w = {k: get_attr_value(gm, n) for k, n in self.shared.items()}
            out["shared_w_in"] = (torch.cat([w["gate"], w["up"]]) if self.glu else w["up"])[None]  # [1, (2)Fs, H]
            out["shared_w_out"] = w["down"][None]  # [1, H, Fs]
            if "shared_gate" in w:
                out["shared_gate"] = w["shared_gate"]  # [1, H]
        return out


def find_blocks(gm: fx.GraphModule) -> list[str]:
    """The module path of every block whose fused expert tensors sit under it."""
    return sorted({n.target[: -len(name) - 1] for n in gm.graph.nodes for name in EXPERT_INPUTS
                   if n.op == "get_attr" and n.target.endswith("." + name)})


def _router_dtype(nodes: list[fx.Node], weight: str) -> str:
    """The plan's ``router_dtype``: "float32" where the router GEMM reads fp32 casts of its input and weight."""
    return "float32" if _fp32_router(nodes, weight) else "model"


def _fp32_router(nodes: list[fx.Node], weight: str) -> bool:
    """Whether the router GEMM reads its weight through a cast to fp32 (DeepSeek-V3's ``.type(torch.float32)``)."""
    def is_fp32_cast(n: object) -> bool:
        return isinstance(n, fx.Node) and n.target is aten.to.dtype and n.args[1] == torch.float32

    for n in nodes:
        if n.target is aten.linear.default and is_fp32_cast(n.args[1]) and n.args[1].args[0].target == weight:
            return is_fp32_cast(n.args[0])
    return False


_RESHAPES = {aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.view.default, aten.reshape.default}
_VIEWS = _RESHAPES | {aten.transpose.int, aten.permute.default, aten.t.default, aten.unsqueeze.default,
                      aten.expand.default, aten.contiguous.default, aten.to.dtype, aten.slice.Tensor, aten.select.int}


def _bias_attr(a: object) -> fx.Node | None:
    """The block's tensor a score shift reads, directly or through a reshape (ERNIE 4.5 keeps its bias [1, E] and
    squeezes it); None for anything else."""
    if isinstance(a, fx.Node) and a.target in _RESHAPES:
        a = a.args[0]
    return a if isinstance(a, fx.Node) and a.op == "get_attr" else None


def read_router(nodes: list[fx.Node], fail, weight: str) -> Router:
    """The router, read backwards from the block's last top-k (the one that picks the experts)."""
    topks = [n for n in nodes if n.target is aten.topk.default]
    if not topks:
        fail("its router has no top-k", "moecompile adopts top-k routers")
    pick = topks[-1]
    choice, groups, group_k = pick.args[0], 1, 1
    if choice.target is aten.masked_fill.Scalar:  # a group mask: DeepSeek-V3's group-limited routing
        per_group = [t for t in topks[:-1] if t.args[0].meta["val"].dim() == 3]  # top-2 in each group [T, G, E/G]
        kept = [t for t in topks[:-1] if t not in per_group]  # the best groups [T, G]
        if len(per_group) != 1 or len(kept) != 1 or per_group[0].args[1] != 2:
            fail("its router masks the scores otherwise than by groups scored by their top-2",
                 "moecompile adopts DeepSeek-V3's group-limited routing")
        groups, group_k = int(per_group[0].args[0].meta["val"].shape[1]), int(kept[0].args[1])
        choice = choice.args[0]
    elif len(topks) != 1:
        fail(f"its router takes {len(topks)} top-ks", "moecompile adopts one top-k, or DeepSeek-V3's groups")
    bias = None
    if choice.target is aten.add.Tensor:  # scores + a tensor of the block: a selection bias
        attrs = [a for a in choice.args if _bias_attr(a) is not None]
        if len(attrs) != 1:
            fail("its router adds something to the scores that is not one bias tensor",
                 "moecompile's selection bias is one [E] tensor")
        bias = _bias_attr(attrs[0]).target
        choice = next(a for a in choice.args if a is not attrs[0])
    if choice.target not in _SCORES:
        late = _score_of_top_logits(pick, choice, weight)
        if late is None or bias or groups > 1:
            fail(f"its top-k picks from {choice.target}, not softmax or sigmoid scores",
                 "moecompile adopts those routers")
        score = _SCORES[late.target]  # softmax over k: the top-k renormalised; sigmoid of each: unnormalised
        return Router(int(pick.args[1]), score, score == "softmax", None, 1, 1, _scale_of(late),
                      _router_dtype(nodes, weight))
    values = next((u for u in pick.users if u.args[1] == 0 and u.users), None)  # the top-k scores (getitem 0)
    indices = next((u for u in pick.users if u.args[1] == 1), None)
    gathered = [n for n in nodes if n.target is aten.gather.default and n.args[0] is choice and n.args[2] is indices]
    weights = gathered[0] if gathered else values
    if weights is None:
        fail("its routing weights are neither the top-k scores nor the scores at the top-k",
             "moecompile adopts those routers")
    if bias and weights is values:
        fail(f"its routing weights are the biased scores ({bias} added)", "moecompile weighs by unbiased scores")
    weights = _past_casts(weights)  # LFM2-MoE divides the gathered scores after a type_as
    divided = next((n for n in nodes if n.target in _DIV and n.args[0] is weights), None)
    return Router(int(pick.args[1]), _SCORES[choice.target], divided is not None, bias, groups, group_k,
                  _scale_of(divided or weights), _router_dtype(nodes, weight))


_CASTS = {aten.to.dtype, aten.type_as.default, aten._to_copy.default}


def _past_casts(n: fx.Node) -> fx.Node:
    """``n``, or the cast of it that its only user is, followed through every such cast."""
    while len(n.users) == 1 and next(iter(n.users)).target in _CASTS:
        n = next(iter(n.users))
    return n


def _scale_of(weights: fx.Node) -> float:
    """The constant the routing weights are multiplied by (DeepSeek-V3's routed_scaling_factor), else 1."""
    scaled = next((u for u in weights.users
                   if u.target is aten.mul.Tensor and isinstance(u.args[1], (int, float))), None)
    return float(scaled.args[1]) if scaled is not None else 1.0


def _score_of_top_logits(pick: fx.Node, choice: fx.Node, weight: str) -> fx.Node | None:
    """The scores of the top-k router logits: a softmax over the k values (Granite-MoE: top-k of
    ``linear(x, W).float()``), which equals the top-k of the softmax renormalised, or a sigmoid of each, scattered
    into -inf first (Llama 4), which is the top-k of the sigmoid; None for any other router."""
    logits = choice.args[0] if choice.target is aten.to.dtype else choice
    if logits.target is not aten.linear.default or getattr(logits.args[1], "target", None) != weight:
        return None
    values = next((u for u in pick.users if u.args[1] == 0), None)
    if values is None:
        return None
    softmax = next((u for u in values.users if _SCORES.get(u.target) == "softmax"), None)
    if softmax is not None:
        return softmax
    scattered = next((u for u in values.users if u.target in (aten.scatter.src, aten.scatter_.src)), None)
    filled = scattered.args[0] if scattered is not None else None
    if filled is None or filled.target is not aten.full_like.default or filled.args[1] != -math.inf:
        return None
    cast = next(iter(scattered.users), None)
    while cast is not None and cast.target is aten.to.dtype:
        cast = next(iter(cast.users), None)
    return cast if cast is not None and _SCORES.get(cast.target) == "sigmoid" else None


def _router_bias(nodes: list[fx.Node], weight: str) -> str | None:
    """The bias the router GEMM adds to its logits (gpt-oss's ``router.bias``), by name; None without one."""
    def attr(n: object) -> str | None:
        n = n.args[0] if isinstance(n, fx.Node) and n.target is aten.to.dtype else n
        return n.target if isinstance(n, fx.Node) and n.op == "get_attr" else None

    gemm = next((n for n in nodes if n.target is aten.linear.default and attr(n.args[1]) == weight), None)
    return attr(gemm.args[2]) if gemm is not None and len(gemm.args) > 2 else None


def _weights_input(gm: fx.GraphModule, nodes: list[fx.Node], w_in: str) -> bool:
    """Whether the routing scores reach the experts' first GEMM through its input rows (Llama 4: ``x * w``), along
    floating-point values only: indices route rows in every block, weights reach the input only there."""
    inside = set(nodes)
    attr = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == w_in)
    weight_side, gemm = {attr}, None
    frontier = [attr]
    while frontier and gemm is None:  # through views of the weight to the op that multiplies by it
        n = frontier.pop()
        for u in n.users:
            if u not in inside:
                continue
            if u.target in _VIEWS:
                weight_side.add(u)
                frontier.append(u)
            else:
                gemm = u
    if gemm is None:
        return False
    floats = {n for n in inside if getattr(n.meta.get("val"), "is_floating_point", lambda: False)()}
    rows = [a for a in gemm.all_input_nodes if a not in weight_side and a in floats]
    return any(n.target in _SCORES for n in ancestors_within(rows, floats) | set(rows))


def read_block(gm: fx.GraphModule, layer: str) -> ExistingBlock:
    """What the block at ``layer`` computes, read from its nodes; what moecompile's block can't be is an error."""
    nodes = [n for n in gm.graph.nodes if layer in module_chain(n)]
    if not nodes:
        raise UnsupportedMoE(f"{layer} holds expert tensors but no traced node comes from it")
    kind = next(str(t) for p, t in nodes[0].meta["nn_module_stack"].values() if clean_path(p) == layer)
    kind = kind.rsplit(".", 1)[-1].strip("'>")
    inside = set(nodes)

    def fail(what: str, fix: str) -> None:
        raise UnsupportedMoE(f"{layer} ({kind}): {what}; {fix} (or set experts.adopt: false to leave the "
                             "model's MoE blocks as they are)")

    attrs = {a.target for n in nodes for a in n.all_input_nodes if a.op == "get_attr"}
    glu = f"{layer}.{HF_NAMES['w_in']}" in attrs
    params = {k: f"{layer}.{v}" for k, v in HF_NAMES.items()}
    if not glu:
        params["w_in"] = f"{layer}.experts.up_proj"
    params["router"] = next((f"{layer}.{n}" for n in ROUTER_NAMES if f"{layer}.{n}" in attrs), params["router"])
    params |= {k: f"{layer}.{v}" for k, v in EXPERT_BIASES.items() if f"{layer}.{v}" in attrs}
    router_bias = _router_bias(nodes, params["router"])
    if router_bias is not None:
        params["router_bias"] = router_bias
    layouts = [{k: f"{layer}.{v}" for k, v in names.items()} for names in SHARED_LAYOUTS]
    shared = next((names for names in layouts if set(names.values()) <= attrs), {})
    if shared and ("gate" in shared) != glu:
        fail("its shared expert is " + ("an MLP beside GLU experts" if glu else "a GLU beside MLP experts"),
             "moecompile's shared experts are of the routed experts' kind")
    if any(n.target in _RANDOM for n in nodes):
        fail("it draws random numbers (router jitter noise)", "set config.router_jitter_noise = 0 before tracing")
    router = read_router(nodes, fail, params["router"])
    extra = sorted(attrs - set(params.values()) - set(shared.values()) - {router.bias})
    if extra:
        fail(f"it reads {', '.join(extra)} beside the router, its selection bias, the experts and a shared expert "
             "(another shared expert, a bias used elsewhere than in the selection)",
             "moecompile adopts blocks of a router, fused experts and at most one shared expert of their kind")
    tensors = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                 if a not in inside and a.op != "get_attr" and isinstance(a.meta.get("val"), torch.Tensor)))
    if len(tensors) != 1:
        fail(f"it takes {len(tensors)} tensor inputs", "an MoE block maps one hidden-state tensor")
    used_outside = [n for n in nodes if any(u not in inside for u in n.users)]
    outs = [n for n in used_outside if isinstance(n.meta.get("val"), torch.Tensor)]
    if len(outs) != 1:
        fail(f"{len(outs)} of its values are used outside it (router logits returned too?)",
             "set config.output_router_logits = False: moecompile computes the router losses the plan asks for")
    act = _expert_act(nodes)
    if act is None or act not in (GLU_ACTS if glu else MLP_ACTS):
        fail(f"its expert activation ({act or 'none found, or several'}) is not one of "
             + " / ".join(GLU_ACTS if glu else MLP_ACTS),
             f"moecompile's {'GLU' if glu else 'MLP'} experts use one of those")
    w_in, w_out = (get_attr_value(gm, params[k]) for k in ("w_in", "w_out"))
    H, width = tensors[0].meta["val"].shape[-1], 2 if glu else 1

    def fits(w_in: torch.Tensor, w_out: torch.Tensor) -> bool:  # [E, (2)F, H] / [E, H, F]
        return (w_in.dim() == w_out.dim() == 3 and w_out.shape[1] == H
                and tuple(w_in.shape[1:]) == (width * w_out.shape[2], H))

    transposed = not fits(w_in, w_out) and fits(w_in.mT, w_out.mT)  # Llama 4's, read by bmm
    if not fits(w_in, w_out) and not transposed:
        layout = "gated [E, 2F, H]" if glu else "[E, F, H]"
        fail(f"its experts are {tuple(w_in.shape)} and {tuple(w_out.shape)}, not {layout} / [E, H, F] or transposed",
             "moecompile adopts fused experts of that layout")
    interleaved = glu and any(n.target is aten.slice.Tensor and n.args[4:5] == (2,) for n in nodes)
    weights_input = _weights_input(gm, nodes, params["w_in"])
    if weights_input and not glu:
        fail("its routing weights scale the input of MLP experts", "moecompile weighs an input only for GLU experts")
    # a dynamic trace's sizes computed here and reused after: they stay, with what they are computed from
    sizes = [n for n in used_outside if n not in outs]
    shapes = set(sizes) | ancestors_within(sizes, inside)
    if any(a.op == "get_attr" for n in shapes for a in n.all_input_nodes):
        fail("sizes it computes from its weights are used outside it", "moecompile adopts self-contained blocks")
    return ExistingBlock(layer, kind, [n for n in nodes if n not in shapes], tensors[0], outs[0], params, shared,
                         int(w_in.shape[0]), router, act, glu, transposed, interleaved, weights_input)


def _expert_act(nodes: list[fx.Node]) -> str | None:
    """The one activation the block's experts (and shared expert) apply, by the name find_ffn gives it; else None.

    A relu whose every use squares it is ReLU² ("relu2"); a gelu's ``approximate`` tells "gelu_tanh"; a sigmoid of
    alpha * min(gate, L), times that min, is gpt-oss's "clamped_swiglu" (its alpha and L named when not glu's)."""
    swiglu = next((n.args[0] for n in nodes if n.target is aten.sigmoid.default and n.args[0].target is aten.mul.Tensor
                   and getattr(n.args[0].args[0], "target", None) is aten.clamp.default), None)
    if swiglu is not None:
        clamp, alpha = swiglu.args
        limit = clamp.args[2] if len(clamp.args) > 2 else clamp.kwargs.get("max")
        known = (alpha, limit) == (SWIGLU_ALPHA, SWIGLU_LIMIT)
        return "clamped_swiglu" if known else f"a clamped SwiGLU of alpha {alpha}, limit {limit}"
    acts = [n for n in nodes if n.target in _ACTS]
    if len({(a.target, a.kwargs.get("approximate"), a.args[1:]) for a in acts}) != 1:
        return None
    act = _ACTS[acts[0].target]
    if act == "gelu" and ("tanh" in acts[0].args[1:] or acts[0].kwargs.get("approximate") == "tanh"):
        return "gelu_tanh"
    squared = [all(u.target is aten.square.default for u in a.users) for a in acts]
    if act == "relu" and any(squared):
        return "relu2" if all(squared) else None
    return act


def check_plan(cfg: ExpertsConfig, block: ExistingBlock) -> None:
    """The plan must describe the experts the model has; the error says what to set."""
    for field, want in block.plan_fields().items():
        if getattr(cfg, field) != want:
            raise PlanError(f"experts.{field}", getattr(cfg, field),
                            f"{block.layer} is already a {block.kind} with {field} = {want!r}; the plan describes "
                            f"the experts the model has: set experts.{field}: {str(want).lower()}")
    if block.router.bias and not cfg.expert_bias:
        raise PlanError("experts.expert_bias", False,
                        f"{block.layer} ({block.kind}) shifts its expert selection by {block.router.bias}; "
                        "without it the routing would change: set experts.expert_bias: true")
    if cfg.granularity != 1:
        raise PlanError("experts.granularity", cfg.granularity,
                        f"{block.layer} ({block.kind}) already has its experts; granularity applies when "
                        "upcycling a dense FFN: set experts.granularity: 1")


def weights_place(cfg: ExpertsConfig, block: ExistingBlock) -> str:
    """Where the adopted block multiplies its routing weights: at the input where the model weighs it there, else
    where ``upcycle`` would put them (a GLU without a down bias: the activation, unless the plan says combine)."""
    if block.weights_input:
        if cfg.apply_weights != "auto":
            raise PlanError("experts.apply_weights", cfg.apply_weights,
                            f"{block.layer} ({block.kind}) weights its experts' input rows, which neither the "
                            "activation nor the combine computes: set experts.apply_weights: auto")
        return "input"
    return weights_at(cfg, block.glu, "b_out" in block.params, block.layer)


def block_io(gm: fx.GraphModule, inputs: list, blocks: list[ExistingBlock]) -> dict[fx.Node, torch.Tensor]:
    """Each block's input and output on the example inputs (one run of the graph as traced)."""
    wanted = {n for b in blocks for n in (b.x, b.out)}
    seen: dict[fx.Node, torch.Tensor] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node):
            value = super().run_node(n)
            if n in wanted:
                seen[n] = value.detach().clone()
            return value

    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return seen


def check_reproduces(gm: fx.GraphModule, cfg: ExpertsConfig, block: ExistingBlock, where: str, x: torch.Tensor,
                     want: torch.Tensor) -> float:
    """moecompile's block (dropless) on the recorded input must give the recorded output; returns the error."""
    tensors = {k: t.detach() for k, t in block.tensors(gm).items()}
    if cfg.expert_bias and "bias" not in tensors:  # a bias the plan adds starts at zero
        tensors["bias"] = torch.zeros(cfg.num_experts, device=x.device)
    with torch.no_grad():
        got, _ = moe_block(cfg, block.act, block.glu, 0, weights_at=where, flat_output=want.dim() == 2 < x.dim())(
            x, **tensors)
    error = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))
    tolerance = 1e-4 if want.dtype == torch.float32 else 3e-2
    if not error <= tolerance:
        raise UnsupportedMoE(
            f"{block.layer} ({block.kind}): moecompile's block, read as {block.describe()}, differs from it by {error:.2e} "
            f"(relative max, tolerance {tolerance:g}), so the block computes something else; write a pass "
            "for it, or convert its dense source instead")
    return error


@register_pass("import_moe", before="find_ffn", provides=("moe",))
def import_moe(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    cfg = ctx.plan.experts
    layers = find_blocks(gm)
    if layers and not cfg.adopt:
        ctx.decide(f"left {len(layers)} MoE block(s) of the model as they are (experts.adopt: false)")
        ctx.record(layers=[])
        return PassResult(gm, False)
    blocks = [read_block(gm, layer) for layer in layers]
    for block in blocks:
        check_plan(cfg, block)
    # meta tensors (a planner's trace) have no values to check against
    on_meta = any(get_attr_value(gm, n).is_meta for b in blocks for n in b.params.values())
    recorded = block_io(gm, ctx.example_inputs, blocks) if blocks and not on_meta else {}
    traced: dict = {}  # layers alike share one traced block
    for block in blocks:
        where = weights_place(cfg, block)
        check = "not checked (meta tensors)"
        if not on_meta:
            error = check_reproduces(gm, cfg, block, where, recorded[block.x], recorded[block.out])
            check = f"reproduces it to {error:.1e}"
        params = register_block(gm, block.layer, block.tensors(gm), block.glu, cfg)
        capacity = insert_block(gm, ctx, block.out, block.x, block.layer, params, block.act, block.glu, where, traced)
        hf_names = block.hf_names()
        hf_attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in hf_names]
        for n in [*reversed(block.nodes), *hf_attrs]:  # users before what they use
            if not n.users:
                gm.graph.erase_node(n)
        delete_unused_attrs(gm, hf_names)
        dropping = f"capacity {capacity}" if capacity else "dropless"
        ctx.decide(f"{block.layer}: adopted {block.kind}, {block.describe()} ({dropping}, routing weights at the "
                   f"{where}); {check}")
    ctx.record(layers=layers)
    return PassResult(gm, bool(blocks))
