"""`moecompile::quantize_fp8` — cast to float8 with per-tile scales from the amax.

Legend: R rows, C columns (the last two dims; leading dims are a batch of
matrices, e.g. expert weights [E, O, I]), B block, nR = ceil(R/B), nC = ceil(C/B).

    recipe        one scale per            scale shape      scale strides (last two dims)
    tensorwise    matrix                   [...]            -
    rowwise       row                      [..., R, 1]      contiguous
    tile          1 x B run of a row       [..., R, nC]     (1, R): outer-dim-major
    block         B x B tile               [..., nR, nC]    contiguous

`tile` (1x128) and `block` (128x128) are DeepSeek-V3's activation and weight
recipes; the layouts are the ones `torch._scaled_mm` takes for its tensorwise,
rowwise, BlockWise1x128 and BlockWise128x128 scalings (pass a weight's scale
transposed, as you pass the weight). Dequantize with x ~= q * scale:

    amax  = max(|x| over the tile, 1e-12)
    scale = amax / fp8_max            (float32)
    q     = clamp(x * (fp8_max / amax), -fp8_max, fp8_max).to(float8)

fmt is "e4m3" (float8_e4m3fn, max 448: weights, activations) or "e5m2"
(float8_e5m2, max 57344: gradients). No autograd: casting is a forward-only
step of FP8 training; the FP8 pass decides what the gradient path casts.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from moecompile.errors import KernelError

from . import backend, library

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
RECIPES = ("tensorwise", "rowwise", "tile", "block")
AMAX_EPS = 1e-12  # an all-zero tile gets a tiny scale instead of a division by zero
FP8_MIN_ARCH = 89  # float8 e4m3 GEMMs (Triton's fp8e4nv, torch._scaled_mm): Ada sm_89, Hopper sm_90 and later
_FP8_DTYPES = tuple(FORMATS.values())


def fp8_max(fmt: str) -> float:
    return float(torch.finfo(FORMATS[fmt]).max)


def check_recipe(recipe: str, block: int, who: str = "quantize_fp8") -> None:
    if recipe not in RECIPES:
        raise ValueError(f"{who}: recipe must be one of {RECIPES}, got {recipe!r}")
    if recipe in ("tile", "block") and (block < 16 or block & (block - 1)):
        raise ValueError(
            f"{who}: recipe {recipe!r} needs block to be a power of two >= 16 (128 is DeepSeek-V3's), "
            f"got {block}"
        )


def check_fp8_arch(device: torch.device, who: str) -> None:
    """Refuse FP8 on a GPU without float8 e4m3 (an A100's sm_80), before Triton's compiler fails deep inside."""
    arch = backend.target_arch(device)
    if arch is not None and arch < FP8_MIN_ARCH:
        raise KernelError(f"{who}: FP8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                          f"sm_{arch} has no float8 e4m3 arithmetic. Set fp8.recipe: none in the plan (bf16 GEMMs)")


def _check(x: Tensor, recipe: str, fmt: str, block: int) -> None:
    if x.dim() < 2:
        raise ValueError(f"quantize_fp8: x must be a matrix or a batch of them, got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point or x.dtype in _FP8_DTYPES:
        raise ValueError(f"quantize_fp8: x must be a float (not float8) tensor, got {x.dtype}")
    if fmt not in FORMATS:
        raise ValueError(f"quantize_fp8: fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
    check_recipe(recipe, block)


def scale_shape(shape: tuple, recipe: str, block: int) -> tuple:
    """Shape of the scale `quantize_fp8` returns for a tensor of `shape`."""
    *lead, R, C = shape
    if recipe == "tensorwise":
        return tuple(lead)
    if recipe == "rowwise":
        return (*lead, R, 1)
    if recipe == "tile":
        return (*lead, R, math.ceil(C / block))
    return (*lead, math.ceil(R / block), math.ceil(C / block))


def empty_scale(x: Tensor, recipe: str, block: int) -> Tensor:
    """An uninitialised float32 scale in the layout of the table above."""
    shape = scale_shape(tuple(x.shape), recipe, block)
    if recipe != "tile":
        return x.new_empty(shape, dtype=torch.float32)
    *lead, R, nC = shape
    return x.new_empty((*lead, nC, R), dtype=torch.float32).transpose(-1, -2)


def expand_scale(scale: Tensor, shape: tuple, recipe: str, block: int) -> Tensor:
    """Broadcast a scale to one value per element of a tensor of `shape`."""
    R, C = shape[-2:]
    if recipe == "tensorwise":
        return scale[..., None, None]
    if recipe == "rowwise":
        return scale
    if recipe == "tile":
        return scale.repeat_interleave(block, -1)[..., :C]
    return scale.repeat_interleave(block, -2)[..., :R, :].repeat_interleave(block, -1)[..., :C]


def _amax(x_f: Tensor, recipe: str, block: int) -> Tensor:
    if x_f.numel() == 0:  # amax of nothing: 0 (clamped to AMAX_EPS by the caller)
        return x_f.new_zeros(scale_shape(tuple(x_f.shape), recipe, block))
    a = x_f.abs()
    if recipe == "tensorwise":
        return a.amax(dim=(-2, -1))
    if recipe == "rowwise":
        return a.amax(-1, keepdim=True)
    *lead, R, C = a.shape
    nR, nC = math.ceil(R / block), math.ceil(C / block)
    if recipe == "tile":
        return F.pad(a, (0, nC * block - C)).view(*lead, R, nC, block).amax(-1)
    a = F.pad(a, (0, nC * block - C, 0, nR * block - R))
    return a.view(*lead, nR, block, nC, block).amax(dim=(-3, -1))


def quantize_fp8_ref(x: Tensor, recipe: str, fmt: str, block: int) -> tuple[Tensor, Tensor]:
    """Pure-torch cast: the CPU implementation and the test oracle."""
    _check(x, recipe, fmt, block)
    fmax = fp8_max(fmt)
    x_f = x.float()
    amax = _amax(x_f, recipe, block).clamp(min=AMAX_EPS)
    # tensor / tensor: IEEE division (`float / tensor` is reciprocal-then-multiply, two roundings)
    fmax_t = torch.tensor(fmax, dtype=torch.float32, device=x.device)
    inv = expand_scale(fmax_t / amax, tuple(x.shape), recipe, block)
    q = (x_f * inv).clamp(-fmax, fmax).to(FORMATS[fmt])
    scale = empty_scale(x, recipe, block)
    scale.copy_(amax / fmax_t)
    return q, scale


def dequantize_fp8(q: Tensor, scale: Tensor, recipe: str, block: int) -> Tensor:
    """float32 q * scale: what a quantized tensor stands for."""
    return q.float() * expand_scale(scale, tuple(q.shape), recipe, block)


@library.op("moecompile::quantize_fp8")
def _quantize_fp8_op(x: Tensor, recipe: str, fmt: str, block: int) -> tuple[Tensor, Tensor]:
    return backend.implementation("quantize_fp8", x.device)(x, recipe, fmt, block)


@_quantize_fp8_op.register_fake
def _quantize_fp8_fake(x, recipe, fmt, block):
    _check(x, recipe, fmt, block)
    return x.new_empty(x.shape, dtype=FORMATS[fmt]), empty_scale(x, recipe, block)


backend.register("quantize_fp8", quantize_fp8_ref, triton="fp8_quantize_triton:quantize_fp8_triton")


def quantize_fp8(x: Tensor, recipe: str = "tensorwise", fmt: str = "e4m3", block: int = 128) -> tuple[Tensor, Tensor]:
    """`(q, scale)`: x cast to float8 `fmt` with one float32 scale per `recipe` tile (see module doc)."""
    return torch.ops.moecompile.quantize_fp8(x, recipe, fmt, block)
