"""Triton body of `moecompile::route` / `route_backward`: score, bias, top-k and renormalise, fused.

Legend: T tokens, E experts (padded to BLOCK_E, a power of two), K top-k.

One program owns BLOCK_T tokens' whole rows of logits: it computes the scores
(softmax or sigmoid) in registers, selects the top k by k rounds of row-max
(ties go to the lower expert), and writes weights and indices once; the
unfused torch sequence is softmax, add, topk, gather, sum, divide: six
kernels and five round trips through memory. Group-limited routing scores
each group in registers too (its best choice score, then its second best) and
keeps the GROUP_K best groups by rounds of row-max before the top-k. Backward
recomputes the scores from the logits instead of saving them.
"""
import triton
import triton.language as tl
import torch
from torch import Tensor

from .route import _SIGMOID_EPS, _check, _dtype

INTERPRET = triton.knobs.runtime.interpret


@triton.jit
def _scores(logits_ptr, rows, cols, T, E, stride_lt, SOFTMAX: tl.constexpr, ACC: tl.constexpr):
    mask = (rows < T)[:, None] & (cols < E)[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_lt + cols[None, :], mask=mask, other=float("-inf"))
    x = tl.where((rows < T)[:, None], x.to(ACC), 0.0)  # rows past T: finite, masked at the store
    if SOFTMAX:
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = p / tl.sum(p, axis=1)[:, None]
    else:
        s = 1.0 / (1.0 + tl.exp(-x))
    return tl.where(mask, s, 0.0)


@triton.jit
def _first_max(x, cols, BLOCK: tl.constexpr):
    """Each row's maximum and the lowest column holding it."""
    best = tl.max(x, axis=1)
    return best, tl.min(tl.where(x == best[:, None], cols[None, :], BLOCK), axis=1)


@triton.jit
def _limit_to_groups(choice, cols, group_size, GROUPS: tl.constexpr, GROUP_K: tl.constexpr,
                     TOP2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr):
    """`choice` with the experts outside each row's GROUP_K best groups at -inf (route.limit_to_groups)."""
    group_of = cols // group_size  # padded columns fall past the last group
    gcols = tl.arange(0, BLOCK_G)
    group_score = tl.full([BLOCK_T, BLOCK_G], float("-inf"), choice.dtype)
    for g in tl.static_range(GROUPS):
        c = tl.where((group_of == g)[None, :], choice, float("-inf"))
        best, at = _first_max(c, cols, BLOCK_E)
        total = best
        if TOP2:
            total += tl.max(tl.where(cols[None, :] == at[:, None], float("-inf"), c), axis=1)
        group_score = tl.where(gcols[None, :] == g, total[:, None], group_score)
    keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(GROUP_K):
        _, sel = _first_max(group_score, gcols, BLOCK_G)
        group_score = tl.where(gcols[None, :] == sel[:, None], float("-inf"), group_score)
        keep = tl.where(group_of[None, :] == sel[:, None], 1, keep)
    return tl.where(keep == 1, choice, float("-inf"))


@triton.jit
def _route_fwd_kernel(
    logits_ptr, bias_ptr, w_ptr, idx_ptr,
    T, E, stride_lt, eps, group_size,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr,
    GROUPS: tl.constexpr, GROUP_K: tl.constexpr, TOP2: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    ACC = w_ptr.dtype.element_ty
    s = _scores(logits_ptr, rows, cols, T, E, stride_lt, SOFTMAX, ACC)
    choice = s
    if HAS_BIAS:
        choice = s + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(ACC)[None, :]
    choice = tl.where((cols < E)[None, :], choice, float("-inf"))
    if GROUPS > 1:
        choice = _limit_to_groups(choice, cols, group_size, GROUPS, GROUP_K, TOP2, BLOCK_T, BLOCK_E, BLOCK_G)
    kcols = tl.arange(0, BLOCK_K)
    w_tk = tl.zeros([BLOCK_T, BLOCK_K], dtype=ACC)
    idx_tk = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(K):
        _, sel = _first_max(choice, cols, BLOCK_E)
        hit = cols[None, :] == sel[:, None]
        w_j = tl.sum(tl.where(hit, s, 0.0), axis=1)
        w_tk = tl.where(kcols[None, :] == j, w_j[:, None], w_tk)
        idx_tk = tl.where(kcols[None, :] == j, sel.to(tl.int64)[:, None], idx_tk)
        choice = tl.where(hit, float("-inf"), choice)
    if NORMALIZE:
        w_tk = w_tk / tl.where(rows < T, tl.sum(w_tk, axis=1) + eps, 1.0)[:, None]
    out = rows[:, None] * K + kcols[None, :]
    mask = (rows < T)[:, None] & (kcols < K)[None, :]
    tl.store(w_ptr + out, w_tk, mask=mask)
    tl.store(idx_ptr + out, idx_tk, mask=mask)


@triton.jit
def _route_bwd_kernel(
    g_ptr, logits_ptr, w_ptr, idx_ptr, dlogits_ptr,
    T, E, stride_lt, eps,
    K: tl.constexpr, SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_E)
    ACC = w_ptr.dtype.element_ty
    s = _scores(logits_ptr, rows, cols, T, E, stride_lt, SOFTMAX, ACC)
    denom = tl.where(row_ok, 0.0, 1.0).to(ACC) + eps  # rows past T: no 0/0
    dot = tl.zeros([BLOCK_T], dtype=ACC)
    if NORMALIZE:  # w = raw / d  =>  d raw = (g - <g, w>) / d
        for j in tl.static_range(K):
            idx_j = tl.load(idx_ptr + rows * K + j, mask=row_ok, other=0)
            denom += tl.sum(tl.where(cols[None, :] == idx_j[:, None], s, 0.0), axis=1)
            g_j = tl.load(g_ptr + rows * K + j, mask=row_ok, other=0.0).to(ACC)
            dot += g_j * tl.load(w_ptr + rows * K + j, mask=row_ok, other=0.0)
    g_te = tl.zeros([BLOCK_T, BLOCK_E], dtype=ACC)
    for j in tl.static_range(K):
        idx_j = tl.load(idx_ptr + rows * K + j, mask=row_ok, other=0)
        g_j = tl.load(g_ptr + rows * K + j, mask=row_ok, other=0.0).to(ACC)
        if NORMALIZE:
            g_j = (g_j - dot) / denom
        g_te += tl.where(cols[None, :] == idx_j[:, None], g_j[:, None], 0.0)
    if SOFTMAX:
        d = s * (g_te - tl.sum(g_te * s, axis=1)[:, None])
    else:
        d = g_te * s * (1.0 - s)
    mask = row_ok[:, None] & (cols < E)[None, :]
    out = dlogits_ptr + rows[:, None] * stride_lt + cols[None, :]
    tl.store(out, d.to(dlogits_ptr.dtype.element_ty), mask=mask)


def _config(E: int) -> dict:
    block_e = triton.next_power_of_2(E)
    if INTERPRET:
        return dict(BLOCK_T=32, BLOCK_E=block_e, num_warps=1)
    return dict(BLOCK_T=max(1, min(64, 4096 // block_e)), BLOCK_E=block_e, num_warps=4)


def _eps(score: str, normalize: bool) -> float:
    return _SIGMOID_EPS if (normalize and score == "sigmoid") else 0.0


def route_triton(
    logits_TE: Tensor, bias_E: Tensor | None, k: int, score: str, normalize: bool, groups: int = 1,
    group_k: int = 1,
) -> tuple[Tensor, Tensor]:
    _check(logits_TE, bias_E, k, score, groups, group_k)
    logits_TE = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
    T, E = logits_TE.shape
    weights_TK = logits_TE.new_empty((T, k), dtype=_dtype(logits_TE))
    idx_TK = logits_TE.new_empty((T, k), dtype=torch.int64)
    cfg = _config(E)
    if T:
        bias = logits_TE if bias_E is None else bias_E.contiguous()
        _route_fwd_kernel[(triton.cdiv(T, cfg["BLOCK_T"]),)](
            logits_TE, bias, weights_TK, idx_TK, T, E, logits_TE.stride(0), _eps(score, normalize), E // groups,
            K=k, HAS_BIAS=bias_E is not None, SOFTMAX=score == "softmax", NORMALIZE=normalize,
            GROUPS=groups, GROUP_K=group_k, TOP2=E // groups >= 2,
            BLOCK_K=triton.next_power_of_2(k), BLOCK_G=triton.next_power_of_2(groups), **cfg)
    return weights_TK, idx_TK


def route_backward_triton(
    grad_weights_TK: Tensor, logits_TE: Tensor, weights_TK: Tensor, idx_TK: Tensor, score: str, normalize: bool
) -> Tensor:
    logits_TE = logits_TE.contiguous()
    T, E = logits_TE.shape
    grad_logits_TE = torch.empty_like(logits_TE)
    cfg = _config(E)
    if T:
        _route_bwd_kernel[(triton.cdiv(T, cfg["BLOCK_T"]),)](
            grad_weights_TK.contiguous(), logits_TE, weights_TK.contiguous(), idx_TK.contiguous(),
            grad_logits_TE, T, E, logits_TE.stride(0), _eps(score, normalize),
            K=idx_TK.shape[1], SOFTMAX=score == "softmax", NORMALIZE=normalize, **cfg)
    return grad_logits_TE
