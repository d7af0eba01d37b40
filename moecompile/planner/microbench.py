"""A CPU "cluster" measured on this machine, so the cost model can be checked against real gloo runs.

    cluster = measure_cpu_cluster(world=2)      # 2 processes, as a 2-rank job would run them

Every rank runs the same microbenchmarks at the same time (so they contend for cores and
memory as a real job does), with ``threads`` torch threads each, and keeps the fastest of
several runs (on a shared machine the least-contended sample; compare with the fastest steps):
- matmul: a 1024 x 1024 x 1024 fp32 GEMM -> achieved FLOP/s (the "peak"; efficiency 1.0)
- memory: a 128 MB tensor copy -> bytes/s read + written
- op overhead: a one-element ``add`` on tensors that require grad -> host seconds per op
- all-to-all: gloo ``all_to_all_single`` at 64 KiB and 4 MiB per rank -> latency + bandwidth
Nothing is hard-coded: every figure in the returned Cluster is measured.
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from ..distributed import free_port
from .cluster import Cluster, Link

_SMALL, _LARGE = 64 * 2**10, 4 * 2**20  # all-to-all payload per rank, bytes


def _timed(fn: Any, repeats: int, warmup: int = 2, clock: Callable[[], float] = time.perf_counter) -> float:
    """The fastest of ``repeats`` runs: on a shared machine the minimum is the least-contended sample."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t = clock()
        fn()
        samples.append(clock() - t)
    return min(samples)


def measure_rank(world: int, cpu_time: bool = False) -> dict[str, float]:
    """This rank's share of the microbenchmarks (all ranks call it together; gloo is up if world > 1).

    ``cpu_time``: time compute, copy and op overhead by this process's CPU time instead of the wall
    clock (with one thread per rank: the time the work takes when no other process competes for the
    core). The all-to-all is always wall-clock time: waiting for peers is its cost.
    """
    clock = time.process_time if cpu_time else time.perf_counter
    import torch.distributed as dist

    def sync() -> None:
        if world > 1:
            dist.barrier()

    out: dict[str, float] = {}
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    sync()
    out["matmul_flops"] = 2 * n**3 / _timed(lambda: torch.mm(a, b), 10, clock=clock)
    x = torch.randn(32 * 2**20)
    y = torch.empty_like(x)
    sync()
    out["copy_bw"] = 2 * x.numel() * 4 / _timed(lambda: y.copy_(x), 10, clock=clock)
    p, q = torch.ones(1, requires_grad=True), torch.ones(1)
    sync()
    out["op_s"] = _timed(lambda: [torch.add(p, q) for _ in range(2000)], 5, clock=clock) / 2000
    if world > 1:
        for size, key in ((_SMALL, "a2a_small"), (_LARGE, "a2a_large")):
            send = torch.zeros(size // 4)
            recv = torch.empty_like(send)
            sync()
            out[key] = _timed(lambda: dist.all_to_all_single(recv, send), 10)
        sync()
    return out


def _entry(rank: int, world: int, threads: int, port: int, fn: Callable, args: tuple, out: str, backend: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    if world > 1:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
    try:
        torch.save(fn(rank, world, *args), os.path.join(out, f"{rank}.pt"))
    finally:
        if world > 1:
            from ..distributed import shutdown

            shutdown()


def run_ranks(fn: Callable, world: int, args: tuple = (), threads: int | None = None,
              timeout_s: float = 600.0, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes (the ``backend`` group up when world > 1;
    under "nccl" rank r on GPU r).

    Returns each rank's result; a rank that raises re-raises here, a hang past ``timeout_s`` is killed.
    """
    import torch.multiprocessing as mp

    threads = threads or threads_per_rank(world)
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(world, threads, free_port(), fn, args, out, backend), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world} ranks did not finish in {timeout_s:.0f} s")
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world)]


def threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def _measure(rank: int, world: int) -> dict[str, float]:
    return measure_rank(world)


def measure_cpu_cluster(world: int = 1, threads: int | None = None, timeout_s: float = 600.0) -> Cluster:
    """Measure ``world`` concurrent CPU processes; the Cluster the cost model should use for that job."""
    threads = threads or threads_per_rank(world)
    return cluster_from(run_ranks(_measure, world, threads=threads, timeout_s=timeout_s), threads)


def cluster_from(ranks: list[dict[str, float]], threads: int) -> Cluster:
    """A Cluster from every rank's ``measure_rank`` figures."""
    world = len(ranks)

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in ranks)

    if world > 1:  # t(s) = alpha + s * (w-1)/w / beta, fitted through the two sizes
        share = (world - 1) / world
        t_small = max(r["a2a_small"] for r in ranks)
        t_large = max(r["a2a_large"] for r in ranks)
        beta = (_LARGE - _SMALL) * share / max(t_large - t_small, 1e-9)
        alpha = max(0.0, t_small - _SMALL * share / beta)
        link = Link(beta, alpha)
    else:
        link = Link(float("inf"), 0.0)
    flops = mean("matmul_flops")
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world
    except (ValueError, OSError, AttributeError):
        memory = 8 * 2**30
    source = (f"measured: {world} process(es) x {threads} thread(s): fp32 1024^3 matmul {flops / 1e9:.1f} GFLOP/s, "
              f"copy {mean('copy_bw') / 1e9:.1f} GB/s, {mean('op_s') * 1e6:.1f} us/op"
              + (f", gloo all-to-all {link.bandwidth / 1e9:.2f} GB/s + {link.latency * 1e6:.0f} us" if world > 1 else ""))
    return Cluster(
        name=f"cpu-gloo-x{world}", gpus=world, gpus_per_node=world, memory_bytes=memory,
        bf16_flops=flops, fp8_flops=flops, hbm_bandwidth=mean("copy_bw"), intra=link, inter=link,
        gemm_efficiency=1.0, hbm_efficiency=1.0, link_efficiency=1.0, op_overhead_s=mean("op_s"),
        usable_memory_fraction=0.9, source=source,
    )
