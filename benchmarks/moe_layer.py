"""One MoE layer, forward+backward, moecompile against the peers and against the machine's GEMM ceiling.

Every implementation gets the same weights and tokens (generated in float64 from a seed
inside its own worker process, then mapped into its parameter layout). The parent spawns
one worker per (implementation, config, dtype) so peers do not disturb each other, runs
several rounds, and reports the median over rounds with the min..max spread.

    python benchmarks/moe_layer.py --quick                 # smoke run, small shapes
    python benchmarks/moe_layer.py --configs base --dtypes fp32 bf16 --rounds 3
    python benchmarks/moe_layer.py --configs fine --interleave --impls moecompile hf_qwen3_grouped_mm  # A/B in one process
    python benchmarks/moe_layer.py --worker moecompile --config base --dtype bf16   # one JSON line

FLOPs counted for every row are the useful ones: router + expert GEMMs of T*k routed tokens,
forward and backward (3x forward). "ceil%" is that FLOP count timed at the best GEMM rate this
machine reaches in that dtype (max of torch.mm and oneDNN mkldnn_linear on the layer's shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers import BUILDERS, REFERENCES, Unavailable, make_weights  # noqa: E402

CONFIGS = {
    "base": dict(H=512, F=1024, E=8, k=2, T=4096),
    "fine": dict(H=1024, F=256, E=64, k=8, T=4096),
    "long": dict(H=512, F=1024, E=8, k=2, T=16384),
    "quick": dict(H=64, F=128, E=8, k=2, T=256),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LIMIT = "gemm_ceiling"


def flops(c: dict) -> float:
    """Useful forward+backward FLOPs: expert GEMMs on T*k rows (H->2F, F->H) and the router."""
    fwd = 2 * c["T"] * c["k"] * (c["H"] * 2 * c["F"] + c["F"] * c["H"]) + 2 * c["T"] * c["H"] * c["E"]
    return 3.0 * fwd


def _time(fn, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def gemm_ceiling(c: dict, dtype: torch.dtype, warmup: int, iters: int) -> dict:
    """Best GFLOP/s of torch.mm and oneDNN linear on the layer's GEMM shapes (fwd and the two bwd forms).

    In bf16, fp32 GEMMs on upcast copies (conversions timed) compete too: on a CPU without native
    bf16 matmul (AVX2-only x86) that is the fastest way the machine multiplies bf16 matrices.
    """
    M = c["T"] * c["k"] // c["E"] * c["E"]  # all routed rows as one GEMM
    shapes = [(M, c["H"], 2 * c["F"]), (M, c["F"], c["H"]), (M, 2 * c["F"], c["H"])]
    best: dict[str, float] = {}
    for m, kk, n in shapes:
        a = torch.randn(m, kk, dtype=dtype)
        b = torch.randn(n, kk, dtype=dtype)
        cands = {"torch.mm": lambda: torch.mm(a, b.t())}
        if dtype != torch.float32:  # without native bf16 matmul the best bf16 GEMM is fp32 on upcast copies
            cands["torch.mm_fp32_upcast"] = lambda: torch.mm(a.float(), b.float().t()).to(dtype)
        try:
            am, bm = a.to_mkldnn(), b.to_mkldnn()
            torch._C._nn.mkldnn_linear(am, bm)
            cands["mkldnn_linear"] = lambda: torch._C._nn.mkldnn_linear(am, bm)
        except Exception:  # noqa: BLE001 - no oneDNN path in this dtype: torch.mm only
            pass
        for name, fn in cands.items():
            gf = 2 * m * kk * n / statistics.median(_time(fn, warmup, iters)) / 1e9
            best[name] = max(best.get(name, 0.0), gf)
    return {"gflops": max(best.values()), "by_backend": best}


def _prepare(impl: str, config: str, dt: str, threads: int, w) -> tuple[dict, Callable[[], torch.Tensor] | None]:
    """The record of one implementation with its errors against float64 filled in, and its timed step."""
    c, dtype = CONFIGS[config], DTYPES[dt]
    rec = {"impl": impl, "config": config, "dtype": dt, "threads": threads, **c}
    try:
        # torch grouped_mm has no float64 kernel: the reference of a grouped_mm peer is its eager twin
        ref_impl = impl.replace("_grouped_mm", "_eager") if impl.endswith("_grouped_mm") else REFERENCES.get(impl, impl)
        fn64, _ = BUILDERS.get(ref_impl, BUILDERS[impl])(w, c["k"], torch.float64)
        x64 = w.x.clone().requires_grad_(True)
        y64 = fn64(x64)
        y64.backward(w.grad_out)
        ref_y, ref_g = y64.detach(), x64.grad.detach()
        del fn64, x64, y64
        fn, params = BUILDERS[impl](w, c["k"], dtype)
    except Unavailable as e:
        return {**rec, "error": str(e)}, None
    except Exception as e:  # noqa: BLE001 - a peer that fails to build is reported, not dropped
        return {**rec, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}, None
    x = w.x.to(dtype).requires_grad_(True)
    g = w.grad_out.to(dtype)

    def step() -> torch.Tensor:
        x.grad = None
        for p in params:
            p.grad = None
        y = fn(x)
        y.backward(g)
        return y

    y = step()
    rec["rel_err_out"] = _rel(y.detach(), ref_y)
    rec["rel_err_dx"] = _rel(x.grad, ref_g)
    return rec, step


def _record_times(rec: dict, times: list[float]) -> dict:
    rec["ms"] = 1e3 * statistics.median(times)
    rec["ms_all"] = [1e3 * t for t in times]
    rec["ms_min"], rec["ms_max"] = 1e3 * min(times), 1e3 * max(times)  # per-iteration spread of one round
    return rec


def worker(impls: list[str], config: str, dt: str, threads: int, warmup: int, iters: int) -> list[dict]:
    """Time ``impls`` in this process; several take their iterations in turn, so drift hits them alike."""
    torch.set_num_threads(threads)
    c, dtype = CONFIGS[config], DTYPES[dt]
    if impls == [LIMIT]:
        return [{"impl": LIMIT, "config": config, "dtype": dt, "threads": threads, **c,
                 **gemm_ceiling(c, dtype, warmup, iters)}]
    w = make_weights(c["H"], c["F"], c["E"], c["T"])
    prepared = [_prepare(impl, config, dt, threads, w) for impl in impls]
    steps = [(rec, step) for rec, step in prepared if step is not None]
    times: dict[str, list[float]] = {rec["impl"]: [] for rec, _ in steps}
    for it in range(warmup + iters):
        for rec, step in steps:
            start = time.perf_counter()
            step()
            if it >= warmup:
                times[rec["impl"]].append(time.perf_counter() - start)
    return [_record_times(rec, times[rec["impl"]]) if step is not None else rec for rec, step in prepared]


def _spawn(impls: list[str], config: str, dt: str, a: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, __file__, "--worker", *impls, "--config", config, "--dtype", dt, "--threads",
           str(a.threads), "--warmup", str(a.warmup), "--iters", str(a.iters), "--host-memory", a.host_memory]

    def failed(why: str) -> list[dict]:
        return [{"impl": impl, "config": config, "dtype": dt, "error": why} for impl in impls]

    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout * len(impls))
    except subprocess.TimeoutExpired:
        return failed(f"timed out after {a.timeout * len(impls)}s")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return failed(f"worker exit {p.returncode}: {tail}")
    return json.loads(lines[-1])


def summarize(rounds: list[list[dict]]) -> list[dict]:
    """Median ms over rounds (each round's value is its own median), with min..max spread."""
    rows = {}
    for rnd in rounds:
        for r in rnd:
            key = (r["config"], r["dtype"], r["impl"])
            rows.setdefault(key, []).append(r)
    out = []
    for (config, dt, impl), rs in rows.items():
        r = dict(rs[-1])
        if impl == LIMIT and "gflops" in r:
            vals = [x["gflops"] for x in rs]
            r.update(gflops=statistics.median(vals), gflops_min=min(vals), gflops_max=max(vals))
        elif "ms" in r:
            vals = [x["ms"] for x in rs if "ms" in x]
            if len(vals) > 1:  # spread over rounds (medians); with one round the per-iteration spread stays
                r.update(ms_min=min(vals), ms_max=max(vals))
            r.update(ms=statistics.median(vals), rounds=len(vals))
        out.append(r)
    return out


def report(rows: list[dict]) -> str:
    lines = []
    groups = sorted({(r["config"], r["dtype"]) for r in rows}, key=lambda g: (list(CONFIGS).index(g[0]), g[1]))
    for config, dt in groups:
        c = CONFIGS[config]
        grp = [r for r in rows if r["config"] == config and r["dtype"] == dt]
        lim = next((r for r in grp if r["impl"] == LIMIT and "gflops" in r), None)
        ceil = lim["gflops"] if lim else float("nan")
        fl = flops(c)
        lines.append(f"\n== {config} {dt}: H={c['H']} F={c['F']} E={c['E']} k={c['k']} T={c['T']}  "
                     f"({fl / 1e9:.2f} GFLOP/iter fwd+bwd)")
        if lim:
            by = ", ".join(f"{k} {v:.0f}" for k, v in lim["by_backend"].items())
            lines.append(f"   GEMM ceiling {ceil:.1f} GFLOP/s (best of: {by}; spread "
                         f"{lim.get('gflops_min', ceil):.0f}..{lim.get('gflops_max', ceil):.0f}) "
                         f"-> {fl / ceil / 1e6:.1f} ms at the limit")
        timed = [r for r in grp if "ms" in r]
        peers = [r for r in timed if r["impl"] not in ("moecompile", "dense_swiglu_Tk")]
        fastest = min(peers, key=lambda r: r["ms"]) if peers else None
        mc_row = next((r for r in timed if r["impl"] == "moecompile"), None)
        hdr = (f"   {'impl':28s} {'ms/iter':>9s} {'spread':>15s} {'tok/s':>9s} {'GFLOP/s':>8s} {'ceil%':>6s} "
               f"{'mc x':>6s} {'err(y)':>8s} {'err(dx)':>8s}")
        lines.append(hdr)
        for r in sorted(timed, key=lambda r: r["ms"]):
            gf = fl / (r["ms"] / 1e3) / 1e9
            ratio = (r["ms"] / mc_row["ms"]) if mc_row else float("nan")
            lines.append(f"   {r['impl']:28s} {r['ms']:9.1f} {r.get('ms_min', r['ms']):7.1f}..{r.get('ms_max', r['ms']):<7.1f}"
                         f"{c['T'] / (r['ms'] / 1e3):9.0f} {gf:8.1f} {100 * gf / ceil:5.1f}% {ratio:6.2f} "
                         f"{r['rel_err_out']:8.1e} {r['rel_err_dx']:8.1e}")
        for r in grp:
            if "error" in r:
                lines.append(f"   {r['impl']:28s} not run: {r['error']}")
        if mc_row and fastest:
            mc_gf = fl / (mc_row["ms"] / 1e3) / 1e9
            lines.append(f"   moecompile vs fastest peer ({fastest['impl']}): {fastest['ms'] / mc_row['ms']:.2f}x "
                         f"tokens/s (target >= 1.30x); {100 * mc_gf / ceil:.1f}% of ceiling (target >= 85%)")
    lines.append("\n'mc x' = that row's ms / moecompile's ms (>1: moecompile is faster). err = ||y - y64|| / ||y64|| "
                 "against the same implementation in float64 (bf16 routing can flip near-tied experts).")
    return "\n".join(lines)


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["config"], r["dtype"]) for r in rows if "ms" in r})
    impls = sorted({r["impl"] for r in rows if "ms" in r})
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(groups)), 4))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        vals = []
        for config, dt in groups:
            r = next((r for r in rows if (r["config"], r["dtype"], r["impl"]) == (config, dt, impl) and "ms" in r),
                     None)
            vals.append(CONFIGS[config]["T"] / (r["ms"] / 1e3) / 1e3 if r else 0.0)
        ax.bar([g + i * width for g in range(len(groups))], vals, width, label=impl)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], [f"{c}\n{d}" for c, d in groups])
    ax.set_ylabel("k tokens/s (fwd+bwd)")
    ax.set_title("MoE layer, forward+backward")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, 1 round: a smoke run")
    ap.add_argument("--configs", nargs="+", default=["base", "fine", "long"], choices=list(CONFIGS))
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--impls", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per worker")
    ap.add_argument("--out", default="benchmarks/results/moe_layer")
    ap.add_argument("--host-memory", choices=["system", "keep"], default="system",
                    help="keep: every worker calls moecompile.host_memory.keep_freed_memory() first (what "
                         "build_train_step does on CPU), so large tensors reuse freed heap instead of page-faulting")
    ap.add_argument("--interleave", action="store_true",
                    help="one worker per round runs every implementation, their iterations in turn: drift of a "
                         "shared machine hits them alike (they share the process's memory and caches)")
    ap.add_argument("--worker", nargs="+", choices=list(BUILDERS) + [LIMIT])
    ap.add_argument("--config", choices=list(CONFIGS))
    ap.add_argument("--dtype", choices=list(DTYPES))
    a = ap.parse_args()
    if a.worker:
        if a.host_memory == "keep":
            from moecompile.host_memory import keep_freed_memory

            keep_freed_memory()
        print(json.dumps(worker(a.worker, a.config, a.dtype, a.threads, a.warmup, a.iters)))
        return
    if a.quick:
        a.configs, a.rounds, a.warmup, a.iters = ["quick"], 1, 1, 2
    print(f"torch {torch.__version__}, {a.threads} threads, {os.cpu_count()} cpus, {a.rounds} round(s) of "
          f"{a.warmup} warm-up + {a.iters} timed iterations per worker, host memory: {a.host_memory}"
          + (", implementations interleaved in one worker" if a.interleave else ""))
    rounds = []
    for rnd in range(a.rounds):
        res = []
        for config in a.configs:
            for dt in a.dtypes:
                workers = [[LIMIT]] + ([a.impls] if a.interleave else [[impl] for impl in a.impls])
                for impls in workers:
                    for r in _spawn(impls, config, dt, a):
                        res.append(r)
                        msg = f"{r['ms']:.1f} ms" if "ms" in r else (f"{r['gflops']:.0f} GFLOP/s" if "gflops" in r
                                                                     else f"not run: {r.get('error')}")
                        print(f"  round {rnd + 1}: {config} {dt} {r['impl']}: {msg}", file=sys.stderr, flush=True)
        rounds.append(res)
    rows = summarize(rounds)
    print(report(rows))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "rounds": rounds}, indent=1))
    try:
        chart(rows, out.with_suffix(".png"))
    except ImportError as e:
        print(f"no chart: {e} (pip install -e '.[bench]')")
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
