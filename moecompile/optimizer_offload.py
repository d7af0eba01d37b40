"""Part of the optimizer in host memory, stepped by the CPU (``parallel.offload_optimizer``; ZeRO-Offload).

The memory wall's largest per-parameter term is the optimizer's: AdamW's two fp32 moments plus,
for a bf16 model, the fp32 master and its gradient, 16 bytes an element against the weight's 2.
Offloading keeps that for a share of the elements in host memory, where there is far more of it
(a DGX H100 has 256 GB of DRAM per GPU), and pays PCIe traffic (the gradient down, the new
values up, in the model's dtype) and a CPU update. The step runs, as Megatron-Core's
HybridDeviceOptimizer and DeepSpeed's ZeRO-Offload do:

    reduced gradients of the host part -> host (asynchronous, pinned buffers)
    device part of the optimizer: its kernels are queued   } the two run side by side
    wait for the gradients; host part of the optimizer     }
    new values -> device (asynchronous; the next forward's kernels queue behind them)

One optimizer holds both parts (its state, param groups, checkpoints and schedulers are the
user's, unchanged); each part is a ``step()`` over its own tensors, so each gets its device's
implementation: torch's default on CUDA (foreach), and on a CPU (the host part, or a whole step
whose device is the CPU) the fused CPU kernel where the optimizer has one and the factory left the
choice to torch (``fused`` and ``foreach`` unset, not ``capturable``: torch would pick its for-loop
one for CPU tensors, 2.2x slower at 32 M elements on 2 cores, ``python benchmarks/host_adamw.py``;
it rounds an ulp apart from it). A factory that sets either keeps its choice on both sides. The
host part is the first tensors in parameter order up to the plan's share of the elements
(:func:`offloaded_count`), whole tensors, so the share reached is at least the one asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.optim.optimizer as optim_hooks

from .errors import MoecompileError
from .grad_sync import Shard
from .optimizer import Update
from .optimizer import updates_for as on_device

# torch optimizers with a fused CPU kernel, which the host part runs unless the factory chose an implementation
FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def offloaded_count(sizes: list[int], fraction: float) -> int:
    """How many of the leading tensors (of ``sizes`` elements) hold ``fraction`` of all elements: the fewest that
    reach it (0 for 0, all for 1)."""
    if fraction <= 0:
        return 0
    target, total = fraction * sum(sizes), 0
    for i, n in enumerate(sizes):
        if total >= target:
            return i
        total += n
    return len(sizes)


def offloaded_share(sizes: list[int], fraction: float) -> float:
    """The share of the elements :func:`offloaded_count` moves (at least ``fraction``: whole tensors move)."""
    total = sum(sizes)
    return sum(sizes[: offloaded_count(sizes, fraction)]) / total if total else 0.0


@dataclasses.dataclass
class HostUpdate(Update):
    """An update whose fp32 master, gradient and optimizer state live in host memory.

    ``grad_in`` receives the reduced gradient from the device (pinned, in the gradient's dtype)
    where that is not already the master's fp32 gradient; ``values_out`` is the new values in the
    parameter's dtype on their way up. Both are None on a CPU device, where host and device are one.
    """

    grad_in: torch.Tensor | None = None
    values_out: torch.Tensor | None = None

    def load_grad(self) -> None:
        """Start the gradient's copy to the host (asynchronous on CUDA: :func:`step` waits for it)."""
        grad = self.shard.grad.detach()
        (self.grad_in if self.grad_in is not None else self.tensor.grad).copy_(grad, non_blocking=True)

    def grad_arrived(self) -> None:
        """The copy is done: the master's fp32 gradient from the received one."""
        if self.grad_in is not None:
            self.tensor.grad.copy_(self.grad_in)

    def stage(self) -> None:
        """The master's new values, cast to the parameter's dtype, into the pinned buffer they go up from."""
        if self.values_out is not None:
            with torch.no_grad():
                self.values_out.copy_(self.tensor)

    def write_back(self) -> None:
        """The master's new values into the parameter (asynchronous on CUDA, from pinned memory)."""
        self.stage()
        with torch.no_grad():
            self.shard.values().copy_(self.tensor if self.values_out is None else self.values_out, non_blocking=True)

    def nbytes(self) -> int:
        """Host bytes of the master, its gradient and the transfer buffers (the optimizer's state not included)."""
        held = [self.tensor, self.tensor.grad, self.grad_in, self.values_out]
        return sum(t.numel() * t.element_size() for t in held if t is not None)


def to_host(shard: Shard, device: torch.device, buffers: bool | None = None) -> HostUpdate:
    """An fp32 master of ``shard``'s values and its gradient, in host memory (pinned for a CUDA device).

    ``buffers``: the transfer buffers where the dtypes differ (None: for a CUDA device; True on the CPU
    gives the host the work of a CUDA run, for planner/host_bench.py to time)."""
    pin = device.type == "cuda"
    buffered = pin if buffers is None else buffers
    values = shard.values().detach()
    dtype = torch.promote_types(values.dtype, torch.float32)

    def host(dt: torch.dtype) -> torch.Tensor:
        return torch.empty(values.shape, dtype=dt, device="cpu", pin_memory=pin)

    master = nn.Parameter(host(dtype))
    with torch.no_grad():
        master.copy_(values)
    master.grad = host(dtype)
    grad_dtype = shard.grad.dtype
    return HostUpdate(shard, master, True,
                      grad_in=host(grad_dtype) if buffered and grad_dtype != dtype else None,
                      values_out=host(values.dtype) if buffered and values.dtype != dtype else None)


def transfer_bytes(elem_bytes: float, grad_bytes: float | None = None) -> float:
    """Pinned host bytes an offloaded element keeps on a CUDA device (:func:`to_host`'s ``grad_in`` and ``values_out``):
    its gradient received, where that is not fp32, and its new value sent, where the parameter is not fp32."""
    grad = elem_bytes if grad_bytes is None else grad_bytes
    return (grad if grad < 4 else 0) + (elem_bytes if elem_bytes < 4 else 0)


def updates_for(shards: list[Shard], masters: bool, fraction: float, device: torch.device) -> list[Update]:
    """What the optimizer updates for each shard (moecompile.optimizer.updates_for), the leading ones holding
    ``fraction`` of the elements in host memory."""
    n = offloaded_count([s.hi - s.lo for s in shards], fraction)
    return [to_host(s, device) for s in shards[:n]] + on_device(shards[n:], masters)


@contextlib.contextmanager
def _only(optimizer: torch.optim.Optimizer, keep: Callable[[torch.Tensor], bool], fused: bool = False
          ) -> Iterator[bool]:
    """The optimizer's groups holding only the tensors ``keep`` accepts; yields whether any is left. ``fused``:
    groups that left the implementation to torch run its fused kernel meanwhile."""
    groups = optimizer.param_groups
    saved = [(g["params"], g.get("fused")) for g in groups]
    fuse = fused and type(optimizer) in FUSED_ON_CPU
    try:
        for g, (params, _) in zip(groups, saved):
            g["params"] = [p for p in params if keep(p)]
            if fuse and g.get("fused") is None and g.get("foreach") is None and not g.get("capturable"):
                g["fused"] = True
        yield any(g["params"] for g in groups)
    finally:
        for g, (params, was) in zip(groups, saved):
            g["params"] = params
            if "fused" in g:
                g["fused"] = was


def check(optimizer: torch.optim.Optimizer, updates: list[Update]) -> None:
    """Refuse an optimizer that cannot step in two parts: one whose update of a tensor reads the others'.

    Every torch.optim optimizer but LBFGS updates each tensor from its own gradient and state (step
    counts included); a custom one must too. Its step hooks still run once a step (:func:`step`).
    """
    if any(isinstance(u, HostUpdate) for u in updates) and isinstance(optimizer, torch.optim.LBFGS):
        raise MoecompileError(
            "parallel.offload_optimizer steps the host's tensors and the device's apart, and LBFGS updates all "
            "parameters as one vector (its line search reads them all); use an optimizer that updates each tensor "
            "on its own (SGD, Adam, AdamW, ...), or parallel.offload_optimizer: 0")


def step(optimizer: torch.optim.Optimizer, updates: list[Update], device: torch.device) -> None:
    """Hand the reduced gradients to the optimizer and step it: the device part while the host part runs."""
    for u in updates:
        u.load_grad()
    host = [u for u in updates if isinstance(u, HostUpdate)]
    on_cpu = device.type == "cpu"
    if not host:
        with _only(optimizer, lambda p: True, fused=on_cpu):
            optimizer.step()
        return
    arrived = None
    if device.type == "cuda":
        arrived = torch.cuda.Event()
        arrived.record()
    on_host = {id(u.tensor) for u in host}
    with _hooks_once(optimizer) as step_part:
        with _only(optimizer, lambda p: id(p) not in on_host, fused=on_cpu) as any_left:
            if any_left:
                step_part()  # queued on the device; runs while the host part below does
        if arrived is not None:
            arrived.synchronize()
        update_on_host(optimizer, host, step_part)


def update_on_host(optimizer: torch.optim.Optimizer, host: list[HostUpdate],
                   step_part: Callable[[], Any] | None = None) -> None:
    """The CPU's part of a step, once the gradients are in: each to fp32, and the optimizer's step over the host
    tensors only (``step_part``: the step to call, :func:`step`'s without hooks; None: ``optimizer.step``)."""
    for u in host:
        u.grad_arrived()
    on_host = {id(u.tensor) for u in host}
    with _only(optimizer, lambda p: id(p) in on_host, fused=True):
        (step_part or optimizer.step)()


@contextlib.contextmanager
def _hooks_once(optimizer: torch.optim.Optimizer) -> Iterator[Callable[[], Any]]:
    """Yield the optimizer's step without its hooks, and run the hooks once around it, with the whole groups.

    Each part is a ``step()`` of its own, and torch runs an optimizer's step hooks in every call: a
    post-hook keeping an EMA of the weights would decay it twice a step, and a pre-hook would see
    half the tensors. So, as one ``optimizer.step()`` does: the pre-hooks (global, then the
    optimizer's) before the first part, the post-hooks after the last, and a learning-rate
    scheduler told the optimizer stepped.
    """
    hooked = type(optimizer).step
    if not getattr(hooked, "hooked", False):  # a step torch did not wrap runs no hooks: call it as it is
        yield optimizer.step
        return
    unhooked = hooked.__wrapped__
    args, kwargs = (optimizer,), {}
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        for pre in itertools.chain(optim_hooks._global_optimizer_pre_hooks.values(),
                                   optimizer._optimizer_step_pre_hooks.values()):
            changed = pre(optimizer, args, kwargs)
            if changed is not None:
                args, kwargs = changed
        yield lambda: unhooked(*args, **kwargs)
        for post in itertools.chain(optimizer._optimizer_step_post_hooks.values(),
                                    optim_hooks._global_optimizer_post_hooks.values()):
            post(optimizer, args, kwargs)
    optimizer._opt_called = True  # what torch.optim.lr_scheduler's wrapper of step() records
