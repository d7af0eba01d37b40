"""Text for people: the ranked table and, for ``--explain``, every term of an estimate."""

from __future__ import annotations

from typing import Any

from ..costs import human
from .cluster import GiB
from .cost_model import Estimate


def _ms(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:,.1f} us"
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.2f} s"


def table(report: Any, top: int = 5) -> str:
    """The top plans that fit, then the closest plans that did not, one line each."""
    lines = [f"{report.profile.summary()}",
             f"cluster: {report.cluster.describe()}",
             f"global batch {report.global_batch} x seq {report.profile.seq_len}", ""]
    w = max([58] + [len(e.candidate.describe()) for e in report.ranked[:top]])
    head = f"{'#':>2}  {'plan':<{w}} {'step':>10} {'tok/s/GPU':>10} {'TFLOP/s/GPU':>11} {'mem/GPU':>9}"
    if report.ranked:
        lines += ["plans that fit (fastest first):", head]
        for i, e in enumerate(report.ranked[:top], 1):
            lines.append(f"{i:>2}  {e.candidate.describe():<{w}} {_ms(e.step_s):>10} {e.tokens_per_s_per_gpu:>10,.0f} "
                         f"{e.tflops_per_gpu:>11,.1f} {human(e.memory_bytes, 'B', 1024):>9}")
        lines.append("")
        lines.append("breakdown of #1: " + ", ".join(f"{t.name} {_ms(t.value)}" for t in report.ranked[0].terms
                                                    if t.counted and t.value > 0))
    else:
        lines.append("no plan fits in memory.")
    if report.rejected:
        lines += ["", f"rejected ({len(report.rejected)}; closest to fitting first):"]
        shown: set[str] = set()
        for e, why in report.rejected:
            if why in shown:
                continue
            shown.add(why)
            lines.append(f"    {e.candidate.describe()}: {why}")
            if len(shown) == 3:
                break
    if report.skipped:
        lines += ["", "not enumerated:"] + [f"    {s}" for s in report.skipped[:8]]
        if len(report.skipped) > 8:
            lines.append(f"    ... and {len(report.skipped) - 8} more")
    if report.notes:
        lines += ["", "notes:"] + [f"    {n}" for n in report.notes]
    return "\n".join(lines)


def explain(est: Estimate) -> str:
    """Every time and memory term of one estimate, with how it was computed."""
    c = est.cluster
    lines = [f"plan: {est.candidate.describe()}",
             f"cluster: {c.describe()}",
             f"  efficiencies: GEMM {c.gemm_efficiency}, HBM {c.hbm_efficiency}, links {c.link_efficiency}; "
             f"usable memory {c.usable_memory_fraction}" + (f"; source: {c.source}" if c.source else ""),
             "step time per rank:"]
    width = max(len(t.name) for t in est.terms + est.memory)
    for t in est.terms:
        mark = "" if t.counted else " (not counted)"
        lines.append(f"  {t.name:<{width}} {_ms(t.value):>11}{mark}  {t.detail}")
    lines.append(f"  {'= step':<{width}} {_ms(est.step_s):>11}  -> {est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
                 f"{est.tflops_per_gpu:,.0f} model TFLOP/s/GPU")
    lines.append("memory per rank:")
    for t in est.memory:
        mark = "" if t.counted else " (not counted)"
        lines.append(f"  {t.name:<{width}} {human(t.value, 'B', 1024):>11}{mark}  {t.detail}")
    verdict = "fits" if est.memory_bytes <= c.usable_memory else "does NOT fit"
    lines.append(f"  {'= total':<{width}} {human(est.memory_bytes, 'B', 1024):>11}  {verdict} in "
                 f"{c.usable_memory / GiB:.1f} GiB usable")
    if est.host_bytes:
        verdict = "fits" if est.host_fits else "does NOT fit"
        lines.append(f"  {'= host':<{width}} {human(est.host_bytes, 'B', 1024):>11}  {verdict} in "
                     f"{c.usable_host_memory / GiB:.1f} GiB of host memory usable per GPU")
    return "\n".join(lines)
