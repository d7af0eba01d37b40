"""Host cost of one operator call: plain aten vs `torch.library.custom_op` vs moecompile's `library.op`.

    python benchmarks/op_overhead.py [--calls 5000]

The same body (x * w on 4 elements, so the arithmetic is free) behind each front end, called
(a) without grad, (b) with inputs that need grad, forward + `y.sum().backward()`. A plain `x * w`
row gives the floor: what any op costs. Prints µs per call and the overhead over the floor;
this is the per-op tax each of the ~14 MoE op calls per layer pays in every step
(`kernels/library.py` says why the two front ends differ).
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch
from torch import Tensor

library = importlib.import_module("moecompile.kernels.library")


def _body(x: Tensor, w: Tensor) -> Tensor:
    return x * w


def _fake(x: Tensor, w: Tensor) -> Tensor:
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, g: Tensor):
    x, w = ctx.saved_tensors
    return g * w, g * x


def _define() -> dict:
    @torch.library.custom_op("op_overhead::with_custom_op", mutates_args=())
    def with_custom_op(x: Tensor, w: Tensor) -> Tensor:
        return _body(x, w)

    with_custom_op.register_fake(_fake)
    with_custom_op.register_autograd(_backward, setup_context=_setup)

    @library.op("op_overhead::with_library_op")
    def with_library_op(x: Tensor, w: Tensor) -> Tensor:
        return _body(x, w)

    with_library_op.register_fake(_fake)
    with_library_op.register_autograd(_backward, setup_context=_setup)
    return {"plain x * w": _body, "torch.library.custom_op": torch.ops.op_overhead.with_custom_op.default,
            "moecompile library.op": torch.ops.op_overhead.with_library_op.default}


def _per_call(fn, x: Tensor, w: Tensor, backward: bool, calls: int) -> float:
    def once() -> None:
        y = fn(x, w)
        if backward:
            y.sum().backward()

    for _ in range(200):
        once()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            once()
        rounds.append((time.perf_counter() - start) / (calls // 5))
    return 1e6 * statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops = _define()
    x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    rows = {}
    for name, fn in ops.items():
        with torch.no_grad():
            no_grad = _per_call(fn, x, w, False, args.calls)
        rows[name] = (no_grad, _per_call(fn, x, w, True, args.calls))
    floor = rows["plain x * w"]
    print(f"torch {torch.__version__}, 1 thread, median of 5 rounds of {args.calls // 5} calls (µs per call)")
    print(f"{'front end':24} {'no grad':>8} {'+over':>7} {'fwd+bwd':>8} {'+over':>7}")
    for name, (ng, fb) in rows.items():
        print(f"{name:24} {ng:8.1f} {ng - floor[0]:7.1f} {fb:8.1f} {fb - floor[1]:7.1f}")


if __name__ == "__main__":
    main()
