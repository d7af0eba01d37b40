"""What one gloo collective costs on this machine, by size: the floor of a small expert-parallel step.

    python benchmarks/collective_latency.py [--world 2] [--calls 200]

Two (or --world) spawned CPU ranks, one thread each, as `moecompile train` runs them. Mean microseconds
per call of `all_to_all_single`, `all_reduce` and a send/recv round trip, at 16 floats (latency only)
and at the main job's dispatch size (256 tokens x top-2 x H=256 fp32 = 512 KiB per rank), next to a
plain TCP loopback round trip between two processes: the transport's own floor. Then the main job's
step itself (tiny-llama, 8 experts top-2, ep = world, batch 4 x 64 bytes per rank, as `moecompile
train` runs it): its collectives per step and the time its waits take, by torch.profiler.
"""
from __future__ import annotations

import argparse
import os
import socket
import time

SIZES = {"16 floats": 16, "512 KiB": 128 * 1024}


def _per_call_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def collectives(rank: int, world: int, calls: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    out = {}
    for name, n in SIZES.items():
        x, y = torch.randn(n), torch.empty(n)
        dist.barrier()
        out[f"all_to_all_single  {name}"] = _per_call_us(lambda: dist.all_to_all_single(y, x), calls)
        dist.barrier()
        out[f"all_reduce         {name}"] = _per_call_us(lambda: dist.all_reduce(x), calls)
        if world == 2:
            peer = 1 - rank

            def round_trip() -> None:
                if rank == 0:
                    dist.send(x, peer), dist.recv(y, peer)
                else:
                    dist.recv(y, peer), dist.send(x, peer)

            dist.barrier()
            out[f"send/recv rtt      {name}"] = _per_call_us(round_trip, calls)
    return out


def ep_step(rank: int, world: int, steps: int) -> dict[str, float]:
    """Per step of the main job's shape: ms, collective calls, ms spent inside the waits (self time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moecompile.bench import BenchSpec, _build, _tokens
    from moecompile.host_memory import keep_freed_memory

    keep_freed_memory()
    spec = BenchSpec(model="tiny-llama", batch=4 * world, seq=64)
    x, y = _tokens(spec, rank, world)
    step = _build(f"moecompile_ep{world}", spec, world, x)
    for _ in range(3):
        step(x, y)
    torch.distributed.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step(x, y)
        elapsed = time.perf_counter() - start
    events = prof.key_averages()
    calls = {kind: sum(e.count for e in events if e.key == f"c10d::{kind}_") / steps
             for kind in ("alltoall_base", "allreduce")}
    wait_us = sum(e.self_cpu_time_total for e in events if "wait_tensor" in e.key)
    return {"ms": 1e3 * elapsed / steps, **calls, "wait_ms": wait_us / 1e3 / steps}


def tcp_round_trip_us(calls: int) -> float:
    """Two processes bouncing 16 bytes over 127.0.0.1 with TCP_NODELAY."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    if os.fork() == 0:
        c = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(calls + 10):
            c.sendall(c.recv(16))
        os._exit(0)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    us = _per_call_us(lambda: (conn.sendall(b"x" * 16), conn.recv(16)), calls)
    os.wait()
    return us


def main() -> None:
    from moecompile.planner.microbench import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--step-count", type=int, default=10, help="profiled steps of the main job (default 10)")
    args = p.parse_args()
    ranks = run_ranks(collectives, args.world, (args.calls,), threads=1)
    print(f"gloo, {args.world} ranks x 1 thread, mean of {args.calls} calls (slowest rank)")
    for key in ranks[0]:
        print(f"  {key}  {max(r[key] for r in ranks):8.0f} us")
    print(f"  tcp loopback rtt   16 bytes   {tcp_round_trip_us(args.calls):8.0f} us  (python sockets, no torch)")
    if args.world > 1:
        steps = run_ranks(ep_step, args.world, (args.step_count,), threads=1)
        slow = max(steps, key=lambda r: r["ms"])
        print(f"main job's step (tiny-llama E8 top-2, ep={args.world}, 256 tokens per rank, {args.step_count} steps "
              f"under torch.profiler, slowest rank): {slow['ms']:.1f} ms a step, {slow['alltoall_base']:.0f} "
              f"all-to-alls + {slow['allreduce']:.0f} all-reduces, {slow['wait_ms']:.1f} ms inside collective waits")


if __name__ == "__main__":
    main()
