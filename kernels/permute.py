"""`moecompile::permute` — sort token copies by expert so each expert's rows are contiguous.

Legend: T tokens, K top-k, E experts, H hidden, N permuted rows, C capacity,
A assignments (T*K; a = t*K + j is token t's j-th choice), S assignments sorted
by expert. row_src_N names the assignment each permuted row came from (-1: pad).

    dropless (capacity=0), idx_TK = [[1, 0], [1, 2]]   (E=3, K=2)
        row_src_N = [1, 0, 2, 3]   x_NH = x_TH[[0, 0, 1, 1]]   group_sizes_E = [1, 2, 1]
    capacity=1, drop_policy="position": expert 1 keeps a=0, drops a=2
        row_src_N = [1, 0, 3]      x_NH = x_TH[[0, 0, 1]]      group_sizes_E = [1, 1, 1]
                                                               load_E        = [1, 2, 1]

Static capacity gives fixed-size buffers (N = E*C), so dispatch needs no host
sync and can sit inside a CUDA graph; load_E still counts what was dropped.

align=a > 1 pads every expert's group to a multiple of a rows (FP8 GEMMs want
16 / 32 / 128) with zero rows (row_src -1). Dropless, N stays static at the
bound round_up(T*K + E*(a-1), a) and the last expert's group takes the slack;
with capacity, C rounds up to a multiple of a (the extra slots keep tokens).

    dropless, align=2, idx_TK = [[1, 0], [1, 2]]   (E=3, K=2): N = round_up(4 + 3, 2) = 8
        row_src_N = [1, -1, 0, 2, 3, -1, -1, -1]   group_sizes_E = [2, 2, 4]
"""
import torch
from torch import Tensor

from . import backend, library

DROP_POLICIES = ("position", "probs")


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def permuted_rows(T: int, K: int, num_experts: int, capacity: int, align: int = 1) -> int:
    """N, the number of rows `permute` returns (static: shapes never depend on the routing)."""
    if capacity:
        return num_experts * _round_up(capacity, align)
    return T * K if align == 1 else _round_up(T * K + num_experts * (align - 1), align)


def _check(x_TH, idx_TK, weights_TK, num_experts, capacity, drop_policy, align=1) -> None:
    if x_TH.dim() != 2 or idx_TK.dim() != 2:
        raise ValueError(
            f"permute: need x_TH [T, H] and idx_TK [T, K], got shapes "
            f"{tuple(x_TH.shape)} and {tuple(idx_TK.shape)}"
        )
    if idx_TK.shape[0] != x_TH.shape[0] or weights_TK.shape != idx_TK.shape:
        raise ValueError(
            f"permute: x_TH {tuple(x_TH.shape)}, idx_TK {tuple(idx_TK.shape)} and weights_TK "
            f"{tuple(weights_TK.shape)} disagree on T or K"
        )
    if idx_TK.dtype.is_floating_point or idx_TK.dtype == torch.bool:
        raise ValueError(f"permute: idx_TK must be an integer tensor, got {idx_TK.dtype}")
    if num_experts < 1 or capacity < 0:
        raise ValueError(
            f"permute: need num_experts >= 1 and capacity >= 0, got {num_experts} and {capacity}"
        )
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"permute: drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    if align < 1:
        raise ValueError(f"permute: align must be >= 1 rows (1: no padding), got {align}")


def _check_idx_values(idx_TK: Tensor, num_experts: int) -> None:
    # Reading values syncs the host; only worth it where that is free (CPU).
    if idx_TK.device.type == "cpu" and idx_TK.numel():
        lo, hi = (int(v) for v in torch.aminmax(idx_TK))
        if lo < 0 or hi >= num_experts:
            raise ValueError(
                f"permute: idx_TK values must lie in [0, {num_experts}), got min {lo}, max {hi}"
            )


def _kept_assignments(idx_A, weights_A, load_E, capacity, drop_policy) -> Tensor:
    """Bool per assignment: does it fit in its expert's first `capacity` slots?"""
    if drop_policy == "position":
        priority_A = torch.argsort(idx_A, stable=True)  # within expert: lowest a first
    else:  # highest weight first, ties to lower a (stable sort of -w keeps a order)
        by_weight_A = torch.argsort(-weights_A, stable=True)
        priority_A = by_weight_A[torch.argsort(idx_A[by_weight_A], stable=True)]
    start_E = torch.cumsum(load_E, 0) - load_E
    rank_A = torch.empty_like(idx_A)
    rank_A[priority_A] = torch.arange(idx_A.numel(), device=idx_A.device) - start_E[idx_A[priority_A]]
    return rank_A < capacity


def _dropless_padded(x_TH, idx_A, order_N, load_E, K, align):
    """Dropless rows with each expert's group padded to a multiple of `align` (module doc)."""
    E, A = load_E.shape[0], idx_A.shape[0]
    N = permuted_rows(x_TH.shape[0], K, E, 0, align)
    sizes_E = (load_E + align - 1) // align * align
    sizes_E[-1] += N - sizes_E.sum()
    expert_S = idx_A[order_N]
    rank_S = torch.arange(A, device=idx_A.device) - (torch.cumsum(load_E, 0) - load_E)[expert_S]
    dest_S = (torch.cumsum(sizes_E, 0) - sizes_E)[expert_S] + rank_S
    row_src_N = torch.full((N,), -1, dtype=torch.int64, device=idx_A.device).scatter_(0, dest_S, order_N)
    x_NH = x_TH.index_select(0, row_src_N.clamp(min=0) // K).masked_fill((row_src_N < 0).unsqueeze(1), 0)
    return x_NH, row_src_N, sizes_E, load_E


def permute_ref(
    x_TH: Tensor, idx_TK: Tensor, weights_TK: Tensor, num_experts: int, capacity: int, drop_policy: str,
    align: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pure-torch dispatch: the CPU implementation and the test oracle."""
    _check(x_TH, idx_TK, weights_TK, num_experts, capacity, drop_policy, align)
    _check_idx_values(idx_TK, num_experts)
    E, K, C = num_experts, idx_TK.shape[1], _round_up(capacity, align)
    idx_A = idx_TK.reshape(-1).long()
    load_E = torch.zeros(E, dtype=torch.int64, device=idx_A.device).index_add_(
        0, idx_A, torch.ones_like(idx_A)
    )
    order_N = torch.argsort(idx_A, stable=True)  # assignments grouped by expert, ascending a
    if C == 0 and align > 1:
        return _dropless_padded(x_TH, idx_A, order_N, load_E, K, align)
    if C == 0:
        # index_select, not x_TH[...]: 29 vs 37 ms at the fine shape, 6 vs 9 us tiny (benchmarks/row_ops_cpu.py)
        return x_TH.index_select(0, order_N // K), order_N, load_E.clone(), load_E
    kept_A = _kept_assignments(idx_A, weights_TK.reshape(-1), load_E, C, drop_policy)
    # Slot of each kept assignment inside its expert's block, in ascending-a order.
    kept_S, expert_S = kept_A[order_N], idx_A[order_N]
    n_kept_E = load_E.clamp(max=C)
    slot_S = torch.cumsum(kept_S.long(), 0) - 1 - (torch.cumsum(n_kept_E, 0) - n_kept_E)[expert_S]
    dest_S = torch.where(kept_S, expert_S * C + slot_S, E * C)  # dropped -> spare row E*C
    row_src = torch.full((E * C + 1,), -1, dtype=torch.int64, device=idx_A.device)
    row_src_N = row_src.scatter_(0, dest_S, order_N)[: E * C].clone()
    pad_N1 = (row_src_N < 0).unsqueeze(1)
    x_NH = x_TH.index_select(0, row_src_N.clamp(min=0) // K).masked_fill(pad_N1, 0)
    return x_NH, row_src_N, torch.full_like(load_E, C), load_E


@library.op("moecompile::permute")
def _permute_op(
    x_TH: Tensor, idx_TK: Tensor, weights_TK: Tensor, num_experts: int, capacity: int, drop_policy: str,
    align: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    impl = backend.implementation("permute", x_TH.device)
    return impl(x_TH, idx_TK, weights_TK, num_experts, capacity, drop_policy, align)


@_permute_op.register_fake
def _permute_fake(x_TH, idx_TK, weights_TK, num_experts, capacity, drop_policy, align=1):
    _check(x_TH, idx_TK, weights_TK, num_experts, capacity, drop_policy, align)
    T, K = idx_TK.shape
    N = permuted_rows(T, K, num_experts, capacity, align)
    x_NH = x_TH.new_empty((N, x_TH.shape[1]))
    row_src_N = x_TH.new_empty((N,), dtype=torch.int64)
    group_sizes_E = x_TH.new_empty((num_experts,), dtype=torch.int64)
    load_E = x_TH.new_empty((num_experts,), dtype=torch.int64)
    return x_NH, row_src_N, group_sizes_E, load_E


def _setup_context(ctx, inputs, output):
    x_TH, idx_TK = inputs[0], inputs[1]
    ctx.save_for_backward(output[1])
    ctx.T, ctx.K = x_TH.shape[0], idx_TK.shape[1]


def permute_backward(grad_x_NH: Tensor, row_src_N: Tensor, num_tokens: int, K: int) -> Tensor:
    """grad_x_TH[t] = sum of grad rows that are copies of token t (padding rows skipped)."""
    # padding rows land in one spare row past the end, so no masked [N, H] copy of the grad is made
    dest_N = torch.where(row_src_N < 0, num_tokens, row_src_N.div(K, rounding_mode="floor"))
    grad_x_TH = grad_x_NH.new_zeros((num_tokens + 1, grad_x_NH.shape[1]))
    return grad_x_TH.index_add_(0, dest_N, grad_x_NH)[:num_tokens]


@library.op("moecompile::permute_backward")
def _permute_backward_op(grad_x_NH: Tensor, row_src_N: Tensor, num_tokens: int, K: int) -> Tensor:
    impl = backend.implementation("permute_backward", grad_x_NH.device)
    return impl(grad_x_NH, row_src_N, num_tokens, K)


@_permute_backward_op.register_fake
def _permute_backward_fake(grad_x_NH, row_src_N, num_tokens, K):
    return grad_x_NH.new_empty((num_tokens, grad_x_NH.shape[1]))


def _backward(ctx, grad_x_NH, *_int_grads):
    (row_src_N,) = ctx.saved_tensors
    grad_x_TH = None
    if grad_x_NH is not None:
        grad_x_TH = torch.ops.moecompile.permute_backward(grad_x_NH.contiguous(), row_src_N, ctx.T, ctx.K)
    return grad_x_TH, None, None, None, None, None, None


_permute_op.register_autograd(_backward, setup_context=_setup_context)
backend.register("permute", permute_ref, triton="permute_triton:permute_triton")
backend.register("permute_backward", permute_backward, triton="permute_triton:permute_backward_triton")


def permute(
    x_TH: Tensor,
    idx_TK: Tensor,
    weights_TK: Tensor,
    num_experts: int,
    capacity: int = 0,
    drop_policy: str = "position",
    align: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Dispatch: `(x_NH, row_src_N, group_sizes_E, load_E)`, rows grouped by expert.

    capacity=0 is dropless (N = T*K); capacity=C > 0 gives N = E*C with expert
    e in rows [e*C, (e+1)*C), overflow dropped by `drop_policy` ("position"
    keeps the earliest assignments, "probs" the highest weights). weights_TK
    only decides what is dropped and gets no gradient. align > 1 pads each
    group to a multiple of align rows (module doc).
    """
    return torch.ops.moecompile.permute(x_TH, idx_TK, weights_TK, num_experts, capacity, drop_policy, align)
