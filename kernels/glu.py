"""`moecompile::glu` — gated linear unit over a fused gate/up projection.

Legend: N rows (any leading shape), F expert FFN width; F2 = 2*F.

    h_NF2 = [gate_NF | up_NF]  ──glu("silu")──▶  out_NF = silu(gate_NF) * up_NF

Gate first, then up, as in Hugging Face Mixtral's fused `gate_up_proj`, so one
grouped_mm produces both halves and this op finishes the SwiGLU/GeGLU.

With `weight_N` (each permuted row's routing weight, 0 for padding rows) the
op multiplies it in, so the combine can sum unweighted (unpermute with ones):

    out_NF = silu(gate_NF) * up_NF * weight_N[:, None]      grad reaches weight_N too

With ``weight_input`` the weight scales the rows before the activation instead, as an expert
whose *input* was weighted computes it (Llama 4: x * w goes into the first GEMM, which is linear):

    out_NF = silu(w * gate_NF) * (w * up_NF)                 w = weight_N[:, None]

Both backends run that as glu(w * h): the scaling is this module's, not each kernel's.

``act="clamped_swiglu"`` is gpt-oss's: the gate clamped above at 7, then g * sigmoid(1.702 g), and the up
half clamped to +-7 and shifted by one:

    out_NF = min(gate, 7) * sigmoid(1.702 min(gate, 7)) * (clamp(up, -7, 7) + 1)
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import backend, library
from .row_ops import row_dot

ACTS = ("silu", "gelu", "gelu_tanh", "relu", "clamped_swiglu")
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # clamped_swiglu's constants (gpt-oss's; glu_triton.py writes them out too)


def _check(h_NF2: Tensor, act: str, weight_N: Optional[Tensor] = None) -> None:
    if act not in ACTS:
        raise ValueError(f"glu: act must be one of {ACTS}, got {act!r}")
    if h_NF2.dim() < 1 or h_NF2.shape[-1] % 2 != 0:
        raise ValueError(f"glu: last dim must be even (gate | up), got shape {tuple(h_NF2.shape)}")
    if weight_N is not None and (weight_N.shape != h_NF2.shape[:-1] or not weight_N.dtype.is_floating_point):
        raise ValueError(
            f"glu: weight_N must be a float tensor of shape {tuple(h_NF2.shape[:-1])} (one per row), "
            f"got {weight_N.dtype} {tuple(weight_N.shape)}"
        )


def _act(x: Tensor, act: str) -> Tensor:
    if act == "silu":
        return F.silu(x)
    if act == "relu":
        return F.relu(x)
    if act == "clamped_swiglu":
        g = x.clamp(max=SWIGLU_LIMIT)
        return g * torch.sigmoid(SWIGLU_ALPHA * g)
    return F.gelu(x, approximate="tanh" if act == "gelu_tanh" else "none")


def _up(up: Tensor, act: str) -> Tensor:
    """The up half as the product reads it: itself, or clamped_swiglu's clamp(up, -L, L) + 1."""
    return up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT).add_(1) if act == "clamped_swiglu" else up


def _up_backward_(grad_up: Tensor, up: Tensor, act: str) -> Tensor:
    """grad_up through ``_up``, in place: zero where clamped_swiglu's clamp cut (torch's clamp keeps the bounds)."""
    return grad_up.masked_fill_(up.abs() > SWIGLU_LIMIT, 0) if act == "clamped_swiglu" else grad_up


def _act_backward(grad: Tensor, x: Tensor, act: str, out: Optional[Tensor] = None) -> Tensor:
    """grad * act'(x), through ATen's own backward formulas (exact and traceable); `out` may be `grad`."""
    if out is None:
        out = torch.empty_like(grad)
    if act == "silu":
        return torch.ops.aten.silu_backward.grad_input(grad, x, grad_input=out)
    if act == "relu":
        return torch.ops.aten.threshold_backward.grad_input(grad, x, 0, grad_input=out)
    if act == "clamped_swiglu":  # d/dx [g sigmoid(a g)] = s (1 + a g (1 - s)), g = min(x, L); 0 above L
        g = x.clamp(max=SWIGLU_LIMIT)
        s = torch.sigmoid(SWIGLU_ALPHA * g)
        slope = s.mul_(g.mul(1 - s).mul_(SWIGLU_ALPHA).add_(1)).masked_fill_(x > SWIGLU_LIMIT, 0)
        return torch.mul(grad, slope, out=out)
    approximate = "tanh" if act == "gelu_tanh" else "none"
    return torch.ops.aten.gelu_backward.grad_input(grad, x, approximate=approximate, grad_input=out)


def glu_ref(h_NF2: Tensor, act: str, weight_N: Optional[Tensor] = None) -> Tensor:
    """Pure-torch GLU: the CPU implementation and the test oracle."""
    _check(h_NF2, act, weight_N)
    gate_NF, up_NF = h_NF2.chunk(2, dim=-1)
    out_NF = _act(gate_NF, act).mul_(_up(up_NF, act))
    return out_NF if weight_N is None else out_NF.mul_(weight_N.to(out_NF.dtype).unsqueeze(-1))


def _scaled_rows(h_NF2: Tensor, weight_N: Tensor) -> Tensor:
    """w * h, row by row: the input-weighted GLU's pre-activation."""
    return h_NF2 * weight_N.to(h_NF2.dtype).unsqueeze(-1)


def _check_weight_input(weight_N: Optional[Tensor], weight_input: bool) -> None:
    if weight_input and weight_N is None:
        raise ValueError("glu: weight_input=True scales the rows by weight_N; pass weight_N")


@library.op("moecompile::glu")
def _glu_op(h_NF2: Tensor, act: str, weight_N: Optional[Tensor] = None, weight_input: bool = False) -> Tensor:
    _check_weight_input(weight_N, weight_input)
    if weight_input:
        h_NF2, weight_N = _scaled_rows(h_NF2, weight_N), None
    return backend.implementation("glu", h_NF2.device)(h_NF2, act, weight_N)


@_glu_op.register_fake
def _glu_fake(h_NF2, act, weight_N=None, weight_input=False):
    _check(h_NF2, act, weight_N)
    _check_weight_input(weight_N, weight_input)
    return h_NF2.new_empty((*h_NF2.shape[:-1], h_NF2.shape[-1] // 2))


def _setup_context(ctx, inputs, output):
    h_NF2, act, weight_N, weight_input = inputs
    ctx.save_for_backward(h_NF2, weight_N)
    ctx.act, ctx.weight_input = act, weight_input


def glu_backward(grad_NF: Tensor, h_NF2: Tensor, act: str) -> Tensor:
    """d gate = g * up * act'(gate), d up = g * act(gate), written straight into one [.., 2F] buffer."""
    gate_NF, up_NF = h_NF2.chunk(2, dim=-1)
    grad_h = h_NF2.new_empty(h_NF2.shape, dtype=torch.promote_types(grad_NF.dtype, h_NF2.dtype))
    grad_gate_NF, grad_up_NF = grad_h.chunk(2, dim=-1)
    torch.mul(grad_NF, _act(gate_NF, act), out=grad_up_NF)
    _up_backward_(grad_up_NF, up_NF, act)
    torch.mul(grad_NF, _up(up_NF, act), out=grad_gate_NF)
    _act_backward(grad_gate_NF, gate_NF, act, out=grad_gate_NF)
    return grad_h


def glu_backward_ref(
    grad_NF: Tensor, h_NF2: Tensor, act: str, weight_N: Optional[Tensor]
) -> tuple[Tensor, Tensor]:
    """(grad_h, grad_weight); grad_weight[n] = <grad[n], act(gate[n]) * up[n]>, empty without weight.

    Weighted, written into grad_h's halves in place with one [N, F] temporary (act(gate)): on a
    CPU a fresh [N, F] buffer costs more than the arithmetic on it (page faults).
        d gate = (g * up) * w * act'(gate)      d up = (g * act(gate)) * w
        grad_w = <g * up, act(gate)>            the unweighted d gate, before w and act'
    """
    if weight_N is None:
        return glu_backward(grad_NF, h_NF2, act), h_NF2.new_empty((0,))
    gate_NF, up_NF = h_NF2.chunk(2, dim=-1)
    grad_h = h_NF2.new_empty(h_NF2.shape, dtype=torch.promote_types(grad_NF.dtype, h_NF2.dtype))
    grad_gate_NF, grad_up_NF = grad_h.chunk(2, dim=-1)
    w_N1 = weight_N.to(grad_h.dtype).unsqueeze(-1)
    act_NF = _act(gate_NF, act)
    torch.mul(grad_NF, _up(up_NF, act), out=grad_gate_NF)
    grad_w_N = row_dot(grad_gate_NF, act_NF, torch.promote_types(h_NF2.dtype, torch.float32))
    _up_backward_(torch.mul(grad_NF, act_NF, out=grad_up_NF).mul_(w_N1), up_NF, act)
    _act_backward(grad_gate_NF.mul_(w_N1), gate_NF, act, out=grad_gate_NF)
    return grad_h, grad_w_N.to(weight_N.dtype)


@library.op("moecompile::glu_backward")
def _glu_backward_op(
    grad_NF: Tensor, h_NF2: Tensor, act: str, weight_N: Optional[Tensor], weight_input: bool = False
) -> tuple[Tensor, Tensor]:
    """(grad_h, grad_weight). With ``weight_input``: d(w h) from the unweighted backward at w h, then
    grad_h = w * d(w h) and grad_w = <d(w h), h>."""
    implementation = backend.implementation("glu_backward", h_NF2.device)
    if not weight_input:
        return implementation(grad_NF, h_NF2, act, weight_N)
    grad_scaled, _ = implementation(grad_NF, _scaled_rows(h_NF2, weight_N), act, None)
    grad_w_N = row_dot(grad_scaled, h_NF2, torch.promote_types(h_NF2.dtype, torch.float32))
    return _scaled_rows(grad_scaled, weight_N), grad_w_N.to(weight_N.dtype)


@_glu_backward_op.register_fake
def _glu_backward_fake(grad_NF, h_NF2, act, weight_N, weight_input=False):
    grad_h = h_NF2.new_empty(h_NF2.shape, dtype=torch.promote_types(grad_NF.dtype, h_NF2.dtype))
    return grad_h, h_NF2.new_empty((0,)) if weight_N is None else weight_N.new_empty(weight_N.shape)


def _backward(ctx, grad_NF):
    h_NF2, weight_N = ctx.saved_tensors
    grad_h, grad_w = torch.ops.moecompile.glu_backward(grad_NF.contiguous(), h_NF2, ctx.act, weight_N,
                                                       ctx.weight_input)
    return grad_h, None, None if weight_N is None else grad_w, None


_glu_op.register_autograd(_backward, setup_context=_setup_context)
backend.register("glu", glu_ref, triton="glu_triton:glu_triton")
backend.register("glu_backward", glu_backward_ref, triton="glu_triton:glu_backward_triton")


def glu(h_NF2: Tensor, act: str = "silu", weight_N: Optional[Tensor] = None, weight_input: bool = False) -> Tensor:
    """act(h[..., :F]) * h[..., F:] (* weight_N[..., None]) for act in silu | gelu | gelu_tanh | relu, or
    gpt-oss's clamped_swiglu (its up half clamped and shifted by one);
    ``weight_input``: act(w h[..., :F]) * (w h[..., F:]), the rows weighted before the activation."""
    return torch.ops.moecompile.glu(h_NF2, act, weight_N, weight_input)
