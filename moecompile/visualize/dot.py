"""SVG / PNG / DOT pictures through graphviz: ``pydot`` builds the graph, the system ``dot`` lays it out.

Same picture as the HTML: top to bottom, one cluster per module group (nested), nodes
filled by role. A collapsed group is drawn as one box. In the SVG each node is
``<g id="node-<fx name>" class="node">``, so tools and tests can find it by name.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from ..errors import MoecompileError
from .model import GraphView

log = logging.getLogger(__name__)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _visible_rep(view: GraphView) -> dict[int, str]:
    """Node id -> the DOT id it is drawn as (itself, or its outermost collapsed group)."""
    collapsed_root: dict[int, int | None] = {}
    for g in view.groups:  # parents precede children
        parent = collapsed_root.get(g.parent) if g.parent >= 0 else None
        collapsed_root[g.id] = parent if parent is not None else (g.id if g.collapsed else None)
    rep = {}
    for n in view.nodes:
        gid = collapsed_root.get(n.group)
        rep[n.id] = f"group_{gid}" if gid is not None else f"n{n.id}"
    return rep


def build_dot(view: GraphView):  # -> pydot.Dot
    try:
        import pydot
    except ImportError as e:
        raise MoecompileError("SVG/PNG/DOT output needs pydot: pip install 'moecompile[viz]'") from e
    graph = pydot.Dot(graph_type="digraph", rankdir="TB", compound="true", label=_quote(view.title), labelloc="t",
                      fontname="Helvetica", nodesep="0.25", ranksep="0.35", newrank="true")
    if len(view.nodes) > 300:
        # graphviz's network-simplex placement grows far worse than linearly with clusters and long
        # edges (767 nodes: minutes); one iteration each keeps big graphs to seconds
        graph.set("nslimit", "1")
        graph.set("nslimit1", "1")
    if len(view.nodes) > 1000:  # crossing minimisation next: 2,000 nodes still take minutes (layer= / collapse=)
        graph.set("mclimit", "0.1")
        graph.set("remincross", "false")
    graph.set_node_defaults(shape="box", style="filled,rounded", fontname="Helvetica", fontsize="10", height="0.3")
    graph.set_edge_defaults(color="#6b7280", arrowsize="0.6")
    rep = _visible_rep(view)
    containers: dict[int, object] = {0: graph}
    for g in view.groups[1:]:
        parent = containers.get(g.parent)
        if parent is None:  # inside a collapsed group: not drawn
            continue
        if g.collapsed:
            count = sum(1 for n in view.nodes if rep[n.id] == f"group_{g.id}")
            parent.add_node(pydot.Node(f"group_{g.id}", label=_quote(f"{g.label}\n({count} nodes, collapsed)"),
                                       fillcolor="#f3f4f6", style="filled,dashed", id=_quote(f"group-{g.path}")))
            continue
        cluster = pydot.Cluster(f"g{g.id}", label=_quote(g.label), style="rounded,filled", color="#9ca3af",
                                fillcolor="#f8fafc" if g.depth % 2 else "#eef2f7", fontsize="10", labeljust="l",
                                id=_quote(f"cluster-{g.path}"))
        parent.add_subgraph(cluster)
        containers[g.id] = cluster
    for n in view.nodes:
        if rep[n.id] != f"n{n.id}":
            continue
        label = n.label + (f"\n{n.detail}" if n.detail else "")
        attrs = dict(label=_quote(label), fillcolor=n.color, fontcolor=n.ink, tooltip=_quote(f"{n.name}: {n.target}"),
                     id=_quote(f"node-{n.name}"))
        if n.new:
            attrs.update(penwidth="2.5", color="#dc2626")
        if n.recompute or n.external:
            attrs["style"] = "filled,rounded,dashed"
        containers[n.group].add_node(pydot.Node(f"n{n.id}", **attrs))
    seen = set()
    for src, dst in view.edges:
        a, b = rep[src], rep[dst]
        if a != b and (a, b) not in seen:
            seen.add((a, b))
            graph.add_edge(pydot.Edge(a, b))
    return graph


def render_dot(view: GraphView, path: Path) -> Path:
    """Write ``path`` as .dot (text), .svg or .png (through the system ``dot``)."""
    graph = build_dot(view)
    fmt = path.suffix.lstrip(".").lower()
    if fmt in ("dot", "gv"):
        path.write_text(graph.to_string())
        return path
    drawn = len(set(_visible_rep(view).values()))
    if drawn > 1000:
        log.warning("graphviz lays out %d nodes slowly (minutes for a few thousand): draw one layer (layer=), "
                    "collapse groups (collapse=), or write .html", drawn)
    if shutil.which("dot") is None:
        raise MoecompileError(
            f"writing {path.name} needs graphviz's `dot` on PATH (Debian: apt-get install graphviz); "
            "or write .html (no dependencies) or .dot"
        )
    try:
        data = graph.create(prog="dot", format=fmt)
    except Exception as e:
        raise MoecompileError(f"graphviz failed to render {path.name}: {e}") from e
    path.write_bytes(data)
    return path
