"""``result.report()``: one table of what every pass did."""

from __future__ import annotations

from typing import Any


def render_report(result: Any) -> str:
    """Plain-text table: pass, nodes (+/-), parameters, wall time, and the pass's decisions."""
    rows = []
    prev_nodes = None
    for rec in result.history:
        delta = "" if prev_nodes is None else f"{rec.num_nodes - prev_nodes:+d}"
        rows.append((rec.name, f"{rec.num_nodes} ({delta})" if delta else str(rec.num_nodes), f"{rec.num_params:,}", f"{rec.wall_s * 1e3:.1f} ms"))
        prev_nodes = rec.num_nodes
    header = ("pass", "nodes", "params", "time")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "-" * len(line)]
    for rec, row in zip(result.history, rows):
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)))
        out.extend(f"    - {d}" for d in rec.decisions)
    return "\n".join(out)
