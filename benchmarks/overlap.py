"""Benchmark: one MoE layer's forward+backward with and without the overlap pass, gloo on CPU.

    python benchmarks/overlap.py                      # ep = 2 and 4, N = none, 1, 2, 4, auto
    python benchmarks/overlap.py --ep 2 --rounds 7 --tokens 2048

Each ep size spawns that many local ranks (one thread each). A rank holds ``--tokens`` tokens of a
one-block model whose FFN becomes an MoE layer (``--experts`` experts, top-``--topk``, shared experts
on), converted once per variant. Variants are timed round-robin (every round runs every variant
``--steps`` steps) so drift on a shared machine hits them alike; a step's time is the slowest
rank's (barrier before each step). Reported per variant: the median step, the minimum (the
least-disturbed step on a busy machine) and the p10..p90 spread, and the
*exposed communication*: the time a rank sits blocked in collective waits (every ``wait_tensor``,
forward and backward, timed by a dispatch mode in separate steps; the slowest rank's), i.e.
communication not hidden behind compute (it includes waiting for a slower peer). ``hidden`` is the fraction of the no-overlap exposed time removed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moecompile.distributed import free_port


class _FFN(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OneLayer(nn.Module):
    """x + FFN(norm(x)): the FFN is what becomes the MoE layer."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(h), _FFN(h, f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _variants(args: argparse.Namespace) -> dict[str, dict | None]:
    out: dict[str, dict | None] = {"no overlap": None}
    for n in args.chunks:
        out[f"N={n}"] = {"enabled": True, "chunks": n if n == "auto" else int(n)}
    return out


def _step(module: Any, x: torch.Tensor) -> None:
    xx = x.detach().requires_grad_(True)
    module(xx).float().square().mean().backward()


def _timed(fn: Any, steps: int) -> list[float]:
    """Each step's time, the slowest rank's (a barrier before each step)."""
    import torch.distributed as dist

    took = torch.zeros(steps)
    for i in range(steps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        took[i] = time.perf_counter() - t
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.tolist()


class _WaitTimer(TorchDispatchMode):
    """Adds up the wall time spent inside torch's wait_tensor (every wait, forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is not torch.ops._c10d_functional.wait_tensor.default:
            return func(*args, **(kwargs or {}))
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - t
        return out


def _exposed(fn: Any, steps: int) -> list[float]:
    """Each step's seconds blocked in collective waits (the slowest rank's)."""
    import torch.distributed as dist

    took = torch.zeros(steps)
    for i in range(steps):
        dist.barrier()
        with _WaitTimer() as timer:
            fn()
        took[i] = timer.seconds
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.tolist()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    import logging

    logging.getLogger("moecompile").setLevel(logging.WARNING)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    import moecompile as mc

    torch.manual_seed(0)
    dense = OneLayer(args.hidden, args.ffn)
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank))
    base = {"experts": {"num_experts": args.experts, "top_k": args.topk, "shared_experts": args.shared},
            "parallel": {"ep": world}}
    modules, notes = {}, {}
    for name, ov in _variants(args).items():
        result = mc.convert(dense, {**base, **({"overlap": ov} if ov else {})}, (x,))
        modules[name] = result.module
        rec = result.record("overlap")
        notes[name] = rec.data.get("chunks", {})
        if name == "N=auto":
            notes["auto_why"] = rec.data.get("schedule", {}).get("mlp", {}).get("why", "")
    for m in modules.values():  # warm-up
        for _ in range(2):
            _step(m, x)
    times: dict[str, list[float]] = {k: [] for k in modules}
    exposed: dict[str, list[float]] = {k: [] for k in modules}
    for _ in range(args.rounds):
        for name, m in modules.items():
            times[name] += _timed(lambda: _step(m, x), args.steps)
    for _ in range(args.rounds):
        for name, m in modules.items():
            exposed[name] += _exposed(lambda: _step(m, x), args.steps)
    if rank == 0:
        torch.save({"times": times, "exposed": exposed, "notes": notes}, os.path.join(out, "result.pt"))
    dist.destroy_process_group()


def run(ep: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(ep, free_port(), args, out), nprocs=ep, start_method="spawn")
        return torch.load(os.path.join(out, "result.pt"))


def table(ep: int, res: dict, args: argparse.Namespace) -> str:
    times, exposed = res["times"], res["exposed"]
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    emed = {k: statistics.median(v) for k, v in exposed.items()}
    base = "no overlap"
    rows = [f"ep={ep}: {args.tokens} tokens/rank, H={args.hidden}, F={args.ffn}, E={args.experts}, top-{args.topk}, "
            f"shared={args.shared}; {args.rounds} rounds x {args.steps} steps per variant, interleaved",
            "| variant | chunks | fwd+bwd ms median | min | p10..p90 | median vs none | exposed comm ms median (min) | hidden |",
            "|---|---|---|---|---|---|---|---|"]
    for name in times:
        q = statistics.quantiles(times[name], n=10) if len(times[name]) > 1 else [med[name]] * 9
        chunks = res["notes"].get(name) or {}
        hidden = "-" if name == base else (f"{1 - emed[name] / emed[base]:.0%}" if emed[base] > 0 else "n/a")
        rows.append(
            f"| {name} | {','.join(str(v) for v in chunks.values()) or '-'} | {med[name] * 1e3:.1f} | "
            f"{low[name] * 1e3:.1f} | {q[0] * 1e3:.1f}..{q[-1] * 1e3:.1f} | {med[name] / med[base]:.2f}x | "
            f"{emed[name] * 1e3:.1f} ({min(exposed[name]) * 1e3:.1f}) | {hidden} |"
        )
    if res["notes"].get("auto_why"):
        rows.append(res["notes"]["auto_why"])
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    p.add_argument("--chunks", nargs="+", default=["1", "2", "4", "auto"])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--shared", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, gloo; load average "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}", flush=True)
    for ep in args.ep:
        print(table(ep, run(ep, args), args), flush=True)


if __name__ == "__main__":
    sys.exit(main())
