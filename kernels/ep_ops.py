"""`moecompile::sort_chunks` — regroup rows laid out in an [A, B] grid of blocks, B-major.

Legend: N rows, H hidden, A x B blocks; block (a, b) holds counts_AB[a, b] rows.

After expert parallelism's all-to-all a rank holds its tokens source-major
(block (s, e): rows from source rank s for local expert e); the expert GEMMs want
them expert-major. The inverse is the same op on the transposed counts:

    counts_AB = [[1, 2], [1, 1]]     x rows: (0,0)=[0]  (0,1)=[1, 2]  (1,0)=[3]  (1,1)=[4]
    sort_chunks(x, counts_AB)        = x[[0, 3, 1, 2, 4]]   blocks (0,0) (1,0) (0,1) (1,1)
    sort_chunks(that, counts_AB.T)   = x

No host sync: every index is computed on the device from counts_AB.
"""
import torch
from torch import Tensor

from . import library


def _check(x_NH: Tensor, counts_AB: Tensor) -> None:
    if x_NH.dim() < 1 or counts_AB.dim() != 2:
        raise ValueError(
            f"sort_chunks: need x_NH [N, ...] and counts_AB [A, B], got shapes "
            f"{tuple(x_NH.shape)} and {tuple(counts_AB.shape)}"
        )
    if counts_AB.dtype.is_floating_point or counts_AB.dtype == torch.bool:
        raise ValueError(f"sort_chunks: counts_AB must be an integer tensor, got {counts_AB.dtype}")


def _check_values(x_NH: Tensor, counts_AB: Tensor) -> None:
    # Reading values syncs the host; only worth it where that is free (CPU).
    if counts_AB.device.type == "cpu" and counts_AB.numel():
        total, low = int(counts_AB.sum()), int(counts_AB.min())
        if low < 0 or total != x_NH.shape[0]:
            raise ValueError(
                f"sort_chunks: counts_AB must be >= 0 and sum to N={x_NH.shape[0]}, got {counts_AB.tolist()}"
            )


def sort_chunks_index(counts_AB: Tensor, num_rows: int) -> Tensor:
    """src_N: output row i is input row src_N[i]."""
    A, B = counts_AB.shape
    sizes_in = counts_AB.reshape(-1).long()  # blocks in (a, b) order
    starts_in = torch.cumsum(sizes_in, 0) - sizes_in
    order = torch.arange(A * B, device=counts_AB.device).view(A, B).t().reshape(-1)  # (b, a) order
    sizes_out, starts_src = sizes_in[order], starts_in[order]
    starts_out = torch.cumsum(sizes_out, 0) - sizes_out
    block_N = torch.repeat_interleave(
        torch.arange(A * B, device=counts_AB.device), sizes_out, output_size=num_rows
    )
    rows_N = torch.arange(num_rows, device=counts_AB.device)
    return starts_src[block_N] + rows_N - starts_out[block_N]


def sort_chunks_ref(x_NH: Tensor, counts_AB: Tensor) -> Tensor:
    """Pure-torch implementation: the CPU path and the test oracle's reference."""
    _check(x_NH, counts_AB)
    _check_values(x_NH, counts_AB)
    return x_NH[sort_chunks_index(counts_AB, x_NH.shape[0])]


@library.op("moecompile::sort_chunks")
def _sort_chunks_op(x_NH: Tensor, counts_AB: Tensor) -> Tensor:
    return sort_chunks_ref(x_NH, counts_AB)


@_sort_chunks_op.register_fake
def _sort_chunks_fake(x_NH, counts_AB):
    _check(x_NH, counts_AB)
    return x_NH.new_empty(x_NH.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _backward(ctx, grad_NH):
    (counts_AB,) = ctx.saved_tensors
    return torch.ops.moecompile.sort_chunks(grad_NH.contiguous(), counts_AB.t().contiguous()), None


_sort_chunks_op.register_autograd(_backward, setup_context=_setup_context)


def sort_chunks(x_NH: Tensor, counts_AB: Tensor) -> Tensor:
    """Rows in blocks (a, b), a-major, regrouped b-major; the inverse is `sort_chunks(y, counts_AB.T)`."""
    return torch.ops.moecompile.sort_chunks(x_NH, counts_AB)
