"""`moecompile::route` — pick the top-k experts per token and their gate weights.

Legend: T tokens, E experts, K top-k.

    logits_TE ──route(k=2, "softmax", normalize=False)──▶ weights_TK,     idx_TK
    [[2., 0., 1.]]                                        [[.665, .245]], [[0, 2]]

The bias (DeepSeek-V3 aux-loss-free balancing) shifts which experts are
*selected* but not the weights, so balancing never leaks into the gradient.

Group-limited routing (DeepSeek-V3's node-limited routing, `groups` > 1): the E
experts form `groups` equal groups; a group's score is the sum of its two best
choice scores (one when a group holds one expert), each token keeps its `group_k`
best groups, and its top-k is taken among their experts only. Like the bias it
changes the selection, never the weights.
"""

from typing import Optional

import torch
from torch import Tensor

from . import backend, library

SCORES = ("softmax", "sigmoid")
# Only sigmoid scores can all be ~0 in a row; softmax rows always sum > 0.
_SIGMOID_EPS = 1e-20


def _check(logits_TE: Tensor, bias_E: Optional[Tensor], k: int, score: str, groups: int = 1, group_k: int = 1) -> None:
    if logits_TE.dim() != 2:
        raise ValueError(f"route: logits_TE must be 2-D [T, E], got shape {tuple(logits_TE.shape)}")
    if not logits_TE.dtype.is_floating_point:
        raise ValueError(f"route: logits_TE must be floating point, got {logits_TE.dtype}")
    E = logits_TE.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"route: need 1 <= k <= num_experts, got k={k}, num_experts={E}")
    if score not in SCORES:
        raise ValueError(f"route: score must be one of {SCORES}, got {score!r}")
    if bias_E is not None and tuple(bias_E.shape) != (E,):
        raise ValueError(f"route: bias_E must have shape ({E},), got {tuple(bias_E.shape)}")
    if groups < 1 or E % groups:
        raise ValueError(f"route: groups={groups} must be >= 1 and divide num_experts={E}")
    if not 1 <= group_k <= groups:
        raise ValueError(f"route: need 1 <= group_k <= groups, got group_k={group_k}, groups={groups}")
    if k > group_k * (E // groups):
        raise ValueError(f"route: k={k} exceeds the {group_k * (E // groups)} experts in group_k={group_k} "
                         f"groups of {E // groups}")


def _dtype(logits_TE: Tensor) -> torch.dtype:
    return torch.promote_types(logits_TE.dtype, torch.float32)


def _scores(logits_TE: Tensor, score: str) -> Tensor:
    logits_TE = logits_TE.to(_dtype(logits_TE))
    return logits_TE.softmax(-1) if score == "softmax" else logits_TE.sigmoid()


def limit_to_groups(choice_TE: Tensor, groups: int, group_k: int) -> Tensor:
    """`choice_TE` with every expert outside a token's `group_k` best groups set to -inf."""
    if groups == 1:
        return choice_TE
    T, E = choice_TE.shape
    per_group = choice_TE.view(T, groups, E // groups)
    group_TG = per_group.topk(min(2, E // groups), dim=-1).values.sum(-1)
    keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, group_TG.topk(group_k, dim=-1).indices, True)
    return choice_TE.masked_fill(~keep_TG.repeat_interleave(E // groups, dim=1), float("-inf"))


def route_ref(
    logits_TE: Tensor, bias_E: Optional[Tensor], k: int, score: str, normalize: bool, groups: int = 1,
    group_k: int = 1,
) -> tuple[Tensor, Tensor]:
    """Pure-torch router: the CPU implementation and the test oracle."""
    _check(logits_TE, bias_E, k, score, groups, group_k)
    scores_TE = _scores(logits_TE, score)
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.to(scores_TE.dtype)
    choice_TE = limit_to_groups(choice_TE, groups, group_k)
    idx_TK = choice_TE.topk(k, dim=-1, sorted=True).indices
    weights_TK = scores_TE.gather(-1, idx_TK)
    if normalize:
        eps = _SIGMOID_EPS if score == "sigmoid" else 0.0
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + eps)
    return weights_TK, idx_TK


@library.op("moecompile::route")
def _route_op(
    logits_TE: Tensor, bias_E: Optional[Tensor], k: int, score: str, normalize: bool, groups: int = 1,
    group_k: int = 1,
) -> tuple[Tensor, Tensor]:
    impl = backend.implementation("route", logits_TE.device)
    return impl(logits_TE, bias_E, k, score, normalize, groups, group_k)


@_route_op.register_fake
def _route_fake(logits_TE, bias_E, k, score, normalize, groups=1, group_k=1):
    _check(logits_TE, bias_E, k, score, groups, group_k)
    T = logits_TE.shape[0]
    weights_TK = logits_TE.new_empty((T, k), dtype=_dtype(logits_TE))
    return weights_TK, logits_TE.new_empty((T, k), dtype=torch.int64)


def _setup_context(ctx, inputs, output):
    logits_TE, _, _, score, normalize, _, _ = inputs
    weights_TK, idx_TK = output
    ctx.save_for_backward(logits_TE, weights_TK, idx_TK)
    ctx.score, ctx.normalize = score, normalize


def route_backward_ref(
    grad_weights_TK: Tensor, logits_TE: Tensor, weights_TK: Tensor, idx_TK: Tensor, score: str, normalize: bool
) -> Tensor:
    """Analytic vjp with the selection (idx) held fixed; only logits get a grad."""
    scores_TE = _scores(logits_TE, score)
    g_TK = grad_weights_TK.to(scores_TE.dtype)
    if normalize:  # w = raw / d  =>  d raw = (g - <g, w>) / d
        eps = _SIGMOID_EPS if score == "sigmoid" else 0.0
        denom_T1 = scores_TE.gather(-1, idx_TK).sum(-1, keepdim=True) + eps
        g_TK = (g_TK - (g_TK * weights_TK).sum(-1, keepdim=True)) / denom_T1
    g_TE = torch.zeros_like(scores_TE).scatter_add_(-1, idx_TK, g_TK)
    if score == "softmax":
        g_TE = scores_TE * (g_TE - (g_TE * scores_TE).sum(-1, keepdim=True))
    else:
        g_TE = g_TE * scores_TE * (1 - scores_TE)
    return g_TE.to(logits_TE.dtype)


@library.op("moecompile::route_backward")
def _route_backward_op(
    grad_weights_TK: Tensor, logits_TE: Tensor, weights_TK: Tensor, idx_TK: Tensor, score: str, normalize: bool
) -> Tensor:
    impl = backend.implementation("route_backward", logits_TE.device)
    return impl(grad_weights_TK, logits_TE, weights_TK, idx_TK, score, normalize)


@_route_backward_op.register_fake
def _route_backward_fake(grad_weights_TK, logits_TE, weights_TK, idx_TK, score, normalize):
    return logits_TE.new_empty(logits_TE.shape)


def _backward(ctx, grad_weights_TK, _grad_idx):
    logits_TE, weights_TK, idx_TK = ctx.saved_tensors
    if grad_weights_TK is None:
        return None, None, None, None, None, None, None
    grad_logits_TE = torch.ops.moecompile.route_backward(
        grad_weights_TK.contiguous(), logits_TE, weights_TK, idx_TK, ctx.score, ctx.normalize
    )
    return grad_logits_TE, None, None, None, None, None, None


_route_op.register_autograd(_backward, setup_context=_setup_context)
backend.register("route", route_ref, triton="route_triton:route_triton")
backend.register("route_backward", route_backward_ref, triton="route_triton:route_backward_triton")


def route(
    logits_TE: Tensor,
    bias_E: Optional[Tensor] = None,
    k: int = 2,
    score: str = "softmax",
    normalize: bool = True,
    groups: int = 1,
    group_k: int = 1,
) -> tuple[Tensor, Tensor]:
    """Top-k routing: `(weights_TK, idx_TK)`, experts sorted by descending choice score.

    `score` is "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3);
    `normalize` rescales each token's k weights to sum to 1; `groups` > 1 picks
    among each token's `group_k` best expert groups only (see the module docstring).
    """
    return torch.ops.moecompile.route(logits_TE, bias_E, k, score, normalize, groups, group_k)
