"""``moecompile.schedule``: dependency analysis and legal reordering of an fx graph, on networkx.

The core IR analysis a scheduling pass needs, kept apart from any one pass::

    dag = dependency_graph(gm.graph)                 # edge a -> b: b must run after a
    order = list_schedule(dag, window, priority)     # a topological order of a contiguous window
    reorder(gm.graph, window, order)                 # the graph's node list becomes that order
    check_schedule(gm.graph)                         # [] when legal, else what is wrong

Edges are the data dependencies plus the orderings values don't show: nodes that mutate an
input or draw random numbers keep their relative order (a reorder must not change what they
read or the RNG stream), and grad-mode / autocast / profiler switches are barriers no node
crosses. A legal schedule is a topological order in which every collective start is read only
by its one wait (so no use of a collective's result precedes its wait).
"""

from __future__ import annotations

import heapq
import operator
from typing import Any, Callable, Iterable

import networkx as nx
import torch
import torch.fx as fx

import moecompile.kernels  # noqa: F401  (defines torch.ops.moecompile.a2a_start / a2a_wait)

from . import distributed

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
ASYNC_STARTS = (torch.ops.moecompile.a2a_start.default,)
ASYNC_WAITS = (torch.ops.moecompile.a2a_wait.default,)
_BARRIERS = {
    torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast,
}
# Nodes that only describe a value (no work): left out when listing what a collective overlaps.
FREE_TARGETS = {
    operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv,
    torch.ops.aten.sym_size.int, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default, torch.ops.aten.t.default, torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim,
    torch.ops.aten.expand.default, torch.ops.aten.alias.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.narrow.default, torch.ops.aten.select.int, torch.ops.aten.detach.default,
    torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten.unbind.int,
}


def is_wait(n: fx.Node) -> bool:
    return n.op == "call_function" and (n.target in distributed.WAITS or n.target in ASYNC_WAITS)


def is_start(n: fx.Node) -> bool:
    """A collective start: torch's functional collectives (waits excluded) or ``moecompile.a2a_start``."""
    if n.op != "call_function":
        return False
    t = n.target
    if t in ASYNC_STARTS:
        return True
    return isinstance(t, torch._ops.OpOverload) and t.namespace in _COLLECTIVE_NAMESPACES and not is_wait(n)


def is_free(n: fx.Node) -> bool:
    """No work of its own (metadata, views, placeholders, attributes)."""
    return n.op != "call_function" or n.target in FREE_TARGETS


def _kind(n: fx.Node) -> str:
    """'barrier', 'ordered' (mutates or draws random numbers) or '' (free to move)."""
    if n.op != "call_function":
        return ""
    t = n.target
    if t in _BARRIERS or getattr(t, "__module__", "").startswith("torch.autograd.profiler"):
        return "barrier"
    if isinstance(t, torch._ops.OpOverload):
        if t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags:
            return "ordered"
    return ""


def dependency_graph(graph: fx.Graph, window: list[fx.Node] | None = None) -> nx.DiGraph:
    """Every node of ``graph`` (or of a contiguous ``window`` of it: enough to reorder that
    window, since nothing outside it moves); an edge a -> b whenever b must run after a."""
    dag = nx.DiGraph()
    nodes = list(graph.nodes) if window is None else list(window)
    inside = set(nodes) if window is not None else None
    dag.add_nodes_from(nodes)
    for n in nodes:
        dag.add_edges_from((a, n) for a in n.all_input_nodes if inside is None or a in inside)
    last_ordered: fx.Node | None = None
    segment: list[fx.Node] = []  # nodes since the last barrier
    barrier: fx.Node | None = None
    for n in nodes:
        kind = _kind(n)
        if kind == "barrier":
            dag.add_edges_from((m, n) for m in segment)
            segment, barrier, last_ordered = [], n, n
            continue
        if barrier is not None:
            dag.add_edge(barrier, n)
        if kind == "ordered":
            if last_ordered is not None:
                dag.add_edge(last_ordered, n)
            last_ordered = n
        segment.append(n)
    return dag


def list_schedule(dag: nx.DiGraph, window: list[fx.Node], priority: Callable[[fx.Node], Any]) -> list[fx.Node]:
    """A topological order of ``window`` (contiguous in the graph) that always runs, among the
    nodes whose inputs are ready, the one with the smallest ``priority`` (ties: original order).

    Deterministic (no hashing of nodes decides anything), so every rank of a group computes the
    same order and issues its collectives in the same sequence.
    """
    inside = set(window)
    pos = {n: i for i, n in enumerate(window)}
    missing = {n: sum(1 for p in dag.predecessors(n) if p in inside) for n in window}
    keys = {n: (priority(n), pos[n]) for n in window}
    ready = [keys[n] for n in window if missing[n] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        n = window[heapq.heappop(ready)[1]]
        order.append(n)
        for s in sorted((s for s in dag.successors(n) if s in inside), key=pos.__getitem__):
            missing[s] -= 1
            if missing[s] == 0:
                heapq.heappush(ready, keys[s])
    if len(order) != len(window):
        stuck = [n.name for n in window if n not in set(order)][:5]
        raise ValueError(f"the window's dependencies form a cycle or leave it (stuck at {stuck})")
    return order


def reorder(graph: fx.Graph, window: list[fx.Node], order: list[fx.Node]) -> None:
    """Make the contiguous ``window`` of ``graph`` run in ``order`` (a permutation of it)."""
    assert set(order) == set(window) and len(order) == len(window), "order must permute the window"
    anchor = window[0].prev
    for n in order:
        anchor.append(n)
        anchor = n


def check_schedule(graph: fx.Graph, nodes: Iterable[fx.Node] | None = None) -> list[str]:
    """What makes the graph's order illegal: an input used before it is computed, a collective
    start read by anything but its single wait, a wait on something that isn't a start."""
    problems: list[str] = []
    pos = {n: i for i, n in enumerate(graph.nodes)}
    for n in graph.nodes if nodes is None else nodes:
        for a in n.all_input_nodes:
            if pos.get(a, len(pos)) >= pos[n]:
                problems.append(f"{n.name} uses {a.name} before it is computed")
        if is_wait(n):
            src = n.args[0]
            if not (isinstance(src, fx.Node) and is_start(src)):
                problems.append(f"{n.name} waits on {getattr(src, 'name', src)}, which is not a collective start")
        elif is_start(n):
            waits = [u for u in n.users if is_wait(u)]
            others = sorted(u.name for u in n.users if not is_wait(u))
            if len(waits) != 1:
                problems.append(f"collective {n.name} has {len(waits)} waits (needs exactly one)")
            if others:
                problems.append(f"the result of collective {n.name} is used before its wait by {', '.join(others)}")
    return problems


def collective_pairs(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """(start, wait) of every collective, in the order the starts run."""
    return [(n, w) for n in graph.nodes if is_start(n) for w in n.users if is_wait(w)]


def between(graph: fx.Graph, first: fx.Node, last: fx.Node) -> list[fx.Node]:
    """The nodes strictly between ``first`` and ``last`` in the graph's order."""
    out, n = [], first.next
    while n is not last and n.op != "root":
        out.append(n)
        n = n.next
    return out
