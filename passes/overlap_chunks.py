"""How the ``overlap`` pass splits one MoE layer's expert section into N chunks.

``MoELayer`` finds what expert_parallel left (any dispatcher). Two ways to split it:

    dropless  token ranges. The section between the routed tokens (x_TH, w_TK, idx_TK) and the
              combined output is cloned once per chunk over narrow(., 0, b_c, b_c+1 - b_c); chunk
              outputs are concatenated. Each chunk permutes, exchanges and combines its own tokens:
              every token meets the same experts with the same weights. The expert load is the sum
              (and what read the whole batch's load, global_aux's all-reduce, moves after it).
              Meta counts of the whole batch's tokens (meta.TOKEN_COUNTS) are scaled to the chunk's.
    static    capacity-slot ranges (all-to-all only). The permute runs once on the whole batch
              (so capacity drops exactly the tokens it did), and chunk c exchanges slots
              [s_c, s_c+1) of every expert: x_ECH[:, s_c:s_c+1] -> all_to_all (fixed splits L*C_c)
              -> experts -> all_to_all back; the [E, C, H] buffer is stitched back for unpermute.

New nodes carry the layer, their role and ``meta["moe"]["chunk"]``. Rows are computed by the
same kernels in a different grouping, so outputs match to float summation order (see
passes/overlap.py for the tolerance).
Legend: T tokens, K top-k, H hidden, E experts, P ep ranks, L = E/P local experts, C capacity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Any, Iterator

import networkx as nx
import torch
import torch.fx as fx

from moecompile import schedule
from moecompile.distributed import ALL_TO_ALL
from moecompile.meta import TOKEN_COUNTS, MoEInfo, Role, moe
from moecompile.outputs import add_side_outputs

from .ep_alltoall import _swap_blocks, dispatch_rows
from .expert_parallel import Block, Emit, row_weights_of

aten, mc = torch.ops.aten, torch.ops.moecompile
EXPERT_ROLES = (Role.EXPERTS, Role.EXPERT_ACT)


@dataclasses.dataclass
class MoELayer:
    """One MoE layer after expert_parallel: its routed inputs, expert section and exchanges."""

    name: str
    info: MoEInfo
    nodes: list[fx.Node]  # every node of the layer, graph order
    x_TH: fx.Node
    routed: list[fx.Node]  # the route's outputs (weights_TK, idx_TK; every getitem of them)
    sink: fx.Node  # the combined routed output [T, H] (unpermute, or the reduce-scatter's wait)
    permute: fx.Node | None
    unpermute: fx.Node | None

    @property
    def experts(self) -> list[fx.Node]:
        return [n for n in self.nodes if moe(n).get("role") in EXPERT_ROLES]

    @property
    def starts(self) -> list[fx.Node]:
        return [n for n in self.nodes if schedule.is_start(n)]


def find_layers(gm: fx.GraphModule) -> list[MoELayer]:
    by_layer: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        layer = n.meta.get("moe", {}).get("layer")
        if layer is not None:
            by_layer.setdefault(layer, []).append(n)
    layers = []
    for name, nodes in by_layer.items():
        info = next((moe(n)["moe"] for n in nodes if "moe" in moe(n)), None)
        route = next((n for n in nodes if n.target is mc.route.default), None)
        ends = _combine_ends(nodes)
        if info is None or route is None or not ends:
            continue
        routed = [u for u in route.users if u.target is operator.getitem]
        logits = route.args[0]
        x_TH = logits.args[0] if isinstance(logits, fx.Node) and logits.target is aten.linear.default else None
        if x_TH is None or len(routed) != len(route.users):
            continue
        one = lambda t: next((n for n in nodes if n.target is t), None)  # noqa: E731
        layers.append(MoELayer(name, info, nodes, x_TH, routed, ends[-1], one(mc.permute.default),
                               one(mc.unpermute.default)))
    return layers


def _combine_ends(nodes: list[fx.Node]) -> list[fx.Node]:
    """The layer's nodes that can hold its combined routed output, in graph order: an unpermute, a wait, or
    a combine-side op (alltoall_dedup's index_add of the partial sums) downstream of the experts. Only
    downstream: the global_aux loss's all-reduce of the expert load is a wait of the layer too, but no
    combine."""
    experts = [n for n in nodes if moe(n).get("role") in EXPERT_ROLES]
    members, down, stack = set(nodes), set(), experts[:1]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in members and u not in down:
                down.add(u)
                stack.append(u)
    return [n for n in nodes if n in down and (
        n.target is mc.unpermute.default or schedule.is_wait(n)
        or (moe(n).get("role") == Role.COMBINE_COMM and not schedule.is_free(n)))]


@contextlib.contextmanager
def _chunk(graph: fx.Graph, c: int, layer: str) -> Iterator[None]:
    """Stamp ``chunk = c`` (and the layer) on every node created inside the block."""
    before = set(graph.nodes)
    yield
    for n in graph.nodes:
        if n not in before:
            meta = n.meta.setdefault("moe", {})
            meta.setdefault("layer", layer)
            meta["chunk"] = c


def _bounds(T: int, n: int) -> list[tuple[int, int]]:
    """n near-equal [lo, hi) ranges of T."""
    cuts = [c * T // n for c in range(n + 1)]
    return list(zip(cuts, cuts[1:]))


def _relabel(node: fx.Node, c: int) -> None:
    """Name the chunk in a wait's failure label ('<layer>: dispatch' -> '<layer>: dispatch (chunk c)')."""
    i = 3 if node.target in schedule.ASYNC_WAITS else 1
    if schedule.is_wait(node) and len(node.args) > i and isinstance(node.args[i], str):
        node.update_arg(i, f"{node.args[i]} (chunk {c})")


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(nodes, key=lambda n: -order.get(n, -1)):
        if n.graph is graph and n in order and not n.users and n.op == "call_function":
            graph.erase_node(n)


def _chunk_meta(m: fx.Node, share: float) -> dict:
    """``m``'s moe entry for a chunk holding ``share`` of the tokens: the counts that stand for the whole
    batch's tokens (TOKEN_COUNTS) scaled to the chunk's."""
    meta = {**m.meta.get("moe", {})}
    for key in TOKEN_COUNTS:
        if key in meta:
            meta[key] = meta[key] * share  # readers take int(): the chunks' shares add up to the whole
    return meta


def chunk_tokens(gm: fx.GraphModule, layer: MoELayer, n: int) -> str | None:
    """Split the layer's section into ``n`` token ranges; returns why not, or None when done."""
    graph = gm.graph
    T = layer.x_TH.meta["val"].shape[0]
    if not isinstance(T, int):
        return f"the token count {T} is symbolic"
    if n > T:
        return f"{n} chunks but only {T} tokens"
    dag = schedule.dependency_graph(graph)
    sources = (layer.x_TH, *layer.routed)
    down = set().union(*(nx.descendants(dag, s) for s in sources))
    before = set().union(*(nx.ancestors(dag, s) for s in sources))  # the router: computed once, for all chunks
    region = ((down & nx.ancestors(dag, layer.sink)) | {layer.sink}) - before - set(sources)
    order = [m for m in graph.nodes if m in region]
    live = nx.ancestors(dag, graph.output_node())
    loads, keep, dead = [], set(), []
    for m in order:
        for u in m.users:
            if u in region or m is layer.sink:
                continue
            if u not in live:  # feeds nothing the graph returns (an unused host-sync value): goes with m
                dead.append(u)
            elif m.target is mc.permute.default and u.target is operator.getitem and u.args[1] == 3:
                loads.append(u)
            else:
                keep.add(m)
    keep |= set().union(*(nx.ancestors(dag, m) & region for m in keep)) if keep else set()
    busy = [m.name for m in keep if not schedule.is_free(m)]
    if busy:
        return f"{', '.join(sorted(busy))} of the expert section is also read outside it"
    chunk_loads: list[list[fx.Node]] = [[] for _ in loads]
    outs = []
    with graph.inserting_before(layer.sink):
        for c, (lo, hi) in enumerate(_bounds(T, n)):
            with _chunk(graph, c, layer.name):
                env: dict[fx.Node, fx.Node] = {s: graph.call_function(aten.narrow.default, (s, 0, lo, hi - lo)) for s in sources}
                for m in order:
                    new = graph.node_copy(m, lambda a: env.get(a, a))
                    for key in ("val", "tensor_meta", "unbacked_bindings"):
                        new.meta.pop(key, None)
                    new.meta["moe"] = _chunk_meta(m, (hi - lo) / T)
                    _relabel(new, c)
                    env[m] = new
                for i, u in enumerate(loads):
                    chunk_loads[i].append(graph.call_function(operator.getitem, (env[u.args[0]], 3)))
                outs.append(env[layer.sink])
        y = graph.call_function(aten.cat.default, (outs, 0))
        y.meta["moe"] = {"layer": layer.name, "role": Role.COMBINE}
        for u, parts in zip(loads, chunk_loads):
            total = parts[0]
            for p in parts[1:]:
                total = graph.call_function(aten.add.Tensor, (total, p))
                total.meta["moe"] = {"layer": layer.name, "role": Role.PERMUTE}
            _replace_load(gm, layer.name, u, total)
            _move_readers_after(graph, total)  # global_aux's all-reduce of the load sat after the one permute
    layer.sink.replace_all_uses_with(y)
    _erase_dead(graph, [*dead, *loads, *order])
    return None


def _move_readers_after(graph: fx.Graph, node: fx.Node) -> None:
    """Move the nodes placed before ``node`` that read it (and, transitively, their readers) right after it,
    in their order: the graph stays topological when a value is rebuilt later than its readers."""
    marked, late = {node}, []
    for n in graph.nodes:
        if n is node:
            break
        if any(a in marked for a in n.all_input_nodes):
            marked.add(n)
            late.append(n)
    anchor = node
    for n in late:
        anchor.append(n)
        anchor = n


def _replace_load(gm: fx.GraphModule, layer: str, old: fx.Node, new: fx.Node) -> None:
    """Point every use of the expert load ``old`` (and the router stats' side output) at ``new``."""
    old.replace_all_uses_with(new)
    state = gm.meta.get("moe_side_outputs")
    if state and layer in state["side"] and old.name in state["side"][layer].values():
        by_name = {m.name: m for m in gm.graph.nodes}
        side = {k: (new if v == old.name else by_name[v]) for k, v in state["side"][layer].items()}
        add_side_outputs(gm, layer, side)


def chunk_slots(gm: fx.GraphModule, layer: MoELayer, n: int, P: int, group: str) -> str | None:
    """Static all-to-all: split every expert's C capacity slots into ``n`` ranges (one permute)."""
    graph, permute, unpermute = gm.graph, layer.permute, layer.unpermute
    if permute is None or unpermute is None:
        return "no permute -> experts -> unpermute section (allgather dispatcher)"
    outs = {u.args[1]: u for u in permute.users if u.target is operator.getitem}
    experts = layer.experts
    E, C = layer.info["num_experts"], int(permute.args[4])
    x_in, sizes = experts[0].args[0], experts[0].args[2]
    if n > C:
        return f"{n} chunks but only {C} capacity slots per expert"
    if 0 not in outs or 1 not in outs or 2 not in outs or not all(isinstance(a, fx.Node) for a in (x_in, sizes)):
        return "the permute's rows or group sizes are not where the static all-to-all puts them"
    L, H = E // P, int(outs[0].meta["val"].shape[1])
    section, y_old = set(experts), unpermute.args[0]
    em = Emit(gm, Block(layer.name, layer.info, permute, outs, experts, unpermute), group)
    w_arrived = row_weights_of(experts)  # the glu applies the routing weights: they travel with the rows
    packed = x_in.target is operator.getitem and x_in.args[0].target is mc.unpack_row_weights.default
    parts = []
    with em.at(unpermute):
        x_ECH = em(Role.DISPATCH, aten.view.default, outs[0], [E, C, H])
        if w_arrived is not None:
            w_src = em.row_weights(Role.PERMUTE, outs[1], permute.args[2], anchor=unpermute)
            w_EC = em(Role.DISPATCH, aten.view.default, w_src, [E, C])
        for c, (lo, hi) in enumerate(_bounds(C, n)):
            Cc = hi - lo
            with _chunk(graph, c, layer.name):
                x_c = em(Role.DISPATCH, aten.reshape.default, em(Role.DISPATCH, aten.slice.Tensor, x_ECH, 1, lo, hi), [E * Cc, H])
                w_c = None if w_arrived is None else em(
                    Role.DISPATCH, aten.reshape.default, em(Role.DISPATCH, aten.slice.Tensor, w_EC, 1, lo, hi), [E * Cc])
                arrived_x, arrived_w = dispatch_rows(
                    em, x_c, w_c, H, [L * Cc] * P, [L * Cc] * P,
                    lambda t, width: _swap_blocks(em, Role.DISPATCH, t, P, L, Cc, width), packed, f" (chunk {c})")
                env: dict[Any, fx.Node] = {
                    x_in: arrived_x,
                    sizes: em(Role.DISPATCH, aten.new_full.default, outs[2], [L], P * Cc),
                }
                if w_arrived is not None:
                    env[w_arrived] = arrived_w
                for m in experts:
                    new = graph.node_copy(m, lambda a: env.get(a, a) if a in env or a in section else a)
                    new.meta.pop("val", None)
                    new.meta["moe"] = {**m.meta.get("moe", {})}
                    env[m] = new
                back = _swap_blocks(em, Role.COMBINE_COMM, env[experts[-1]], L, P, Cc, H)
                y_c = em.collective(ALL_TO_ALL, back, [L * Cc] * P, [L * Cc] * P, what=f"combine (chunk {c})")
                parts.append(em(Role.COMBINE_COMM, aten.view.default, y_c, [E, Cc, H]))
        y_NH = em(Role.COMBINE_COMM, aten.reshape.default, em(Role.COMBINE_COMM, aten.cat.default, parts, 1), [E * C, H])
    old = [m for m in layer.nodes if m not in (permute, unpermute, *outs.values()) and m.op == "call_function"]
    unpermute.replace_input_with(y_old, y_NH)
    _erase_dead(graph, old)
    return None
