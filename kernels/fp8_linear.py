"""`moecompile::fp8_linear` and `moecompile::fp8_grouped_linear` — FP8 GEMMs that train.

Legend: M rows (tokens), K in features, N out features, E experts, B block.

    x_MK ─quantize─▶ x_q (e4m3), x_scale ─┐
    w_NK ─quantize─▶ w_q (e4m3), w_scale ─┴─ FP8 GEMM, float32 accumulate ─▶ y_MN (x's dtype)

    recipe       x scale                w scale                 grad scale
    tensorwise   current amax           current amax            current amax
    delayed      max of amax history    max of amax history     max of amax history
    blockwise    1 x B tiles            B x B blocks            1 x B tiles

Backward: dgrad and wgrad are FP8 GEMMs too, on the gradient cast to e4m3
(`fmt="e4m3"`) or e5m2 (`fmt="hybrid"`). What is saved for backward is the
float8 `x_q` (1 byte per element) and a reference to the weight (re-quantized,
bit-identically, in backward), so stored activations are half of bf16's.
Each backward is one op as well (`fp8_linear_backward`, `fp8_grouped_linear_backward`):
a compiled backward (AOTAutograd, Inductor) then calls it rather than tracing its
float8 pads, casts and dequantizes, which Inductor's CPU backend fails to lower (pads)
or, with buffer reuse, lowered into wrong gradients (the grouped dequantize; torch 2.13).

Dense GEMMs run `torch._scaled_mm` (CPU and CUDA): tensorwise directly;
blockwise as one unit-scaled GEMM per K block, its row and column scales
applied and the blocks summed in float32 (exactly the blockwise product; CPU
`_scaled_mm` has no block scaling, and rowwise scales with a float32 output
only on sm_90). M, K and N are
zero-padded to multiples of 16, the alignment FP8 GEMMs need. Expert GEMMs run
`moecompile::grouped_mm_fp8` forward and dgrad; their wgrad runs
`grouped_mm_wgrad` on the dequantized FP8 activations (no FP8 wgrad kernel yet).

`delayed` takes `amax_history` [3, L] (rows x, w, grad; newest first), a buffer
the caller owns: backward rolls it and writes this step's amaxes, once per step.
A history that is still all zero falls back to the current amax.

Both ops return `(y, x_q, x_scale, amax_xw)`: the float8 copy and its scale are
outputs so autograd can save them (and memory tools can see them); only `y` is
differentiable.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from . import library
from .fp8_quantize import AMAX_EPS, FORMATS, dequantize_fp8, fp8_max, quantize_fp8
from .grouped_mm import _segment_sum

RECIPES = ("tensorwise", "delayed", "blockwise")
FP8_FORMATS = ("e4m3", "hybrid")
ALIGN = 16  # rows / columns of an FP8 GEMM operand: multiples of 16 bytes


def _check(recipe: str, fmt: str, block: int, history: Optional[Tensor], who: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"{who}: recipe must be one of {RECIPES}, got {recipe!r}")
    if fmt not in FP8_FORMATS:
        raise ValueError(f"{who}: fmt must be one of {FP8_FORMATS}, got {fmt!r}")
    if recipe == "blockwise" and (block < 16 or block & (block - 1)):
        raise ValueError(f"{who}: blockwise needs block to be a power of two >= 16, got {block}")
    if recipe == "delayed" and (history is None or history.dim() != 2 or history.shape[0] != 3):
        shape = None if history is None else tuple(history.shape)
        raise ValueError(f"{who}: recipe 'delayed' needs amax_history of shape [3, L], got {shape}")


def grad_format(fmt: str) -> str:
    return "e5m2" if fmt == "hybrid" else "e4m3"


# ---------------------------------------------------------------- quantization


def _quantize_with_amax(x: Tensor, amax: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """Cast with a given (tensorwise) amax; values beyond it saturate."""
    fmax = fp8_max(fmt)
    scale = (amax.float().clamp(min=AMAX_EPS) / fmax).reshape(())
    return (x.float() / scale).clamp(-fmax, fmax).to(FORMATS[fmt]), scale


def _delayed_amax(history_row: Tensor, current: Tensor) -> Tensor:
    """The history's max, or the current amax while the history is empty (no host sync)."""
    past = history_row.amax()
    return torch.where(past > 0, past, current)


def _quantize(x: Tensor, role: str, recipe: str, fmt: str, block: int, history: Optional[Tensor], row: int):
    """(q, scale, amax) of one GEMM operand; role "act" (1 x B tiles) or "weight" (B x B blocks)."""
    amax = x.detach().abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)  # no rows: 0
    if recipe == "delayed":
        used = _delayed_amax(history[row], amax)  # type: ignore[index]
        q, scale = _quantize_with_amax(x, used, fmt)
        if x.dim() == 3:  # expert weights: grouped_mm_fp8 takes one scale per expert
            scale = scale.expand(x.shape[0]).contiguous()
        return q, scale, amax
    q_recipe = "tensorwise" if recipe == "tensorwise" else ("tile" if role == "act" else "block")
    q, scale = quantize_fp8(x.contiguous(), q_recipe, fmt, block)
    return q, scale, amax


def _transposed_tiles(q: Tensor, scale: Tensor, recipe: str, fmt: str, block: int) -> tuple[Tensor, Tensor]:
    """q^T quantized as the contraction now runs along the old rows (wgrad's operands)."""
    if recipe != "blockwise":
        return q.t().contiguous(), scale
    return quantize_fp8(dequantize_fp8(q, scale, "tile", block).t().contiguous(), "tile", fmt, block)


# ---------------------------------------------------------------- the dense FP8 GEMM


def _pad2(t: Tensor, rows: int, cols: int) -> Tensor:
    R, C = t.shape
    if R == rows and C == cols:
        return t.contiguous()
    out = t.new_zeros((rows, cols))
    out[:R, :C] = t
    return out


def _up(n: int, m: int = ALIGN) -> int:
    return max(m, -(-n // m) * m)


def fp8_mm(a_q: Tensor, a_s: Tensor, b_q: Tensor, b_s: Tensor, block: int, b_blocks: bool) -> Tensor:
    """float32 a @ b.T from float8 a [M, K], b [N, K] and their decode scales.

    Scales are 0-d (tensorwise), or a [M, ceil(K/B)] 1 x B tile scale with b's
    [ceil(N/B), ceil(K/B)] block scale (`b_blocks`) or [N, ceil(K/B)] tile scale.
    """
    (M, K), N = a_q.shape, b_q.shape[0]
    Mp, Kp, Np = _up(M), _up(K), _up(N)
    a_p, b_p = _pad2(a_q, Mp, Kp), _pad2(b_q, Np, Kp)
    if a_s.dim() == 0:
        y = torch._scaled_mm(a_p, b_p.t(), scale_a=a_s, scale_b=b_s, out_dtype=torch.float32)
        return y[:M, :N].contiguous()
    # Each K block's product unscaled (unit tensorwise scales), then its row and column scales in
    # float32: what a rowwise-scaled GEMM computes, but a rowwise `_scaled_mm` with a float32 output
    # exists only in cuBLAS 12.9+ on sm_90 (sm_89 and sm_100 take a bf16 or fp16 output only) and not
    # on the CPU in torch 2.11; the unit-scaled one runs everywhere.
    unit = a_q.new_ones((), dtype=torch.float32)
    y = a_q.new_zeros((M, N), dtype=torch.float32)
    for kb in range(math.ceil(K / block)):
        lo, hi = kb * block, min(K, (kb + 1) * block)
        width = _up(hi - lo)
        a_blk = _pad2(a_p[:, lo:hi], Mp, width)
        b_blk = _pad2(b_p[:, lo:hi], Np, width)
        sb = b_s[:, kb].repeat_interleave(block)[:N] if b_blocks else b_s[:, kb]
        part = torch._scaled_mm(a_blk, b_blk.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32)
        y.addcmul_(part[:M, :N].mul_(sb), a_s[:, kb, None])
    return y  # contiguous: the padding must not show in the strides (fake impls: contiguous)


# ---------------------------------------------------------------- fp8_linear


def fp8_linear_ref(x, w_NK, bias_N, amax_history, recipe, fmt, block):
    """Forward of `fp8_linear` (any leading dims on x): the CPU/CUDA implementation."""
    _check(recipe, fmt, block, amax_history, "fp8_linear")
    x_MK = x.reshape(-1, x.shape[-1])
    x_q, x_s, amax_x = _quantize(x_MK, "act", recipe, "e4m3", block, amax_history, 0)
    w_q, w_s, amax_w = _quantize(w_NK, "weight", recipe, "e4m3", block, amax_history, 1)
    y = fp8_mm(x_q, x_s, w_q, w_s, block, b_blocks=True)
    if bias_N is not None:
        y = y + bias_N.float()
    y = y.to(x.dtype).reshape(*x.shape[:-1], w_NK.shape[0])
    return y, x_q, x_s, torch.stack([amax_x, amax_w])


@library.op("moecompile::fp8_linear")
def _fp8_linear_op(
    x: Tensor, w: Tensor, bias: Optional[Tensor], amax_history: Optional[Tensor], recipe: str, fmt: str, block: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return fp8_linear_ref(x, w, bias, amax_history, recipe, fmt, block)


@_fp8_linear_op.register_fake
def _fp8_linear_fake(x, w, bias, amax_history, recipe, fmt, block):
    _check(recipe, fmt, block, amax_history, "fp8_linear")
    M, K = x.shape[:-1].numel(), x.shape[-1]
    return (
        x.new_empty((*x.shape[:-1], w.shape[0])),
        x.new_empty((M, K), dtype=FORMATS["e4m3"]),
        _fake_scale(x, (M, K), recipe, block),
        x.new_empty((2,), dtype=torch.float32),
    )


def _fake_scale(x: Tensor, shape: tuple, recipe: str, block: int) -> Tensor:
    if recipe != "blockwise":
        return x.new_empty((), dtype=torch.float32)
    M, K = shape
    return x.new_empty((math.ceil(K / block), M), dtype=torch.float32).t()


def _linear_setup(ctx, inputs, output):
    x, w, bias, history, recipe, fmt, block = inputs
    _, x_q, x_s, amax = output
    ctx.mark_non_differentiable(x_q, x_s, amax)
    ctx.save_for_backward(x_q, x_s, w, amax)
    ctx.history = history  # a long-lived buffer, mutated by backward: kept off the version check
    ctx.cfg = (recipe, fmt, block, bias is not None, tuple(x.shape), x.dtype)


def fp8_linear_backward_ref(
    dy: Tensor, x_q: Tensor, x_s: Tensor, w: Tensor, history: Optional[Tensor], recipe: str, fmt: str, block: int,
    x_dtype: torch.dtype, need_x: bool, need_w: bool, need_b: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx_MK, dw_NK, db_N, amax_grad): FP8 dgrad and wgrad of `fp8_linear`; a gradient not asked for is empty."""
    gfmt = grad_format(fmt)
    g_MN = dy.reshape(-1, dy.shape[-1]).contiguous()
    w_q, w_s, _ = _quantize(w, "weight", recipe, "e4m3", block, history, 1)  # bit-identical to forward's
    g_q, g_s, amax_g = _quantize(g_MN, "act", recipe, gfmt, block, history, 2)
    dx, dw, db = (w.new_empty((0,)) for _ in range(3))  # three, not one aliased three times
    if need_x:  # dx_MK = g_MN @ w_NK: contraction over N
        w_t = w_q.t().contiguous()
        w_ts = w_s.t().contiguous() if w_s.dim() else w_s
        dx = fp8_mm(g_q, g_s, w_t, w_ts, block, b_blocks=True).to(x_dtype)
    if need_w:  # dw_NK = g^T_NM @ x_MK: contraction over M
        gt_q, gt_s = _transposed_tiles(g_q, g_s, recipe, gfmt, block)
        xt_q, xt_s = _transposed_tiles(x_q, x_s, recipe, "e4m3", block)
        dw = fp8_mm(gt_q, gt_s, xt_q, xt_s, block, b_blocks=False).to(w.dtype)
    if need_b:
        db = g_MN.float().sum(0).to(w.dtype)
    return dx, dw, db, amax_g


@library.op("moecompile::fp8_linear_backward")
def _fp8_linear_backward_op(
    dy: Tensor, x_q: Tensor, x_s: Tensor, w: Tensor, history: Optional[Tensor], recipe: str, fmt: str, block: int,
    x_dtype: torch.dtype, need_x: bool, need_w: bool, need_b: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One op, so a compiled backward calls it instead of tracing its float8 pads (module doc)."""
    return fp8_linear_backward_ref(dy, x_q, x_s, w, history, recipe, fmt, block, x_dtype, need_x, need_w, need_b)


@_fp8_linear_backward_op.register_fake
def _fp8_linear_backward_fake(dy, x_q, x_s, w, history, recipe, fmt, block, x_dtype, need_x, need_w, need_b):
    M, (N, K) = x_q.shape[0], w.shape
    return (dy.new_empty((M, K) if need_x else (0,), dtype=x_dtype if need_x else w.dtype),
            w.new_empty((N, K) if need_w else (0,)), w.new_empty((N,) if need_b else (0,)),
            dy.new_empty((), dtype=torch.float32))


def _linear_backward(ctx, dy, *_unused):
    x_q, x_s, w, amax = ctx.saved_tensors
    history = ctx.history
    recipe, fmt, block, has_bias, x_shape, x_dtype = ctx.cfg
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    dx, dw, db, amax_g = torch.ops.moecompile.fp8_linear_backward(
        dy, x_q, x_s, w, history, recipe, fmt, block, x_dtype, need_x, need_w, need_b and has_bias)
    if history is not None:
        update_amax_history(history, torch.cat([amax, amax_g.reshape(1)]))
    return (dx.reshape(x_shape) if need_x else None, dw if need_w else None, db if need_b and has_bias else None,
            None, None, None, None)


_fp8_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def fp8_linear(x, w, bias=None, amax_history=None, recipe="tensorwise", fmt="hybrid", block=128) -> Tensor:
    """F.linear(x, w, bias) as an FP8 GEMM (see the module doc); returns y only."""
    return torch.ops.moecompile.fp8_linear(x, w, bias, amax_history, recipe, fmt, block)[0]


# ---------------------------------------------------------------- fp8_grouped_linear

_GROUPED_RECIPE = {"tensorwise": "tensorwise", "delayed": "tensorwise", "blockwise": "blockwise"}


def fp8_grouped_linear_ref(x_NI, w_EOI, group_sizes_E, bias_EO, amax_history, recipe, fmt, block):
    """Forward of `fp8_grouped_linear`: quantize, then `moecompile::grouped_mm_fp8`."""
    _check(recipe, fmt, block, amax_history, "fp8_grouped_linear")
    x_q, x_s, amax_x = _quantize(x_NI, "act", recipe, "e4m3", block, amax_history, 0)
    w_q, w_s, amax_w = _quantize(w_EOI, "weight", recipe, "e4m3", block, amax_history, 1)
    y = torch.ops.moecompile.grouped_mm_fp8(
        x_q, x_s, w_q, w_s, group_sizes_E, _GROUPED_RECIPE[recipe], block, bias_EO, x_NI.dtype
    )
    return y, x_q, x_s, torch.stack([amax_x, amax_w])


@library.op("moecompile::fp8_grouped_linear")
def _fp8_grouped_op(
    x_NI: Tensor, w_EOI: Tensor, group_sizes_E: Tensor, bias_EO: Optional[Tensor], amax_history: Optional[Tensor],
    recipe: str, fmt: str, block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return fp8_grouped_linear_ref(x_NI, w_EOI, group_sizes_E, bias_EO, amax_history, recipe, fmt, block)


@_fp8_grouped_op.register_fake
def _fp8_grouped_fake(x_NI, w_EOI, group_sizes_E, bias_EO, amax_history, recipe, fmt, block):
    _check(recipe, fmt, block, amax_history, "fp8_grouped_linear")
    N, I = x_NI.shape
    return (
        x_NI.new_empty((N, w_EOI.shape[1])),
        x_NI.new_empty((N, I), dtype=FORMATS["e4m3"]),
        _fake_scale(x_NI, (N, I), recipe, block),
        x_NI.new_empty((2,), dtype=torch.float32),
    )


def _grouped_setup(ctx, inputs, output):
    x_NI, w_EOI, group_sizes_E, bias_EO, history, recipe, fmt, block = inputs
    _, x_q, x_s, amax = output
    ctx.mark_non_differentiable(x_q, x_s, amax)
    ctx.save_for_backward(x_q, x_s, w_EOI, group_sizes_E, amax)
    ctx.history = history
    ctx.cfg = (recipe, fmt, block, bias_EO is not None, x_NI.dtype)


def fp8_grouped_linear_backward_ref(
    dy_NO: Tensor, x_q: Tensor, x_s: Tensor, w_EOI: Tensor, sizes_E: Tensor, history: Optional[Tensor], recipe: str,
    fmt: str, block: int, x_dtype: torch.dtype, need_x: bool, need_w: bool, need_b: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx_NI, dw_EOI, db_EO, amax_grad) of `fp8_grouped_linear`; a gradient not asked for is empty."""
    dy_NO = dy_NO.contiguous()
    w_q, w_s, _ = _quantize(w_EOI, "weight", recipe, "e4m3", block, history, 1)
    g_q, g_s, amax_g = _quantize(dy_NO, "act", recipe, grad_format(fmt), block, history, 2)
    dx, dw, db = (w_EOI.new_empty((0,)) for _ in range(3))
    if need_x:  # dx_NI[rows of e] = dy[rows of e] @ w[e]: the transposed weight, its blocks transposed
        w_ts = w_s.transpose(-1, -2).contiguous() if w_s.dim() == 3 else w_s
        dx = torch.ops.moecompile.grouped_mm_fp8(
            g_q, g_s, w_q.transpose(1, 2).contiguous(), w_ts, sizes_E, _GROUPED_RECIPE[recipe], block, None, x_dtype
        )
    if need_w:
        x_NI = dequantize_fp8(x_q, x_s, "tile" if recipe == "blockwise" else "tensorwise", block)
        dw = torch.ops.moecompile.grouped_mm_wgrad(dy_NO.float(), x_NI, sizes_E).to(w_EOI.dtype)
    if need_b:
        db = _segment_sum(dy_NO, sizes_E)
    return dx, dw, db, amax_g


@library.op("moecompile::fp8_grouped_linear_backward")
def _fp8_grouped_backward_op(
    dy_NO: Tensor, x_q: Tensor, x_s: Tensor, w_EOI: Tensor, sizes_E: Tensor, history: Optional[Tensor], recipe: str,
    fmt: str, block: int, x_dtype: torch.dtype, need_x: bool, need_w: bool, need_b: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One op for the reason `fp8_linear_backward` is one (its dequantize of float8 activations too)."""
    return fp8_grouped_linear_backward_ref(dy_NO, x_q, x_s, w_EOI, sizes_E, history, recipe, fmt, block, x_dtype,
                                           need_x, need_w, need_b)


@_fp8_grouped_backward_op.register_fake
def _fp8_grouped_backward_fake(dy_NO, x_q, x_s, w_EOI, sizes_E, history, recipe, fmt, block, x_dtype,
                               need_x, need_w, need_b):
    (N, I), (E, O, _) = x_q.shape, w_EOI.shape
    return (dy_NO.new_empty((N, I) if need_x else (0,), dtype=x_dtype if need_x else w_EOI.dtype),
            w_EOI.new_empty((E, O, I) if need_w else (0,)),
            (dy_NO.new_empty((E, O)) if need_b else w_EOI.new_empty((0,))),
            dy_NO.new_empty((), dtype=torch.float32))


def _grouped_backward(ctx, dy_NO, *_unused):
    x_q, x_s, w_EOI, sizes_E, amax = ctx.saved_tensors
    history = ctx.history
    recipe, fmt, block, has_bias, x_dtype = ctx.cfg
    need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
    dx, dw, db, amax_g = torch.ops.moecompile.fp8_grouped_linear_backward(
        dy_NO, x_q, x_s, w_EOI, sizes_E, history, recipe, fmt, block, x_dtype, need_x, need_w, need_b and has_bias)
    if history is not None:
        update_amax_history(history, torch.cat([amax, amax_g.reshape(1)]))
    return (dx if need_x else None, dw if need_w else None, None, db if need_b and has_bias else None,
            None, None, None, None)


_fp8_grouped_op.register_autograd(_grouped_backward, setup_context=_grouped_setup)


def fp8_grouped_linear(x_NI, w_EOI, group_sizes_E, bias_EO=None, amax_history=None, recipe="tensorwise",
                       fmt="hybrid", block=128) -> Tensor:
    """`grouped_mm` as FP8 GEMMs (see the module doc); returns y_NO only."""
    return torch.ops.moecompile.fp8_grouped_linear(x_NI, w_EOI, group_sizes_E, bias_EO, amax_history, recipe, fmt, block)[0]


# ---------------------------------------------------------------- delayed-scaling state


# custom_op, not library.op: it mutates `history`, and custom_op writes the functionalization.
@torch.library.custom_op("moecompile::fp8_update_amax_history", mutates_args=("history",))
def update_amax_history(history: Tensor, amax_3: Tensor) -> None:
    """Roll history [3, L] one step and write this step's (x, w, grad) amaxes first."""
    history.copy_(torch.cat([amax_3.to(history.dtype).reshape(3, 1), history[:, :-1]], dim=1))


@update_amax_history.register_fake
def _update_fake(history, amax_3):
    return None
