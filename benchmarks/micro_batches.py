"""Gradient accumulation: the same batch per step in 1, 2, 4 or 8 micro-batches (CPU).

    python benchmarks/micro_batches.py [--batch 8] [--seq 256] [--rounds 3] [--steps 3]

The zoo's ``small-llama`` upcycled to 8 experts top-2 (fp32, AdamW, dropless), converted at each
micro-batch size and stepped on the same ``--batch`` sequences: ``build_train_step`` runs a batch
of M traced batches as M micro-batches and syncs once. Per micro-batch size: the step's peak
allocation above its start (CPU allocator events, ``moecompile.memory.measure_memory``), the
median step time (variants interleaved over ``--rounds`` rounds so machine drift hits all alike),
and the first step's loss, which must agree across rows (the same function of the same batch).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import moecompile as mc
from moecompile.memory import measure_memory
from moecompile.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", default="8,4,2,1", help="micro-batch sizes (sequences), comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    a = ap.parse_args()
    sizes = [int(m) for m in a.micro.split(",")]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (a.batch, a.seq + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    plan = {"experts": {"num_experts": 8, "top_k": 2, "router_noise": 0.01}}
    steps, first, peak = {}, {}, {}
    for m in sizes:
        torch.manual_seed(0)
        dense, (example,) = build_model("small-llama", batch_size=m, seq_len=a.seq, seed=0)
        step = mc.build_train_step(mc.convert(dense, plan, (example,)), precision="fp32",
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        first[m] = step(x, y).lm_loss  # also warms the allocator up
        peak[m] = measure_memory(lambda: step(x, y)).peak
        steps[m] = step
    times: dict[int, list[float]] = {m: [] for m in sizes}
    for _ in range(a.rounds):
        for m in sizes:
            for _ in range(a.steps):
                t = time.perf_counter()
                steps[m](x, y)
                times[m].append(time.perf_counter() - t)
    print(f"small-llama E8 top-2, fp32, batch {a.batch} x {a.seq} a step, {torch.get_num_threads()} threads, "
          f"median of {a.rounds} x {a.steps} steps")
    print(f"{'micro-batch':>11} {'micro-batches':>13} {'step peak MiB':>13} {'step ms':>8} {'first loss':>10}")
    for m in sizes:
        print(f"{m:>11} {a.batch // m:>13} {peak[m] / 2**20:>13.1f} {statistics.median(times[m]) * 1e3:>8.0f} "
              f"{first[m]:>10.4f}")


if __name__ == "__main__":
    main()
