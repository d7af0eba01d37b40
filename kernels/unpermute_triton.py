"""Triton body of `moecompile::unpermute` / `unpermute_backward`: the weighted combine and its gradient.

Legend: N permuted rows, H hidden, T tokens, K top-k, A = T*K assignments.

    dest_A[a]          = the row assignment a landed in (-1: dropped)     inverts row_src_N
    out_TH[t]          = sum_j w[t, j] * y_NH[dest_A[t*K + j]]              one program per token tile
                                                                          (weighted=False: no w)
    grad_y_NH[r]       = w[row_src[r]] * grad_TH[row_src[r] // K]         row gather
    grad_weights_TK[a] = <grad_TH[a // K], y_NH[dest_A[a]]>               row dots, float32

Every token reads its K rows and sums them in registers (float32): no atomics,
deterministic. Assumes what permute guarantees: each assignment occupies at
most one row.
"""
import triton
import triton.language as tl
import torch
from torch import Tensor

from .permute_triton import INTERPRET, combine_rows, gather_rows, invert_rows
from .unpermute import _check


@triton.jit
def _rowdot_kernel(
    g_ptr, y_ptr, dest_ptr, out_ptr, A, H, K,
    stride_gt, stride_yn,
    BLOCK_A: tl.constexpr, BLOCK_H: tl.constexpr,
):
    a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    d = tl.load(dest_ptr + a, mask=a < A, other=-1)
    tok = (a // K).to(tl.int64)
    row = tl.where(d >= 0, d, 0)
    acc = tl.zeros([BLOCK_A], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = (d >= 0)[:, None] & (h < H)[None, :]
        g = tl.load(g_ptr + tok[:, None] * stride_gt + h[None, :], mask=m, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row[:, None] * stride_yn + h[None, :], mask=m, other=0.0).to(tl.float32)
        acc += tl.sum(g * y, axis=1)
    tl.store(out_ptr + a, acc.to(out_ptr.dtype.element_ty), mask=a < A)


def unpermute_triton(
    y_NH: Tensor, row_src_N: Tensor, weights_TK: Tensor, num_tokens: int, weighted: bool = True
) -> Tensor:
    _check(y_NH, row_src_N, weights_TK, num_tokens)
    K = weights_TK.shape[1]
    dest_A = invert_rows(row_src_N.contiguous(), weights_TK.numel())
    coef_A = weights_TK.reshape(-1).contiguous() if weighted else None
    return combine_rows(y_NH, dest_A, coef_A, num_tokens, K, y_NH.dtype)


def unpermute_backward_triton(
    grad_TH: Tensor, y_NH: Tensor, row_src_N: Tensor, weights_TK: Tensor, weighted: bool = True
) -> tuple[Tensor, Tensor]:
    T, K = weights_TK.shape
    row_src_N = row_src_N.contiguous()
    w_A = weights_TK.reshape(-1).contiguous() if weighted else None
    grad_y_NH = gather_rows(grad_TH, row_src_N, K, w_A, torch.promote_types(grad_TH.dtype, y_NH.dtype))
    if not weighted:
        return grad_y_NH, torch.zeros_like(weights_TK)
    dest_A = invert_rows(row_src_N, T * K)
    grad_w_A = torch.empty(T * K, dtype=weights_TK.dtype, device=weights_TK.device)
    A, H = T * K, y_NH.shape[1]
    y_NH = y_NH if y_NH.stride(-1) == 1 else y_NH.contiguous()
    grad_TH = grad_TH if grad_TH.stride(-1) == 1 else grad_TH.contiguous()
    if A:
        # 8 warps on a GPU: with 4, ptxas gives the [32, 256] fp32 tiles 252 registers a thread for sm_90
        block_a, block_h, warps = (64, min(64, triton.next_power_of_2(max(H, 1))), 1) if INTERPRET else (32, 256, 8)
        _rowdot_kernel[(triton.cdiv(A, block_a),)](
            grad_TH, y_NH, dest_A, grad_w_A, A, H, K, grad_TH.stride(0), y_NH.stride(0),
            BLOCK_A=block_a, BLOCK_H=block_h, num_warps=warps)
    return grad_y_NH, grad_w_A.view(T, K)
