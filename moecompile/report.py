"""``result.report()``: one table of what every pass did, and what it decided.

Per pass: nodes (added / removed), parameters, forward FLOPs per token, activation
bytes, communication bytes per step, wall time; under the table, each pass's
decisions (``ctx.decide``) and the structured facts it recorded (``ctx.record``).
Rendered with ``rich`` when stdout is a terminal, as plain text otherwise, or as
Markdown (``style="markdown"``, what ``moecompile inspect`` writes to report.md).
"""

from __future__ import annotations

import dataclasses
import io
import os
import reprlib
import shutil
import sys
from typing import Any, Iterable, Literal

import torch
import torch.fx as fx

from .costs import GraphCosts, graph_costs, human
from .errors import MoecompileError
from .history import PassRecord

Style = Literal["rich", "plain", "markdown"]

NOTES = (
    "FLOPs: forward pass, matmul-class ops (as torch.utils.flop_counter counts them), per token of the example batch. "
    "Activations: bytes of the tensors the forward materialises (views and recomputed nodes excluded). "
    "Comm/step: payload of the graph's functional collectives, x2 for their backward mirrors."
)
ESTIMATE_NOTE = (
    "~: an estimate: data-dependent expert rows (dropless dispatch) taken as the rows the layer sends "
    "(balanced routing), or an op whose cost could not be read."
)


def notes(rows: list[PassRow]) -> str:
    rough = any(r.costs is not None and (r.costs.approximate or r.costs.estimated) for r in rows)
    return NOTES + (" " + ESTIMATE_NOTE if rough else "")


@dataclasses.dataclass
class PassRow:
    """One pass, as the report shows it."""

    name: str
    changed: bool
    nodes: int
    added: int
    removed: int
    params: int
    params_delta: int
    costs: GraphCosts | None
    wall_s: float
    decisions: list[str]
    data: dict[str, Any]

    @property
    def flops_per_token(self) -> float | None:
        return None if self.costs is None else self.costs.flops_per_token


def _node_keys(graph: fx.Graph | None) -> set[tuple[str, str]]:
    return set() if graph is None else {(n.name, str(n.target)) for n in graph.nodes}


def _history(result_or_history: Any) -> list[PassRecord]:
    history = getattr(result_or_history, "history", result_or_history)
    return list(history)


def report_rows(result_or_history: Any) -> list[PassRow]:
    """The report's rows: a ConversionResult or its ``history`` in, one PassRow per record out."""
    rows: list[PassRow] = []
    prev_keys: set[tuple[str, str]] | None = None
    prev_params: int | None = None
    for rec in _history(result_or_history):
        keys = _node_keys(rec.graph)
        added = len(keys - prev_keys) if prev_keys is not None else 0
        removed = len(prev_keys - keys) if prev_keys is not None else 0
        rows.append(PassRow(
            name=rec.name, changed=rec.changed, nodes=rec.num_nodes, added=added, removed=removed,
            params=rec.num_params, params_delta=0 if prev_params is None else rec.num_params - prev_params,
            costs=graph_costs(rec.graph, getattr(rec, "subgraphs", None)) if rec.graph is not None else None,
            wall_s=rec.wall_s,
            decisions=list(rec.decisions), data=dict(rec.data),
        ))
        prev_keys, prev_params = keys, rec.num_params
    return rows


_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict = 80, 80, 8, 8


def format_value(value: Any, limit: int = 8) -> str:
    """A short, readable rendering of whatever a pass recorded (lists, dicts, tensors, numbers)."""
    if isinstance(value, torch.Tensor):
        if value.numel() <= limit:
            return f"{[round(v, 4) if isinstance(v, float) else v for v in value.flatten().tolist()]}"
        return f"tensor{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, (list, tuple, set)):
        items = [format_value(v, limit) for v in value]
        more = f", ... (+{len(items) - limit} more)" if len(items) > limit else ""
        return ", ".join(items[:limit]) + more if items else "(none)"
    if isinstance(value, dict):
        items = [f"{k}={format_value(v, limit)}" for k, v in value.items()]
        more = f", ... (+{len(items) - limit} more)" if len(items) > limit else ""
        return "; ".join(items[:limit]) + more if items else "(none)"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (str, int, bool)) or value is None:
        return str(value)
    return _repr.repr(value)


def format_data(data: dict[str, Any], width: int = 200) -> list[str]:
    """``key: value`` per recorded fact, each cut to ``width`` characters (the record keeps it all)."""
    lines = [f"{key}: {format_value(value)}" for key, value in data.items()]
    return [line if len(line) <= width else line[: width - 5] + " ..." for line in lines]


def _delta(value: int, text: str) -> str:
    return f" ({text})" if value else ""


def _cells(row: PassRow, first: bool) -> list[str]:
    c = row.costs
    nodes = str(row.nodes) if first else f"{row.nodes} (+{row.added}/-{row.removed})"
    params = human(row.params) + ("" if first else _delta(row.params_delta, ("+" if row.params_delta > 0 else "-") + human(abs(row.params_delta))))
    missing = "?"
    approx = "~" if c is not None and (c.approximate or c.estimated) else ""
    return [
        row.name + ("" if row.changed else " (no change)"),
        nodes,
        params,
        missing if c is None else approx + human(c.flops_per_token, "FLOP"),
        missing if c is None else approx + human(c.activation_bytes, "B", 1024),
        missing if c is None else (approx + human(c.comm_bytes_step, "B", 1024) if c.collectives else "-"),
        f"{row.wall_s * 1e3:.1f} ms",
    ]


HEADER = ["pass", "nodes (+/-)", "params", "FLOPs/token", "activations", "comm/step", "time"]


def _summary(rows: list[PassRow]) -> str:
    if not rows or rows[-1].costs is None:
        return ""
    first, last = rows[0], rows[-1]
    c0, c1 = first.costs, last.costs
    assert c1 is not None
    text = f"{c1.tokens} tokens in the example batch; {first.name} -> {last.name}: params {human(first.params)} -> {human(last.params)}"
    if c0 is not None and c0.flops_per_token:
        text += f", FLOPs/token x{c1.flops_per_token / c0.flops_per_token:.2f}"
    return text


def render_plain(rows: list[PassRow]) -> str:
    table = [HEADER] + [_cells(r, i == 0) for i, r in enumerate(rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER))]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [fmt(HEADER), "-" * len(fmt(HEADER))]
    for row, cells in zip(rows, table[1:]):
        out.append(fmt(cells))
        out.extend(f"    - {d}" for d in row.decisions)
        out.extend(f"    * {d}" for d in format_data(row.data))
    out += ["", _summary(rows), notes(rows)]
    return "\n".join(line for line in out if line is not None)


def render_markdown(rows: list[PassRow]) -> str:
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    out = ["# moecompile report", "", _summary(rows), "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(esc(c) for c in _cells(r, i == 0)) + " |" for i, r in enumerate(rows)]
    out += ["", f"_{notes(rows)}_", "", "## What each pass decided", ""]
    for row in rows:
        out.append(f"### {row.name}")
        out.append("")
        lines = row.decisions + [f"_{d}_" for d in format_data(row.data)]
        out.extend(f"- {esc(d)}" for d in lines or ["(nothing recorded)"])
        if row.costs is not None and row.costs.flops_by_role:
            parts = ", ".join(f"{k} {human(v / max(row.costs.tokens, 1), 'FLOP')}" for k, v in sorted(row.costs.flops_by_role.items()))
            out.append(f"- FLOPs/token by role: {parts}")
        out.append("")
    return "\n".join(out)


def render_rich(rows: list[PassRow], width: int | None = None) -> str:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.tree import Tree

    table = Table(title="moecompile: what every pass did", caption=escape(_summary(rows)), header_style="bold cyan")
    for i, h in enumerate(HEADER):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i < 3)
    for i, row in enumerate(rows):
        table.add_row(*(escape(c) for c in _cells(row, i == 0)), style=None if row.changed else "dim")
    tree = Tree("[bold]decisions[/bold]")
    for row in rows:
        branch = tree.add(f"[bold cyan]{escape(row.name)}[/bold cyan]")
        for d in row.decisions:
            branch.add(escape(d))
        for d in format_data(row.data):
            branch.add(f"[dim]{escape(d)}[/dim]")
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, highlight=False, width=width or shutil.get_terminal_size((120, 40)).columns)
    console.print(table)
    console.print(tree)
    console.print(f"[dim]{escape(notes(rows))}[/dim]")
    return buf.getvalue().rstrip("\n")


def _auto_style() -> Style:
    return "rich" if sys.stdout.isatty() and os.environ.get("TERM") != "dumb" else "plain"


def render_report(result_or_history: Any, style: Style | None = None) -> str:
    """The report as text: ``style`` rich (ANSI), plain, or markdown; by default rich on a terminal."""
    rows = report_rows(result_or_history)
    style = style or _auto_style()
    if style == "markdown":
        return render_markdown(rows)
    if style == "rich":
        return render_rich(rows)
    if style == "plain":
        return render_plain(rows)
    raise MoecompileError(f"unknown report style {style!r}; use 'rich', 'plain' or 'markdown'")


def rows_as_dicts(rows: Iterable[PassRow]) -> list[dict[str, Any]]:
    """JSON-ready rows (for tools that read the report programmatically)."""
    out = []
    for r in rows:
        d = {k: v for k, v in dataclasses.asdict(r).items() if k not in ("costs", "data")}
        d["data"] = {k: format_value(v) for k, v in r.data.items()}
        if r.costs is not None:
            d.update(flops_per_token=r.costs.flops_per_token, activation_bytes=r.costs.activation_bytes,
                     comm_bytes_step=r.costs.comm_bytes_step, tokens=r.costs.tokens)
        out.append(d)
    return out
