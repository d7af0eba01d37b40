"""The ``allgather`` dispatcher of ``expert_parallel``: every rank sees the ep group's tokens.

    x_GH, idx_GK, w_GK = all_gather(x_TH, idx_TK, w_TK)            G = P*T, source s = row // T
    bucket = my local expert (dropless) or (source, local expert) (static), else "elsewhere"
    x_RH, row_src_R, sizes, _ = moecompile.permute(x_GH, bucket, w_GK, buckets + 1, C, policy)
    partial_GH = moecompile.unpermute(experts(my rows), row_src, w_GK, G)    (or, when the glu applies
                                                        the weights: experts(my rows, row_weights(row_src, w_GK)))
    y_TH = reduce_scatter(partial_GH)                                 # sum of every rank's experts

No count exchange; bytes ~ 2 (P-1) T H per rank (independent of k). Static buckets are per source
rank, so capacity drops exactly the tokens the source's own permute would (see plan.parallel).
The local permute's ``load_E`` is replaced by a count over the local idx_TK. Needs the same
token count on every rank of the group (all-gather is fixed-size).
Legend: P ep ranks, L = E/P local experts, C capacity, T local tokens, K top-k, H hidden.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from moecompile.distributed import ALL_GATHER, REDUCE_SCATTER, World
from moecompile.meta import Role

from .ep_alltoall import _swap_blocks, _swap_rows
from .expert_parallel import Block, Emit, replace_load, rewire_experts

aten, mc = torch.ops.aten, torch.ops.moecompile
D, CC = Role.DISPATCH, Role.COMBINE_COMM


def rewrite(gm: fx.GraphModule, em: Emit, world: World, capacity: int | None) -> None:
    block, P = em.block, world.ep
    E = block.info["num_experts"]
    L = E // P
    lo, hi = block.info["expert_range"]
    x_TH, idx_TK, w_TK, _E, _C, policy = block.permute.args

    with em.at(block.permute):
        idx_A = em(D, aten.reshape.default, idx_TK, [-1])
        ones_A = em(D, aten.ones_like.default, idx_A)
        load_E = em(D, aten.index_add.default, em(D, aten.new_zeros.default, idx_A, [E]), 0, idx_A, ones_A)
    replace_load(gm, block, load_E)

    with em.at(block.experts[0]):
        x_GH = em.collective(ALL_GATHER, x_TH, P, what="dispatch tokens")
        idx_GK = em.collective(ALL_GATHER, idx_TK, P, what="dispatch expert ids")
        w_GK = em.collective(ALL_GATHER, w_TK, P, what="dispatch routing weights")
        G = em(D, aten.sym_size.int, x_GH, 0)
        mine = em(D, aten.bitwise_and.Tensor, em(D, aten.ge.Scalar, idx_GK, lo), em(D, aten.lt.Scalar, idx_GK, hi))
        local_GK = em(D, aten.sub.Scalar, idx_GK, lo)
        if capacity is None:
            buckets = L
        else:  # bucket (source s, expert e) = s*L + e: capacity applies per source rank
            T = em(D, aten.sym_size.int, x_TH, 0)
            rows_G = em(D, aten.arange.start, 0, G, device=x_TH.meta["val"].device)
            src_G1 = em(D, aten.unsqueeze.default, em(D, aten.div.Scalar_mode, rows_G, T, rounding_mode="floor"), 1)
            local_GK = em(D, aten.add.Tensor, em(D, aten.mul.Scalar, src_G1, L), local_GK)
            buckets = P * L
        bucket_GK = em(D, aten.where.ScalarOther, mine, local_GK, buckets)
        perm = em(D, mc.permute.default, x_GH, bucket_GK, w_GK, buckets + 1, capacity or 0, policy)
        x_RH, row_src_R, sizes_B = (em(D, operator.getitem, perm, i) for i in range(3))
        if capacity is None:
            n_mine = em.host_ints(D, em(D, aten.sum.dim_IntList, em(D, aten.narrow.default, sizes_B, 0, 0, L), [0], True), [0])[0]
            x_in = em(D, aten.narrow.default, x_RH, 0, 0, n_mine)
            sizes_L = em(D, aten.narrow.default, sizes_B, 0, 0, L)
        else:
            n_mine = P * L * capacity
            x_in = _swap_blocks(em, D, em(D, aten.narrow.default, x_RH, 0, 0, n_mine), P, L, capacity, x_TH.meta["val"].shape[1])
            sizes_L = em(D, aten.new_full.default, sizes_B, [L], P * capacity)
        row_src_mine = em(D, aten.narrow.default, row_src_R, 0, 0, n_mine)
        w_in, w_old = None, block.row_weights
        if w_old is not None:  # the glu applies them: my rows' weights, from the gathered ones
            w_in = em.row_weights(D, row_src_mine, w_GK, anchor=block.experts[0])
            if capacity is not None:
                w_in = _swap_rows(em, D, w_in, P, L, capacity)
    rewire_experts(block, x_in, sizes_L, w_in)

    y_out = block.expert_out
    with em.at(block.unpermute):
        y_mine = y_out if capacity is None else _swap_blocks(em, CC, y_out, L, P, capacity, y_out.meta["val"].shape[1])
        partial_GH = em(CC, mc.unpermute.default, y_mine, row_src_mine, w_GK, G, w_in is None)
        y_TH = em.collective(REDUCE_SCATTER, partial_GH, "sum", P, what="combine")
    block.unpermute.replace_all_uses_with(y_TH)
    erase_local_permute(gm, block, w_old)


def erase_local_permute(gm: fx.GraphModule, block: Block, w_old: fx.Node | None) -> None:
    """The local permute and what read it (the combine; the local rows' weights ``w_old``), once a dispatcher
    that permutes on the experts' side has replaced them."""
    for n in [block.unpermute, *([w_old] if w_old is not None else []),
              *sorted(block.outs.values(), key=lambda n: -n.args[1]), block.permute]:
        _erase_if_unused(gm, n)


def _erase_if_unused(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase ``node`` if nothing reads it, then whatever of its inputs that leaves unread."""
    if getattr(node, "_erased", False) or node.users or node.op != "call_function":
        return
    inputs = node.all_input_nodes
    gm.graph.erase_node(node)
    for n in inputs:
        _erase_if_unused(gm, n)
