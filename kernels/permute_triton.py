"""Triton body of `moecompile::permute` / `permute_backward`: sort token copies by expert, no host sync.

Legend: T tokens, K top-k, A = T*K assignments (a = t*K + j), E experts
(padded to BLOCK_E), H hidden, N permuted rows, nB = ceil(A / BLOCK_A) blocks.

    histogram   hist_nBE[b, e]   = #assignments of block b routed to e         (nB programs)
    scan        prefix_nBE[b, e] = #earlier assignments routed to e;           (1 program)
                load_E, group_sizes_E (aligned / capacity), start_E
    scatter     rank = prefix + in-block rank (one-hot cumsum);                 (nB programs)
                row_src_N[start_E[e] + rank] = a           (if rank < capacity)
    gather      x_NH[r] = x_TH[row_src_N[r] // K], 0 for padding rows          (N x H tiles)

Ranks are stable (ascending a within an expert), so row_src_N is identical to
the reference's. drop_policy="probs" ranks by weight, a sort: that one step
runs torch's sort (`_kept_assignments`); histogram, scan and scatter then
count only the kept assignments. Backward inverts row_src_N (dest_A) and sums
each token's K rows in one program per token tile: no atomics, deterministic.
The combine (`_combine_kernel`) and row gather are shared with unpermute.
"""
import triton
import triton.language as tl
import torch
from torch import Tensor

from .permute import _check, _kept_assignments, _round_up, permuted_rows

INTERPRET = triton.knobs.runtime.interpret


@triton.jit
def _hist_kernel(
    idx_ptr, kept_ptr, hist_ptr, hist_kept_ptr, A, E,
    HAS_KEPT: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    a = pid * BLOCK_A + tl.arange(0, BLOCK_A)
    e = tl.load(idx_ptr + a, mask=a < A, other=-1).to(tl.int32)  # -1 matches no expert
    cols = tl.arange(0, BLOCK_E)
    onehot = (e[:, None] == cols[None, :]).to(tl.int32)
    tl.store(hist_ptr + pid * E + cols, tl.sum(onehot, axis=0), mask=cols < E)
    if HAS_KEPT:
        kept = tl.load(kept_ptr + a, mask=a < A, other=0).to(tl.int32)
        tl.store(hist_kept_ptr + pid * E + cols, tl.sum(onehot * kept[:, None], axis=0), mask=cols < E)


@triton.jit
def _scan_kernel(
    hist_ptr, hist_kept_ptr, prefix_ptr, load_ptr, sizes_ptr, start_ptr,
    n_blocks, E, N, C, align,
    HAS_KEPT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    load = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b0 in range(0, n_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        m = (b < n_blocks)[:, None] & col_ok[None, :]
        at = b[:, None] * E + cols[None, :]
        h_all = tl.load(hist_ptr + at, mask=m, other=0)
        h = tl.load(hist_kept_ptr + at, mask=m, other=0) if HAS_KEPT else h_all
        tl.store(prefix_ptr + at, tl.cumsum(h, axis=0) - h + carry[None, :], mask=m)
        carry += tl.sum(h, axis=0)
        load += tl.sum(h_all, axis=0)
    padded = (load + align - 1) // align * align
    slack = N - tl.sum(tl.where(col_ok, padded, 0), axis=0)  # dropless: the last group takes it
    sizes = tl.where(cols == E - 1, padded + slack, padded)
    sizes = tl.where(C > 0, C, sizes)
    sizes = tl.where(col_ok, sizes, 0)
    tl.store(load_ptr + cols, load.to(tl.int64), mask=col_ok)
    tl.store(sizes_ptr + cols, sizes.to(tl.int64), mask=col_ok)
    tl.store(start_ptr + cols, tl.cumsum(sizes, axis=0) - sizes, mask=col_ok)


@triton.jit
def _scatter_kernel(
    idx_ptr, kept_ptr, prefix_ptr, start_ptr, row_src_ptr, A, E, cap,
    HAS_KEPT: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    a = pid * BLOCK_A + tl.arange(0, BLOCK_A)
    e = tl.load(idx_ptr + a, mask=a < A, other=-1).to(tl.int32)
    if HAS_KEPT:
        e = tl.where(tl.load(kept_ptr + a, mask=a < A, other=0) != 0, e, -1)
    cols = tl.arange(0, BLOCK_E)
    onehot = (e[:, None] == cols[None, :]).to(tl.int32)
    prefix = tl.load(prefix_ptr + pid * E + cols, mask=cols < E, other=0)
    start = tl.load(start_ptr + cols, mask=cols < E, other=0)
    rank = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + prefix[None, :]), axis=1)
    dest = tl.sum(onehot * start[None, :], axis=1) + rank
    ok = (tl.sum(onehot, axis=1) > 0) & (rank < cap)
    tl.store(row_src_ptr + dest, a.to(tl.int64), mask=ok)


@triton.jit
def _gather_kernel(
    src_ptr, row_src_ptr, coef_ptr, out_ptr, N, H, K,
    stride_st, stride_on,
    HAS_COEF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[r] = coef[row_src[r]] * src[row_src[r] // K], zero where row_src[r] < 0."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    a = tl.load(row_src_ptr + r, mask=r < N, other=-1)
    tok = tl.where(a >= 0, a // K, 0).to(tl.int64)
    m = (a >= 0)[:, None] & (h < H)[None, :]
    v = tl.load(src_ptr + tok[:, None] * stride_st + h[None, :], mask=m, other=0.0)
    if HAS_COEF:
        c = tl.load(coef_ptr + tl.where(a >= 0, a, 0), mask=a >= 0, other=0.0)
        v = v.to(tl.float32) * c.to(tl.float32)[:, None]
    out = out_ptr + r.to(tl.int64)[:, None] * stride_on + h[None, :]
    tl.store(out, v.to(out_ptr.dtype.element_ty), mask=(r < N)[:, None] & (h < H)[None, :])


@triton.jit
def _invert_kernel(row_src_ptr, dest_ptr, N, BLOCK: tl.constexpr):
    """dest[row_src[r]] = r: the row each assignment landed in (dest stays -1 if dropped)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(row_src_ptr + r, mask=r < N, other=-1)
    tl.store(dest_ptr + tl.where(a >= 0, a, 0), r.to(tl.int64), mask=a >= 0)


@triton.jit
def _combine_kernel(
    y_ptr, dest_ptr, coef_ptr, out_ptr, T, H,
    stride_yn, stride_ot,
    K: tl.constexpr, HAS_COEF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t] = sum_j coef[t, j] * y[dest[t, j]] over rows that exist, accumulated in float32."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        a = t.to(tl.int64) * K + j
        d = tl.load(dest_ptr + a, mask=t < T, other=-1)
        m = (d >= 0)[:, None] & (h < H)[None, :]
        v = tl.load(y_ptr + tl.where(d >= 0, d, 0)[:, None] * stride_yn + h[None, :], mask=m, other=0.0)
        v = v.to(tl.float32)
        if HAS_COEF:
            v = v * tl.load(coef_ptr + a, mask=d >= 0, other=0.0).to(tl.float32)[:, None]
        acc += v
    out = out_ptr + t.to(tl.int64)[:, None] * stride_ot + h[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(t < T)[:, None] & (h < H)[None, :])


def _index_config(E: int) -> dict:
    block_e = triton.next_power_of_2(E)
    if INTERPRET:
        return dict(BLOCK_A=64, BLOCK_E=block_e)
    return dict(BLOCK_A=max(16, min(256, 16384 // block_e)), BLOCK_E=block_e)


def row_config(H: int) -> dict:
    """Tiles for the row copies: whole rows of up to 2K elements per program on a GPU."""
    if INTERPRET:
        return dict(BLOCK_R=32, BLOCK_H=min(64, triton.next_power_of_2(H)), num_warps=1)
    block_h = min(2048, triton.next_power_of_2(H))
    return dict(BLOCK_R=max(1, 2048 // block_h), BLOCK_H=block_h, num_warps=4)


def gather_rows(src_TH: Tensor, row_src_N: Tensor, K: int, coef_A: Tensor | None, out_dtype) -> Tensor:
    """out_NH[r] = (coef_A[row_src_N[r]] *) src_TH[row_src_N[r] // K]; zero rows for row_src -1."""
    N, H = row_src_N.shape[0], src_TH.shape[1]
    src_TH = src_TH if src_TH.stride(-1) == 1 else src_TH.contiguous()
    out_NH = src_TH.new_empty((N, H), dtype=out_dtype)
    cfg = row_config(H)
    if N and H:
        grid = (triton.cdiv(N, cfg["BLOCK_R"]), triton.cdiv(H, cfg["BLOCK_H"]))
        _gather_kernel[grid](src_TH, row_src_N, src_TH if coef_A is None else coef_A, out_NH, N, H, K,
                             src_TH.stride(0), out_NH.stride(0), HAS_COEF=coef_A is not None, **cfg)
    return out_NH


def invert_rows(row_src_N: Tensor, num_assignments: int) -> Tensor:
    """dest_A: the permuted row of each assignment, -1 where it was dropped."""
    dest_A = torch.full((num_assignments,), -1, dtype=torch.int64, device=row_src_N.device)
    N = row_src_N.shape[0]
    if N:
        block = 64 if INTERPRET else 1024
        _invert_kernel[(triton.cdiv(N, block),)](row_src_N, dest_A, N, BLOCK=block)
    return dest_A


def combine_rows(y_NH: Tensor, dest_A: Tensor, coef_A: Tensor | None, T: int, K: int, out_dtype) -> Tensor:
    """out_TH[t] = sum_j (coef_A[t*K+j] *) y_NH[dest_A[t*K+j]]."""
    H = y_NH.shape[1]
    y_NH = y_NH if y_NH.stride(-1) == 1 else y_NH.contiguous()
    out_TH = y_NH.new_empty((T, H), dtype=out_dtype)
    cfg = row_config(H)
    if T and H:
        grid = (triton.cdiv(T, cfg["BLOCK_R"]), triton.cdiv(H, cfg["BLOCK_H"]))
        _combine_kernel[grid](y_NH, dest_A, y_NH if coef_A is None else coef_A, out_TH, T, H,
                              y_NH.stride(0), out_TH.stride(0), K=K, HAS_COEF=coef_A is not None,
                              BLOCK_T=cfg["BLOCK_R"], BLOCK_H=cfg["BLOCK_H"], num_warps=cfg["num_warps"])
    return out_TH


def permute_triton(
    x_TH: Tensor, idx_TK: Tensor, weights_TK: Tensor, num_experts: int, capacity: int, drop_policy: str,
    align: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check(x_TH, idx_TK, weights_TK, num_experts, capacity, drop_policy, align)
    (T, K), E, dev = idx_TK.shape, num_experts, x_TH.device
    A, C = T * K, _round_up(capacity, align)
    N = permuted_rows(T, K, E, capacity, align)
    idx_A = idx_TK.reshape(-1).contiguous()
    kept_A = None
    if C and drop_policy == "probs":  # rank by weight: torch's sort, the rest below
        idx_long = idx_A.long()
        load = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, idx_long, torch.ones_like(idx_long))
        kept_A = _kept_assignments(idx_long, weights_TK.reshape(-1), load, C, "probs").to(torch.int8)
    cfg = _index_config(E)
    n_blocks = triton.cdiv(A, cfg["BLOCK_A"])
    hist = torch.empty((max(n_blocks, 1), E), dtype=torch.int32, device=dev)
    hist_kept = torch.empty_like(hist) if kept_A is not None else hist
    prefix = torch.empty_like(hist)
    load_E = torch.empty(E, dtype=torch.int64, device=dev)
    sizes_E = torch.empty(E, dtype=torch.int64, device=dev)
    start_E = torch.empty(E, dtype=torch.int32, device=dev)
    if C > 0 or align > 1:  # padding rows exist: they stay -1
        row_src_N = torch.full((N,), -1, dtype=torch.int64, device=dev)
    else:  # dropless: the scatter writes every row
        row_src_N = torch.empty((N,), dtype=torch.int64, device=dev)
    has_kept, kept = kept_A is not None, idx_A if kept_A is None else kept_A
    if A:
        _hist_kernel[(n_blocks,)](idx_A, kept, hist, hist_kept, A, E, HAS_KEPT=has_kept, **cfg)
    _scan_kernel[(1,)](hist, hist_kept, prefix, load_E, sizes_E, start_E, n_blocks if A else 0, E, N, C, align,
                       HAS_KEPT=has_kept, BLOCK_B=4 if INTERPRET else 32, BLOCK_E=cfg["BLOCK_E"])
    if A:
        cap = C if (C and not has_kept) else A + 1
        _scatter_kernel[(n_blocks,)](idx_A, kept, prefix, start_E, row_src_N, A, E, cap, HAS_KEPT=has_kept,
                                     **cfg)
    x_NH = gather_rows(x_TH, row_src_N, K, None, x_TH.dtype)
    return x_NH, row_src_N, sizes_E, load_E


def permute_backward_triton(grad_x_NH: Tensor, row_src_N: Tensor, num_tokens: int, K: int) -> Tensor:
    dest_A = invert_rows(row_src_N, num_tokens * K)
    return combine_rows(grad_x_NH, dest_A, None, num_tokens, K, grad_x_NH.dtype)
