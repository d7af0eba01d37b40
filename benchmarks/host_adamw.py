"""How fast the host steps an offloaded optimizer, against the host's own copy bandwidth.

    python benchmarks/host_adamw.py [--elements 32M] [--tensors 64] [--threads 2] [--rounds 5]

The planner prices parallel.offload_optimizer's CPU update as a stream of bytes at
``host_bandwidth x host_efficiency`` (moecompile/planner/cluster.py takes 0.5, an assumption).
This measures both sides of that on the machine it runs on: the bandwidth of a large tensor copy
(read + write bytes over time) and torch.optim.AdamW's step over fp32 masters with fp32 gradients,
as optimizer_offload holds them, in each implementation torch has for CPU tensors (the for-loop
one torch picks by default, foreach, fused; freed host memory kept for reuse, as build_train_step
does with the optimizer offloaded), counted in the cost model's bytes an element (master
and both moments read and written, the gradient read: 28). Beside them moecompile.AdamW (fp32 and
bf16 moments), whose CPU update is torch's fused kernel over cache-sized chunks with bf16 moments
widened, one pass over memory, counted as the planner counts it (kernels/adamw.py host_traffic: 28,
20 in bf16), and its readable reference (``MOECOMPILE_KERNELS=reference``'s, a pass per op, counted
with the same bytes, so its GB/s is what that one pass would need). Prints each one's GB/s and its
ratio to the copy's: the efficiency the planner assumes; and its time against fused AdamW's. Rounds
take turns; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

BYTES_PER_ELEMENT = 2 * (4 + 2 * 4) + 4  # planner/cost_model.py's AdamW stream, fp32 moments and gradient
IMPLEMENTATIONS = {"default (for-loop)": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
MOMENTS = {"moecompile.AdamW fp32 moments": torch.float32, "moecompile.AdamW bf16 moments": torch.bfloat16}


def _elements(text: str) -> int:
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(text)


def _copy_seconds(n: int) -> float:
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


def _adamw(n: int, tensors: int, build) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.randn(n // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = build(params)
    opt.step()  # builds the state
    return opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", default="32M", help="optimizer elements (K/M/G suffixes; default 32M)")
    ap.add_argument("--tensors", type=int, default=64, help="tensors they are split into (default 64)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", default="", help="also time the bf16 host body at these chunk sizes, e.g. 16K,256K,1M "
                    "(kernels/adamw.py CHUNK: fp32 elements widened at a time)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from moecompile.host_memory import keep_freed_memory

    keep_freed_memory()  # as build_train_step does with the optimizer offloaded: temporaries reuse freed heap
    n = _elements(args.elements)
    from moecompile import AdamW
    from moecompile.kernels import backend
    from moecompile.kernels import adamw as adamw_kernel
    from moecompile.kernels.adamw import host_traffic

    default_chunk = adamw_kernel.CHUNK

    built, counted = {}, {}
    for name, options in IMPLEMENTATIONS.items():
        built["AdamW " + name] = _adamw(n, args.tensors, lambda ps: torch.optim.AdamW(ps, lr=1e-3, **options))
        counted["AdamW " + name] = BYTES_PER_ELEMENT
    kernels, chunks = {}, {}
    for name, dtype in MOMENTS.items():  # its host body (auto), and its reference
        for kernel in ("auto", "reference"):
            label = name + (" (reference)" if kernel == "reference" else "")
            built[label] = _adamw(n, args.tensors, lambda ps: AdamW(ps, lr=1e-3, moment_dtype=dtype))
            counted[label], kernels[label] = host_traffic(dtype.itemsize), kernel
    for text in filter(None, args.chunks.split(",")):
        label = f"moecompile.AdamW bf16 moments, chunk {text}"
        built[label] = _adamw(n, args.tensors, lambda ps: AdamW(ps, lr=1e-3, moment_dtype=torch.bfloat16))
        counted[label], chunks[label] = host_traffic(2), _elements(text)
    times: dict[str, list[float]] = {name: [] for name in ["copy", *built]}
    for _ in range(args.rounds):
        times["copy"].append(_copy_seconds(n))
        for name, opt in built.items():
            adamw_kernel.CHUNK = chunks.get(name, default_chunk)
            with backend.use(kernels.get(name, "auto")):
                start = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - start)
    adamw_kernel.CHUNK = default_chunk
    copy_bw = 2 * 4 * n / statistics.median(times["copy"])
    print(f"{n / 1e6:.1f} M fp32 elements in {args.tensors} tensors, {args.threads} threads, median of "
          f"{args.rounds} rounds")
    fused = statistics.median(times["AdamW fused"])
    print(f"{'':<42} {'ms':>9} {'B/elem':>7} {'GB/s':>7} {'x copy':>7} {'x fused time':>12}")
    print(f"{'copy (read+write)':<42} {statistics.median(times['copy']) * 1e3:>9.1f} {8:>7} {copy_bw / 1e9:>7.2f} "
          f"{1:>7.2f} {'':>12}")
    for name in built:
        t = statistics.median(times[name])
        bw = counted[name] * n / t
        print(f"{name:<42} {t * 1e3:>9.1f} {counted[name]:>7g} {bw / 1e9:>7.2f} {bw / copy_bw:>7.2f} "
              f"{t / fused:>12.2f}")


if __name__ == "__main__":
    main()
