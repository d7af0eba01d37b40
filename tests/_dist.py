"""Spawn helper for distributed tests: N processes over gloo on CPU, bounded by a wall-clock timeout.

    results = spawn(scenario, world_size=2, args=(...), timeout=60)   # scenario(rank, world_size, *args)

Each rank runs ``scenario`` with ``torch.distributed`` initialised and returns something small and
picklable (checks run inside the ranks). A rank that raises fails the test with its traceback; a
rank that hangs past ``timeout`` is killed and the test fails saying so, so CI never hangs.
``may_exit`` names ranks allowed to die without reporting (fault-injection tests).
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, results: Any, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share the CI's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        from moecompile.distributed import shutdown

        shutdown()


def spawn(fn: Callable, world_size: int, args: tuple = (), timeout: float = 90.0, may_exit: tuple[int, ...] = ()) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; their results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, results, args), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    expected = set(range(world_size))
    try:
        while expected - set(out) - set(errors):
            pending = expected - set(out) - set(errors)
            if all(not procs[r].is_alive() for r in pending) and all(r in may_exit for r in pending):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"ranks {sorted(pending)} did not finish within {timeout:.0f} s (hang?); "
                    f"finished: {sorted(out)}, failed: {sorted(errors)}" + _tracebacks(errors)
                )
            try:
                rank, status, value = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            (out if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError(f"ranks {sorted(errors)} raised:" + _tracebacks(errors))
    return [out.get(r) for r in range(world_size)]


def _tracebacks(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
