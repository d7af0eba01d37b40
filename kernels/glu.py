"""`moecompile::glu` — gated linear unit over a fused gate/up projection.

Legend: N rows (any leading shape), F expert FFN width; F2 = 2*F.

    h_NF2 = [gate_NF | up_NF]  ──glu("silu")──▶  out_NF = silu(gate_NF) * up_NF

Gate first, then up, as in Hugging Face Mixtral's fused `gate_up_proj`, so one
grouped_mm produces both halves and this op finishes the SwiGLU/GeGLU.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

ACTS = ("silu", "gelu", "gelu_tanh", "relu")


def _check(h_NF2: Tensor, act: str) -> None:
    if act not in ACTS:
        raise ValueError(f"glu: act must be one of {ACTS}, got {act!r}")
    if h_NF2.dim() < 1 or h_NF2.shape[-1] % 2 != 0:
        raise ValueError(f"glu: last dim must be even (gate | up), got shape {tuple(h_NF2.shape)}")


def _act(x: Tensor, act: str) -> Tensor:
    if act == "silu":
        return F.silu(x)
    if act == "relu":
        return F.relu(x)
    return F.gelu(x, approximate="tanh" if act == "gelu_tanh" else "none")


def _act_backward(grad: Tensor, x: Tensor, act: str) -> Tensor:
    """grad * act'(x), through ATen's own backward formulas (exact and traceable)."""
    if act == "silu":
        return torch.ops.aten.silu_backward(grad, x)
    if act == "relu":
        return torch.ops.aten.threshold_backward(grad, x, 0)
    return torch.ops.aten.gelu_backward(grad, x, approximate="tanh" if act == "gelu_tanh" else "none")


def glu_ref(h_NF2: Tensor, act: str) -> Tensor:
    """Pure-torch GLU: the CPU implementation and the test oracle."""
    _check(h_NF2, act)
    gate_NF, up_NF = h_NF2.chunk(2, dim=-1)
    return _act(gate_NF, act) * up_NF


@torch.library.custom_op("moecompile::glu", mutates_args=())
def _glu_op(h_NF2: Tensor, act: str) -> Tensor:
    return glu_ref(h_NF2, act)


@_glu_op.register_fake
def _glu_fake(h_NF2, act):
    _check(h_NF2, act)
    return h_NF2.new_empty((*h_NF2.shape[:-1], h_NF2.shape[-1] // 2))


def _setup_context(ctx, inputs, output):
    h_NF2, act = inputs
    ctx.save_for_backward(h_NF2)
    ctx.act = act


def glu_backward(grad_NF: Tensor, h_NF2: Tensor, act: str) -> Tensor:
    """d gate = g * up * act'(gate), d up = g * act(gate), concatenated back to [.., 2F]."""
    gate_NF, up_NF = h_NF2.chunk(2, dim=-1)
    grad_gate_NF = _act_backward(grad_NF * up_NF, gate_NF, act)
    return torch.cat([grad_gate_NF, grad_NF * _act(gate_NF, act)], dim=-1)


def _backward(ctx, grad_NF):
    (h_NF2,) = ctx.saved_tensors
    return glu_backward(grad_NF, h_NF2, ctx.act), None


_glu_op.register_autograd(_backward, setup_context=_setup_context)


def glu(h_NF2: Tensor, act: str = "silu") -> Tensor:
    """act(h[..., :F]) * h[..., F:] for act in silu | gelu | gelu_tanh | relu."""
    return torch.ops.moecompile.glu(h_NF2, act)
