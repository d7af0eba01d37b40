"""Pass ``recompute``: recompute regions in backward, offload others, fit an activation budget.

Before (one Llama layer's post-attention norm, saved tensors marked ``*``)::

    h* = add(x, attn);  v* = pow(h, 2) ... n* = mul(w, rsqrt(...) * h);  y = linear(n*, Wg) ...

After ``recompute.modules: [layernorm]``::

    n = call_module[recompute_layernorm_model_layers_0_post_attention_layernorm](h, w, Wg, Wu)
        # RecomputeRegion: checkpoint(norm)(h, w) -> only h is saved; the linears that read n
        # save a handle instead of n, and the norm runs again when backward needs n

Regions come from the graph: ``router`` / ``moe_act`` / ``shared_experts`` / ``moe`` from
``meta["moe"]`` roles and layers, ``attention`` / ``layernorm`` / ``mlp`` from
``nn_module_stack`` (one region per module instance). Touching selected regions
merge into one unit where the merged unit may still be recomputed (no collective, no
size only the run knows: at ep > 1 the MoE block's exchange sits between its parts);
a node two regions claim stays in the larger. ``recompute.budget`` picks regions greedily by bytes freed per
recompute FLOP until the activation estimate (``moecompile.memory``, fake
tensors) fits, then drops picks the budget no longer needs. ``recompute.offload``
outlines its regions into ``OffloadRegion``s instead (passes/regions.py).
Legend: R a recomputed region, C its consumers (nodes outside R saving R's outputs).
"""

from __future__ import annotations

import dataclasses
import operator
import re

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from moecompile.costs import collective_kind, human
from moecompile.graph import ancestors_within, module_path
from moecompile.memory import ActivationProfile, profile_activations
from moecompile.meta import Role, moe
from moecompile.pass_manager import PassContext, register_pass, register_verifier

from .regions import OffloadRegion, RecomputeRegion, outline, stable_toposort

_ROLES = {
    "router": {Role.ROUTER, Role.ROUTE},
    "moe_act": {Role.EXPERT_ACT},
    "shared_experts": {Role.SHARED_EXPERTS},
}
_ACTS = {torch.ops.moecompile.glu.default, torch.ops.aten.silu.default, torch.ops.aten.gelu.default,
         torch.ops.aten.relu.default}


@dataclasses.dataclass
class Region:
    kind: str
    name: str  # the module path (or MoE layer) it covers
    nodes: set[fx.Node]


def _stack_types(node: fx.Node) -> list[tuple[str, str]]:
    return [(re.sub(r"^L\['self'\]\.?", "", p), str(t).rsplit(".", 1)[-1]) for p, t in (node.meta.get("nn_module_stack") or {}).values()]


def find_regions(gm: fx.GraphModule, kinds: list[str]) -> list[Region]:
    """Every region of the given kinds, one per MoE layer or module instance, in graph order."""
    moe_layers = {moe(n).get("layer") for n in gm.graph.nodes if moe(n).get("role") == Role.ROUTE}
    found: dict[tuple[str, str], set[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        role, layer = moe(n).get("role"), moe(n).get("layer")
        keys = []
        for kind, roles in _ROLES.items():
            if role in roles:
                keys.append((kind, layer))
        if role == Role.SHARED_EXPERTS and n.target in _ACTS:  # the shared experts' activation is an expert's too
            keys.append(("moe_act", layer))
        if layer in moe_layers:
            keys.append(("moe", layer))
        if role == Role.FFN:
            keys.append(("mlp", layer))
        stack = _stack_types(n)
        attention = [p for p, t in stack if "Attention" in t]
        if attention and role is None:
            keys.append(("attention", attention[-1]))
        if stack and "Norm" in stack[-1][1]:
            keys.append(("layernorm", module_path(n)))
        for key in keys:
            if key[0] in kinds:
                found.setdefault(key, set()).add(n)
    return [Region(k, name, nodes) for (k, name), nodes in found.items()]


# ---------------------------------------------------------------- units: R, its consumers C, convex


@dataclasses.dataclass
class Unit:
    regions: list[Region]
    recompute: set[fx.Node]
    consumers: set[fx.Node]

    @property
    def nodes(self) -> set[fx.Node]:
        return self.recompute | self.consumers


class _Graph:
    """Reachability helpers over one graph, in topological order."""

    def __init__(self, gm: fx.GraphModule, profile: ActivationProfile):
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.profile = profile
        self.by_name = {n.name: n for n in gm.graph.nodes}

    def between(self, nodes: set[fx.Node]) -> set[fx.Node]:
        """Nodes outside ``nodes`` on a path from one of them to another (what breaks convexity)."""
        lo, hi = min(self.order[n] for n in nodes), max(self.order[n] for n in nodes)
        down: set[fx.Node] = set()
        stack = [u for n in nodes for u in n.users if u not in nodes]
        while stack:
            u = stack.pop()
            if u in down or self.order[u] > hi:
                continue
            down.add(u)
            stack.extend(u.users)
        up: set[fx.Node] = set()
        stack = [a for n in nodes for a in n.all_input_nodes if a not in nodes]
        while stack:
            a = stack.pop()
            if a in up or self.order[a] < lo:
                continue
            up.add(a)
            stack.extend(a.all_input_nodes)
        return down & up

    def savers_of(self, nodes: set[fx.Node]) -> set[fx.Node]:
        """Nodes outside ``nodes`` that save a storage one of ``nodes`` made."""
        made = set().union(*(self.profile.produced.get(n.name, set()) for n in nodes))
        names = {n.name for n in nodes}
        out = set()
        for key in made:
            t = self.profile.tensors.get(key)
            if t is not None:
                out |= {self.by_name[s] for s in t.savers - names if s in self.by_name}
        return out


def build_units(g: _Graph, regions: list[Region]) -> list[Unit]:
    """Units to outline, in graph order: touching regions merge where the merged unit may be recomputed; a
    region that cannot join the units it touches stands alone, or is left out (:func:`left_out`) where even
    alone it would share nodes with one. Each node is in one unit: a node two regions claim belongs to the
    larger region, and a consumer another unit recomputes, or that an earlier unit takes along, is dropped
    (a consumer is only a saving, never needed)."""
    units: list[Unit] = []
    for r in sorted(_disjoint(regions), key=lambda r: min(g.order[n] for n in r.nodes)):
        alone = _unit(g, [r])
        near = [u for u in units if alone.nodes & u.nodes or _touch(u.recompute, r.nodes)]
        merged = _unit(g, [x for u in near for x in u.regions] + [r])
        if _may_recompute(merged) and not any(merged.nodes & u.nodes for u in units if u not in near):
            units = [u for u in units if u not in near] + [merged]
        elif _may_recompute(alone) and not any(alone.recompute & u.recompute for u in units):
            units.append(alone)
    order = g.order
    units.sort(key=lambda u: min(order[n] for n in u.recompute))
    recomputed, taken = set().union(*(u.recompute for u in units)) if units else set(), set()
    for u in units:
        dropped = u.consumers & (recomputed | taken)
        u.consumers -= dropped  # and what reads a dropped one, so R + C stays convex
        u.consumers -= {n for n in u.consumers if ancestors_within([n], u.consumers | dropped) & dropped}
        taken |= u.consumers
    return units


def left_out(regions: list[Region], units: list[Unit]) -> list[Region]:
    """Regions none of whose nodes any unit recomputes."""
    inside = set().union(*(u.recompute for u in units)) if units else set()
    return [r for r in regions if not r.nodes & inside]


def _disjoint(regions: list[Region]) -> list[Region]:
    """The regions without shared nodes: a node two regions claim (the shared expert's activation is in both
    moe_act and shared_experts) stays in the larger; a region left empty is covered by the other whole."""
    out: list[Region] = []
    for r in sorted(regions, key=lambda r: -len(r.nodes)):
        nodes = r.nodes - set().union(*(o.nodes for o in out)) if out else set(r.nodes)
        if nodes:
            out.append(Region(r.kind, r.name, nodes))
    return out


def _touch(a: set[fx.Node], b: set[fx.Node]) -> bool:
    return any(u in b for n in a for u in n.users) or any(u in a for n in b for u in n.users)


def _unit(g: _Graph, group: list[Region]) -> Unit:
    r = set().union(*(x.nodes for x in group))
    r |= g.between(r)
    c = g.savers_of(r)
    for _ in range(32):  # keep the unit convex: views on the way join C; a consumer behind real work leaves
        extra = g.between(r | c)
        if not extra:
            break
        costly = {n for n in extra if not _is_view_like(n)}
        c |= extra - costly
        c -= {n for n in c if ancestors_within([n], extra | c) & costly}
    sized = {n for n in c if _makes_unbacked(n)}  # the outlined module could not return the size it makes up
    c -= sized | {n for n in c if ancestors_within([n], c | sized) & sized}
    return Unit(group, r, c)


def _may_recompute(u: Unit) -> bool:
    """What it recomputes holds no collective, no write to a tensor from outside, and makes no shape only the
    run knows (the rerun would make up another)."""
    return _recomputable(Region("", "", u.recompute)) and not any(_makes_unbacked(n) for n in u.recompute)


def _makes_unbacked(n: fx.Node) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    def symbols(v: object) -> set:
        try:
            return set(free_unbacked_symbols(v))
        except Exception:  # not a shape
            return set()

    made = symbols(n.meta.get("val"))
    return bool(made and made - set().union(*(symbols(a.meta.get("val")) for a in n.all_input_nodes)))


def _is_view_like(n: fx.Node) -> bool:
    """Shape bookkeeping and views: free to run beside the consumers."""
    if n.target is operator.getitem or n.target in (torch.ops.aten.sym_size.int, torch.ops.aten._assert_tensor_metadata.default):
        return True
    schema = getattr(n.target, "_schema", None)
    return schema is not None and bool(schema.returns) and all(r.alias_info is not None for r in schema.returns)


def predicted_bytes(g: _Graph, units: list[Unit]) -> int:
    """Activation bytes after recomputing ``units``, from the baseline profile (no rerun)."""
    p = g.profile
    recomputed = {n.name for u in units for n in u.recompute}
    unit_of = {n.name: i for i, u in enumerate(units) for n in u.nodes}
    keep = set(p.outputs)
    for key, t in p.tensors.items():
        if not t.on_device:
            continue
        made_in = unit_of.get(t.producer) if t.producer in recomputed else None
        if made_in is None or any(unit_of.get(s) != made_in for s in t.savers):
            keep.add(key)
    for u in units:  # checkpoint keeps each region's inputs
        made = set().union(*(p.produced.get(n.name, set()) for n in u.recompute))
        for n in u.recompute:
            keep |= p.uses.get(n.name, set()) - made
    return sum(p.tensors[k].nbytes if k in p.tensors else p.sizes.get(k, 0) for k in keep)


def recompute_flops(g: _Graph, unit: Unit) -> int:
    """R runs once more for its own backward, and once more for its consumers' backward."""
    flops = sum(g.profile.flops.get(n.name, 0) for n in unit.recompute)
    return flops * (2 if unit.consumers else 1)


def choose(g: _Graph, candidates: list[Region], budget: int) -> tuple[list[Region], int]:
    """Greedy knapsack: the region freeing most bytes per recompute FLOP, until the budget fits."""
    chosen: list[Region] = []
    current = predicted_bytes(g, [])
    while current > budget:
        best, best_score, best_bytes = None, 0.0, current
        spent = sum(recompute_flops(g, u) for u in build_units(g, chosen))
        for r in candidates:
            if r in chosen or any(r.nodes <= c.nodes for c in chosen):
                continue
            trial = build_units(g, [c for c in chosen if not c.nodes <= r.nodes] + [r])
            after = predicted_bytes(g, trial)
            score = (current - after) / (max(0, sum(recompute_flops(g, u) for u in trial) - spent) + 1)
            if after < current and score > best_score:
                best, best_score, best_bytes = r, score, after
        if best is None:
            break
        chosen = [c for c in chosen if not c.nodes <= best.nodes] + [best]
        current = best_bytes
    def cost(r: Region) -> int:
        return sum(recompute_flops(g, u) for u in build_units(g, [r]))

    for r in sorted(chosen, key=cost, reverse=True):  # undo what isn't needed
        rest = [c for c in chosen if c is not r]
        if predicted_bytes(g, build_units(g, rest)) <= budget:
            chosen = rest
    return chosen, predicted_bytes(g, build_units(g, chosen))


# ---------------------------------------------------------------- the pass


def _recomputable(r: Region) -> bool:
    """No collectives (every rank would have to re-run them in step) and no in-place op on a tensor from
    outside the region (a rerun would write it again); a tensor the region allocates and fills in place
    (DeepSeek-V3's attention writes its query halves into a new_empty) is allocated again by the rerun."""
    return not any(collective_kind(n) is not None or any(t not in r.nodes for t in _written(n)) for n in r.nodes)


def _written(n: fx.Node) -> list[fx.Node]:
    """The tensors an in-place op writes, each traced back through the views it was reached by."""
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        t = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
        while isinstance(t, fx.Node) and t.op == "call_function" and getattr(t.target, "is_view", False):
            t = t.args[0]
        out.append(t)
    return out


def _label(regions: list[Region]) -> str:
    return " + ".join(f"{r.kind}:{r.name}" for r in regions)


@register_pass("recompute", after="fp8")
def recompute(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    cfg = ctx.plan.recompute
    if not cfg.modules and not cfg.offload and cfg.budget is None:
        ctx.decide("recompute.modules, .offload and .budget are empty: every activation is kept")
        return PassResult(gm, False)
    profile = profile_activations(gm.graph, gm, ctx.example_inputs, ep=ctx.plan.parallel.expert_ranks)
    g = _Graph(gm, profile)
    baseline = profile.device_bytes
    skipped = []
    if cfg.budget is not None:
        budget = cfg.budget_bytes(baseline) or 0
        candidates = find_regions(gm, cfg.candidates)
        skipped = [r for r in candidates if not _recomputable(r)]
        chosen, predicted = choose(g, [r for r in candidates if _recomputable(r)], budget)
        fits = "fits" if predicted <= budget else "does not fit even recomputing every candidate"
        ctx.decide(f"budget {human(budget, 'B', 1024)} (recompute.budget={cfg.budget!r}, baseline "
                   f"{human(baseline, 'B', 1024)}): chose {len(chosen)} of {len(candidates)} regions -> "
                   f"predicted {human(predicted, 'B', 1024)}, {fits}")
    else:
        found = find_regions(gm, cfg.modules)
        skipped = [r for r in found if not _recomputable(r)]
        chosen = [r for r in found if _recomputable(r)]
    for r in skipped:
        ctx.decide(f"{r.kind}:{r.name} not recomputed: it holds a collective or an in-place op")
    units = build_units(g, chosen)
    for r in left_out(chosen, units):
        ctx.decide(f"{r.kind}:{r.name} not recomputed: joined to the regions it touches it would span a collective "
                   "or make a size only the run knows, and it cannot stand alone beside them")
    taken = set().union(*(u.nodes for u in units)) if units else set()
    offloads = []  # what a recompute unit already covers is not offloaded as well
    for u in build_units(g, [Region(r.kind, r.name, r.nodes - taken) for r in find_regions(gm, cfg.offload)
                             if _recomputable(r) and r.nodes - taken]):
        if u.recompute & taken:
            ctx.decide(f"offload {_label(u.regions)} skipped: it would overlap a recomputed region")
        else:
            offloads.append(u)
    record = {"baseline_bytes": baseline, "predicted_bytes": predicted_bytes(g, units), "recomputed": [], "offloaded": []}
    for u in units:
        kinds = sorted({r.kind for r in u.regions})
        name = "recompute_" + "_".join(kinds) + "_" + u.regions[0].name
        outline(gm, u.nodes, lambda sub, u=u, kinds=kinds: RecomputeRegion(sub, {n.name for n in u.recompute}, kinds),
                 name, {"layer": u.regions[0].name, "role": Role.RECOMPUTE, "recompute": kinds})
        flops = recompute_flops(g, u)
        record["recomputed"].append({"regions": _label(u.regions), "nodes": len(u.recompute), "consumers": len(u.consumers), "flops": flops})
        ctx.decide(f"recompute {_label(u.regions)}: {len(u.recompute)} nodes, {len(u.consumers)} consumers keep a "
                   f"handle, +{human(flops)}FLOP in backward")
    for u in offloads:
        kinds = sorted({r.kind for r in u.regions})
        outline(gm, u.recompute, lambda sub, kinds=kinds: OffloadRegion(sub, cfg.offload_min_bytes, kinds),
                 "offload_" + "_".join(kinds) + "_" + u.regions[0].name, {"layer": u.regions[0].name, "offload": kinds})
        record["offloaded"].append({"regions": _label(u.regions), "nodes": len(u.recompute)})
        ctx.decide(f"offload {_label(u.regions)}: saved tensors >= {cfg.offload_min_bytes} B go to host memory")
    stable_toposort(gm.graph)
    after = profile_activations(gm.graph, gm, ctx.example_inputs, ep=ctx.plan.parallel.expert_ranks)
    record |= {"activation_bytes": after.device_bytes, "offloaded_bytes": after.host_bytes}
    ctx.decide(f"activations per rank {human(baseline, 'B', 1024)} -> {human(after.device_bytes, 'B', 1024)}"
               + (f" (+{human(after.host_bytes, 'B', 1024)} on host)" if after.host_bytes else ""))
    ctx.record(recompute=record)
    return PassResult(gm, bool(units or offloads))


def _regions_are_self_contained(gm: fx.GraphModule, ctx: PassContext) -> None:
    for name, mod in gm.named_modules():
        if isinstance(mod, RecomputeRegion):
            for n in mod.recompute.graph.nodes:
                assert collective_kind(n) is None, f"{name} recomputes collective {n.name}"


register_verifier("recompute", _regions_are_self_contained)
