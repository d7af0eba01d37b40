"""`adamw_update`: one AdamW step of one tensor, its moments stored in their own dtype.

Legend: n elements of the tensor (any shape, updated element by element); t the step count.

    m = lerp(m, g, 1 - beta1)         v = beta2 * v + (1 - beta2) * g * g      (fp32; stored rounded)
    p = p * (1 - lr * wd) - m / ((sqrt(v) / bc2_sqrt + eps) / step_size)       (fp32; stored in p's dtype)

with ``step_size = lr / (1 - beta1^t)`` and ``bc2_sqrt = sqrt(1 - beta2^t)``, computed from the 0-dim
count tensor on its device (no host sync, so a CUDA graph can hold the step). torch.optim.AdamW's
formula, as moecompile.AdamW keeps it. Three bodies:

- the reference: that formula in torch ops, one pass per op over the tensor and fp32 copies of bf16
  moments; readable, and the oracle the others are tested against;
- the host body (CPU tensors): torch's own fused CPU AdamW, one vectorised multi-threaded pass, over
  chunks small enough to stay in cache, each chunk's bf16 moments (or value) widened into fp32
  buffers and rounded back once; elementwise, so a range of a tensor updates alone, bitwise;
- the Triton body (CUDA): reads g, m, v, p once and writes m, v, p once.

A plain function, not a ``torch.library`` op: an optimizer step is never traced or exported, and a
captured step records the kernel it launches as it is.
"""
import torch
from torch import Tensor

from . import backend

# elements the host body widens at a time: 1 MiB an fp32 buffer, in cache even with a host's cache shared by its
# GPUs' processes; smaller chunks pay tens of us of dispatch each (benchmarks/host_adamw.py --chunks sweeps it)
CHUNK = 1 << 18


def bias_corrections(step: Tensor, lr: float, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    """``(lr / (1 - beta1^t), sqrt(1 - beta2^t))`` as 0-dim tensors on the count's device, in its dtype."""
    return lr / (1 - beta1 ** step), (1 - beta2 ** step).sqrt()


def adamw_update_ref(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor, *,
                     lr: float, weight_decay: float, beta1: float, beta2: float, eps: float) -> None:
    """Pure-torch update of ``p``, ``m`` and ``v`` in place: the test oracle (``step``: the count, this step's
    included)."""
    step_size, bc2_sqrt = bias_corrections(step, lr, beta1, beta2)
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


def adamw_update_host(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor, *,
                      lr: float, weight_decay: float, beta1: float, beta2: float, eps: float) -> None:
    """The update by ``torch._fused_adamw_`` (torch.optim.AdamW(fused=True)'s CPU kernel): at once where every
    tensor is fp32, else over CHUNK-element slices with the others widened into reused fp32 buffers."""
    tensors = [p, g, m, v]
    if not all(t.is_contiguous() for t in tensors) or not isinstance(lr, (int, float)):
        adamw_update_ref(p, g, m, v, step, lr=lr, weight_decay=weight_decay, beta1=beta1, beta2=beta2, eps=eps)
        return
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    if all(t.dtype == torch.float32 for t in tensors):
        torch._fused_adamw_([p], [g], [m], [v], [], [step], **hyper)
        return
    flat = [t.view(-1) for t in tensors]
    n = p.numel()
    buffers = [None if t.dtype == torch.float32 else torch.empty(min(n, CHUNK), device=p.device) for t in flat]
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        parts = [t[lo:hi] if buf is None else buf[:hi - lo].copy_(t[lo:hi]) for t, buf in zip(flat, buffers)]
        torch._fused_adamw_(*([part] for part in parts), [], [step], **hyper)
        for i in (0, 2, 3):  # the value and the moments, rounded back once; the gradient is only read
            if buffers[i] is not None:
                flat[i][lo:hi].copy_(parts[i])


def adamw_update(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor, *,
                 lr: float, weight_decay: float, beta1: float, beta2: float, eps: float) -> None:
    """One AdamW step of ``p`` (in place, with its moments ``m`` and ``v``; ``step`` the 0-dim count, this step
    included); see the module docstring."""
    if not (p.shape == g.shape == m.shape == v.shape):
        raise ValueError(f"adamw_update: p {tuple(p.shape)}, g {tuple(g.shape)}, m {tuple(m.shape)} and v "
                         f"{tuple(v.shape)} must have one shape")
    backend.implementation("adamw_update", p.device)(p, g, m, v, step, lr=lr, weight_decay=weight_decay,
                                                     beta1=beta1, beta2=beta2, eps=eps)


def host_traffic(moment_bytes: float) -> float:
    """Bytes an element the host body moves over memory for an fp32 master and gradient: one pass, the master and
    both moments read and written, the gradient read (its widened chunks stay in cache). 28 with fp32 moments, as
    torch's fused AdamW; 20 in bf16."""
    return 2 * (4 + 2 * moment_bytes) + 4


backend.register("adamw_update", adamw_update_ref, triton="adamw_triton:adamw_update", host=adamw_update_host)
