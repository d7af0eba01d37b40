"""Triton body of `adamw_update`: one pass over g, m, v and p (see kernels/adamw.py).

All math in fp32, IEEE-rounded division and square root as torch's; the moments are stored in
their own dtype, the parameter in its own. Tensors that are not contiguous, and hyperparameters given
as tensors, take the reference.
"""
import triton
import triton.language as tl
from torch import Tensor

from .adamw import adamw_update_ref, bias_corrections

BLOCK = 1024


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, step_size_ptr, bc2_sqrt_ptr, n, decay, w1, beta2, w2, eps,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # torch.lerp: start + w (end - start) for w < 0.5, else end - (end - start)(1 - w)
    m = tl.where(w1 < 0.5, m + w1 * (g - m), g - (g - m) * (1.0 - w1))
    v = v * beta2 + w2 * g * g
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    step_size = tl.load(step_size_ptr).to(tl.float32)
    bc2_sqrt = tl.load(bc2_sqrt_ptr).to(tl.float32)
    denom = tl.div_rn(tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps, step_size)
    p = p * decay - tl.div_rn(m, denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)


def adamw_update(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor, *,
                 lr: float, weight_decay: float, beta1: float, beta2: float, eps: float) -> None:
    scalars = (lr, weight_decay, beta1, beta2, eps)
    if not all(t.is_contiguous() for t in (p, g, m, v)) or p.numel() == 0 or \
            not all(isinstance(x, (int, float)) for x in scalars):  # e.g. a tensor lr
        adamw_update_ref(p, g, m, v, step, lr=lr, weight_decay=weight_decay, beta1=beta1, beta2=beta2, eps=eps)
        return
    step_size, bc2_sqrt = bias_corrections(step, lr, beta1, beta2)  # on the device: no host sync
    n = p.numel()
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](p, g, m, v, step_size, bc2_sqrt, n, 1 - lr * weight_decay, 1 - beta1,
                                            beta2, 1 - beta2, eps, BLOCK=BLOCK)
