"""CPU expert GEMMs: one torch._grouped_mm for all experts against one mm per expert.

    python benchmarks/grouped_mm_cpu.py [--threads 2] [--dtypes fp32 bf16] [--iters 20]

Both are the reference's own paths (`moecompile.kernels.grouped_mm`: `nt_*` is the forward and
dgrad product, `tn_*` the weight gradient), timed on the same tensors in one process, alternating
per iteration so machine drift hits both alike. Prints the median µs per call and the ratio
(> 1: the one call is faster), and checks the two agree. `_one_call` picks the path from these
figures; bf16 is only meaningful on a CPU with native bf16 matmul (else both run in fp32 copies
inside the op, and this script times the raw bf16 kernels).
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

gm = importlib.import_module("moecompile.kernels.grouped_mm")  # the module, not the op function

SHAPES = [  # (rows N, experts E, in I, out O): tiny-llama, small, the moe_layer base and fine configs
    (256, 8, 32, 128),
    (256, 8, 256, 1024),
    (8192, 8, 512, 2048),
    (8192, 64, 512, 256),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _time(fns: dict, iters: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up
    for _ in range(iters):
        for k, f in fns.items():
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    return {k: 1e6 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES))
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.iters} calls (µs)")
    print(f"{'shape N,E,I,O':>22} {'dtype':>5} | {'nt loop':>9} {'nt one':>9} {'ratio':>6} | "
          f"{'tn loop':>9} {'tn one':>9} {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    for N, E, I, O in SHAPES:
        for name in args.dtypes:
            dtype = DTYPES[name]
            x = torch.randn(N, I, generator=g).to(dtype)
            w = torch.randn(E, O, I, generator=g).to(dtype)
            dy = torch.randn(N, O, generator=g).to(dtype)
            sizes = torch.bincount(torch.randint(0, E, (N,), generator=g), minlength=E)
            iters = max(3, args.iters // (10 if N * I * O > 1e9 else 1))
            t = _time({"nt loop": lambda: gm.nt_per_expert(x, w, sizes), "nt one": lambda: gm.nt_one_call(x, w, sizes),
                       "tn loop": lambda: gm.tn_per_expert(dy, x, sizes), "tn one": lambda: gm.tn_one_call(dy, x, sizes)},
                      iters)
            tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=1.0)
            torch.testing.assert_close(gm.nt_one_call(x, w, sizes), gm.nt_per_expert(x, w, sizes), **tol)
            torch.testing.assert_close(gm.tn_one_call(dy, x, sizes), gm.tn_per_expert(dy, x, sizes), **tol)
            print(f"{f'{N},{E},{I},{O}':>22} {name:>5} | {t['nt loop']:9.0f} {t['nt one']:9.0f} "
                  f"{t['nt loop'] / t['nt one']:5.2f}x | {t['tn loop']:9.0f} {t['tn one']:9.0f} "
                  f"{t['tn loop'] / t['tn one']:5.2f}x")


if __name__ == "__main__":
    main()
