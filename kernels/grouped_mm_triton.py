"""Triton bodies of `moecompile::grouped_mm`, `grouped_mm_wgrad` and `grouped_mm_fp8`: one launch for all experts.

Legend: N rows (sorted by expert), E experts, I in, O out; BM x BN output tiles.

    forward / dgrad / fp8:  (cdiv(N, BM) + E) x cdiv(O, BN) programs, GROUP_M m tiles at a time
        sweeping the n tiles (L2 reuse); m tile p finds its expert from the per-expert tile
        counts cdiv(size_e, BM) (a cumsum over E in registers), so tiles never straddle two
        experts and no host sync reads group_sizes_E.
        y[rows, cols] = x[rows, :] @ w[e, cols, :].T (+ bias[e, cols])
    wgrad: grid (cdiv(I, BN), cdiv(O, BM), E); program (i, o, e) loops over e's rows.
        dw[e] = dy[rows of e].T @ x[rows of e]   (zero for an empty expert)

Weights are read through strides, so dgrad's w.transpose(1, 2) is never copied.
float32 accumulates in "ieee" precision unless torch allows TF32 matmuls.
Under TRITON_INTERPRET the bf16 tiles go to tl.dot as float32 (the
interpreter's bf16 dot returns garbage; bf16 products are exact in float32).
FP8 scales (kernels/grouped_mm_fp8.py) apply per output tile (tensorwise,
rowwise) or per K block (blockwise: BLOCK_K divides the scale block, so each
K step uses one x-tile scale per row and one w-block scale per column).
"""
import triton
import triton.language as tl
import torch
from torch import Tensor

from .grouped_mm import _check, _check_sizes
from .fp8_quantize import check_fp8_arch
from .grouped_mm_fp8 import _check as _check_fp8

INTERPRET = triton.knobs.runtime.interpret
_RECIPE_ID = {"tensorwise": 0, "rowwise": 1, "blockwise": 2}


@triton.jit
def _tile_ids(N, O, E, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(m tile, n tile) of this program: GROUP_M m tiles sweep all n tiles together, so their
    x rows and their experts' weight tiles are reused from L2 instead of re-read from memory."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BLOCK_M) + E
    num_n = tl.cdiv(O, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group, (pid % per_group) // group


@triton.jit
def _tile_of(pid_m, sizes_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row of m tile pid_m, end row of that expert); expert == E: no tile."""
    es = tl.arange(0, BLOCK_E)
    sizes = tl.load(sizes_ptr + es, mask=es < E, other=0).to(tl.int32)
    tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    e = tl.sum((tile_end <= pid_m).to(tl.int32), axis=0)
    row_end_all = tl.cumsum(sizes, axis=0)
    mine = es == e
    row_start = tl.sum(tl.where(mine, row_end_all - sizes, 0), axis=0)
    row_end = tl.sum(tl.where(mine, row_end_all, 0), axis=0)
    first_tile = tl.sum(tl.where(mine, tile_end - tiles, 0), axis=0)
    return e, row_start + (pid_m - first_tile) * BLOCK_M, row_end


@triton.jit
def _grouped_mm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, sizes_ptr,
    N, O, I, E,
    stride_xn, stride_xi, stride_we, stride_wo, stride_wi, stride_be, stride_yn,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(N, O, E, BLOCK_M, BLOCK_N, GROUP_M)
    e, m0, row_end = _tile_of(pid_m, sizes_ptr, E, BLOCK_M, BLOCK_E)
    if e < E:
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok, col_ok = rows < row_end, cols < O
        x_tile = x_ptr + rows.to(tl.int64)[:, None] * stride_xn + ks[None, :] * stride_xi
        w_tile = w_ptr + e.to(tl.int64) * stride_we + cols[None, :] * stride_wo + ks[:, None] * stride_wi
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_ok = (k0 + ks) < I
            a = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter's bf16 dot is wrong; bf16 products are exact in fp32
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            x_tile += BLOCK_K * stride_xi
            w_tile += BLOCK_K * stride_wi
        if HAS_BIAS:
            acc += tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rows.to(tl.int64)[:, None] * stride_yn + cols[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    g_ptr, x_ptr, dw_ptr, sizes_ptr,
    O, I, E,
    stride_gn, stride_go, stride_xn, stride_xi, stride_de, stride_do,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,  # unused here: the wgrad shares the forward's autotune configs
):
    e = tl.program_id(2)  # expert slowest: its rows of dy and x stay in L2 across the (o, i) tiles
    es = tl.arange(0, BLOCK_E)
    sizes = tl.load(sizes_ptr + es, mask=es < E, other=0)
    row_start = tl.sum(tl.where(es < e, sizes, 0), axis=0)
    row_end = row_start + tl.sum(tl.where(es == e, sizes, 0), axis=0)
    os_ = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    is_ = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ns = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for n0 in range(row_start, row_end, BLOCK_K):
        n = (n0 + ns).to(tl.int64)
        n_ok = n < row_end
        a = tl.load(g_ptr + n[None, :] * stride_gn + os_[:, None] * stride_go,
                    mask=n_ok[None, :] & (os_ < O)[:, None], other=0.0)
        b = tl.load(x_ptr + n[:, None] * stride_xn + is_[None, :] * stride_xi,
                    mask=n_ok[:, None] & (is_ < I)[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    dw = dw_ptr + e.to(tl.int64) * stride_de + os_[:, None] * stride_do + is_[None, :]
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=(os_ < O)[:, None] & (is_ < I)[None, :])


@triton.jit
def _grouped_mm_fp8_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, sizes_ptr,
    N, O, I, E, SCALE_BLOCK,
    stride_xn, stride_xi, stride_xsn, stride_xsk,
    stride_we, stride_wo, stride_wi, stride_wse, stride_wso, stride_wsk,
    stride_be, stride_yn,
    RECIPE: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(N, O, E, BLOCK_M, BLOCK_N, GROUP_M)
    e, m0, row_end = _tile_of(pid_m, sizes_ptr, E, BLOCK_M, BLOCK_E)
    if e < E:
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok, col_ok = rows < row_end, cols < O
        rows64 = rows.to(tl.int64)
        x_tile = x_ptr + rows64[:, None] * stride_xn + ks[None, :] * stride_xi
        w_tile = w_ptr + e.to(tl.int64) * stride_we + cols[None, :] * stride_wo + ks[:, None] * stride_wi
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_ok = (k0 + ks) < I
            a = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:  # an fp8 dot needs K >= 32 on a GPU; fp8 -> bf16 is exact
                a, b = a.to(tl.bfloat16), b.to(tl.bfloat16)
            if RECIPE == 2:  # blockwise: scale this K block's partial product
                kb = k0 // SCALE_BLOCK
                sx = tl.load(xs_ptr + rows64 * stride_xsn + kb * stride_xsk, mask=row_ok, other=0.0)
                sw = tl.load(ws_ptr + e * stride_wse + (cols // SCALE_BLOCK) * stride_wso + kb * stride_wsk,
                             mask=col_ok, other=0.0)
                acc += tl.dot(a, b) * sx[:, None] * sw[None, :]
            else:
                acc = tl.dot(a, b, acc)
            x_tile += BLOCK_K * stride_xi
            w_tile += BLOCK_K * stride_wi
        if RECIPE == 0:
            acc = acc * (tl.load(xs_ptr) * tl.load(ws_ptr + e * stride_wse))
        elif RECIPE == 1:
            sx = tl.load(xs_ptr + rows64 * stride_xsn, mask=row_ok, other=0.0)
            sw = tl.load(ws_ptr + e * stride_wse + cols * stride_wso, mask=col_ok, other=0.0)
            acc = acc * sx[:, None] * sw[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rows64[:, None] * stride_yn + cols[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _configs() -> list:
    """Autotune candidates for the grouped GEMMs on a GPU (Hopper-sized tiles first)."""
    return [
        triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8), num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in [
            (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
            (128, 64, 64, 4, 4), (64, 64, 64, 4, 3), (64, 64, 32, 4, 2),
        ]
    ]


_INTERPRET_CFG = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=2)  # few programs: each costs ~5 ms interpreted


def _autotuned(kernel, key):
    return kernel if INTERPRET else triton.autotune(configs=_configs(), key=key)(kernel)


_grouped_mm = _autotuned(_grouped_mm_kernel, ["O", "I", "HAS_BIAS"])
_grouped_wgrad = _autotuned(_grouped_wgrad_kernel, ["O", "I"])


def _meta(**fixed) -> dict:
    return {**_INTERPRET_CFG, **fixed} if INTERPRET else fixed


def _upcast(dtype: torch.dtype) -> bool:
    return INTERPRET and dtype == torch.bfloat16


def _precision(dtype: torch.dtype) -> str:
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def grouped_mm_triton(x_NI: Tensor, w_EOI: Tensor, group_sizes_E: Tensor, bias_EO: Tensor | None) -> Tensor:
    _check(x_NI, w_EOI, group_sizes_E, bias_EO)
    N, (E, O, I) = x_NI.shape[0], w_EOI.shape
    _check_sizes(group_sizes_E, N)
    y_NO = x_NI.new_empty((N, O))
    if N == 0 or O == 0:
        return y_NO
    bias = x_NI if bias_EO is None else bias_EO
    grid = lambda meta: ((triton.cdiv(N, meta["BLOCK_M"]) + E) * triton.cdiv(O, meta["BLOCK_N"]),)  # noqa: E731
    _grouped_mm[grid](
        x_NI, w_EOI, bias, y_NO, group_sizes_E.contiguous(), N, O, I, E,
        x_NI.stride(0), x_NI.stride(1), *w_EOI.stride(), bias.stride(0), y_NO.stride(0),
        **_meta(HAS_BIAS=bias_EO is not None, PRECISION=_precision(x_NI.dtype), UPCAST=_upcast(x_NI.dtype),
                BLOCK_E=triton.next_power_of_2(E)))
    return y_NO


def grouped_mm_wgrad_triton(grad_y_NO: Tensor, x_NI: Tensor, group_sizes_E: Tensor) -> Tensor:
    O, I, E = grad_y_NO.shape[1], x_NI.shape[1], group_sizes_E.shape[0]
    dw_EOI = grad_y_NO.new_empty((E, O, I))
    if O == 0 or I == 0:
        return dw_EOI
    grid = lambda meta: (triton.cdiv(I, meta["BLOCK_N"]), triton.cdiv(O, meta["BLOCK_M"]), E)  # noqa: E731
    _grouped_wgrad[grid](
        grad_y_NO, x_NI, dw_EOI, group_sizes_E.contiguous(), O, I, E,
        *grad_y_NO.stride(), *x_NI.stride(), dw_EOI.stride(0), dw_EOI.stride(1),
        **_meta(PRECISION=_precision(x_NI.dtype), UPCAST=_upcast(x_NI.dtype), BLOCK_E=triton.next_power_of_2(E)))
    return dw_EOI


def _fp8_config(recipe: str, block: int) -> dict:
    """Fixed tiles (FP8 wants BLOCK_K >= 32 on Hopper); blockwise needs BLOCK_K | block."""
    if INTERPRET:
        cfg = dict(_INTERPRET_CFG)
        return {**cfg, "BLOCK_K": min(cfg["BLOCK_K"], block)} if recipe == "blockwise" else cfg
    bk = min(128, block) if recipe == "blockwise" else 128
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=3)


def grouped_mm_fp8_triton(
    x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, group_sizes_E: Tensor,
    recipe: str, block: int, bias_EO: Tensor | None, out_dtype: torch.dtype,
) -> Tensor:
    _check_fp8(x_q, x_scale, w_q, w_scale, group_sizes_E, recipe, block, bias_EO, out_dtype)
    check_fp8_arch(x_q.device, "grouped_mm_fp8")
    N, (E, O, I) = x_q.shape[0], w_q.shape
    _check_sizes(group_sizes_E, N)
    y_NO = x_q.new_empty((N, O), dtype=out_dtype)
    if N == 0 or O == 0:
        return y_NO
    # scales as [rows, k-blocks] / [E, cols, k-blocks] strides, whatever the recipe's shape
    xs = x_scale.reshape(1, 1) if x_scale.dim() == 0 else x_scale
    ws = w_scale.reshape(E, 1, 1) if w_scale.dim() == 1 else w_scale
    bias = y_NO if bias_EO is None else bias_EO
    cfg = _fp8_config(recipe, block)
    grid = ((triton.cdiv(N, cfg["BLOCK_M"]) + E) * triton.cdiv(O, cfg["BLOCK_N"]),)
    _grouped_mm_fp8_kernel[grid](
        x_q, xs, w_q, ws, bias, y_NO, group_sizes_E.contiguous(), N, O, I, E, max(block, 1),
        x_q.stride(0), x_q.stride(1), xs.stride(0), xs.stride(1),
        *w_q.stride(), *ws.stride(), bias.stride(0), y_NO.stride(0),
        RECIPE=_RECIPE_ID[recipe], HAS_BIAS=bias_EO is not None, UPCAST=not INTERPRET and cfg["BLOCK_K"] < 32,
        BLOCK_E=triton.next_power_of_2(E), **cfg)
    return y_NO
