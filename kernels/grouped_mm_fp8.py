"""`moecompile::grouped_mm_fp8` — grouped_mm on float8 operands with their scales.

Legend: N permuted rows, E experts, I in features, O out features, B block.

    y_NO[rows of e] = (x_q * x_scale)[rows of e] @ (w_q[e] * w_scale[e]).T (+ bias_EO[e])

with the scales `quantize_fp8` makes (x_q from x_NI, w_q from w_EOI):

    recipe       x_scale (quantize recipe)    w_scale (quantize recipe)
    tensorwise   []          (tensorwise)     [E]          (tensorwise, one per expert)
    rowwise      [N, 1]      (rowwise)        [E, O, 1]    (rowwise)
    blockwise    [N, ceil(I/B)]   (tile)      [E, ceil(O/B), ceil(I/B)]   (block; DeepSeek-V3)

The product accumulates in float32 and comes out as `out_dtype`. For the
input gradient pass w transposed, `w_q.transpose(1, 2)` with
`w_scale.transpose(-1, -2)` (blockwise; a B x B tile is its own transpose),
and a quantized grad as x. No autograd of its own: the FP8 pass builds the
training step from this op, `quantize_fp8`, and `grouped_mm_wgrad`.
"""
from typing import Optional

import torch
from torch import Tensor

from . import backend, library
from .fp8_quantize import FORMATS, check_recipe, dequantize_fp8, scale_shape
from .grouped_mm import _expert_of_row, grouped_mm_ref

GEMM_RECIPES = {  # grouped_mm_fp8 recipe -> (x's quantize recipe, w's quantize recipe)
    "tensorwise": ("tensorwise", "tensorwise"),
    "rowwise": ("rowwise", "rowwise"),
    "blockwise": ("tile", "block"),
}
_FP8 = tuple(FORMATS.values())


def _check(x_q, x_scale, w_q, w_scale, group_sizes_E, recipe, block, bias_EO, out_dtype) -> None:
    if recipe not in GEMM_RECIPES:
        raise ValueError(f"grouped_mm_fp8: recipe must be one of {tuple(GEMM_RECIPES)}, got {recipe!r}")
    x_recipe, w_recipe = GEMM_RECIPES[recipe]
    check_recipe(x_recipe, block, "grouped_mm_fp8")
    if x_q.dim() != 2 or w_q.dim() != 3 or group_sizes_E.dim() != 1:
        raise ValueError(
            f"grouped_mm_fp8: need x_q [N, I], w_q [E, O, I], group_sizes_E [E], got shapes "
            f"{tuple(x_q.shape)}, {tuple(w_q.shape)}, {tuple(group_sizes_E.shape)}"
        )
    E, O, I = w_q.shape
    if x_q.shape[1] != I or group_sizes_E.shape[0] != E:
        raise ValueError(
            f"grouped_mm_fp8: x_q {tuple(x_q.shape)}, w_q {tuple(w_q.shape)} and group_sizes_E "
            f"{tuple(group_sizes_E.shape)} disagree on I or E"
        )
    if x_q.dtype not in _FP8 or w_q.dtype not in _FP8:
        raise ValueError(
            f"grouped_mm_fp8: x_q and w_q must be float8 (from quantize_fp8), got {x_q.dtype}, {w_q.dtype}"
        )
    for name, s, t, r in (("x_scale", x_scale, x_q, x_recipe), ("w_scale", w_scale, w_q, w_recipe)):
        want = scale_shape(tuple(t.shape), r, block)
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(
                f"grouped_mm_fp8: recipe {recipe!r} needs {name} float32 of shape {want} "
                f"(quantize_fp8 recipe {r!r}, block {block}), got {s.dtype} {tuple(s.shape)}"
            )
    if group_sizes_E.dtype.is_floating_point or group_sizes_E.dtype == torch.bool:
        raise ValueError(f"grouped_mm_fp8: group_sizes_E must be integer, got {group_sizes_E.dtype}")
    if not out_dtype.is_floating_point or out_dtype in _FP8:
        raise ValueError(f"grouped_mm_fp8: out_dtype must be a float (not float8) dtype, got {out_dtype}")
    if bias_EO is not None and tuple(bias_EO.shape) != (E, O):
        raise ValueError(f"grouped_mm_fp8: bias_EO must have shape ({E}, {O}), got {tuple(bias_EO.shape)}")


def grouped_mm_fp8_ref(
    x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, group_sizes_E: Tensor,
    recipe: str, block: int, bias_EO: Optional[Tensor], out_dtype: torch.dtype,
) -> Tensor:
    """Dequantize to float32, then the float32 grouped_mm: the CPU implementation and the oracle."""
    _check(x_q, x_scale, w_q, w_scale, group_sizes_E, recipe, block, bias_EO, out_dtype)
    x_recipe, w_recipe = GEMM_RECIPES[recipe]
    x_NI = dequantize_fp8(x_q, x_scale, x_recipe, block)
    w_EOI = dequantize_fp8(w_q, w_scale, w_recipe, block)
    y_NO = grouped_mm_ref(x_NI, w_EOI, group_sizes_E, None)
    if bias_EO is not None:
        y_NO = y_NO + bias_EO.float()[_expert_of_row(group_sizes_E, x_q.shape[0])]
    return y_NO.to(out_dtype)


@library.op("moecompile::grouped_mm_fp8")
def _grouped_mm_fp8_op(
    x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, group_sizes_E: Tensor,
    recipe: str, block: int, bias_EO: Optional[Tensor], out_dtype: torch.dtype,
) -> Tensor:
    impl = backend.implementation("grouped_mm_fp8", x_q.device)
    return impl(x_q, x_scale, w_q, w_scale, group_sizes_E, recipe, block, bias_EO, out_dtype)


@_grouped_mm_fp8_op.register_fake
def _grouped_mm_fp8_fake(x_q, x_scale, w_q, w_scale, group_sizes_E, recipe, block, bias_EO, out_dtype):
    _check(x_q, x_scale, w_q, w_scale, group_sizes_E, recipe, block, bias_EO, out_dtype)
    return x_q.new_empty((x_q.shape[0], w_q.shape[1]), dtype=out_dtype)


backend.register("grouped_mm_fp8", grouped_mm_fp8_ref, triton="grouped_mm_triton:grouped_mm_fp8_triton")


def grouped_mm_fp8(
    x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, group_sizes_E: Tensor,
    recipe: str = "tensorwise", block: int = 128, bias_EO: Optional[Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Expert matmul on quantized rows and weights: y_NO in `out_dtype` (see module doc)."""
    return torch.ops.moecompile.grouped_mm_fp8(
        x_q, x_scale, w_q, w_scale, group_sizes_E, recipe, block, bias_EO, out_dtype
    )
