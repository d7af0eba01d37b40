"""What one training micro-batch of a model costs, read off its converted graph.

    prof = profile_config("deepseek-v3", seq_len=4096)        # traced on the meta device
    prof = profile_result(result)                             # a graph you converted yourself

A large Hugging Face MoE config is analysed without allocating anything: its dense
equivalent (the same attention, an FFN as wide as one expert; see ``arch.py``) is built on
the meta device and converted with the matching ``experts`` plan, so ``upcycle`` produces
the model's MoE layers exactly. Tracing all 61 layers of DeepSeek-V3 is not needed: we
convert one MoE layer (and one dense layer when the model has dense layers of another
width) and scale by layer count: the ops outside ``model.layers.N`` are the base
(embedding, final norm, head), the ops of layer 0 are one layer. That is exact for FLOPs
and bytes of identical layers. Activation memory comes from the memory estimator
(``moecompile.memory_estimate``), whose per-layer split is scaled the same way; without it, the
whole-graph figure of ``moecompile.costs`` at 1 and 2 layers is differenced. The
multi-token-prediction module is not modelled. FLOPs are ``moecompile.costs.node_flops``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from .. import costs
from ..bucket_layout import param_reads
from ..errors import MoecompileError
from ..graph import module_path
from ..meta import Role
from .arch import _fields, load_model_config, moe_arch, named_configs  # noqa: F401  (named_configs re-exported)

mc = torch.ops.moecompile

# the decoder layers' ModuleList: model.layers (Llama and most), transformer.h (GPT-2), blocks, layer (BERT)
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")
_MOE_ROLES = {r.value for r in (Role.ROUTER, Role.ROUTE, Role.PERMUTE, Role.DISPATCH, Role.EXPERTS, Role.EXPERT_ACT,
                                Role.COMBINE_COMM, Role.COMBINE, Role.SHARED_EXPERTS, Role.ROUTER_LOSS)}
_NOT_WORK = {"sym_size", "_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "wait_tensor",
             # the routing weights' column of the dispatch: the cost model prices it with the exchange
             "pack_row_weights", "unpack_row_weights"}
_GATHERS = {"embedding", "index_select", "gather", "index"}  # read only the rows they return


@dataclasses.dataclass(frozen=True)
class NodeCost:
    """One op of the forward graph (one micro-batch): its work and what it belongs to."""

    flops: float
    bytes: float  # bytes read + written (parameters included)
    category: str  # attention_core | attention_proj | dense_mlp | router | experts | shared_experts | head | other | memory
    tags: frozenset[str]  # recompute regions it is in: attention, mlp, layernorm, router, moe_act, moe, shared_experts, up_proj
    fp8: bool = False  # already an FP8 GEMM in the graph
    recomputed: bool = False  # marked for recompute in the graph
    weight_bytes: float = 0.0  # the part of ``bytes`` that is parameters (expert weights shrink with ep)


@dataclasses.dataclass
class LayerProfile:
    """The ops of one layer kind (or of the base: embedding, final norm, head), and how many there are."""

    kind: str  # "base" | "dense" | "moe"
    count: int
    nodes: list[NodeCost]
    dispatch_bytes: float = 0.0  # routed rows of one MoE layer (x_NH = T*k*H elements), per micro-batch
    hidden_bytes: float = 0.0  # hidden states of one micro-batch (T*H elements)
    dense_params: float = 0.0  # elements, per layer
    expert_params: float = 0.0
    activation_bytes: float = 0.0  # kept for backward, per layer, one micro-batch (memory estimator)
    row_weight_bytes: float = 0.0  # per-row routing weights the experts' glu reads (apply_weights: activation)
    # its parameters in the order the forward first reads them, as (elements, routed expert?), experts as all E;
    # where gradient buckets are cut and which backward fills side by side (cost_model.in_flight_bytes)
    tensors: tuple[tuple[float, bool], ...] = ()
    tail: tuple[tuple[float, bool], ...] = ()  # the base's read after the layers (final norm, head)
    first: int = 0  # the model's first layer of this kind (DeepSeek's dense layers come before its MoE ones)

    @property
    def flops(self) -> float:
        return sum(n.flops for n in self.nodes)


@dataclasses.dataclass
class ModelProfile:
    """A model's forward graph per micro-batch, by layer kind, plus what it holds in memory."""

    name: str
    seq_len: int
    micro_batch: int  # sequences in the traced micro-batch
    hidden: int
    num_experts: int
    top_k: int
    elem_bytes: int  # bytes per element of parameters and activations (bf16: 2)
    layers: list[LayerProfile]  # base first
    plan: Any  # the moecompile Plan the graph was converted with
    memory_source: str
    # bytes per parameter element besides the parameter, from the memory estimator (None: the cost model's
    # AdamW default): (model-dtype gradient, whole on every rank; what parallel.shard_optimizer splits: the
    # optimizer states, fp32 masters and their fp32 grads)
    state_bytes: tuple[float, float] | None = None
    approximate: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)
    # elements of the largest dense parameter and of the largest routed-expert tensor (all E experts): one
    # bigger than a gradient bucket is a bucket of its own, which ZeRO-2 holds whole while it is in flight
    largest_params: tuple[float, float] = (0.0, 0.0)
    # each expert traced as this many slices (parallel.etp): routed rows x etp, expert GEMMs etp x narrower; the
    # cost model prices a candidate on the profile of its own etp
    etp: int = 1

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def num_layers(self) -> int:
        return sum(lp.count for lp in self.layers if lp.kind != "base")

    @property
    def moe_layers(self) -> int:
        return sum(lp.count for lp in self.layers if lp.kind == "moe")

    def total(self, attr: str) -> float:
        return sum(getattr(lp, attr) * lp.count for lp in self.layers)

    @property
    def flops(self) -> float:
        """Forward FLOPs of one micro-batch (the whole model)."""
        return sum(lp.flops * lp.count for lp in self.layers)

    @property
    def flops_per_token(self) -> float:
        return self.flops / self.tokens

    @property
    def dense_params(self) -> float:
        return self.total("dense_params")

    @property
    def expert_params(self) -> float:
        return self.total("expert_params")

    @property
    def activation_bytes(self) -> float:
        return self.total("activation_bytes")

    def summary(self) -> str:
        return (f"{self.name}: {self.num_layers} layers ({self.moe_layers} MoE, E={self.num_experts} top-{self.top_k}), "
                f"{costs.human(self.dense_params + self.expert_params)} params ({costs.human(self.expert_params)} in "
                f"experts), {costs.human(self.flops_per_token, 'FLOP')}/token forward at seq {self.seq_len}")


# --- graphs -> costs ---------------------------------------------------------------------------------


def _is_view(node: fx.Node) -> bool:
    import operator

    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _op_name(node: fx.Node) -> str:
    target = node.target
    name = target.name() if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
    return name.split("::")[-1].split(".")[0]


def _tags(path: str, role: str) -> frozenset[str]:
    leaf = path.rsplit(".", 1)[-1]
    tags = set()
    if ".self_attn" in f".{path}":
        tags.add("attention")
        if leaf in ("q_b_proj", "kv_b_proj"):
            tags.add("up_proj")
    if "norm" in leaf:
        tags.add("layernorm")
    if role in _MOE_ROLES:
        tags.add("moe")
        tags.add({"router": "router", "route": "router", "expert_act": "moe_act",
                  "shared_experts": "shared_experts"}.get(role, "moe"))
    elif ".mlp" in f".{path}":
        tags.add("mlp")
    return frozenset(tags)


def _category(node: fx.Node, path: str, role: str, tags: frozenset[str], flops: float) -> str:
    if role == "experts":
        return "experts"
    if role in ("shared_experts", "router"):
        return role if flops else "memory"
    if not flops:
        return "memory"
    if "scaled_dot_product" in _op_name(node):
        return "attention_core"
    if "lm_head" in path:
        return "head"
    if "attention" in tags:
        return "attention_proj"
    if "mlp" in tags:
        return "dense_mlp"
    return "other"


def node_costs(gm: fx.GraphModule) -> list[tuple[fx.Node, NodeCost]]:
    """Every op of a forward graph with its FLOPs (``costs.node_flops``), bytes moved and category.

    Regions the recompute pass outlined (``memory_region`` modules) are walked into; the ops of
    a recomputed part are marked ``recomputed``. Collectives are left out (the cost model prices
    communication from the plan).
    """
    out: list[tuple[fx.Node, NodeCost]] = []
    # Rows each MoE layer's permute hands on: with expert parallelism the rows an expert rank
    # receives are data-dependent; with balanced routing it receives what it sends.
    layer_rows = getattr(costs, "layer_rows", None)
    rows = layer_rows(gm.graph) if layer_rows else {}
    _walk(gm, gm.graph, None, False, out, rows)
    return out


def _measure(fn: Any, node: fx.Node, rows_of: dict[str, int], *args: Any) -> Any:
    """``fn(*args)``; for a data-dependent size, again with the layer's balanced-routing rows."""
    value = fn(*args)
    if value is None:
        rows = rows_of.get((node.meta.get("moe") or {}).get("layer"))
        if rows is not None:
            try:
                value = fn(*args, rows)
            except TypeError:  # a costs.py without the rows argument
                value = None
    return value


def _walk(root: torch.nn.Module, graph: fx.Graph, weight_inputs: list[bool] | None, recomputed: bool,
          out: list[tuple[fx.Node, NodeCost]], rows: dict[str, int]) -> None:
    """Cost ``graph``'s ops into ``out``; ``weight_inputs`` flags which placeholders carry parameters."""
    weights_in: set[fx.Node] = set()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if weight_inputs is not None:
        weights_in = {p for p, w in zip(placeholders, weight_inputs) if w}
    for node in graph.nodes:
        if node.op == "get_attr":
            weights_in.add(node)
        elif node.op == "call_module":
            _walk_region(root, node, weights_in, recomputed, out, rows)
        elif node.op == "call_function":
            nc = _node_cost(node, weights_in, recomputed, rows)
            if nc is not None:
                out.append((node, nc))


def _walk_region(root: torch.nn.Module, node: fx.Node, weights_in: set[fx.Node], recomputed: bool,
                 out: list[tuple[fx.Node, NodeCost]], rows: dict[str, int]) -> None:
    module = root.get_submodule(str(node.target))
    args = [a in weights_in for a in node.args]
    kind = getattr(module, "memory_region", None)
    if kind == "recompute":  # passes/regions.py: the recomputed part R and its consumers C
        unit = dict(zip(module._in, args))
        _walk(module.recompute, module.recompute.graph, [unit.get(n, False) for n in module._r_in], True, out, rows)
        if module.consumers is not None:
            _walk(module.consumers, module.consumers.graph, [unit.get(n, False) for n in module._c_in], recomputed,
                  out, rows)
    elif kind == "offload":
        _walk(module.graph_module, module.graph_module.graph, args, recomputed, out, rows)
    elif isinstance(module, fx.GraphModule):
        _walk(module, module.graph, args, recomputed, out, rows)


def _node_cost(node: fx.Node, weights_in: set[fx.Node], recomputed: bool, rows: dict[str, int]) -> NodeCost | None:
    if _is_view(node) or costs.collective_kind(node) is not None:
        return None
    name = _op_name(node)
    if name in _NOT_WORK or "sym_" in name:
        return None
    flops = float(_measure(costs.node_flops, node, rows, node) or 0)
    out_b = _measure(costs.tensor_bytes, node, rows, node.meta.get("val")) or 0
    weights = 0.0
    if name in _GATHERS:
        moved = 2 * out_b
    else:
        moved = out_b
        for a in node.all_input_nodes:
            v = a.meta.get("val")
            size = (_measure(costs.tensor_bytes, node, rows, v) or 0) if isinstance(v, torch.Tensor) else 0
            moved += size
            weights += size if a in weights_in else 0
    path = module_path(node)
    role = str(node.meta.get("moe", {}).get("role") or "")
    tags = _tags(path, role)
    fp8 = "scaled_mm" in name or "fp8" in name
    return NodeCost(flops, float(moved), _category(node, path, role, tags, flops), tags, fp8,
                    recomputed or costs.is_recomputed(node), float(weights))


def _layer_of(path: str) -> int | None:
    m = _LAYER.search(path)
    return int(m.group(1)) if m else None


def _split(result: Any) -> dict[int | None, list[tuple[fx.Node, NodeCost]]]:
    groups: dict[int | None, list] = {}
    for node, nc in node_costs(result.module):
        groups.setdefault(_layer_of(module_path(node)), []).append((node, nc))
    return groups


def _params(result: Any) -> dict[int | None, tuple[float, float]]:
    """Per layer index (None: outside layers): (dense, expert) parameter elements."""
    out: dict[int | None, list[float]] = {}
    for name, p in result.module.named_parameters():
        entry = out.setdefault(_layer_of(name), [0.0, 0.0])
        entry[1 if ".experts." in f".{name}" else 0] += p.numel()
    return {k: (v[0], v[1]) for k, v in out.items()}


def _tensors(result: Any, ep: int = 1) -> dict[int | None, tuple[tuple[float, bool], ...]]:
    """Per layer index, its trainable parameters in forward read order as (elements, routed expert?), experts
    scaled to all E; None: the base's read before the first layer, -1: the base's read after the layers."""
    reads = param_reads(result.module)
    named = {n: p for n, p in result.module.named_parameters() if p.requires_grad}
    at = {n: reads.get(n, (len(result.module.graph.nodes), 0))[0] for n in named}  # unread: last, as DDP takes them
    layers = [at[n] for n in named if _layer_of(n) is not None]
    out: dict[int | None, list[tuple[float, bool]]] = {}
    for n in sorted(named, key=at.__getitem__):
        expert = ".experts." in f".{n}"
        idx = _layer_of(n)
        key = idx if idx is not None else (None if not layers or at[n] < min(layers) else -1)
        out.setdefault(key, []).append((float(named[n].numel() * (ep if expert else 1)), expert))
    return {k: tuple(v) for k, v in out.items()}


def _largest(*results: Any, ep: int = 1) -> tuple[float, float]:
    """(dense, expert) elements of the largest single parameter of ``results``; experts scaled to all E."""
    dense = expert = 0.0
    for result in results:
        for name, p in result.module.named_parameters():
            if ".experts." in f".{name}":
                expert = max(expert, float(p.numel() * ep))
            else:
                dense = max(dense, float(p.numel()))
    return dense, expert


def _moe_bytes(pairs: list[tuple[fx.Node, NodeCost]]) -> tuple[float, float, float]:
    """(routed rows x_NH, hidden x_TH, per-row routing weights w_N) bytes of an MoE layer.

    w_N is 0 unless the experts' glu applies the weights (``experts.apply_weights: activation``):
    then expert parallelism moves it with the rows, one more exchange each way. In a dropless
    expert-parallel graph the glu's w_N has a data-dependent length: it is the permute's N, as
    the balanced-routing estimate (``costs.layer_rows``) has it.
    """
    rows = hidden = weights = 0.0
    n_rows = None
    for node, _ in pairs:
        if node.meta.get("moe", {}).get("role") == Role.PERMUTE and "permute" in _op_name(node) and not rows:
            val = node.meta.get("val")
            x_NH = val[0] if isinstance(val, (tuple, list)) else val
            rows = float(costs.tensor_bytes(x_NH) or 0)
            n_rows = x_NH.shape[0] if isinstance(x_NH, torch.Tensor) and isinstance(x_NH.shape[0], int) else None
            x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            hidden = float(costs.tensor_bytes(x) or 0)
        elif node.meta.get("moe", {}).get("routed_rows") and not rows:  # alltoall_dedup: the pairs it stands for
            x = node.args[0].meta.get("val")
            hidden = float(costs.tensor_bytes(x) or 0)
            n_rows = int(node.meta["moe"]["routed_rows"])
            rows = hidden / x.shape[0] * n_rows
        elif node.target is mc.glu.default and len(node.args) > 2 and isinstance(node.args[2], fx.Node):
            w = node.args[2].meta.get("val")
            if isinstance(w, torch.Tensor):
                weights = float(costs.tensor_bytes(w) or (n_rows or 0) * w.element_size())
    return rows, hidden, weights


@dataclasses.dataclass(frozen=True)
class Memory:
    """Activation bytes one micro-batch keeps for backward, where the figure comes from, and state per param."""

    total: float
    by_layer: dict[int | None, float] | None  # layer index -> bytes (None: outside the layers); None if unknown
    source: str
    state_bytes: tuple[float, float] | None  # (gradient, shardable optimizer state) bytes per parameter element


def measure_activations(result: Any, micro_batch: int) -> Memory:
    """The memory estimator's figure for ``result`` (``moecompile.memory_estimate``), or moecompile.costs' without it."""
    try:
        from ..memory_estimate import estimate_memory  # the memory engineer's estimator
    except ImportError:
        c = costs.graph_costs(result.history[-1].graph)
        return Memory(float(c.activation_bytes), None,
                      "moecompile.costs activation_bytes (moecompile.memory_estimate not available)", None)
    try:
        est = estimate_memory(result, batch=micro_batch, by_pass=False, shard_optimizer=False,  # per element, whole
                              shard_gradients=False, offload_optimizer=0.0)  # on the device
    except MoecompileError as e:  # e.g. a graph whose shapes depend on the data (expert parallelism)
        c = costs.graph_costs(result.history[-1].graph)
        return Memory(float(c.activation_bytes), None, f"moecompile.costs activation_bytes (the memory estimator "
                      f"could not run: {str(e).splitlines()[0][:120]})", None)
    by_layer: dict[int | None, float] = {}
    for layer, cats in est.by_layer.items():
        idx = _layer_of(layer)
        by_layer[idx] = by_layer.get(idx, 0.0) + float(sum(cats.values()))
    n = sum(p.numel() for p in dict(result.module.named_parameters()).values())
    state = ((est.grads - est.master_grads) / n, (est.optimizer + est.masters + est.master_grads) / n) if n else None
    return Memory(float(est.activations), by_layer, "moecompile.memory_estimate.estimate_memory", state)


# --- building profiles --------------------------------------------------------------------------------


def _meta_convert(cfg: Any, plan: dict, micro_batch: int, seq_len: int, etp: int = 1) -> Any:
    """Build ``cfg`` on the meta device and convert it; nothing is allocated. ``etp`` > 1: with each expert
    cut into that many slices, all on this process (the graph an etp group computes between them)."""
    from transformers import AutoModelForCausalLM

    from ..convert import convert
    from ..passes.ep_slices import slices_pass

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.train()
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        try:
            return convert(model, plan, (ids,), passes=[slices_pass(etp)] if etp > 1 else None)
        except MoecompileError:
            raise
        except Exception as e:  # export / a pass on a model we rebuilt
            raise MoecompileError(f"tracing the dense equivalent of {cfg.model_type} on the meta device failed: "
                                  f"{type(e).__name__}: {e}") from e


def _costs_of(pairs: list[tuple[fx.Node, NodeCost]]) -> list[NodeCost]:
    return [nc for _, nc in pairs]


def _layer_memory(mem: Memory, index: int | None) -> float:
    assert mem.by_layer is not None
    return mem.by_layer.get(index, 0.0)


@functools.lru_cache(maxsize=32)
def _profile_cached(key: str, seq_len: int, micro_batch: int, sections: str) -> ModelProfile:
    spec = json.loads(key)
    if "model" in spec:
        config = load_model_config(spec["model"])
    else:
        from transformers import AutoConfig

        fields = dict(spec["config"])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    arch = moe_arch(config, spec.get("experts"))
    extra = json.loads(sections)
    etp = int(extra.pop("parallel", {}).get("etp", 1))  # the slices are traced on one process: no parallel section
    plan = {**extra, "experts": {**arch.experts, **extra.get("experts", {})}}
    if seq_len > getattr(config, "max_position_embeddings", seq_len):
        arch = dataclasses.replace(arch, base={**arch.base, "max_position_embeddings": seq_len})
    p1 = _meta_convert(arch.config(1, arch.moe_intermediate), plan, micro_batch, seq_len, etp)
    g1, par1, m1 = _split(p1), _params(p1), measure_activations(p1, micro_batch)
    if m1.by_layer is not None:  # the estimator splits by layer: one traced layer is enough
        base_act, moe_act = _layer_memory(m1, None), _layer_memory(m1, 0)
        traced = "1 MoE layer"
    else:  # a whole-graph figure: difference of 1 and 2 layers
        m2 = measure_activations(_meta_convert(arch.config(2, arch.moe_intermediate), plan, micro_batch, seq_len,
                                               etp), micro_batch)
        base_act, moe_act = 2 * m1.total - m2.total, m2.total - m1.total
        traced = "1 and 2 MoE layers"
    rows, hidden, weights = _moe_bytes(g1.get(0, []))
    t1 = _tensors(p1)
    base = LayerProfile("base", 1, _costs_of(g1.get(None, [])), hidden_bytes=hidden,
                        dense_params=par1.get(None, (0, 0))[0], activation_bytes=max(0.0, base_act),
                        tensors=t1.get(None, ()), tail=t1.get(-1, ()))
    moe = LayerProfile("moe", arch.n_moe, _costs_of(g1.get(0, [])), rows, hidden, *par1.get(0, (0.0, 0.0)),
                       activation_bytes=moe_act, row_weight_bytes=weights, tensors=t1.get(0, ()), first=arch.n_dense)
    layers = [base, moe]
    largest = _largest(p1)
    if arch.n_dense:
        no_experts = {**plan, "experts": {**plan["experts"], "layers": []}}
        d1 = _meta_convert(arch.config(1, arch.dense_intermediate), no_experts, micro_batch, seq_len)
        md = measure_activations(d1, micro_batch)
        dense_act = _layer_memory(md, 0) if md.by_layer is not None else md.total - base_act
        layers.append(LayerProfile("dense", arch.n_dense, _costs_of(_split(d1).get(0, [])), 0.0, hidden,
                                   _params(d1).get(0, (0.0, 0.0))[0], 0.0, activation_bytes=dense_act,
                                   tensors=_tensors(d1).get(0, ())))
        traced += " and 1 dense layer"
        largest = (max(largest[0], _largest(d1)[0]), largest[1])
    experts = p1.plan.experts
    elem = next(p1.module.parameters()).element_size()
    approx = costs.graph_costs(p1.history[-1].graph).approximate
    notes = [f"traced {traced} on the meta device; scaled to {arch.n_moe} MoE + {arch.n_dense} dense layers"]
    return ModelProfile(spec.get("name", config.model_type), seq_len, micro_batch, config.hidden_size,
                        experts.num_experts, experts.top_k, elem, layers, p1.plan, m1.source, m1.state_bytes, approx,
                        notes, largest, etp)


def profile_config(model: Any, *, seq_len: int, micro_batch: int = 1, experts: dict | None = None,
                   sections: dict | None = None) -> ModelProfile:
    """Profile a Hugging Face config (object, shipped name, zoo name or path), traced on the meta device.

    ``sections`` are extra plan sections (``recompute``, ``fp8``...) the graph is converted with.
    """
    if isinstance(model, (str, Path)):
        key = {"model": str(model), "name": Path(str(model)).stem}
    else:
        cfg = load_model_config(model)
        key = {"config": {**_fields(cfg), "model_type": cfg.model_type}, "name": cfg.model_type}
    if experts:
        key["experts"] = dict(experts)
    return _profile_cached(json.dumps(key, sort_keys=True, default=str), seq_len, micro_batch,
                           json.dumps(sections or {}, sort_keys=True))


def profile_result(result: Any) -> ModelProfile:
    """Profile a ConversionResult as it is: every layer of its graph, at its example batch.

    A graph converted with ``parallel.ep > 1`` holds E/ep experts (E*etp/(ep*etp) slices under
    ``parallel.etp``); its expert parameters and weight bytes are scaled back to the whole model (the
    cost model divides by ep x etp again).
    """
    ids = result.example_inputs[0] if result.example_inputs else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise MoecompileError("profile_result needs a result converted from token ids [batch, seq] "
                              "(result.example_inputs[0])")
    micro_batch, seq_len = ids.shape
    ep = result.plan.parallel.expert_ranks  # the ranks the experts are spread over: ep x etp
    groups = _split(result)
    params = _params(result)

    def whole(nodes: list[NodeCost]) -> list[NodeCost]:
        if ep == 1:
            return nodes
        return [dataclasses.replace(n, weight_bytes=n.weight_bytes * ep, bytes=n.bytes + n.weight_bytes * (ep - 1))
                if n.category == "experts" else n for n in nodes]

    tensors = _tensors(result, ep)
    layers = [LayerProfile("base", 1, whole(_costs_of(groups.pop(None, []))), dense_params=params.get(None, (0, 0))[0],
                           tensors=tensors.get(None, ()), tail=tensors.get(-1, ()))]
    for idx in sorted(groups):
        pairs = groups[idx]
        rows, hidden_b, weights = _moe_bytes(pairs)
        dp, xp = params.get(idx, (0.0, 0.0))
        layers.append(LayerProfile("moe" if rows else "dense", 1, whole(_costs_of(pairs)), rows, hidden_b, dp, xp * ep,
                                   row_weight_bytes=weights, tensors=tensors.get(idx, ()), first=idx))
    layers[0].hidden_bytes = max((lp.hidden_bytes for lp in layers), default=0.0)
    mem = measure_activations(result, int(micro_batch))
    layers[0].activation_bytes = mem.total  # a whole-graph figure, kept on the base
    experts = result.plan.experts
    elem = next(p.element_size() for p in result.module.parameters())
    name = experts_param(result)
    hidden = result.module.get_parameter(name).shape[-1] if name else 0
    etp = slices_of(result)
    return ModelProfile(type(result.module).__name__, int(seq_len), int(micro_batch), int(hidden), experts.num_experts,
                        experts.top_k, elem, layers, result.plan, mem.source, mem.state_bytes,
                        costs.graph_costs(result.history[-1].graph).approximate,
                        [f"profiled the converted graph as is (ep={result.plan.parallel.ep}"
                         + (f" x etp={etp})" if etp > 1 else ")")], _largest(result, ep=ep), etp)


def experts_param(result: Any) -> str | None:
    """Name of one routed-expert weight [E, out, H] (its last dim is the hidden size)."""
    for name, _ in result.module.named_parameters():
        if name.endswith("experts.w_gate_up") or name.endswith("experts.w_up"):
            return name
    return None


def slices_of(result: Any) -> int:
    """The slices each expert of ``result``'s graph is cut into: ``parallel.etp``, or ``slices_pass``'s."""
    infos = [n.meta["moe"]["moe"] for n in result.module.graph.nodes if "moe" in n.meta.get("moe", {})]
    return max((int(info.get("slices", 1)) for info in infos), default=1)
