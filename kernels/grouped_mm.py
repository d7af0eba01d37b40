"""`moecompile::grouped_mm` — one matmul per expert over its contiguous block of rows.

Legend: N permuted rows, E experts, I in features, O out features.

    x_NI rows [0, 2) -> expert 0, [2, 5) -> expert 1       (group_sizes_E = [2, 3])
    y_NO[0:2] = x_NI[0:2] @ w_EOI[0].T (+ bias_EO[0])
    y_NO[2:5] = x_NI[2:5] @ w_EOI[1].T (+ bias_EO[1])

Weights are [E, O, I] like nn.Linear, so a dense FFN's weights stack straight in.
The reference is one torch._grouped_mm for all experts (the sizes stay on the device:
no host sync), except where a loop of one BLAS call per expert is the only kernel or
measured faster (float64; native bf16/fp16 on a CPU): see `_one_call`.
"""
import functools
from typing import Optional

import torch
from torch import Tensor

from . import backend, library

def _check(x_NI: Tensor, w_EOI: Tensor, group_sizes_E: Tensor, bias_EO: Optional[Tensor]) -> None:
    if x_NI.dim() != 2 or w_EOI.dim() != 3 or group_sizes_E.dim() != 1:
        raise ValueError(
            f"grouped_mm: need x_NI [N, I], w_EOI [E, O, I], group_sizes_E [E], got shapes "
            f"{tuple(x_NI.shape)}, {tuple(w_EOI.shape)}, {tuple(group_sizes_E.shape)}"
        )
    E, O, I = w_EOI.shape
    if x_NI.shape[1] != I or group_sizes_E.shape[0] != E:
        raise ValueError(
            f"grouped_mm: x_NI {tuple(x_NI.shape)}, w_EOI {tuple(w_EOI.shape)} and group_sizes_E "
            f"{tuple(group_sizes_E.shape)} disagree on I or E"
        )
    if x_NI.dtype != w_EOI.dtype or (bias_EO is not None and bias_EO.dtype != x_NI.dtype):
        bias_dtype = None if bias_EO is None else bias_EO.dtype
        raise ValueError(
            f"grouped_mm: dtypes differ: x {x_NI.dtype}, w {w_EOI.dtype}, bias {bias_dtype}"
        )
    if group_sizes_E.dtype.is_floating_point or group_sizes_E.dtype == torch.bool:
        raise ValueError(f"grouped_mm: group_sizes_E must be integer, got {group_sizes_E.dtype}")
    if bias_EO is not None and tuple(bias_EO.shape) != (E, O):
        raise ValueError(f"grouped_mm: bias_EO must have shape ({E}, {O}), got {tuple(bias_EO.shape)}")


def _expert_of_row(group_sizes_E: Tensor, N: int) -> Tensor:
    experts_E = torch.arange(group_sizes_E.shape[0], device=group_sizes_E.device)
    return torch.repeat_interleave(experts_E, group_sizes_E, output_size=N)


def _pad_to(t: Tensor, dim: int, multiple: int) -> Tensor:
    extra = -t.shape[dim] % multiple
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return torch.nn.functional.pad(t, pad)


@functools.cache
def _align(dtype: torch.dtype) -> int:
    # torch._grouped_mm wants every non-unit stride a multiple of 16 bytes; zero
    # padding of the feature dims satisfies that and leaves the products exact.
    return 16 // torch.empty((), dtype=dtype).element_size()


def _matrix_layout(t: Tensor, multiple: int) -> Tensor:
    """`t` itself if its last two dims have one unit stride and aligned others (a transposed view
    passes: dgrad reads w in place), else a contiguous copy."""
    inner = t.stride()[-2:]
    if 1 in inner and all(s == 1 or s % multiple == 0 for s in t.stride()):
        return t
    return t.contiguous()


@functools.cache
def _cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` natively (oneDNN's AVX512/AMX/AVX-NE paths)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def _compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype expert GEMMs run in: on a CPU without native bf16/fp16 matmul, fp32.

    Without it (e.g. AVX2-only x86), ATen's bf16 mm falls back to a slow loop: on a 2-core AVX2 EPYC
    15 GFLOP/s for x @ w.T (and ~0.3 for x @ w) against ~130 for fp32 copies through MKL; the result is the same fp32
    accumulation rounded once to the input dtype.
    """
    return dtype if device.type != "cpu" or _cpu_has_native(dtype) else torch.float32


def _one_call(dtype: torch.dtype, device: torch.device) -> bool:
    """One torch._grouped_mm for all experts, or one mm per expert?

    One call everywhere it has a kernel, except native bf16/fp16 on a CPU: there a
    mm per expert into a slice of the output measured faster (~900 vs ~590 GFLOP/s
    on 2 AMX cores). On an AVX2 CPU in fp32 the one call is faster at every shape
    measured (`benchmarks/grouped_mm_cpu.py`), and it saves the host loop: ~90 us a
    call at 8 experts. float64 (the tests' oracle dtype) has no grouped kernel; on a GPU
    its loop reads the sizes on the host (a sync), which only the oracle pays.
    """
    if dtype == torch.float64:
        return False
    return device.type != "cpu" or dtype == torch.float32


def nt_per_expert(a_NA: Tensor, b_EBA: Tensor, group_sizes_E: Tensor) -> Tensor:
    """out_NB[rows of e] = a_NA[rows of e] @ b_EBA[e].T, one mm per expert (reads the sizes on the host)."""
    out_NB = a_NA.new_empty((a_NA.shape[0], b_EBA.shape[1]))
    sizes = group_sizes_E.tolist()
    for e, (a_nA, out_nB) in enumerate(zip(a_NA.split(sizes), out_NB.split(sizes))):
        if a_nA.shape[0]:
            torch.mm(a_nA, b_EBA[e].t(), out=out_nB)
    return out_NB


def nt_one_call(a_NA: Tensor, b_EBA: Tensor, group_sizes_E: Tensor) -> Tensor:
    """The same product as one torch._grouped_mm, feature dims zero-padded to its 16-byte alignment."""
    N, B = a_NA.shape[0], b_EBA.shape[1]
    if N == 0:  # an empty tensor's strides can be anything; torch._grouped_mm rejects some
        return a_NA.new_empty((0, B))
    m = _align(a_NA.dtype)
    offs_E = torch.cumsum(group_sizes_E, 0, dtype=torch.int32)
    # out features padded too: a 1-wide output row is not 16-byte aligned
    a_NA = _matrix_layout(_pad_to(a_NA, 1, m), m)
    b_EAB = _matrix_layout(_pad_to(_pad_to(b_EBA, 2, m), 1, m).transpose(-2, -1), m)
    out_NB = torch._grouped_mm(a_NA, b_EAB, offs_E)
    return out_NB if out_NB.shape[1] == B else out_NB[:, :B].contiguous()


def tn_per_expert(a_NA: Tensor, b_NB: Tensor, group_sizes_E: Tensor) -> Tensor:
    """out_EAB[e] = a_NA[rows of e].T @ b_NB[rows of e], one mm per expert; zero for empty groups."""
    out_EAB = a_NA.new_empty((group_sizes_E.shape[0], a_NA.shape[1], b_NB.shape[1]))
    sizes = group_sizes_E.tolist()
    for e, (a_nA, b_nB) in enumerate(zip(a_NA.split(sizes), b_NB.split(sizes))):
        if a_nA.shape[0]:
            torch.mm(a_nA.t(), b_nB, out=out_EAB[e])
        else:
            out_EAB[e].zero_()
    return out_EAB


def tn_one_call(a_NA: Tensor, b_NB: Tensor, group_sizes_E: Tensor) -> Tensor:
    """The same weight-gradient product as one torch._grouped_mm (zero for empty groups)."""
    A, B = a_NA.shape[1], b_NB.shape[1]
    if a_NA.shape[0] == 0:  # as in nt_one_call: an empty tensor's strides can be anything
        return a_NA.new_zeros((group_sizes_E.shape[0], A, B))
    m = _align(a_NA.dtype)
    offs_E = torch.cumsum(group_sizes_E, 0, dtype=torch.int32)
    a_AN = _matrix_layout(_pad_to(a_NA, 1, m).t(), m)
    out_EAB = torch._grouped_mm(a_AN, _matrix_layout(_pad_to(b_NB, 1, m), m), offs_E)
    return out_EAB if out_EAB.shape[1:] == (A, B) else out_EAB[:, :A, :B].contiguous()


def _grouped_nt(a_NA: Tensor, b_EBA: Tensor, group_sizes_E: Tensor) -> Tensor:
    dtype = _compute_dtype(a_NA.dtype, a_NA.device)
    impl = nt_one_call if _one_call(dtype, a_NA.device) else nt_per_expert
    return impl(a_NA.to(dtype), b_EBA.to(dtype), group_sizes_E).to(a_NA.dtype)


def _grouped_tn(a_NA: Tensor, b_NB: Tensor, group_sizes_E: Tensor) -> Tensor:
    dtype = _compute_dtype(a_NA.dtype, a_NA.device)
    impl = tn_one_call if _one_call(dtype, a_NA.device) else tn_per_expert
    return impl(a_NA.to(dtype), b_NB.to(dtype), group_sizes_E).to(a_NA.dtype)


def _segment_sum(v_NO: Tensor, group_sizes_E: Tensor) -> Tensor:
    E, N = group_sizes_E.shape[0], v_NO.shape[0]
    sums_EO = v_NO.new_zeros((E, v_NO.shape[1]), dtype=torch.promote_types(v_NO.dtype, torch.float32))
    return sums_EO.index_add_(0, _expert_of_row(group_sizes_E, N), v_NO.to(sums_EO.dtype)).to(v_NO.dtype)


def _check_sizes(group_sizes_E: Tensor, N: int) -> None:
    if group_sizes_E.device.type == "cpu":  # free to check here; on a GPU it would sync
        sizes = group_sizes_E.tolist()  # one read of E ints, cheaper than two reductions
        if sum(sizes) != N or min(sizes, default=0) < 0:
            raise ValueError(f"grouped_mm: group_sizes_E must be >= 0 and sum to N={N}, got {sizes}")


def grouped_mm_ref(
    x_NI: Tensor, w_EOI: Tensor, group_sizes_E: Tensor, bias_EO: Optional[Tensor]
) -> Tensor:
    """Pure-torch grouped matmul: the CPU implementation and the test oracle."""
    _check(x_NI, w_EOI, group_sizes_E, bias_EO)
    N = x_NI.shape[0]
    _check_sizes(group_sizes_E, N)
    y_NO = _grouped_nt(x_NI, w_EOI, group_sizes_E)
    if bias_EO is not None:
        y_NO = y_NO + bias_EO[_expert_of_row(group_sizes_E, N)]
    return y_NO


@library.op("moecompile::grouped_mm")
def _grouped_mm_op(
    x_NI: Tensor, w_EOI: Tensor, group_sizes_E: Tensor, bias_EO: Optional[Tensor]
) -> Tensor:
    return backend.implementation("grouped_mm", x_NI.device)(x_NI, w_EOI, group_sizes_E, bias_EO)


@_grouped_mm_op.register_fake
def _grouped_mm_fake(x_NI, w_EOI, group_sizes_E, bias_EO):
    _check(x_NI, w_EOI, group_sizes_E, bias_EO)
    return x_NI.new_empty((x_NI.shape[0], w_EOI.shape[1]))


@library.op("moecompile::grouped_mm_wgrad")
def _grouped_mm_wgrad_op(grad_y_NO: Tensor, x_NI: Tensor, group_sizes_E: Tensor) -> Tensor:
    """dw_EOI[e] = grad_y_NO[rows of e].T @ x_NI[rows of e] (zero for empty groups).

    An op of its own, not inline torch._grouped_mm: ATen's meta kernel for that
    accepts only bfloat16, so a traced backward (torch.compile, export) would
    fail in float32, and a device backend can swap in its own kernel here.
    """
    return backend.implementation("grouped_mm_wgrad", x_NI.device)(grad_y_NO, x_NI, group_sizes_E)


def grouped_mm_wgrad_ref(grad_y_NO: Tensor, x_NI: Tensor, group_sizes_E: Tensor) -> Tensor:
    """Pure-torch weight gradient: the CPU implementation and the test oracle."""
    return _grouped_tn(grad_y_NO.contiguous(), x_NI, group_sizes_E)


@_grouped_mm_wgrad_op.register_fake
def _grouped_mm_wgrad_fake(grad_y_NO, x_NI, group_sizes_E):
    return x_NI.new_empty((group_sizes_E.shape[0], grad_y_NO.shape[1], x_NI.shape[1]))


def _setup_context(ctx, inputs, output):
    x_NI, w_EOI, group_sizes_E, bias_EO = inputs
    ctx.save_for_backward(x_NI, w_EOI, group_sizes_E)
    ctx.has_bias = bias_EO is not None


def _backward(ctx, grad_y_NO):
    """dx = dy @ w[e] (the forward op on w^T), dw[e] = dy[rows]^T x[rows], db[e] = sum of dy[rows]."""
    x_NI, w_EOI, group_sizes_E = ctx.saved_tensors
    # y.sum() hands back a stride-0 grad, which torch._grouped_mm rejects.
    grad_y_NO = grad_y_NO.contiguous()
    need_x, need_w, _, need_b = ctx.needs_input_grad
    dx = dw = db = None
    if need_x:
        dx = torch.ops.moecompile.grouped_mm(grad_y_NO, w_EOI.transpose(1, 2), group_sizes_E, None)
    if need_w:
        dw = torch.ops.moecompile.grouped_mm_wgrad(grad_y_NO, x_NI, group_sizes_E)
    if need_b and ctx.has_bias:
        db = _segment_sum(grad_y_NO, group_sizes_E)
    return dx, dw, None, db


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)
backend.register("grouped_mm", grouped_mm_ref, triton="grouped_mm_triton:grouped_mm_triton")
backend.register("grouped_mm_wgrad", grouped_mm_wgrad_ref, triton="grouped_mm_triton:grouped_mm_wgrad_triton")


def grouped_mm(
    x_NI: Tensor, w_EOI: Tensor, group_sizes_E: Tensor, bias_EO: Optional[Tensor] = None
) -> Tensor:
    """Expert matmul over expert-sorted rows (from `permute`): y_NO, same dtype as x."""
    return torch.ops.moecompile.grouped_mm(x_NI, w_EOI, group_sizes_E, bias_EO)
