"""Spawn helper for distributed tests: N processes over gloo on CPU, bounded by a wall-clock timeout.

    results = spawn(scenario, world_size=2, args=(...), timeout=60)   # scenario(rank, world_size, *args)

Each rank runs ``scenario`` with ``torch.distributed`` initialised and returns something picklable
(checks run inside the ranks); it comes back through a file, so a rank may exit as soon as it is
done. A rank that raises fails the test with its traceback; a rank that hangs past ``timeout`` is
killed and the test fails saying so, so CI never hangs. ``may_exit`` names ranks allowed to die
without reporting (fault-injection tests).

``fake_rank(rank, world_size)`` instead poses this one process as a rank of a larger world (torch's
``fake`` process group: no live collectives) for what only needs the shapes a rank would hold.

Ranks are forked from a forkserver that has imported torch, transformers' models and moecompile
once for the whole session: a fresh interpreter per rank spent ~6 s importing them, for every
scenario. The forkserver keeps the environment of the first spawn (its start).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing as mp

from moecompile.distributed import free_port

_PRELOAD = ["torch", "torch.distributed", "torch.fx", "transformers", "transformers.modeling_utils",
            "transformers.models.llama.modeling_llama", "moecompile", "moecompile.train_step"]
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(_PRELOAD)


def _worker(fn: Callable, rank: int, world_size: int, port: int, results: Any, args: tuple, out: str) -> None:
    import logging

    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share the CI's cores
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=90))
        torch.save(fn(rank, world_size, *args), os.path.join(out, f"{rank}.pt"))
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        from moecompile.distributed import shutdown

        shutdown()


def spawn(fn: Callable, world_size: int, args: tuple = (), timeout: float = 90.0, may_exit: tuple[int, ...] = ()) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; their results by rank (None for a rank
    in ``may_exit`` that died without one)."""
    with tempfile.TemporaryDirectory() as out:
        results = _CTX.Queue()
        port = free_port()
        procs = [_CTX.Process(target=_worker, args=(fn, r, world_size, port, results, args, out), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        done: set[int] = set()
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = set(range(world_size))
        try:
            while pending:
                if all(not procs[r].is_alive() for r in pending) and all(r in may_exit for r in pending):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"ranks {sorted(pending)} did not finish within {timeout:.0f} s (hang?); "
                        f"finished: {sorted(done)}, failed: {sorted(errors)}" + _tracebacks(errors)
                    )
                try:
                    rank, status = results.get(timeout=min(left, 0.5))
                except queue.Empty:
                    _fail_if_died(procs, pending - set(may_exit), results)
                    continue
                pending.discard(rank)
                if status == "ok":
                    done.add(rank)
                else:
                    errors[rank] = status
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            raise AssertionError(f"ranks {sorted(errors)} raised:" + _tracebacks(errors))
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) if r in done else None
                for r in range(world_size)]


def _fail_if_died(procs: list, ranks: set[int], results: Any) -> None:
    """A rank that exited without a word (a crash, ``os._exit``) fails the test now, not at the timeout."""
    dead = sorted(r for r in ranks if not procs[r].is_alive())
    if dead and results.empty():  # what a rank put before it exited is in the queue by now
        codes = ", ".join(f"rank {r}: {procs[r].exitcode}" for r in dead)
        raise AssertionError(f"ranks {dead} exited without a result (exit codes {codes})")


def _tracebacks(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))


def _fake_all_to_all_writes(world_size: int) -> bool:
    import torch.distributed as dist

    probe = torch.full((world_size,), -1)
    dist.all_to_all_single(probe, torch.arange(world_size))
    return bool(probe.min() >= 0)


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int, ep_step: bool = False) -> Iterator[None]:
    """This process poses as ``rank`` of a ``world_size`` world: no live collectives.

    An expert-parallel step (``ep_step``) needs its all-to-all of token counts to come back written:
    torch 2.13's fake group copies the input through (as if every rank sent the same), 2.11's and 2.12's
    leaves the output as allocated, so such a test is skipped there.
    """
    import pytest
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        if ep_step and not _fake_all_to_all_writes(world_size):
            pytest.skip(f"torch {torch.__version__}'s fake process group leaves all-to-all outputs unwritten")
        yield
    finally:
        dist.destroy_process_group()
