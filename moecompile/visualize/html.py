"""One self-contained HTML file per graph: data, script and style inline, nothing fetched.

The page (script in ``assets/graph.js``): the graph top to bottom, module groups that
collapse and expand on click, nodes coloured by role, a search box (text, or
``role:experts``), a layer selector, and a side panel with the clicked node's op,
target, shapes, dtype and ``meta["moe"]``. Opening it needs only a browser.
"""

from __future__ import annotations

import html
from importlib import resources
from pathlib import Path
from typing import Iterable

from .model import GraphView

_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
<div id="bar">
  <h1>{title}</h1>
  <input id="search" type="search" placeholder="search nodes (name, op, role:experts)" autocomplete="off">
  <span id="search-count"></span>
  <label>layer <select id="layer"><option value="-1">all layers</option></select></label>
  <button id="expand-all" type="button">expand all</button>
  <button id="collapse-layers" type="button">collapse layers</button>
  <button id="fit" type="button">fit</button>
  <label><input id="mark-new" type="checkbox" checked> mark nodes this pass added</label>
  <span id="visible-count"></span>
</div>
<div id="main">
  <div id="canvas">
    <svg id="graph" xmlns="http://www.w3.org/2000/svg">
      <defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">
        <path d="M 0 0 L 10 5 L 0 10 z" fill="#9ca3af"/></marker></defs>
      <g id="viewport"></g>
    </svg>
  </div>
  <div id="side">
    <div id="panel"><p>Click a node to see its op, shapes, dtype and <code>meta["moe"]</code>.
      Click a group's title to collapse it, a collapsed group to expand it. Drag to pan, scroll to zoom.</p></div>
    {about}
    <h3>roles</h3>
    <div id="legend"></div>
  </div>
</div>
<script type="application/json" id="graph-data">{data}</script>
<script>
{js}
</script>
</body>
</html>
"""


def _asset(name: str) -> str:
    return resources.files("moecompile.visualize").joinpath("assets", name).read_text(encoding="utf-8")


def _about(lines: Iterable[str], decisions: Iterable[str]) -> str:
    lines, decisions = list(lines), list(decisions)
    if not lines and not decisions:
        return ""
    out = ['<div id="about"><h3>this pass</h3><ul>']
    out += [f"<li>{html.escape(line)}</li>" for line in lines]
    out.append("</ul>")
    if decisions:
        out.append('<h3>decisions</h3><ul id="decisions">')
        out += [f"<li>{html.escape(d)}</li>" for d in decisions]
        out.append("</ul>")
    out.append("</div>")
    return "\n".join(out)


def render_html(view: GraphView, path: Path, about: Iterable[str] = (), decisions: Iterable[str] = ()) -> Path:
    """Write the interactive page for ``view`` to ``path``."""
    page = _TEMPLATE.format(
        title=html.escape(view.title), css=_asset("graph.css"), js=_asset("graph.js"),
        data=view.to_json(), about=_about(about, decisions),
    )
    path.write_text(page, encoding="utf-8")
    return path
