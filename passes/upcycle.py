"""Pass ``upcycle``: replace each selected dense FFN with a routed MoE block.

Before (one Llama MLP)::

    linear(x, Wg) -> silu -> mul(., linear(x, Wu)) -> linear(., Wd) -> y

After::

    x_TH = view(x, [-1, H]);  logits_TE = linear(x_TH, router.weight)
    weights_TK, idx_TK = moecompile.route(logits_TE, expert_bias, k, score, normalize[, groups, group_k])
    [weights_TK = weights_TK * route_scale]
    x_NH, row_src_N, sizes_E, load_E = moecompile.permute(x_TH, idx_TK, weights_TK, E, capacity, policy)
    w_N = where(row_src_N >= 0, weights_TK.view(-1)[row_src_N], 0)       # each row's routing weight
    h_NF = moecompile.glu(moecompile.grouped_mm(x_NH, experts.w_gate_up, sizes_E, None), "silu", w_N)
    y_TH = moecompile.unpermute(moecompile.grouped_mm(h_NF, experts.w_down, sizes_E, None), row_src_N, weights_TK, T,
                                weighted=False)
    y = view_as(y_TH [+ shared_experts(x_TH)], x)

That is ``experts.apply_weights: activation`` (``auto`` picks it for GLU experts without a
down-projection bias): the weight enters on the [N, F] GLU output, so the combine only sums
and keeps no [N, H] rows for its backward. ``combine`` (and non-GLU or biased experts)
leaves glu unweighted and has ``unpermute`` multiply the expert outputs.

Initialisation is sparse / granular upcycling: expert ``c*G + s`` holds slice ``s`` of
the dense FFN (copy ``c``); router rows of a virtual group (G experts of one copy)
start equal, so a token takes whole copies; down projections are scaled by
``G / (1 + shared_experts)`` so the sum is exactly the dense FFN at init.
Legend: T tokens, K top-k, E experts, H hidden, F intermediate, N permuted rows.
"""

from __future__ import annotations

import hashlib

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.traceback import annotate

import moecompile.kernels  # noqa: F401  (registers torch.ops.moecompile.*)
from moecompile.kernels import row_weights
from moecompile.distributed import ALL_REDUCE, wait_tensor
from moecompile.errors import PlanError
from moecompile.graph import add_parameter, clean_path, delete_unused_attrs, get_attr_value, inline, trace_block
from moecompile.meta import FFNInfo, MoEInfo, Role, moe, set_moe
from moecompile.outputs import add_side_outputs
from moecompile.pass_manager import PassContext, register_pass
from moecompile.plan import ExpertsConfig

aten, mc = torch.ops.aten, torch.ops.moecompile


def _generator(seed: int, layer: str) -> torch.Generator:
    """Same init on every rank and run: seeded by the plan seed and the layer's name."""
    digest = hashlib.sha256(f"{seed}:{layer}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _dense(gm: fx.GraphModule, info: FFNInfo, key: str, bias: bool = False) -> torch.Tensor | None:
    """A dense FFN tensor in linear layout ([out, in] for weights)."""
    name = (info["biases"] if bias else info["weights"]).get(key)
    if name is None and key in ("gate", "up") and "gate_up" in info["weights"] and not bias:
        fused = get_attr_value(gm, info["weights"]["gate_up"]).detach()  # [2F, H], gate rows first
        return fused.chunk(2, dim=0)[0 if key == "gate" else 1]
    if name is None:
        return None
    t = get_attr_value(gm, name).detach()
    return t.t() if (info["transposed"] and not bias) else t


def expert_weights(gm: fx.GraphModule, info: FFNInfo, cfg: ExpertsConfig) -> dict[str, torch.Tensor]:
    """Expert tensors by granular upcycling: expert c*G+s = slice s of copy c."""
    E, G, S = cfg.num_experts, cfg.granularity, cfg.shared_experts
    F = info["intermediate"]
    if F % G:
        raise PlanError("experts.granularity", G, f"must divide the intermediate size F={F} of the FFN it splits")
    Fs, copies = F // G, E // G
    glu = info["kind"] == "glu"
    w_in_keys = ("gate", "up") if glu else ("up",)

    def slices(t: torch.Tensor, dim: int) -> torch.Tensor:  # [G, ...] slices along the F dimension
        return torch.stack(t.split(Fs, dim=dim))

    w_in = torch.cat([slices(_dense(gm, info, k), 0) for k in w_in_keys], dim=1)  # [G, (2)Fs, H]
    w_out = slices(_dense(gm, info, "down"), 1) * (G / (1 + S))  # [G, H, Fs]
    out = {"w_in": w_in.repeat(copies, 1, 1), "w_out": w_out.repeat(copies, 1, 1)}
    if any(_dense(gm, info, k, bias=True) is not None for k in (*w_in_keys, "down")):
        b_in = torch.cat(
            [slices(_bias_or_zero(gm, info, k, F), 0) for k in w_in_keys], dim=1
        )  # [G, (2)Fs]
        out["b_in"] = b_in.repeat(copies, 1)
        out["b_out"] = (_bias_or_zero(gm, info, "down", info["hidden"]) / (1 + S)).expand(E, -1).contiguous()
    if S:
        full_in = torch.cat([_dense(gm, info, k) for k in w_in_keys], dim=0)  # [(2)F, H]
        out["shared_w_in"] = full_in.expand(S, -1, -1).contiguous()
        out["shared_w_out"] = (_dense(gm, info, "down") / (1 + S)).expand(S, -1, -1).contiguous()
        if "b_in" in out:
            out["shared_b_in"] = torch.cat([_bias_or_zero(gm, info, k, F) for k in w_in_keys]).expand(S, -1).contiguous()
            out["shared_b_out"] = out["b_out"][:S].clone()
    return out


def _bias_or_zero(gm: fx.GraphModule, info: FFNInfo, key: str, size: int) -> torch.Tensor:
    b = _dense(gm, info, key, bias=True)
    down = _dense(gm, info, "down")
    return b if b is not None else torch.zeros(size, dtype=down.dtype, device=down.device)


def router_weight(cfg: ExpertsConfig, hidden: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Virtual groups: the G experts of one FFN copy share a router row at init."""
    copies = cfg.num_experts // cfg.granularity
    rows = torch.randn(copies, hidden, generator=g) * hidden**-0.5
    w = rows.repeat_interleave(cfg.granularity, dim=0)
    if cfg.router_noise:
        w = w + cfg.router_noise * torch.randn(w.shape, generator=g)
    return w.to(dtype)


_PARAM_NAMES = {
    True: {"w_in": "experts.w_gate_up", "w_out": "experts.w_down", "b_in": "experts.b_gate_up", "b_out": "experts.b_down"},
    False: {"w_in": "experts.w_up", "w_out": "experts.w_down", "b_in": "experts.b_up", "b_out": "experts.b_down"},
}
MLP_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "relu": F.relu,
            "relu2": lambda h: F.relu(h).square()}  # a plain MLP's activation by find_ffn's name


def register_block(gm: fx.GraphModule, layer: str, tensors: dict[str, torch.Tensor], glu: bool,
                   cfg: ExpertsConfig) -> dict[str, str]:
    """Add a block's tensors under the layer's module path, by moecompile's names; returns key -> name.

    ``tensors`` keys: "router", "w_in", "w_out", and optionally biases and shared experts.
    The selection bias (``experts.expert_bias``) is a buffer, zero unless ``tensors`` has one.
    """
    names = dict(_PARAM_NAMES[glu])
    names |= {f"shared_{k}": n.replace("experts.", "shared_experts.") for k, n in names.items()}
    names |= {"router": "router.weight", "bias": "router.expert_bias", "shared_gate": "shared_experts.gate.weight",
              "router_bias": "router.bias"}
    prefix = f"{layer}." if layer else ""
    if cfg.expert_bias and "bias" not in tensors:
        tensors = {**tensors, "bias": torch.zeros(cfg.num_experts, device=tensors["w_in"].device)}
    return {k: add_parameter(gm, prefix + names[k], t, requires_grad=k != "bias") for k, t in tensors.items()}


def upcycled_tensors(gm: fx.GraphModule, layer: str, info: FFNInfo, cfg: ExpertsConfig, seed: int) -> dict[str, torch.Tensor]:
    """The block's tensors by granular upcycling of the dense FFN ``info``, router seeded by the layer."""
    tensors = expert_weights(gm, info, cfg)
    w_in = tensors["w_in"]  # the router lives where the FFN did (its generator stays on the CPU)
    tensors["router"] = router_weight(cfg, info["hidden"], w_in.dtype, _generator(seed, layer)).to(w_in.device)
    return tensors


def weights_at(cfg: ExpertsConfig, glu: bool, down_bias: bool, layer: str) -> str:
    """Where ``layer``'s routing weights are multiplied in: "activation" or "combine" (see the docstring)."""
    fits = glu and not down_bias
    if cfg.apply_weights == "activation" and not fits:
        why = "its experts are not GLUs" if not glu else "its down projection has a bias"
        raise PlanError(
            "experts.apply_weights", "activation",
            f"cannot apply to {layer or '<root>'}: {why}, so the weight would not commute with the down "
            "projection; use 'auto' (activation where it applies) or 'combine'",
        )
    return "activation" if fits and cfg.apply_weights != "combine" else "combine"


def moe_block(cfg: ExpertsConfig, act: str, glu: bool, capacity: int, load_group: tuple[str, int] | None = None,
              weights_at: str = "combine", flat_output: bool = False):
    """The MoE computation as plain torch code; traced to ATen and inlined by the pass.

    ``load_group`` (group name, size): sum the expert load over those ranks for the
    ``global_aux`` loss, launched after the permute and waited on where the loss needs it.
    ``weights_at``: "activation" hands glu each row's weight, "combine" hands them to unpermute, "input" hands
    them to glu to scale its rows before the activation (an adopted Llama 4 weights the experts' input rows).
    ``flat_output``: return [T, H] rows, as a block that flattens its input does (Llama 4's), not x's shape.
    """
    E, k, S = cfg.num_experts, cfg.top_k, cfg.shared_experts
    in_act = weights_at in ("activation", "input")
    groups = (cfg.route_groups, cfg.route_group_top_k) if cfg.route_groups > 1 else ()

    def expert_mlp(x, w_in, w_out, b_in, b_out, sizes, w_N=None):
        with annotate({"role": "experts"}):
            h = mc.grouped_mm(x, w_in, sizes, b_in)
        with annotate({"role": "expert_act"}):
            h = mc.glu(h, act, w_N, weights_at == "input") if glu else MLP_ACTS[act](h)
        with annotate({"role": "experts"}):
            return mc.grouped_mm(h, w_out, sizes, b_out)

    def block(x, router, w_in, w_out, bias=None, b_in=None, b_out=None, shared_w_in=None, shared_w_out=None, shared_b_in=None, shared_b_out=None,
              shared_gate=None, router_bias=None):
        x_TH = x.reshape(-1, x.shape[-1])
        with annotate({"role": "router"}):
            if cfg.router_dtype == "float32":
                logits_TE = F.linear(x_TH.float(), router.float(), None if router_bias is None else router_bias.float())
            else:
                logits_TE = F.linear(x_TH, router, router_bias)
        with annotate({"role": "route"}):
            weights_TK, idx_TK = mc.route(logits_TE, bias, k, cfg.score, cfg.normalize, *groups)
            if cfg.route_scale != 1.0:
                weights_TK = weights_TK * cfg.route_scale
        with annotate({"role": "permute"}):
            x_NH, row_src_N, sizes_E, load_E = mc.permute(x_TH, idx_TK, weights_TK, E, capacity, cfg.drop_policy)
        if load_group is not None:
            with annotate({"role": "collective_start", "group": load_group[0]}):
                pending = ALL_REDUCE(load_E, "sum", load_group[0])
        w_N = None
        if in_act:
            with annotate({"role": "permute"}):
                w_N = row_weights(row_src_N, weights_TK)
        y_NH = expert_mlp(x_NH, w_in, w_out, b_in, b_out, sizes_E, w_N)
        with annotate({"role": "combine"}):
            y_TH = mc.unpermute(y_NH, row_src_N, weights_TK, x_TH.shape[0], not in_act)
        if S:
            with annotate({"role": "shared_experts"}):
                shared_TH = _shared_mlp(x_TH, shared_w_in, shared_w_out, shared_b_in, shared_b_out, act, glu)
                if shared_gate is not None:  # Qwen2-MoE: a per-token sigmoid gate on the shared expert
                    shared_TH = torch.sigmoid(F.linear(x_TH, shared_gate)) * shared_TH
                y_TH = y_TH + shared_TH
        global_load = None
        if load_group is not None:
            with annotate({"role": "collective_wait", "group": load_group[0]}):
                global_load = (wait_tensor(pending, "global expert load (global_aux)", load_group[0]), load_group[1])
        with annotate({"role": "router_loss"}):
            side = router_losses(logits_TE, idx_TK, load_E, cfg, x.shape[1] if x.dim() == 3 else None, global_load)
        return y_TH if flat_output else y_TH.view(x.shape), {"load": load_E, **side}

    return block


def _shared_mlp(x_TH, w_in_SIH, w_out_SHF, b_in, b_out, act: str, glu: bool):
    """All shared experts as two dense GEMMs: [T, H] -> [T, S, (2)F] -> [T, S*F] -> [T, H]."""
    S, I, H = w_in_SIH.shape
    h = F.linear(x_TH, w_in_SIH.reshape(S * I, H), None if b_in is None else b_in.reshape(-1))
    h = h.view(-1, S, I)
    h = mc.glu(h, act) if glu else MLP_ACTS[act](h)
    w_out = w_out_SHF.permute(1, 0, 2).reshape(H, -1)
    return F.linear(h.reshape(h.shape[0], -1), w_out, None if b_out is None else b_out.sum(0))


def router_losses(logits_TE, idx_TK, load_E, cfg: ExpertsConfig, seq_len: int | None,
                  global_load: tuple | None = None) -> dict:
    """Unweighted router losses; the training step multiplies in the plan's coefficients.

    ``global_load`` (load summed over R ranks, R): global_aux's f_E over all R ranks' tokens.
    The mean over ranks of E * sum_e f_E P_e(local) is then the single-process loss.
    """
    out = {}
    logits = logits_TE.float()
    if cfg.z_loss_coeff > 0:
        out["z_loss"] = torch.logsumexp(logits, -1).square().mean()
    if cfg.aux_loss == "none":
        return out
    E, k = cfg.num_experts, cfg.top_k
    if cfg.score == "softmax":
        probs_TE = logits.softmax(-1)
    else:  # sigmoid scores normalised over experts (DeepSeek-V3)
        sig = logits.sigmoid()
        probs_TE = sig / sig.sum(-1, keepdim=True)
    if cfg.aux_loss != "seq_aux" or seq_len is None:  # Switch: E * sum_e f_e P_e over the batch
        load, ranks = global_load if global_load is not None else (load_E, 1)
        f_E = load.float() / (idx_TK.shape[0] * ranks * k)
        out["aux_loss"] = E * (f_E * probs_TE.mean(0)).sum()
    else:  # seq_aux: the same per sequence, averaged over sequences
        B = idx_TK.shape[0] // seq_len
        counts_BE = torch.zeros(B, E, device=logits.device).scatter_add_(
            1, idx_TK.reshape(B, -1), torch.ones(B, seq_len * k, device=logits.device)
        )
        f_BE = counts_BE / (seq_len * k)
        out["aux_loss"] = E * (f_BE * probs_TE.view(B, seq_len, E).mean(1)).sum(-1).mean()
    return out


@register_pass("upcycle", after="find_ffn", requires=("ffn",), provides=("moe",))
def upcycle(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    cfg = ctx.plan.experts
    by_name = {n.name: n for n in gm.graph.nodes}
    ffns = [n for n in gm.graph.nodes if "ffn" in n.meta.get("moe", {})]
    converted, traced = [], {}
    # A model with MoE layers of its own (import_moe) keeps its dense FFNs unless the plan lists them.
    adopted = any("moe" in moe(n) for n in gm.graph.nodes)
    if adopted and ffns and cfg.layers == "all":
        ctx.decide(f"left {len(ffns)} dense FFN(s) dense: the model has MoE layers of its own; name them in "
                   "experts.layers to upcycle them too")
        ffns = []
    for out in ffns:
        info: FFNInfo = moe(out)["ffn"]
        layer = moe(out)["layer"]
        if not cfg.selects(moe(out)["ffn_index"], layer):
            continue
        x = by_name[info["input"]]
        params = register_block(gm, layer, upcycled_tensors(gm, layer, info, cfg, cfg.seed), info["kind"] == "glu", cfg)
        where = weights_at(cfg, info["kind"] == "glu", "down" in info["biases"], layer)
        capacity = insert_block(gm, ctx, out, x, layer, params, info["act"], info["kind"] == "glu", where, traced)
        _erase_ffn(gm, info, by_name)
        converted.append(layer)
        ctx.decide(
            f"{layer or '<root>'}: {info['kind']} FFN -> {cfg.num_experts} experts top-{cfg.top_k} (G={cfg.granularity}, "
            f"shared={cfg.shared_experts}, {'dropless' if not capacity else f'capacity {capacity}'}, "
            f"routing weights at the {where})"
        )
    ctx.record(layers=converted)
    return gm


def insert_block(gm: fx.GraphModule, ctx: PassContext, out: fx.Node, x: fx.Node, layer: str, params: dict[str, str],
                 act: str, glu: bool, where: str, traced: dict | None = None) -> int:
    """Build the MoE block on ``x`` from ``params``, route ``out``'s users to it; returns its capacity.

    The block's output node carries the :class:`MoEInfo`; its router losses and load become
    side outputs. ``out`` and what only it used are left for the caller to erase. ``traced``: blocks
    traced so far, by what decides their graph, so layers alike share one trace.
    """
    cfg = ctx.plan.experts
    x_val = x.meta["val"]
    capacity = cfg.capacity(int(x_val.shape[:-1].numel()))
    flat = out.meta["val"].dim() == 2 < x_val.dim()  # the block returns its rows flattened
    values = {k: get_attr_value(gm, n) for k, n in params.items()}
    key = (act, glu, capacity, where, flat, repr(tuple(x_val.shape)), x_val.dtype, x_val.device,
           tuple((k, tuple(v.shape), v.dtype) for k, v in values.items()))
    traced = {} if traced is None else traced
    if key not in traced:
        traced[key] = trace_block(moe_block(cfg, act, glu, capacity, _load_group(ctx), where, flat),
                                  {"x": torch.zeros(x_val.shape, dtype=x_val.dtype, device=x_val.device), **values})
    block = traced[key]
    existing = set(gm.graph.nodes)
    with gm.graph.inserting_before(out):
        attrs = [gm.graph.get_attr(n) for n in params.values()]
    y, side = inline(gm.graph, block, [x, *attrs], anchor=out)
    _stamp([n for n in gm.graph.nodes if n not in existing], out, layer)
    out.replace_all_uses_with(y)
    add_side_outputs(gm, layer, side)
    moe_info = MoEInfo(
        num_experts=cfg.num_experts, top_k=cfg.top_k, granularity=cfg.granularity, shared_experts=cfg.shared_experts,
        act=act, glu=glu, params=params, nodes={}, expert_range=(0, cfg.num_experts), weights_at=where,
    )
    set_moe(y, layer=layer, role=Role.COMBINE, moe=moe_info)
    return capacity


def _load_group(ctx: PassContext) -> tuple[str, int] | None:
    """The data-parallel group global_aux sums the expert load over (None: one rank, plain aux)."""
    world = ctx.world
    if ctx.plan.experts.aux_loss != "global_aux" or world is None or world.world_size == 1:
        return None
    return world.dp_group.group_name, world.world_size


def _stamp(new_nodes: list[fx.Node], origin: fx.Node, layer: str) -> None:
    """Every node the block added gets the layer, its annotated role, and the FFN's provenance."""
    stack = {k: v for k, v in origin.meta.get("nn_module_stack", {}).items() if layer.startswith(clean_path(v[0]))}
    for n in new_nodes:
        custom = n.meta.pop("custom", {})
        role = custom.get("role")
        n.meta["moe"] = {"layer": layer, **({"role": Role(role)} if role else {})}
        if "group" in custom:  # a collective the block launched, on this process group
            n.meta["moe"]["group"] = custom["group"]
        n.meta["nn_module_stack"] = dict(stack)
        if "stack_trace" in origin.meta:
            n.meta["stack_trace"] = origin.meta["stack_trace"]


def _erase_ffn(gm: fx.GraphModule, info: FFNInfo, by_name: dict[str, fx.Node]) -> None:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = sorted((by_name[n] for n in info["nodes"]), key=order.__getitem__)
    params = list(info["weights"].values()) + list(info["biases"].values())
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in params]
    for n in [*reversed(nodes), *attrs]:  # users before what they use
        if not n.users:
            gm.graph.erase_node(n)
    delete_unused_attrs(gm, params)
