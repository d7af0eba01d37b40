"""MoE kernel benchmark: each Triton kernel against its torch reference and the physical limit, on CUDA.

    python benchmarks/kernels_gpu.py                      # all shapes, bf16, 4096 tokens
    python benchmarks/kernels_gpu.py --shapes qwen3-30b --tokens 8192 --json out.json
    python benchmarks/kernels_gpu.py --dry-run            # tiny shapes on CPU under TRITON_INTERPRET=1:
                                                          # checks the script runs; its timings mean nothing

Memory-bound kernels (route, permute, unpermute, glu, quantize, adamw_update) report GB/s
against a device-to-device copy of the same bytes; GEMMs report TFLOP/s
against torch._grouped_mm (cuBLAS/CUTLASS bf16), FP8 against
torch._scaled_grouped_mm where this torch has it. Targets on H100/H200:
grouped GEMM >= 90% of torch._grouped_mm, permute >= 70% of copy bandwidth,
fused router >= 3x the unfused torch sequence. Without CUDA (and without
--dry-run) it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# name: (hidden H, expert FFN width F, experts E, top-k K)
SHAPES = {
    "deepseek-v3": (7168, 2048, 256, 8),
    "qwen3-30b": (2048, 768, 128, 8),
    "qwen3-235b": (4096, 1536, 128, 8),
}
DRY_SHAPES = {"tiny": (48, 32, 8, 2)}


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES), help="expert shapes")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step (T)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rep", type=int, default=50, help="timed repetitions per kernel")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    return p.parse_args(argv)


def _timer(device, rep: int):
    """ms per call of fn: CUDA events around `rep` calls after warm-up, L2 flushed between calls."""
    import time

    import torch

    if device.type != "cuda":
        def cpu_ms(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return cpu_ms
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device)

    def ms(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
        for i in range(rep):
            flush.zero_()
            start[i].record()
            fn()
            end[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(start, end))
        return times[len(times) // 2]  # median
    return ms


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    import moecompile.kernels as mk
    from moecompile.kernels import backend

    device = torch.device("cuda" if not args.dry_run else "cpu")
    dtype = getattr(torch, args.dtype)
    ms = _timer(device, args.rep)
    shapes = DRY_SHAPES if args.dry_run else {k: SHAPES[k] for k in args.shapes}
    T = 40 if args.dry_run else args.tokens
    rows: list[dict] = []

    def add(shape, kernel, impl, t_ms, work, unit, limit_name=None, limit_ms=None):
        rate = work / (t_ms * 1e-3) / (1e9 if unit == "GB/s" else 1e12)
        row = dict(shape=shape, kernel=kernel, impl=impl, ms=round(t_ms, 4), rate=round(rate, 2), unit=unit)
        if limit_ms is not None:
            limit = work / (limit_ms * 1e-3) / (1e9 if unit == "GB/s" else 1e12)
            row.update(limit=limit_name, limit_rate=round(limit, 2), of_limit=round(rate / limit, 3))
        rows.append(row)
        extra = f"  {row['of_limit']:.0%} of {limit_name} ({row['limit_rate']:.1f})" if limit_ms else ""
        print(f"{shape:>12} {kernel:<28} {impl:<10} {t_ms:9.3f} ms {rate:9.1f} {unit}{extra}", flush=True)

    def both(shape, kernel, fn, work, unit, limit_name=None, limit_fn=None):
        limit_ms = None
        if limit_fn is not None:
            try:
                limit_ms = ms(limit_fn)
            except Exception as e:  # e.g. this GPU / torch lacks the cuBLAS path: say so, keep going
                print(f"{shape:>12} {kernel:<28} limit {limit_name} unavailable: {type(e).__name__}: {e}")
        for impl in ("triton", "reference"):
            with backend.use(impl):
                try:
                    t_ms = ms(fn)
                except Exception as e:
                    print(f"{shape:>12} {kernel:<28} {impl:<10} FAILED: {type(e).__name__}: {e}")
                    rows.append(dict(shape=shape, kernel=kernel, impl=impl, error=f"{type(e).__name__}: {e}"))
                    continue
                add(shape, kernel, impl, t_ms, work, unit, limit_name, limit_ms)

    def copy_of(nbytes):
        src = torch.empty(max(nbytes // 2, 1), dtype=torch.int16, device=device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)  # reads and writes nbytes / 2 each: nbytes moved

    el = torch.empty((), dtype=dtype).element_size()
    for name, (H, F, E, K) in shapes.items():
        N = T * K
        logits = torch.randn(T, E, generator=torch.Generator().manual_seed(0)).to(device, dtype)
        x = torch.randn(T, H, device=device, dtype=dtype)
        with backend.use("reference"):
            weights, idx = mk.route(logits, None, K, "softmax", True)
            x_NH, row_src, sizes, _ = mk.permute(x, idx, weights, E, 0, "position")

        moved = T * E * el + T * K * 12  # logits in; weights (fp32) + indices (int64) out
        both(name, "route", lambda: mk.route(logits, None, K, "softmax", True), moved, "GB/s",
             "copy", copy_of(moved))
        moved = 2 * N * H * el
        both(name, "permute", lambda: mk.permute(x, idx, weights, E, 0, "position"), moved, "GB/s",
             "copy", copy_of(moved))
        both(name, "permute align=128", lambda: mk.permute(x, idx, weights, E, 0, "position", 128), moved,
             "GB/s", "copy", copy_of(moved))
        moved = (N + T) * H * el
        both(name, "unpermute", lambda: mk.unpermute(x_NH, row_src, weights, T), moved, "GB/s",
             "copy", copy_of(moved))

        h = torch.randn(N, 2 * F, device=device, dtype=dtype)
        w_N = torch.rand(N, device=device)
        moved = 3 * N * F * el
        both(name, "glu silu", lambda: mk.glu(h, "silu"), moved, "GB/s", "copy", copy_of(moved))
        both(name, "glu silu weighted", lambda: mk.glu(h, "silu", w_N), moved, "GB/s", "copy", copy_of(moved))

        w1 = torch.randn(E, 2 * F, H, device=device, dtype=dtype) / H**0.5
        w2 = torch.randn(E, H, F, device=device, dtype=dtype) / F**0.5
        offs = torch.cumsum(sizes, 0, dtype=torch.int32)
        g1 = torch.randn(N, 2 * F, device=device, dtype=dtype)

        def cublas(a, b_t):
            return lambda: torch._grouped_mm(a, b_t, offs)
        limit = cublas(x_NH, w1.transpose(-2, -1)) if device.type == "cuda" else None
        both(name, "grouped_mm up", lambda: mk.grouped_mm(x_NH, w1, sizes), 2 * N * 2 * F * H, "TFLOP/s",
             "_grouped_mm", limit)
        limit = cublas(h[:, :F].contiguous(), w2.transpose(-2, -1)) if device.type == "cuda" else None
        h_F = h[:, :F].contiguous()
        both(name, "grouped_mm down", lambda: mk.grouped_mm(h_F, w2, sizes), 2 * N * H * F, "TFLOP/s",
             "_grouped_mm", limit)
        limit = cublas(g1, w1) if device.type == "cuda" else None
        both(name, "grouped_mm dgrad", lambda: mk.grouped_mm(g1, w1.transpose(1, 2), sizes), 2 * N * 2 * F * H,
             "TFLOP/s", "_grouped_mm", limit)
        limit = (lambda: torch._grouped_mm(g1.t(), x_NH, offs)) if device.type == "cuda" else None
        both(name, "grouped_mm wgrad", lambda: torch.ops.moecompile.grouped_mm_wgrad(g1, x_NH, sizes),
             2 * N * 2 * F * H, "TFLOP/s", "_grouped_mm", limit)

        moved = N * H * (el + 1)
        for recipe in ("tensorwise", "tile"):
            both(name, f"quantize_fp8 {recipe}", lambda r=recipe: mk.quantize_fp8(x_NH, r, "e4m3", 128),
                 moved, "GB/s", "copy", copy_of(moved))
        # FP8 GEMMs on groups padded to 16 rows, as FP8 GEMMs (and the FP8 pass) want
        with backend.use("reference"):
            x_al, _, sizes_al, _ = mk.permute(x, idx, weights, E, 0, "position", 16)
        offs_al, N_al = torch.cumsum(sizes_al, 0, dtype=torch.int32), x_al.shape[0]
        for recipe, (xr, wr) in (("rowwise", ("rowwise", "rowwise")), ("blockwise", ("tile", "block"))):
            with backend.use("reference"):
                xq, xs = mk.quantize_fp8(x_al, xr, "e4m3", 128)
                wq, ws = mk.quantize_fp8(w1, wr, "e4m3", 128)
            limit = None
            if recipe == "rowwise" and device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm"):
                xs_r, ws_r = xs.reshape(-1), ws.reshape(E, -1)
                limit = lambda: torch._scaled_grouped_mm(  # noqa: E731
                    xq, wq.transpose(-2, -1), xs_r, ws_r, offs=offs_al, out_dtype=torch.bfloat16)
            both(name, f"grouped_mm_fp8 {recipe}",
                 lambda r=recipe: mk.grouped_mm_fp8(xq, xs, wq, ws, sizes_al, r, 128, None, torch.bfloat16),
                 2 * N_al * 2 * F * H, "TFLOP/s", "_scaled_grouped_mm" if limit else None, limit)
        # moecompile.AdamW's step of one expert's up projection: fp32 master and gradient, bf16 moments
        n = 2 * F * H
        master, grad = torch.randn(n, device=device), torch.randn(n, device=device)
        m, v = torch.zeros(n, device=device, dtype=torch.bfloat16), torch.zeros(n, device=device, dtype=torch.bfloat16)
        step = torch.tensor(10.0, device=device, dtype=torch.float64)
        moved = n * (4 + 4 + 4 + 2 + 2 + 2 + 2)  # master read + written, gradient read, moments read + written
        both(name, "adamw_update bf16 moments",
             lambda: mk.adamw_update(master, grad, m, v, step, lr=1e-3, weight_decay=0.1, beta1=0.9,
                                     beta2=0.999, eps=1e-8), moved, "GB/s", "copy", copy_of(moved))
        del w1, w2, master, grad, m, v
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    args = _args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before moecompile's Triton bodies are imported
        args.rep = 1
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device here, nothing measured (run on a GPU machine, or --dry-run)")
        return 0
    if not args.dry_run:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  tokens {args.tokens}  "
              f"dtype {args.dtype}")
    else:
        print("dry run: tiny shapes on CPU under TRITON_INTERPRET=1; timings are meaningless")
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
