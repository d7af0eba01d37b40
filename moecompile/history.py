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
    )


def _op_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", None) if not hasattr(target, "_schema") else str(target)  # type: ignore[return-value]
