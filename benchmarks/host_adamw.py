"""How fast the host steps an offloaded optimizer, against the host's own copy bandwidth.

    python benchmarks/host_adamw.py [--elements 32M] [--tensors 64] [--threads 2] [--rounds 5]

The planner prices parallel.offload_optimizer's CPU update as a stream of bytes at
``host_bandwidth x host_efficiency`` (moecompile/planner/cluster.py takes 0.5, an assumption).
This measures both sides of that on the machine it runs on: the bandwidth of a large tensor copy
(read + write bytes over time) and torch.optim.AdamW's step over fp32 masters with fp32 gradients,
as optimizer_offload holds them, in each implementation torch has for CPU tensors (the for-loop
one torch picks by default, foreach, fused; freed host memory kept for reuse, as build_train_step
does with the optimizer offloaded), counted in the cost model's bytes an element (master
and both moments read and written, the gradient read: 28). Prints each one's GB/s and its ratio
to the copy's: the efficiency the planner assumes. Rounds take turns; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

BYTES_PER_ELEMENT = 2 * (4 + 2 * 4) + 4  # planner/cost_model.py's AdamW stream, fp32 moments and gradient
IMPLEMENTATIONS = {"default (for-loop)": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _elements(text: str) -> int:
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(text)


def _copy_seconds(n: int) -> float:
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


def _adamw(n: int, tensors: int, options: dict) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(torch.randn(n // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, **options)
    opt.step()  # builds the state
    return opt, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", default="32M", help="optimizer elements (K/M/G suffixes; default 32M)")
    ap.add_argument("--tensors", type=int, default=64, help="tensors they are split into (default 64)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from moecompile.host_memory import keep_freed_memory

    keep_freed_memory()  # as build_train_step does with the optimizer offloaded: temporaries reuse freed heap
    n = _elements(args.elements)
    built = {name: _adamw(n, args.tensors, options) for name, options in IMPLEMENTATIONS.items()}
    times: dict[str, list[float]] = {name: [] for name in ["copy", *built]}
    for _ in range(args.rounds):
        times["copy"].append(_copy_seconds(n))
        for name, (opt, _) in built.items():
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    copy_bw = 2 * 4 * n / statistics.median(times["copy"])
    print(f"{n / 1e6:.1f} M fp32 elements in {args.tensors} tensors, {args.threads} threads, median of "
          f"{args.rounds} rounds")
    print(f"{'':<26} {'ms':>9} {'GB/s':>7} {'x copy':>7}")
    print(f"{'copy (read+write)':<26} {statistics.median(times['copy']) * 1e3:>9.1f} {copy_bw / 1e9:>7.2f} {1:>7.2f}")
    for name in built:
        t = statistics.median(times[name])
        bw = BYTES_PER_ELEMENT * n / t
        print(f"{'AdamW ' + name:<26} {t * 1e3:>9.1f} {bw / 1e9:>7.2f} {bw / copy_bw:>7.2f}")


if __name__ == "__main__":
    main()
