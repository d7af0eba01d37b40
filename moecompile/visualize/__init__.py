"""``moecompile.visualize``: draw the graph after any pass, as interactive HTML or graphviz.

    mc.visualize(result, "graph.html")                         # after the last pass
    mc.visualize(result, "upcycle.svg", after="upcycle", layer=0)
    mc.visualize(gm, "graph.dot", collapse=["model.layers.1"])

``.html`` is one self-contained page (no network); ``.svg`` / ``.png`` go through the system
``dot``, ``.dot`` is the graphviz source. Nodes the chosen pass added are outlined in red.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any, Iterable

import torch.fx as fx

from ..errors import MoecompileError
from ..history import PassRecord
from .model import OP_COLORS, ROLE_COLORS, GraphView, build_view, color_of, layer_groups, overlap_notes

__all__ = ["OP_COLORS", "ROLE_COLORS", "GraphView", "build_view", "color_of", "layer_groups", "visualize", "resolve"]

FORMATS = ("html", "svg", "png", "dot", "gv")


def resolve(result_or_gm: Any, after: str | None = None) -> tuple[fx.Graph, str, PassRecord | None, PassRecord | None]:
    """(graph, title, record, previous record) for a ConversionResult / history / PassRecord / GraphModule / Graph."""
    history = getattr(result_or_gm, "history", None)
    if history is None and isinstance(result_or_gm, list) and all(isinstance(r, PassRecord) for r in result_or_gm):
        history = result_or_gm
    if history is not None:
        names = [r.name for r in history]
        if not names:
            raise MoecompileError("the history is empty: nothing to draw")
        name = after or names[-1]
        if name not in names:
            raise MoecompileError(f"after={name!r}: no such pass ran; ran: {', '.join(names)}")
        i = names.index(name)
        rec = history[i]
        if rec.graph is None:
            raise MoecompileError(f"the record of {name!r} holds no graph copy to draw")
        return rec.graph, f"after {name}", rec, history[i - 1] if i else None
    if after is not None:
        raise MoecompileError("after= picks a pass of a ConversionResult; a GraphModule or Graph is drawn as it is")
    if isinstance(result_or_gm, PassRecord):
        if result_or_gm.graph is None:
            raise MoecompileError(f"the record of {result_or_gm.name!r} holds no graph copy to draw")
        return result_or_gm.graph, f"after {result_or_gm.name}", result_or_gm, None
    if isinstance(result_or_gm, fx.GraphModule):
        return result_or_gm.graph, type(result_or_gm).__name__, None, None
    if isinstance(result_or_gm, fx.Graph):
        return result_or_gm, "graph", None, None
    raise MoecompileError(
        f"can't draw a {type(result_or_gm).__name__}; pass a ConversionResult, its history, a PassRecord, "
        "an fx.GraphModule or an fx.Graph"
    )


def _new_names(rec: PassRecord | None, prev: PassRecord | None) -> set[str]:
    if rec is None or prev is None or rec.graph is None or prev.graph is None:
        return set()
    before = {(n.name, str(n.target)) for n in prev.graph.nodes}
    return {n.name for n in rec.graph.nodes if (n.name, str(n.target)) not in before}


def _about(rec: PassRecord | None, view: GraphView, new: set[str]) -> list[str]:
    if rec is None:
        return [f"{len(view.nodes)} nodes"]
    from ..costs import graph_costs, human

    lines = [f"pass: {rec.name}", f"{rec.num_nodes} nodes, {len(new)} added by this pass", f"{human(rec.num_params)} parameters"]
    if rec.graph is not None:
        c = graph_costs(rec.graph, rec.subgraphs)
        lines.append(f"{human(c.flops_per_token, 'FLOP')} per token (forward), {human(c.activation_bytes, 'B', 1024)} activations")
        if c.collectives:
            lines.append(f"{c.collectives} collectives, {human(c.comm_bytes_step, 'B', 1024)} per step")
    lines += [f"wall time {rec.wall_s * 1e3:.1f} ms"]
    from ..report import format_data

    return lines + format_data(rec.data)


def visualize(
    result_or_gm: Any,
    path: str | Path,
    after: str | None = None,
    layer: str | int | None = None,
    *,
    collapse: Iterable[str] = (),
    title: str | None = None,
) -> Path:
    """Draw the graph after pass ``after`` (default: the last) to ``path`` (.html/.svg/.png/.dot).

    ``layer`` keeps one module subtree: a module path (``"model.layers.3"``) or the index of
    a repeating block (``3``), with the nodes just outside it that feed or use it.
    ``collapse`` lists module paths drawn as one box (the HTML lets you toggle them).
    """
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise MoecompileError(f"can't tell the format of {path.name!r}; end it in one of .{', .'.join(FORMATS)}")
    graph, default_title, rec, prev = resolve(result_or_gm, after)
    new = _new_names(rec, prev)
    notes = overlap_notes(rec.data) if rec is not None else {}
    view = build_view(graph, title or default_title, new_names=new, layer=layer, collapse=collapse, notes=notes)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "html":
        from .html import render_html

        return render_html(view, path, about=_about(rec, view, new), decisions=rec.decisions if rec else ())
    from .dot import render_dot

    return render_dot(view, path)


class _CallableModule(types.ModuleType):
    """``moecompile.visualize`` is this package *and* the function: ``mc.visualize(result, "g.html")``
    calls :func:`visualize`, while ``import moecompile.visualize.model`` still finds the submodule
    (exporting the function under the package's own name would hide the package)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Path:
        return visualize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
