"""Run a function on N local gloo ranks (torch.multiprocessing, spawn) with a hard deadline.

    results = run(fn, world_size=2, args=(...), timeout=120)   # fn(rank, world_size, *args) -> picklable

A rank that raises fails the test with its traceback; a hang past ``timeout`` kills the
ranks this call started and fails, so CI never blocks on a collective.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=90))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out, f"{rank}.pt"))
    finally:
        from moecompile.distributed import shutdown

        shutdown()


def run(fn: Callable, world_size: int, args: tuple = (), timeout: float = 180.0) -> list[Any]:
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(world_size, free_port(), fn, args, out), nprocs=world_size,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):  # raises ProcessRaisedException / ProcessExitedException on failure
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout:.0f} s")
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world_size)]
