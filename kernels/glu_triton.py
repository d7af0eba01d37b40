"""Triton body of `moecompile::glu` / `glu_backward`: fused SwiGLU / GeGLU, optionally row-weighted.

Legend: M rows (leading dims flattened), F FFN width; h_MF2 = [gate | up].

One read of h and one write of the output (forward); backward reads grad and
h once and writes dh, plus dweight[m] = <grad[m], act(gate[m]) * up[m]>
accumulated in float32 in the same loop. All math in float32.
"""
import triton
import triton.language as tl
import torch
from torch import Tensor

from .glu import _check

INTERPRET = triton.knobs.runtime.interpret  # what @triton.jit below was decorated under
_ACT_ID = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "clamped_swiglu": 4}


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _act(x, ACT: tl.constexpr):
    # constants: sqrt(1/2), sqrt(2/pi); in _act_grad also 1/sqrt(2 pi) and 3 * 0.044715
    if ACT == 0:
        y = x * _sigmoid(x)
    elif ACT == 1:
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACT == 2:
        y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif ACT == 3:
        y = tl.maximum(x, 0.0)
    else:  # clamped_swiglu: glu.SWIGLU_LIMIT 7, glu.SWIGLU_ALPHA 1.702
        g = tl.minimum(x, 7.0)
        y = g * _sigmoid(1.702 * g)
    return y


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    """act'(x)"""
    if ACT == 0:
        s = _sigmoid(x)
        d = s * (1.0 + x * (1.0 - s))
    elif ACT == 1:
        d = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACT == 2:
        t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    elif ACT == 3:
        d = (x > 0.0).to(tl.float32)
    else:
        g = tl.minimum(x, 7.0)
        s = _sigmoid(1.702 * g)
        d = tl.where(x <= 7.0, s * (1.0 + 1.702 * g * (1.0 - s)), 0.0)
    return d


@triton.jit
def _up(up, ACT: tl.constexpr):
    """The up half as the product reads it (glu._up)."""
    if ACT == 4:
        up = tl.minimum(tl.maximum(up, -7.0), 7.0) + 1.0
    return up


@triton.jit
def _up_grad(up, ACT: tl.constexpr):
    if ACT == 4:
        d = ((up >= -7.0) & (up <= 7.0)).to(tl.float32)
    else:
        d = tl.full(up.shape, 1.0, tl.float32)
    return d


@triton.jit
def _glu_fwd_kernel(
    h_ptr, w_ptr, out_ptr,
    M, F,
    stride_hm, stride_om,
    HAS_W: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    h_rows = h_ptr + rows[:, None] * stride_hm + cols[None, :]
    gate = tl.load(h_rows, mask=mask, other=0.0).to(tl.float32)
    up = _up(tl.load(h_rows + F, mask=mask, other=0.0).to(tl.float32), ACT)
    out = _act(gate, ACT) * up
    if HAS_W:
        out = out * tl.load(w_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    g_ptr, h_ptr, w_ptr, dh_ptr, dw_ptr,
    M, F,
    stride_gm, stride_hm, stride_dhm,
    HAS_W: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < M
    if HAS_W:
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_M], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (cols < F)[None, :]
        g = tl.load(g_ptr + rows[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h_rows = h_ptr + rows[:, None] * stride_hm + cols[None, :]
        gate = tl.load(h_rows, mask=mask, other=0.0).to(tl.float32)
        up_raw = tl.load(h_rows + F, mask=mask, other=0.0).to(tl.float32)
        up = _up(up_raw, ACT)
        a = _act(gate, ACT)
        if HAS_W:
            dw += tl.sum(g * a * up, axis=1)
            g = g * w[:, None]
        dh_rows = dh_ptr + rows[:, None] * stride_dhm + cols[None, :]
        tl.store(dh_rows, (g * up * _act_grad(gate, ACT)).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_rows + F, (g * a * _up_grad(up_raw, ACT)).to(dh_ptr.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(dw_ptr + rows, dw.to(dw_ptr.dtype.element_ty), mask=row_ok)


def _config(F: int, backward: bool = False) -> dict:
    """Tile sizes: small under the interpreter (each program is a numpy call), ~4K elements on a GPU. The
    backward keeps five tiles live: in fp32 on 4 warps ptxas gave it 241-255 registers a thread for sm_90 (the
    limit), on 8 warps 122-128, so twice the warps fit an SM (kernels/cross_compile.py, ad hoc sweep)."""
    if INTERPRET:
        return dict(BLOCK_M=32, BLOCK_F=min(64, triton.next_power_of_2(F)), num_warps=1)
    block_f = min(256, triton.next_power_of_2(F))
    return dict(BLOCK_M=max(1, 4096 // block_f), BLOCK_F=block_f, num_warps=8 if backward else 4)


def _rows(t: Tensor, width: int) -> Tensor:
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def glu_triton(h_NF2: Tensor, act: str, weight_N: Tensor | None = None) -> Tensor:
    _check(h_NF2, act, weight_N)
    F2 = h_NF2.shape[-1]
    h_MF2 = _rows(h_NF2, F2)
    M, F = h_MF2.shape[0], F2 // 2
    out_MF = h_MF2.new_empty((M, F))
    w_M = h_MF2 if weight_N is None else weight_N.reshape(-1).contiguous()
    cfg = _config(F)
    if M and F:
        grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(F, cfg["BLOCK_F"]))
        _glu_fwd_kernel[grid](h_MF2, w_M, out_MF, M, F, h_MF2.stride(0), out_MF.stride(0),
                              HAS_W=weight_N is not None, ACT=_ACT_ID[act], **cfg)
    return out_MF.view(*h_NF2.shape[:-1], F)


def glu_backward_triton(
    grad_NF: Tensor, h_NF2: Tensor, act: str, weight_N: Tensor | None
) -> tuple[Tensor, Tensor]:
    F2 = h_NF2.shape[-1]
    h_MF2, g_MF = _rows(h_NF2, F2), _rows(grad_NF, F2 // 2)
    M, F = h_MF2.shape[0], F2 // 2
    dh_MF2 = h_MF2.new_empty((M, F2), dtype=torch.promote_types(grad_NF.dtype, h_NF2.dtype))
    has_w = weight_N is not None
    w_M = weight_N.reshape(-1).contiguous() if has_w else h_MF2
    dw_M = weight_N.new_empty((M,)) if has_w else h_MF2.new_empty((0,))
    cfg = _config(F, backward=True)
    if M:
        _glu_bwd_kernel[(triton.cdiv(M, cfg["BLOCK_M"]),)](
            g_MF, h_MF2, w_M, dh_MF2, dw_M, M, F, g_MF.stride(0), h_MF2.stride(0), dh_MF2.stride(0),
            HAS_W=has_w, ACT=_ACT_ID[act], **cfg)
    return dh_MF2.view(h_NF2.shape), dw_M.view(weight_N.shape) if has_w else dw_M
