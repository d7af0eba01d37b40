"""`moecompile::a2a_start` / `moecompile::a2a_wait` — an all-to-all whose backward is asynchronous too.

Legend: N rows sent, M rows received, H hidden; splits are per rank of the group.

torch's functional all-to-all waits for its transposed exchange inside its own backward, so a
backward is serial however the forward was scheduled. This pair moves the backward's start and
wait apart the same way the forward's are::

    forward:   y_MH = a2a_wait(a2a_start(x_NH, recv, send, g), recv, send, what, g)
    backward:  a2a_wait's backward   STARTS all_to_all(grad_y_MH, send, recv)   (not waited) and
                                     hands it to the a2a_start node that made its input
               ...autograd runs whatever the forward ran between start and wait, mirrored...
               a2a_start's backward  WAITS for it -> grad_x_NH

Autograd's engine runs ready nodes latest-forward-first, so the compute a scheduling pass put
between a start and its wait in the forward runs between the transposed start and wait in the
backward. The values are exactly those of torch's all-to-all (same exchange, same splits).
A failed forward wait raises ``moecompile.wait_tensor``'s named error (it is called by name, so
this file imports only torch).
"""
import torch
from torch import Tensor

_fc = torch.ops._c10d_functional
_lib = torch.library.Library("moecompile", "FRAGMENT")
_lib.define(
    "a2a_start(Tensor x, SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name) -> Tensor"
)
_lib.define(
    "a2a_wait(Tensor(a) t, SymInt[] output_split_sizes, SymInt[] input_split_sizes, str what, str group_name)"
    " -> Tensor(a)"
)


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list, in_splits: list, group: str) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.pending = out_splits, in_splits, group, None
        return _fc.all_to_all_single(x.contiguous(), out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        pending, ctx.pending = ctx.pending, None
        if pending is None:  # no _Wait started it (its output unused): exchange here, as torch would
            pending = _fc.all_to_all_single(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group)
        return _fc.wait_tensor(pending), None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, out_splits: list, in_splits: list, what: str, group: str) -> Tensor:
        # t.grad_fn is the _Start node that made t (a custom Function's node is its ctx): the
        # transposed exchange this backward starts is handed to that node's backward.
        start = t.grad_fn
        ctx.start = start if start is not None and hasattr(start, "pending") else None
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return torch.ops.moecompile.wait_tensor(t, what, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.start is not None:
            ctx.start.pending = _fc.all_to_all_single(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group)
        return grad, None, None, None, None


def _start_impl(x: Tensor, output_split_sizes: list, input_split_sizes: list, group_name: str) -> Tensor:
    return _Start.apply(x, list(output_split_sizes), list(input_split_sizes), group_name)


def _wait_impl(t: Tensor, output_split_sizes: list, input_split_sizes: list, what: str, group_name: str) -> Tensor:
    return _Wait.apply(t, list(output_split_sizes), list(input_split_sizes), what, group_name)


# CompositeImplicitAutograd: the autograd.Functions above are the autograd; a trace (make_fx,
# FakeTensorProp) sees through to torch's functional collectives and their fake impls.
_lib.impl("a2a_start", _start_impl, "CompositeImplicitAutograd")
_lib.impl("a2a_wait", _wait_impl, "CompositeImplicitAutograd")


def a2a_start(x_NH: Tensor, output_split_sizes: list, input_split_sizes: list, group_name: str) -> Tensor:
    """Start ``all_to_all_single(x_NH)``; the result must go through :func:`a2a_wait` before any use."""
    return torch.ops.moecompile.a2a_start(x_NH, output_split_sizes, input_split_sizes, group_name)


def a2a_wait(t: Tensor, output_split_sizes: list, input_split_sizes: list, what: str, group_name: str) -> Tensor:
    """Wait for an :func:`a2a_start` (same splits); its backward starts the transposed exchange."""
    return torch.ops.moecompile.a2a_wait(t, output_split_sizes, input_split_sizes, what, group_name)
