"""What a fresh large CPU tensor costs with glibc's default malloc, and with `keep_freed_memory()`.

    python benchmarks/host_memory.py [--threads 2] [--calls 20]

Each mode runs in its own process (mallopt is process-wide). Median ms of: writing a freshly
allocated tensor (`torch.empty(...).fill_(1)`), an elementwise op that allocates its output
(`a * b`), the same op into a preallocated buffer (`out=`: the floor, no allocation), at the
moe_layer `fine` shape's [T·k, F] = [32768, 256] and [T·k, H] = [32768, 1024] float32.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from row_ops_cpu import _median  # same folder: a script's own directory is on sys.path

SHAPES = {"[32768, 256]": (32768, 256), "[32768, 1024]": (32768, 1024)}


def worker(keep: bool, threads: int, calls: int) -> dict:
    import torch

    from moecompile.host_memory import keep_freed_memory

    kept = keep_freed_memory() if keep else False
    torch.set_num_threads(threads)
    out = {"kept": kept}
    for name, shape in SHAPES.items():
        a, b, buf = torch.randn(shape), torch.randn(shape), torch.empty(shape)
        out[name] = {
            "fresh fill": _median(lambda: torch.empty(shape).fill_(1), calls),
            "a * b": _median(lambda: a * b, calls),
            "a * b, out=": _median(lambda: torch.mul(a, b, out=buf), calls),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--worker", choices=["system", "keep"])
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker == "keep", args.threads, args.calls)))
        return
    runs = {}
    for mode in ("system", "keep"):
        cmd = [sys.executable, __file__, "--worker", mode, "--threads", str(args.threads), "--calls", str(args.calls)]
        runs[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    print(f"median ms of {args.calls} calls, {args.threads} threads; keep_freed_memory applied: {runs['keep']['kept']}")
    print(f"{'shape':15s} {'op':14s} {'glibc default':>14s} {'kept heap':>10s} {'ratio':>7s}")
    for name in SHAPES:
        for op, sys_s in runs["system"][name].items():
            keep_s = runs["keep"][name][op]
            print(f"{name:15s} {op:14s} {sys_s * 1e3:14.2f} {keep_s * 1e3:10.2f} {sys_s / keep_s:6.2f}x")


if __name__ == "__main__":
    main()
