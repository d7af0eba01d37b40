"""Pass ``overlap``: pipeline each MoE layer's exchanges with its compute.

Before (one layer after expert_parallel, all-to-all, dropless; everything serial)::

    permute -> counts a2a, wait -> splits -> dispatch a2a, wait -> experts -> combine a2a, wait -> unpermute
    shared_experts(x) ; add

After, ``overlap.chunks: 2`` (chunk c = tokens [c*T/2, (c+1)*T/2), see passes/overlap_chunks.py)::

    permute(0), counts(0) start, permute(1), counts(1) start       # dispatch cones hoisted
    counts(0) wait, dispatch(0) start, counts(1) wait, dispatch(1) start
    shared_experts, router_loss                                     # independent compute in the gap
    dispatch(0) wait, experts(0), combine(0) start                  # dispatch(1) in flight
    dispatch(1) wait, experts(1), combine(1) start                  # combine(0) in flight
    combine(0) wait, unpermute(0), combine(1) wait, unpermute(1), cat ; add

The order is a list schedule over the layer's window of the networkx dependency graph
(moecompile/schedule.py): among ready nodes, first whatever feeds a dispatch-side start (and
the starts), then the count waits those need, then other compute in graph order, and waits
last (dispatch before combine, by chunk), so every start runs as early and every wait as late
as dependencies allow. ``overlap.shared_expert: false`` keeps the shared experts after the
last wait. ``overlap.backward`` turns the float all-to-alls into moecompile.a2a_start /
a2a_wait (kernels/async_a2a.py), whose backward overlaps the transposed exchanges the same way.

Numerics: the same rows meet the same kernels in another grouping. Forward outputs match the
non-overlapped graph to float summation order (GEMM blocking over fewer rows); weight
gradients sum N partial products (fp32: rtol 1e-5, atol 1e-6 in the tests). Dropless chunks
route their own tokens (no drops); static chunks split capacity slots of one permute, so the
same tokens are dropped. With the allgather dispatcher the backward stays torch's (waited in
place), and in static mode it is not chunked (capacity is per gathered bucket).
"""

from __future__ import annotations

import networkx as nx
import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from moecompile import schedule
from moecompile.distributed import ALL_TO_ALL, World
from moecompile.meta import Role, moe
from moecompile.pass_manager import PassContext, register_pass, register_verifier
from moecompile.shapes import propagate_fake

from . import overlap_auto
from .overlap_chunks import EXPERT_ROLES, MoELayer, chunk_slots, chunk_tokens, find_layers

mc = torch.ops.moecompile
_LABELS = {Role.EXPERT_ACT: "experts", Role.DISPATCH: "dispatch prep", Role.COMBINE_COMM: "combine prep"}


@register_pass("overlap", after="expert_parallel", requires=("expert_parallel",), provides=("overlap",))
def overlap(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    cfg, par = ctx.plan.overlap, ctx.plan.parallel
    world: World | None = ctx.world
    if not cfg.enabled:
        ctx.decide("overlap.enabled is false: graph unchanged")
        return PassResult(gm, False)
    if par.expert_ranks == 1 or world is None:
        ctx.decide("parallel.ep is 1: no exchanges to overlap, graph unchanged")
        ctx.record(schedule={})
        return PassResult(gm, False)
    dropless = par.dispatch_mode == "dropless"
    records = {}
    for layer in find_layers(gm):
        if not layer.starts:
            continue
        n, why = _chunks(gm, ctx, layer, world, dropless)
        if n > 1:
            if dropless:
                reason = chunk_tokens(gm, layer, n)
            elif par.dispatcher == "alltoall":
                reason = chunk_slots(gm, layer, n, world.ep, world.ep_group_name)
            else:
                reason = "static allgather buckets by (source, expert) over the gathered batch; chunks would change drops"
            if reason:
                why, n = f"not chunked: {reason}", 1
            else:
                propagate_fake(gm, ctx.example_inputs)  # the chunks' values (dtypes) for what follows
        layer = next(m for m in find_layers(gm) if m.name == layer.name)
        if cfg.backward and par.dispatcher != "allgather":
            _make_async(gm, layer)
        _schedule(gm, layer.name, cfg.shared_expert)
        records[layer.name] = _describe(gm, layer.name, n, why)
        ctx.decide(f"{layer.name}: {n} chunk{'s' * (n > 1)} ({why})")
        for c in records[layer.name]["collectives"]:
            ctx.decide(f"{layer.name} chunk {c['chunk']} {c['what']} overlaps {', '.join(c['overlaps']) or 'nothing'}")
    if cfg.backward and par.dispatcher == "allgather":
        ctx.decide("allgather dispatcher: the backward's gathers and reduce-scatters stay synchronous (torch's autograd)")
    ctx.record(schedule=records, chunks={k: v["chunks"] for k, v in records.items()})
    return PassResult(gm, bool(records))


def _chunks(gm: fx.GraphModule, ctx: PassContext, layer: MoELayer, world: World, dropless: bool) -> tuple[int, str]:
    cfg, par = ctx.plan.overlap, ctx.plan.parallel
    if cfg.chunks != "auto":
        return int(cfg.chunks), "overlap.chunks"
    if par.dispatcher == "allgather" and not dropless:
        return 1, "auto: static allgather is not chunked (capacity is per gathered bucket)"
    costs = overlap_auto.measure(gm, layer, world, par.dispatcher, dropless)
    limit = min(overlap_auto.MAX_AUTO_CHUNKS, costs.rows if dropless else int(layer.permute.args[4]))  # type: ignore[union-attr]
    n, why = overlap_auto.choose(costs, max(limit, 1))
    if dropless:
        n = min(n, int(layer.x_TH.meta["val"].shape[0]))
    return n, f"auto: {why}"


def _make_async(gm: fx.GraphModule, layer: MoELayer) -> None:
    """Float all-to-alls -> a2a_start / a2a_wait (same exchange; asynchronous backward too)."""
    graph = gm.graph
    for s in layer.starts:
        val = s.args[0].meta.get("val")  # type: ignore[union-attr]
        waits = list(s.users)
        if s.target is not ALL_TO_ALL or val is None or not val.is_floating_point() or len(waits) != 1:
            continue
        (w,) = waits
        x, out_splits, in_splits, group = s.args
        with graph.inserting_before(s):
            s2 = graph.call_function(mc.a2a_start.default, (x, out_splits, in_splits, group))
        with graph.inserting_before(w):
            w2 = graph.call_function(mc.a2a_wait.default, (s2, out_splits, in_splits, w.args[1], group))
        for old, new in ((s, s2), (w, w2)):
            for key in ("moe", "nn_module_stack", "stack_trace"):
                if key in old.meta:
                    new.meta[key] = dict(old.meta[key]) if key == "moe" else old.meta[key]
        w.replace_all_uses_with(w2)
        graph.erase_node(w)
        graph.erase_node(s)


def _window(graph: fx.Graph, layer: str) -> list[fx.Node]:
    nodes = list(graph.nodes)
    idx = [i for i, n in enumerate(nodes) if moe(n).get("layer") == layer]
    return nodes[idx[0]: idx[-1] + 1]


def _schedule(gm: fx.GraphModule, layer: str, shared_expert: bool) -> None:
    """Reorder the layer's window: starts as early, waits as late as dependencies allow."""
    graph = gm.graph
    window = _window(graph, layer)
    dag = schedule.dependency_graph(graph, window)
    compute = {n for n in window if moe(n).get("role") in EXPERT_ROLES}
    cone: set[fx.Node] = set()  # what the dispatch-side starts need
    combine_side = set()
    for s in (n for n in window if schedule.is_start(n)):
        up = nx.ancestors(dag, s)
        if up & compute:
            combine_side.add(s)
        else:
            cone |= up | {s}
    waits_cone = {n for n in cone if schedule.is_wait(n)}
    phase = {n: int(n.args[0] in combine_side) for n in window if schedule.is_wait(n)}  # 0 dispatch, 1 combine

    def priority(n: fx.Node) -> tuple:
        chunk = moe(n).get("chunk") or 0
        if n in waits_cone:
            return (1,)
        if n in cone or n in combine_side:
            return (0,)
        if schedule.is_wait(n):
            return (3, phase[n], chunk)
        if not shared_expert and moe(n).get("role") == Role.SHARED_EXPERTS:
            return (4,)
        return (2,)

    schedule.reorder(graph, window, schedule.list_schedule(dag, window, priority))


def _label(n: fx.Node) -> str:
    meta = moe(n)
    role = meta.get("role")
    name = _LABELS.get(role, str(role.value if role is not None else "dense"))  # type: ignore[union-attr]
    return f"{name}(chunk {meta['chunk']})" if meta.get("chunk") is not None else name


def _what(wait: fx.Node) -> str:
    what = wait.args[3] if wait.target in schedule.ASYNC_WAITS else wait.args[1]
    text = str(what).split(": ", 1)[-1]
    return text.split(" (chunk")[0]


def _describe(gm: fx.GraphModule, layer: str, n: int, why: str) -> dict:
    """Per collective of the layer, in start order: which compute runs while it is in flight."""
    graph = gm.graph
    collectives, timeline = [], []
    for s, w in schedule.collective_pairs(graph):
        if moe(s).get("layer") != layer:
            continue
        labels: list[str] = []
        work = [m for m in schedule.between(graph, s, w)
                if not (schedule.is_free(m) or schedule.is_start(m) or schedule.is_wait(m))]
        for m in work:
            if _label(m) not in labels:
                labels.append(_label(m))
        collectives.append({"chunk": moe(s).get("chunk") or 0, "what": _what(w), "start": s.name, "wait": w.name,
                            "overlaps": labels, "nodes": [m.name for m in work]})
    for m in _window(graph, layer):
        if schedule.is_start(m) or schedule.is_wait(m):
            item = f"{'start' if schedule.is_start(m) else 'wait'} {_what(next(iter(m.users)) if schedule.is_start(m) else m)}"
            item += f"(chunk {moe(m).get('chunk') or 0})"
        elif schedule.is_free(m):
            continue
        else:
            item = _label(m)
        if not timeline or timeline[-1] != item:
            timeline.append(item)
    return {"chunks": n, "why": why, "collectives": collectives, "timeline": timeline}


def verify_schedule(gm: fx.GraphModule, ctx: PassContext) -> None:
    """The order is topological and no collective's result is read before its wait."""
    problems = schedule.check_schedule(gm.graph)
    assert not problems, "; ".join(problems[:5])


register_verifier("overlap", verify_schedule)
