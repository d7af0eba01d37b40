"""`moecompile::unpermute` — weighted combine of expert outputs back into token order.

Legend: N permuted rows, H hidden, T tokens, K top-k; an assignment is a = t*K + j.

    row_src_N = [1, 0, 2, -1]   (K=2)                      # -1: padding row
    out_TH[0] = w[0, 1] * y_NH[0] + w[0, 0] * y_NH[1]
    out_TH[1] = w[1, 0] * y_NH[2]                          # a=3 was dropped

The inverse of `permute`: dropped assignments and padding rows contribute
nothing, and a token with no surviving rows comes out as zeros.

weighted=False sums the rows as they are: they already carry their weights (`glu`'s
weight_N multiplied them in on [N, F], Megatron-Core's "probs in the activation"), and
weights_TK only gives K. Its backward needs no y_NH, so none is saved for it.
"""
import torch
from torch import Tensor

from . import backend, library
from .row_ops import row_dot


def _check(y_NH: Tensor, row_src_N: Tensor, weights_TK: Tensor, num_tokens: int) -> None:
    if y_NH.dim() != 2 or row_src_N.dim() != 1 or weights_TK.dim() != 2:
        raise ValueError(
            f"unpermute: need y_NH [N, H], row_src_N [N], weights_TK [T, K], got shapes "
            f"{tuple(y_NH.shape)}, {tuple(row_src_N.shape)}, {tuple(weights_TK.shape)}"
        )
    if row_src_N.shape[0] != y_NH.shape[0] or weights_TK.shape[0] != num_tokens:
        raise ValueError(
            f"unpermute: y_NH {tuple(y_NH.shape)}, row_src_N {tuple(row_src_N.shape)}, weights_TK "
            f"{tuple(weights_TK.shape)} and num_tokens={num_tokens} disagree on N or T"
        )
    if row_src_N.dtype.is_floating_point or row_src_N.dtype == torch.bool:
        raise ValueError(f"unpermute: row_src_N must be an integer tensor, got {row_src_N.dtype}")


def _rows(row_src_N: Tensor, weights_TK: Tensor, dtype: torch.dtype, weighted: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(source assignment clamped to >= 0, destination token, weight per row; 0 for pads, else 1 unweighted)."""
    valid_N = row_src_N >= 0
    src_N = row_src_N.clamp(min=0).long()
    w_N = row_weights(row_src_N, weights_TK).to(dtype) if weighted else valid_N.to(dtype)
    return src_N, src_N // weights_TK.shape[1], w_N


def row_weights(row_src_N: Tensor, weights_TK: Tensor) -> Tensor:
    """w_N: the routing weight of each permuted row, 0 for padding rows (differentiable in weights_TK)."""
    w_N = weights_TK.reshape(-1).index_select(0, row_src_N.clamp(min=0).long())
    return torch.where(row_src_N >= 0, w_N, 0)


def unpermute_ref(y_NH: Tensor, row_src_N: Tensor, weights_TK: Tensor, num_tokens: int, weighted: bool = True) -> Tensor:
    """Pure-torch combine: the CPU implementation and the test oracle."""
    _check(y_NH, row_src_N, weights_TK, num_tokens)
    pads = True
    if row_src_N.device.type == "cpu" and row_src_N.numel():  # free check on CPU only
        (lo, hi), A = (int(v) for v in torch.aminmax(row_src_N)), weights_TK.numel()
        if lo < -1 or hi >= A:
            raise ValueError(
                f"unpermute: row_src_N values must lie in [-1, {A}), got min {lo}, max {hi}"
            )
        pads = lo < 0
    _, tok_N, w_N = _rows(row_src_N, weights_TK, y_NH.dtype, weighted)
    out_TH = y_NH.new_zeros((num_tokens, y_NH.shape[1]))
    # unweighted and no padding rows (dropless): the rows go in as they are, no [N, H] product
    return out_TH.index_add_(0, tok_N, y_NH * w_N.unsqueeze(1) if weighted or pads else y_NH)


@library.op("moecompile::unpermute")
def _unpermute_op(y_NH: Tensor, row_src_N: Tensor, weights_TK: Tensor, num_tokens: int, weighted: bool = True) -> Tensor:
    impl = backend.implementation("unpermute", y_NH.device)
    return impl(y_NH, row_src_N, weights_TK, num_tokens, weighted)


@_unpermute_op.register_fake
def _unpermute_fake(y_NH, row_src_N, weights_TK, num_tokens, weighted=True):
    _check(y_NH, row_src_N, weights_TK, num_tokens)
    return y_NH.new_empty((num_tokens, y_NH.shape[1]))


def _setup_context(ctx, inputs, output):
    y_NH, row_src_N, weights_TK, _, weighted = inputs
    # unweighted, the backward is a row gather: y_NH's values are not needed, only its shape and dtype
    ctx.save_for_backward(y_NH if weighted else y_NH.new_empty((0, y_NH.shape[1])), row_src_N, weights_TK)
    ctx.weighted = weighted


def unpermute_backward(
    grad_TH: Tensor, y_NH: Tensor, row_src_N: Tensor, weights_TK: Tensor, weighted: bool = True
) -> tuple[Tensor, Tensor]:
    """grad_y[r] = w[row_src[r]] * grad[t]; grad_w[a] = <grad[t], y[row of a]> (0 if dropped).

    weighted=False: grad_y[r] = grad[t] (0 for pads), grad_w = 0, and y_NH may be an empty [0, H].
    """
    src_N, tok_N, w_N = _rows(row_src_N, weights_TK, y_NH.dtype, weighted)
    grad_rows_NH = grad_TH.index_select(0, tok_N)
    if not weighted:
        if row_src_N.device.type != "cpu" or bool((row_src_N < 0).any()):  # zero the pads' rows
            grad_rows_NH = grad_rows_NH.mul_(w_N.unsqueeze(1))
        return grad_rows_NH.to(torch.promote_types(grad_TH.dtype, y_NH.dtype)), torch.zeros_like(weights_TK)
    acc = torch.promote_types(weights_TK.dtype, torch.float32)
    dot_N = row_dot(grad_rows_NH, y_NH, acc).masked_fill(row_src_N < 0, 0)
    grad_y_NH = grad_rows_NH.mul_(w_N.unsqueeze(1))
    grad_w_A = weights_TK.new_zeros((weights_TK.numel(),), dtype=acc).index_add_(0, src_N, dot_N)
    return grad_y_NH, grad_w_A.reshape(weights_TK.shape).to(weights_TK.dtype)


@library.op("moecompile::unpermute_backward")
def _unpermute_backward_op(
    grad_TH: Tensor, y_NH: Tensor, row_src_N: Tensor, weights_TK: Tensor, weighted: bool = True
) -> tuple[Tensor, Tensor]:
    impl = backend.implementation("unpermute_backward", grad_TH.device)
    return impl(grad_TH, y_NH, row_src_N, weights_TK, weighted)


@_unpermute_backward_op.register_fake
def _unpermute_backward_fake(grad_TH, y_NH, row_src_N, weights_TK, weighted=True):
    grad_dtype = torch.promote_types(grad_TH.dtype, y_NH.dtype)
    grad_y_NH = y_NH.new_empty((row_src_N.shape[0], y_NH.shape[1]), dtype=grad_dtype)
    return grad_y_NH, weights_TK.new_empty(weights_TK.shape)


def _backward(ctx, grad_TH):
    y_NH, row_src_N, weights_TK = ctx.saved_tensors
    grad_y_NH, grad_weights_TK = torch.ops.moecompile.unpermute_backward(
        grad_TH.contiguous(), y_NH, row_src_N, weights_TK, ctx.weighted
    )
    return grad_y_NH, None, grad_weights_TK if ctx.weighted else None, None, None


_unpermute_op.register_autograd(_backward, setup_context=_setup_context)
backend.register("unpermute", unpermute_ref, triton="unpermute_triton:unpermute_triton")
backend.register("unpermute_backward", unpermute_backward, triton="unpermute_triton:unpermute_backward_triton")


def unpermute(y_NH: Tensor, row_src_N: Tensor, weights_TK: Tensor, num_tokens: int, weighted: bool = True) -> Tensor:
    """Combine: out_TH[t] = sum over t's surviving rows r of weights[row_src[r]] * y_NH[r] (weighted=False: of y_NH[r])."""
    return torch.ops.moecompile.unpermute(y_NH, row_src_N, weights_TK, num_tokens, weighted)
