"""CUDA graphs emulated on CPU, so the capture runners can be tested without a GPU.

A real CUDA graph records the device kernels a region launches and replays them later
without running any Python: every value the Python code computed at capture time (a
learning rate, a bias correction read with ``.item()``, a shape) is frozen into the graph,
inputs must be copied into the buffers the capture used, and a host read during capture
is an error. ``emulated_cuda_graphs()`` reproduces exactly that at the ATen level:

- ``torch.cuda.graph(g)`` records every ATen op (function, argument objects, outputs)
  through a TorchDispatchMode; host reads (``.item()``, ``equal``, ``nonzero``...) raise
  as a capture would;
- ``g.replay()`` re-runs the recorded ops on the same tensor objects and writes each
  result into the tensor the capture produced (views and in-place ops alias already),
  outside autocast, which already chose the recorded ops' dtypes;
- ``torch.cuda.set_sync_debug_mode("error")`` makes host reads raise outside capture;
- streams, ``synchronize`` and memory pools are no-ops (one device, one stream); a replayed
  collective is waited on at once, as stream order would.

``torch.cuda.make_graphed_callables`` then runs torch's own implementation on top.
What it cannot show: memory-pool reuse between graphs and real stream ordering.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.item.default, aten.equal.default, aten.is_nonzero.default,
              aten.nonzero.default, aten.masked_select.default}


class _NoHostReads(TorchDispatchMode):
    """Raise on every op that hands a device value to the host; optionally record the rest."""

    def __init__(self, tape: list | None, why: str):
        super().__init__()
        self.tape, self.why = tape, why
        self.before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tensor, value before capture)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise RuntimeError(f"{self.why}: {func} reads a device tensor on the host (emulated CUDA graph)")
        if self.tape is not None:
            self._remember_writes(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.tape is not None:
            self.tape.append((func, args, kwargs, out))
        return out

    def _remember_writes(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Keep the old value of every tensor the op writes: a capture launches nothing, so it changes nothing.
        c10d's in-place collectives (broadcast_, allreduce_, alltoall_base_, ...) write their tensors without
        saying so in their schemas: all their tensors count as written (missed, a ZeRO all-gather's values
        received at capture stayed, and the replay's update came on top of the capture's)."""
        for i, a in enumerate(func._schema.arguments):
            written = a.alias_info is not None and a.alias_info.is_write
            if not (written or func.namespace == "c10d"):
                continue
            value = args[i] if i < len(args) else kwargs.get(a.name)
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor) and id(t) not in self.before:
                    self.before[id(t)] = (t, t.detach().clone())

    def undo_writes(self) -> None:
        """Last write first, so that of views of one memory written in turn (an optimizer's update of this rank's
        range, then its broadcast of it) the value from before the capture is the one left."""
        with torch.no_grad():
            for t, old in reversed(list(self.before.values())):
                t.copy_(old)
        self.before.clear()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


class EmulatedGraph:
    """A recorded op tape replayed without the Python that produced it."""

    made: list["EmulatedGraph"] = []  # every graph created inside emulated_cuda_graphs()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.tape: list[tuple] = []
        self.replays = 0
        EmulatedGraph.made.append(self)

    def replay(self) -> None:
        """Kernels only: no autograd graph, and no autocast. The tape holds ops autocast already rewrote (the
        dispatch mode records below it); run again under the caller's autocast, an fp32 ``bmm`` it had let be
        would compute in bf16 (missed, an imported DeepSeek-V3's attention replayed 2e-3 off its eager logits)."""
        self.replays += 1
        with torch.no_grad(), torch._C._DisableAutocast():
            for func, args, kwargs, recorded in self.tape:
                self._rerun(func, args, kwargs, recorded)

    @staticmethod
    def _rerun(func: Any, args: tuple, kwargs: dict, recorded: Any) -> None:
        fresh = func(*args, **kwargs)
        if func.namespace == "_c10d_functional" and func is not torch.ops._c10d_functional.wait_tensor.default:
            fresh = pytree.tree_map_only(torch.Tensor, torch.ops._c10d_functional.wait_tensor, fresh)
        for rec, new in zip(pytree.tree_leaves(recorded), pytree.tree_leaves(fresh)):
            if isinstance(new, torch.ScriptObject) and hasattr(new, "wait"):
                new.wait()  # a collective: in a graph it is a kernel in stream order, done before the next op
            elif isinstance(rec, torch.Tensor) and not _same_memory(rec, new):
                if rec.shape != new.shape:
                    raise RuntimeError(f"{func} gave shape {tuple(new.shape)} on replay, {tuple(rec.shape)} "
                                       "at capture: a data-dependent shape inside a CUDA graph")
                rec.copy_(new)

    def pool(self) -> tuple:
        return (0, 0)


@contextlib.contextmanager
def _graph(graph: EmulatedGraph, pool: Any = None, stream: Any = None, capture_error_mode: str = "global",
           **newer_options: Any):  # torch 2.14's make_graphed_callables passes enable_annotations
    recorder = _NoHostReads(graph.tape, "operation not permitted when stream is capturing")
    try:
        with recorder:
            yield graph
    finally:
        recorder.undo_writes()


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _SyncDebug:
    mode: _NoHostReads | None = None

    @classmethod
    def set(cls, mode: Any) -> None:
        if cls.mode is not None:
            cls.mode.__exit__(None, None, None)
            cls.mode = None
        if mode in ("error", 2):
            cls.mode = _NoHostReads(None, "called a synchronizing CUDA operation")
            cls.mode.__enter__()


@contextlib.contextmanager
def emulated_cuda_graphs() -> Iterator[list[EmulatedGraph]]:
    """Patch torch.cuda's graph, stream and capturable-optimizer hooks; yields the graphs made."""
    import torch.cuda.graphs as graphs
    import torch.optim.adam as adam

    EmulatedGraph.made = made = []
    patches = [
        (torch.cuda, "CUDAGraph", EmulatedGraph), (torch.cuda, "graph", _graph),
        (torch.cuda, "graph_pool_handle", lambda: (0, 0)), (graphs, "graph_pool_handle", lambda: (0, 0)),
        (torch.cuda, "synchronize", lambda *a, **k: None), (torch.cuda, "Stream", _Stream),
        (torch.cuda, "current_stream", lambda *a, **k: _Stream()),
        (torch.cuda, "stream", lambda s: contextlib.nullcontext()),
        (torch.cuda, "set_sync_debug_mode", _SyncDebug.set),
        # the device here is the CPU: let capturable optimizers keep their state on it
        (adam, "_get_capturable_supported_devices", lambda *a, **k: ["cpu", "cuda"]),
    ]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    try:
        for mod, name, value in patches:
            setattr(mod, name, value)
        yield made
    finally:
        _SyncDebug.set("default")
        for mod, name, value in saved:
            setattr(mod, name, value)
