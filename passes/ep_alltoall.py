"""The ``alltoall`` dispatcher of ``expert_parallel``: routed copies travel to their expert's rank and back.

Rows leave the local permute sorted by global expert, so they are already grouped by
destination rank (expert e lives on rank e // L). They arrive source-major, blocks
(source s, local expert e); ``sort_chunks`` makes them expert-major for the GEMMs and its
transpose undoes that before the return trip. The combine (``unpermute``) stays on the
source rank. Where the experts' glu applies the routing weights (``experts.apply_weights``),
each row's weight travels with it: as one more column of the rows' own all-to-all
(``pack_row_weights`` -> exchange -> regroup -> ``unpack_row_weights``; its gradient comes back
in the same column), or, where ``parallel.pack_routing_weights`` says the copies cost more than
the collectives they save (large rows), as one more all-to-all of N floats with the same splits.

    dropless   splits from a count exchange (one host sync); the last send split is written
               N - (the others), so the returning buffer provably has the permute's N rows
    static     every split is L*C rows: no count exchange, no host sync
Legend: P ep ranks, L = E/P local experts, C capacity, N rows sent, M rows received, H hidden.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

from moecompile.distributed import ALL_TO_ALL, World
from moecompile.meta import Role
from moecompile.plan.parallel import ParallelConfig

from .expert_parallel import Block, Emit, rewire_experts

aten, mc = torch.ops.aten, torch.ops.moecompile
D, CC = Role.DISPATCH, Role.COMBINE_COMM


def _swap_blocks(em: Emit, role: Role, x: fx.Node, a: int, b: int, rows: int, width: int) -> fx.Node:
    """[a, b, rows, width] blocks -> [b, a, rows, width] (static mode's fixed-size sort_chunks)."""
    grid = em(role, aten.view.default, x, [a, b, rows, width])
    return em(role, aten.reshape.default, em(role, aten.transpose.int, grid, 0, 1), [-1, width])


def _swap_rows(em: Emit, role: Role, w: fx.Node, a: int, b: int, rows: int) -> fx.Node:
    """``_swap_blocks`` of a 1-d per-row tensor (the routing weights)."""
    w_N1 = em(role, aten.view.default, w, [-1, 1])
    return em(role, aten.view.default, _swap_blocks(em, role, w_N1, a, b, rows, 1), [-1])


def packs_weights(block: Block, cfg: ParallelConfig) -> bool:
    """Whether ``block``'s routing weights ride in its rows' all-to-all (same dtype, else packing would widen the
    rows; and the plan's rule)."""
    w_N, x_NH = block.row_weights, block.outs[0]
    if w_N is None or "val" not in x_NH.meta or "val" not in w_N.meta:
        return False
    x, w = x_NH.meta["val"], w_N.meta["val"]
    if w.dtype != x.dtype:
        return False
    return cfg.packs_routing_weights(x.numel() * x.element_size(), x.device.type)


def dispatch_rows(em: Emit, x_NH: fx.Node, w_N: fx.Node | None, H: int, recv: list, send: list,
                  regroup: Callable[[fx.Node, int], fx.Node], pack: bool, label: str = "") -> tuple[fx.Node, fx.Node | None]:
    """The [N, H] rows (and their routing weights, if any) to their experts' rank, regrouped expert-major.

    ``regroup(arrived, width)`` reorders the rows that arrived; packed, the weights are their last column.
    ``label`` follows the waits' names (" (chunk c)").
    """
    if w_N is not None and pack:
        packed = em.collective(ALL_TO_ALL, em(D, mc.pack_row_weights.default, x_NH, w_N), recv, send, what=f"dispatch{label}")
        both = em(D, mc.unpack_row_weights.default, regroup(packed, H + 1))
        return em(D, operator.getitem, both, 0), em(D, operator.getitem, both, 1)
    x_in = regroup(em.collective(ALL_TO_ALL, x_NH, recv, send, what=f"dispatch{label}"), H)
    if w_N is None:
        return x_in, None
    w_M = em.collective(ALL_TO_ALL, w_N, recv, send, what=f"dispatch routing weights{label}")
    w_in = regroup(em(D, aten.view.default, w_M, [-1, 1]), 1)
    return x_in, em(D, aten.view.default, w_in, [-1])


def rewrite(gm: fx.GraphModule, em: Emit, world: World, capacity: int | None, pack_weights: bool) -> None:
    block = em.block
    P = world.ep
    L = block.info["num_experts"] // P
    x_NH, sizes_E, w_N = block.outs[0], block.outs[2], block.row_weights
    H = x_NH.meta["val"].shape[1]

    with em.at(block.experts[0]):
        if capacity is None:
            counts = em.collective(ALL_TO_ALL, sizes_E, [L] * P, [L] * P, what="dispatch counts")
            counts_PL = em(D, aten.view.default, counts, [P, L])  # rows from source s for my expert e
            send_P = em(D, aten.sum.dim_IntList, em(D, aten.view.default, sizes_E, [P, L]), [1])
            recv_P = em(D, aten.sum.dim_IntList, counts_PL, [1])
            # one host sync; the last send split is N - the others, so the rows coming back provably
            # number the permute's N (the combine's unpermute checks that statically)
            splits = em.host_ints(D, em(D, aten.cat.default, [send_P, recv_P]), [*range(P - 1), *range(P, 2 * P)])
            last = em(D, aten.sym_size.int, x_NH, 0)
            for s in splits[: P - 1]:
                last = em(D, operator.sub, last, s)
            send, recv = [*splits[: P - 1], last], splits[P - 1:]
            x_in, w_in = dispatch_rows(em, x_NH, w_N, H, recv, send,
                                       lambda t, width: em(D, mc.sort_chunks.default, t, counts_PL), pack_weights)
            sizes_L = em(D, aten.sum.dim_IntList, counts_PL, [0])
        else:
            send = recv = [L * capacity] * P
            x_in, w_in = dispatch_rows(em, x_NH, w_N, H, recv, send,
                                       lambda t, width: _swap_blocks(em, D, t, P, L, capacity, width), pack_weights)
            sizes_L = em(D, aten.new_full.default, sizes_E, [L], P * capacity)
    rewire_experts(block, x_in, sizes_L, w_in)

    y_MH = block.expert_out
    with em.at(block.unpermute):
        if capacity is None:
            y_src = em(CC, mc.sort_chunks.default, y_MH, em(CC, aten.t.default, counts_PL))
        else:
            y_src = _swap_blocks(em, CC, y_MH, L, P, capacity, y_MH.meta["val"].shape[1])
        y_NH = em.collective(ALL_TO_ALL, y_src, send, recv, what="combine")
    block.unpermute.replace_input_with(y_MH, y_NH)
