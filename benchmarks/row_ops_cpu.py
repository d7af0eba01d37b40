"""CPU row ops of dispatch and combine: which torch formulation the reference kernels use, and why.

    python benchmarks/row_ops_cpu.py [--threads 2]

At a tiny shape (tiny-llama: T=128 tokens, H=32, T·k=256 rows) and the moe_layer `fine` shape
(T=4096, H=1024, T·k=32768 rows), the median time of:

* the row gather `x_TH[idx]` (advanced indexing) vs `x_TH.index_select(0, idx)` — permute and
  unpermute_backward use index_select;
* the per-row dot <a[n], b[n]> of unpermute_backward as einsum, `linalg.vecdot` and a batched
  `bmm` of [1, H] @ [H, 1] — the kernel uses bmm;
* the combine's routing-weight multiply `y_NH * w_N[:, None]` and its scatter `index_add_`, the
  part of the combine that would shrink by H/F if the weights were applied inside the GLU instead.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = {"tiny": (128, 32, 256), "fine": (4096, 1024, 32768)}  # (T, H, rows T·k)


def _median(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, median per call")
    for name, (T, H, N) in SHAPES.items():
        x = torch.randn(T, H, generator=g)
        idx = torch.randint(0, T, (N,), generator=g)
        a, b, w = torch.randn(N, H, generator=g), torch.randn(N, H, generator=g), torch.rand(N, generator=g)
        torch.testing.assert_close(x[idx], x.index_select(0, idx))
        dots = {"einsum": lambda: torch.einsum("nh,nh->n", a, b), "linalg.vecdot": lambda: torch.linalg.vecdot(a, b),
                "bmm": lambda: torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)}
        for f in dots.values():
            torch.testing.assert_close(f(), dots["einsum"](), rtol=1e-4, atol=1e-3)
        calls = 2000 if N < 1000 else 15
        unit, scale = ("us", 1e6) if N < 1000 else ("ms", 1e3)
        rows = {"gather x[idx]": lambda: x[idx], "gather index_select": lambda: x.index_select(0, idx),
                **{f"dot {k}": f for k, f in dots.items()},
                "combine y * w[:, None]": lambda: a * w[:, None],
                "combine index_add_": lambda: torch.zeros(T, H).index_add_(0, idx, a)}
        print(f"== {name}: T={T} H={H} rows={N}")
        for label, fn in rows.items():
            print(f"   {label:24} {_median(fn, calls) * scale:9.2f} {unit}")


if __name__ == "__main__":
    main()
