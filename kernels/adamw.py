"""`adamw_update`: one AdamW step of one tensor, its moments stored in their own dtype.

Legend: n elements of the tensor (any shape, updated element by element).

    m = lerp(m, g, 1 - beta1)         v = beta2 * v + (1 - beta2) * g * g      (fp32; stored rounded)
    p = p * (1 - lr * wd) - m / ((sqrt(v) / bc2_sqrt + eps) / step_size)       (fp32; stored in p's dtype)

with ``step_size = lr / (1 - beta1^t)`` and ``bc2_sqrt = sqrt(1 - beta2^t)`` given as 0-dim tensors
(computed on the device from the step count: no host sync, so a CUDA graph can hold the step).
torch.optim.AdamW's formula, as moecompile.AdamW keeps it. The reference is that in torch ops, one
pass per op over the tensor and fp32 copies of bf16 moments; the Triton body reads g, m, v, p once
and writes m, v, p once.

A plain function, not a ``torch.library`` op: an optimizer step is never traced or exported, and a
captured step records the kernel it launches as it is.
"""
import functools

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import backend


def adamw_update_ref(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step_size: Tensor, bc2_sqrt: Tensor, *,
                     lr: float, weight_decay: float, beta1: float, beta2: float, eps: float) -> None:
    """Pure-torch update of ``p``, ``m`` and ``v`` in place: the CPU implementation and the test oracle."""
    grad = g.float()
    exp_avg = m.float().lerp_(grad, 1 - beta1)  # in place when the moments are fp32
    exp_avg_sq = v.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    for stored, computed in ((m, exp_avg), (v, exp_avg_sq)):
        if computed is not stored:
            stored.copy_(computed)  # rounded to the moments' dtype once
    value = p.float() if p.dtype != torch.float32 else p
    value.mul_(1 - lr * weight_decay)
    # torch's denom sqrt(v / bc2) + eps, divided by the step size: then one fused addcdiv
    denom = exp_avg_sq.sqrt().div_(bc2_sqrt).add_(eps).div_(step_size)
    value.addcdiv_(exp_avg, denom, value=-1)
    if value is not p:
        p.copy_(value)


def adamw_update(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step_size: Tensor, bc2_sqrt: Tensor, *,
                 lr: float, weight_decay: float, beta1: float, beta2: float, eps: float) -> None:
    """One AdamW step of ``p`` (in place, with its moments ``m`` and ``v``); see the module docstring."""
    if not (p.shape == g.shape == m.shape == v.shape):
        raise ValueError(f"adamw_update: p {tuple(p.shape)}, g {tuple(g.shape)}, m {tuple(m.shape)} and v "
                         f"{tuple(v.shape)} must have one shape")
    backend.implementation("adamw_update", p.device)(p, g, m, v, step_size, bc2_sqrt, lr=lr,
                                                     weight_decay=weight_decay, beta1=beta1, beta2=beta2, eps=eps)


backend.register("adamw_update", adamw_update_ref, triton="adamw_triton:adamw_update")


class _Traffic(TorchDispatchMode):
    """Bytes each op moves over memory, one pass per op: its tensor inputs read (a copy's destination is only
    written, views move nothing) and its outputs written. 0-dim tensors (the hyperparameters) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view:
            inputs = args[1:] if func is torch.ops.aten.copy_.default else args
            read = {id(t): t for t in tree_leaves((inputs, kwargs)) if isinstance(t, Tensor) and t.dim()}
            written = [t for t in tree_leaves(out) if isinstance(t, Tensor) and t.dim()]
            self.bytes += sum(t.nbytes for t in (*read.values(), *written))
        return out


@functools.cache
def reference_traffic(moment_dtype: torch.dtype, param_dtype: torch.dtype = torch.float32) -> float:
    """Bytes per element :func:`adamw_update_ref` moves over memory (with an fp32 gradient): one pass per op, counted
    from its own ops on meta tensors. The Triton body, like torch's fused AdamW, makes one pass in all; the
    reference is what runs on a CPU, so the planner prices an offloaded update of these moments with it."""
    n = 1024
    p = torch.empty(n, dtype=param_dtype, device="meta")
    g = torch.empty(n, device="meta")
    m, v = (torch.empty(n, dtype=moment_dtype, device="meta") for _ in range(2))
    scalar = torch.empty((), dtype=torch.float64, device="meta")
    with _Traffic() as traffic:
        adamw_update_ref(p, g, m, v, scalar, scalar, lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.999, eps=1e-8)
    return traffic.bytes / n
