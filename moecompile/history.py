"""What every pass did: a snapshot of the graph after it, and what it decided."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch.fx as fx

from .graph import count_parameters


@dataclasses.dataclass
class PassRecord:
    """One row of ``result.history``."""

    name: str
    changed: bool
    wall_s: float
    code: str  # the graph's generated Python after the pass
    num_nodes: int
    num_params: int
    op_counts: dict[str, int]  # call_function target -> count
    decisions: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)  # structured facts for tools (report, viz)
    graph: fx.Graph | None = dataclasses.field(default=None, repr=False)  # a copy, for diff / visualize
    # call_module target -> (the module's memory_region or class name, {submodule path: graph copy}) for
    # called modules holding fx graphs (e.g. recompute regions), so costs can look inside them
    subgraphs: dict[str, tuple[str, dict[str, fx.Graph]]] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def nodes(self) -> int:
        return self.num_nodes


def snapshot(name: str, gm: fx.GraphModule, changed: bool, wall_s: float, decisions: list[str], data: dict) -> PassRecord:
    ops = collections.Counter(_op_name(n) for n in gm.graph.nodes if n.op == "call_function")
    graph_copy = fx.Graph()
    graph_copy.output(graph_copy.graph_copy(gm.graph, {}))  # node_copy keeps each node's meta
    return PassRecord(
        name=name,
        changed=changed,
        wall_s=wall_s,
        code=gm.code,
        num_nodes=len(gm.graph.nodes),
        num_params=count_parameters(gm),
        op_counts=dict(ops),
        decisions=list(decisions),
        data=dict(data),
        graph=graph_copy,
        subgraphs=_subgraphs(gm),
    )


def _copy(graph: fx.Graph) -> fx.Graph:
    g = fx.Graph()
    g.output(g.graph_copy(graph, {}))
    return g


def _subgraphs(gm: fx.GraphModule) -> dict[str, tuple[str, dict[str, fx.Graph]]]:
    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_module" or n.target in out:
            continue
        try:
            module = gm.get_submodule(str(n.target))
        except AttributeError:
            continue
        graphs = {path: _copy(m.graph) for path, m in module.named_modules() if isinstance(m, fx.GraphModule)}
        if graphs:
            out[str(n.target)] = (str(getattr(module, "memory_region", type(module).__name__)), graphs)
    return out


def _op_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", None) if not hasattr(target, "_schema") else str(target)  # type: ignore[return-value]
