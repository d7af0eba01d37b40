"""Triton body of `moecompile::quantize_fp8`: amax, scale and float8 cast in as few passes as the recipe allows.

Legend: Bt batch of matrices, R rows, C columns, B block (see kernels/fp8_quantize.py).

    tile, block   one pass: a program loads its BLOCK_R x B (tile) or B x B (block) tile,
                  reduces |x| to the tile's amax in registers, writes scale and q
    rowwise       one program per BLOCK_R rows: loop over C for the amax, loop again to cast
    tensorwise    two launches: tile amaxes atomic_max'ed into amax[Bt], then the cast

Same arithmetic as the reference (IEEE divisions via tl.div_rn), so q and the
scales match it bit for bit. On a GPU, float8 needs sm89+ (Ada, Hopper).
"""
import math

import triton
import triton.language as tl
import torch
from torch import Tensor

from .fp8_quantize import AMAX_EPS, FORMATS, _check, check_fp8_arch, empty_scale, fp8_max

INTERPRET = triton.knobs.runtime.interpret
# mantissa bits and smallest normal exponent of each float8 format
_GRID = {"e4m3": dict(MANTISSA=3, MIN_EXP=-6), "e5m2": dict(MANTISSA=2, MIN_EXP=-14)}


@triton.jit
def _scales(amax, fmax, eps):
    amax = tl.maximum(amax, eps)
    return tl.div_rn(amax, fmax), tl.div_rn(fmax, amax)  # (scale, 1 / scale)


@triton.jit
def _cast(x, inv, fmax, q_dtype: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round to the float8 grid in float32 (RTNE: +/- 1.5 * 2^23 ulp), then convert exactly.

    The interpreter's own float32 -> float8 conversion drops the carry when
    rounding crosses a power of two (124.3 -> 64, not 128); rounding first
    makes the conversion exact on every backend, at no cost a memory-bound kernel notices.
    """
    v = tl.clamp(x * inv, -fmax, fmax)
    exp = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exp, MIN_EXP) - MANTISSA  # subnormals share the smallest normal's ulp
    magic = ((ulp_exp + 127 + 23) << 23).to(tl.float32, bitcast=True) * 1.5
    r = (v + magic) - magic
    return tl.where(r == 0.0, v * 0.0, r).to(q_dtype)  # keep the sign of zero, as torch does


@triton.jit
def _quant_tile_kernel(
    x_ptr, q_ptr, s_ptr, R, C, fmax, eps,
    stride_xb, stride_xr, stride_qb, stride_qr, stride_sb, stride_sr, stride_sc,
    WHOLE_TILE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
    MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
):
    """WHOLE_TILE: one scale for the BLOCK_R x BLOCK tile ("block"), else one per row ("tile")."""
    b, pr, pc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = (pr * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = pc * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + b * stride_xb + rows[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if WHOLE_TILE:
        scale, inv = _scales(tl.max(amax, axis=0), fmax, eps)
        tl.store(s_ptr + b * stride_sb + pr * stride_sr + pc * stride_sc, scale)
        q = _cast(x, inv, fmax, q_ptr.dtype.element_ty, MANTISSA, MIN_EXP)
    else:
        scale, inv = _scales(amax, fmax, eps)
        tl.store(s_ptr + b * stride_sb + rows * stride_sr + pc * stride_sc, scale, mask=rows < R)
        q = _cast(x, inv[:, None], fmax, q_ptr.dtype.element_ty, MANTISSA, MIN_EXP)
    tl.store(q_ptr + b * stride_qb + rows[:, None] * stride_qr + cols[None, :], q, mask=mask)


@triton.jit
def _quant_rowwise_kernel(
    x_ptr, q_ptr, s_ptr, R, C, fmax, eps,
    stride_xb, stride_xr, stride_qb, stride_qr, stride_sb,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
):
    b = tl.program_id(0)
    rows = (tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    x_rows = x_ptr + b * stride_xb + rows[:, None] * stride_xr
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(x_rows + cols[None, :], mask=(rows < R)[:, None] & (cols < C)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    scale, inv = _scales(amax, fmax, eps)
    tl.store(s_ptr + b * stride_sb + rows, scale, mask=rows < R)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = _cast(x, inv[:, None], fmax, q_ptr.dtype.element_ty, MANTISSA, MIN_EXP)
        tl.store(q_ptr + b * stride_qb + rows[:, None] * stride_qr + cols[None, :], q, mask=mask)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, R, C, stride_xb, stride_xr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    rows = (tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + b * stride_xb + rows[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0)
    tl.atomic_max(amax_ptr + b, tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0))


@triton.jit
def _cast_tensorwise_kernel(
    x_ptr, amax_ptr, q_ptr, s_ptr, R, C, fmax, eps,
    stride_xb, stride_xr, stride_qb, stride_qr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
):
    b, pr, pc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    scale, inv = _scales(tl.load(amax_ptr + b), fmax, eps)
    if (pr == 0) & (pc == 0):
        tl.store(s_ptr + b, scale)
    rows = (pr * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + b * stride_xb + rows[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0)
    q = _cast(x.to(tl.float32), inv, fmax, q_ptr.dtype.element_ty, MANTISSA, MIN_EXP)
    tl.store(q_ptr + b * stride_qb + rows[:, None] * stride_qr + cols[None, :], q, mask=mask)


def _tiles(C: int) -> tuple[int, int]:
    if INTERPRET:
        return 32, min(64, triton.next_power_of_2(C))
    block_c = min(1024, triton.next_power_of_2(C))
    return max(1, 4096 // block_c), block_c


def quantize_fp8_triton(x: Tensor, recipe: str, fmt: str, block: int) -> tuple[Tensor, Tensor]:
    _check(x, recipe, fmt, block)
    check_fp8_arch(x.device, "quantize_fp8")
    *lead, R, C = x.shape
    Bt = math.prod(lead)  # not reshape(-1, ...): it cannot infer the -1 of an empty x
    x3 = x.reshape(Bt, R, C)
    x3 = x3 if x3.stride(-1) == 1 else x3.contiguous()
    q = x3.new_empty(x3.shape, dtype=FORMATS[fmt])
    scale = empty_scale(x, recipe, block)  # the reference's layout, strides included
    s3 = scale.view(Bt) if recipe == "tensorwise" else scale.view(Bt, *scale.shape[-2:])
    fmax = fp8_max(fmt)
    if x.numel() == 0:
        return q.view(x.shape), scale.fill_(AMAX_EPS / fmax)
    common = (fmax, AMAX_EPS, x3.stride(0), x3.stride(1), q.stride(0), q.stride(1))
    grid_fmt = _GRID[fmt]
    if recipe in ("tile", "block"):
        whole = recipe == "block"
        block_r = block if whole else (32 if INTERPRET else max(1, 4096 // block))
        grid = (Bt, triton.cdiv(R, block_r), triton.cdiv(C, block))
        _quant_tile_kernel[grid](x3, q, s3, R, C, *common, s3.stride(0), s3.stride(1), s3.stride(2),
                                 WHOLE_TILE=whole, BLOCK_R=block_r, BLOCK=block, **grid_fmt,
                                 num_warps=1 if INTERPRET else (8 if whole else 4))
    elif recipe == "rowwise":
        block_r, block_c = _tiles(C)
        _quant_rowwise_kernel[(Bt, triton.cdiv(R, block_r))](
            x3, q, s3, R, C, *common, s3.stride(0), BLOCK_R=block_r, BLOCK_C=block_c, **grid_fmt)
    else:
        block_r, block_c = _tiles(C)
        grid = (Bt, triton.cdiv(R, block_r), triton.cdiv(C, block_c))
        amax = torch.zeros(Bt, dtype=torch.float32, device=x.device)
        _amax_kernel[grid](x3, amax, R, C, x3.stride(0), x3.stride(1), BLOCK_R=block_r, BLOCK_C=block_c)
        _cast_tensorwise_kernel[grid](x3, amax, q, s3, R, C, *common, BLOCK_R=block_r, BLOCK_C=block_c,
                                      **grid_fmt)
    return q.view(x.shape), scale
