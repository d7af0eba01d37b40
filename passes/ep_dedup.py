"""The ``alltoall_dedup`` dispatcher of ``expert_parallel``: each token travels once to every rank that holds
one of its experts, and comes back once, as that rank's partial sum.

The ``alltoall`` dispatcher sends a token's k routed copies, so a token whose experts share a rank crosses
the wire more than once; with top-8 over 8 ranks a token has ~5.3 distinct ranks, not 8. This one sends
(token, rank) pairs (DeepEP's de-duplication, at rank level) with the token's expert ids and weights::

    need_TP  = one-hot of idx_TK // L                              token t needs rank r
    tok_N    = the needed (r, t) pairs, rank-major: token ids       (one sort of P*T keys)
    x_MH, idx_MK, w_MK = all_to_all(x_TH[tok_N], idx_TK[tok_N], w_TK[tok_N])     M tokens arrive
    row_src  = the arrived (m, k) whose expert is mine, expert-major            (one sort of M*K keys)
    y        = experts(x_MH[row_src // K], sizes_L)
    partial_MH = moecompile.unpermute(y, row_src, w_MK, M)          the rank's weighted sum per token
    y_TH     = index_add(0, tok_N, all_to_all(partial_MH))          the sources add the ranks' partials

Dropless: one count exchange of (tokens, routed pairs) per destination and one host sync for every split.
Bytes ~ 2 * T * H * (distinct ranks per token) * (P-1)/P per rank, plus the ids and weights (2K numbers a
token). The local permute's ``load_E`` becomes a count over the local idx_TK, as under allgather.
Legend: P ep ranks, L = E/P local experts, T local tokens, K top-k, H hidden, M tokens received.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from moecompile.distributed import ALL_TO_ALL, World
from moecompile.meta import Role

from .ep_allgather import erase_local_permute
from .expert_parallel import Emit, replace_load, rewire_experts

aten, mc = torch.ops.aten, torch.ops.moecompile
D, CC = Role.DISPATCH, Role.COMBINE_COMM


def _total(em: Emit, counts: list) -> fx.Node:
    """The sum of SymInt nodes, as one expression (two sums in the same order are provably equal)."""
    total = counts[0]
    for c in counts[1:]:
        total = em(D, operator.add, total, c)
    return total


def ranks_reached(E: int, K: int, P: int) -> float:
    """Expected distinct ranks a token's K experts sit on under uniform routing, P ranks of E/P experts each: a
    rank is missed when none of the K is among its E/P, with probability C(E - E/P, K) / C(E, K)."""
    missed = math.comb(E - E // P, K) / math.comb(E, K) if K <= E - E // P else 0.0
    return P * (1.0 - missed)


def balanced_counts(T: int, K: int, E: int, P: int) -> tuple[int, int]:
    """(tokens, routed pairs) a rank sends each rank under uniform routing."""
    return round(T * ranks_reached(E, K, P) / P), round(T * K / P)


def rewrite(gm: fx.GraphModule, em: Emit, world: World, top_k: int) -> None:
    """``top_k``: the routed choices per token, slices included (experts.top_k x parallel.etp)."""
    block, P = em.block, world.ep
    E = block.info["num_experts"]
    L = E // P
    lo, hi = block.info["expert_range"]
    x_TH, idx_TK = block.permute.args[:2]
    w_TK = block.permute.args[2]
    device = x_TH.meta["val"].device

    with em.at(block.permute):  # the router stats count every routed pair of this rank's tokens, as before
        idx_A = em(D, aten.reshape.default, idx_TK, [-1])
        load_E = em(D, aten.index_add.default, em(D, aten.new_zeros.default, idx_A, [E]), 0, idx_A,
                    em(D, aten.ones_like.default, idx_A))
    replace_load(gm, block, load_E)

    with em.at(block.experts[0]):
        T, K = em(D, aten.sym_size.int, x_TH, 0), em(D, aten.sym_size.int, idx_TK, 1)
        dest_TK = em(D, aten.div.Scalar_mode, idx_TK, L, rounding_mode="floor")
        need_TP = em(D, aten.scatter.value, em(D, aten.new_zeros.default, idx_TK, [T, P]), 1, dest_TK, 1)
        tokens_P = em(D, aten.sum.dim_IntList, need_TP, [0])  # distinct tokens for each rank
        pairs_P = em(D, aten.index_add.default, em(D, aten.new_zeros.default, idx_A, [P]), 0,
                     em(D, aten.reshape.default, dest_TK, [-1]), em(D, aten.ones_like.default, idx_A))
        PT = em(D, operator.mul, T, P)
        keys_PT = em(D, aten.view.default, em(D, aten.arange.default, PT, device=device), [P, T])  # r*T + t
        needed = em(D, aten.ne.Scalar, em(D, aten.t.default, need_TP), 0)
        keys = em(D, aten.reshape.default, em(D, aten.where.ScalarOther, needed, keys_PT, PT), [-1])
        sorted_keys = em(D, operator.getitem, em(D, aten.sort.default, keys), 0)

        sent = em(D, aten.reshape.default, em(D, aten.stack.default, [tokens_P, pairs_P], 1), [-1])
        got = em.collective(ALL_TO_ALL, sent, [2] * P, [2] * P, what="dispatch counts")
        ints = em.host_ints(D, em(D, aten.cat.default, [tokens_P, got]), list(range(3 * P)))  # the one host sync
        tokens, pairs = balanced_counts(int(x_TH.meta["val"].shape[0]), top_k, E, P)
        for i, n in enumerate(ints):  # what memory_estimate takes for these data-dependent counts
            n.meta["moe"]["balanced"] = tokens if i < P or (i - P) % 2 == 0 else pairs
        send, recv, mine = ints[:P], ints[P::2], ints[P + 1::2]
        N, M = _total(em, send), _total(em, recv)

        tok_N = em(D, aten.remainder.Scalar, em(D, aten.narrow.default, sorted_keys, 0, 0, N), T)
        x_NH = em(D, aten.index_select.default, x_TH, 0, tok_N)
        # the routed pairs, the rows the permute had: costs and the planner's profile read the layer's size here
        x_NH.meta["moe"]["routed_rows"] = int(x_TH.meta["val"].shape[0]) * top_k
        x_MH = em.collective(ALL_TO_ALL, x_NH, recv, send, what="dispatch")
        idx_MK = em.collective(ALL_TO_ALL, em(D, aten.index_select.default, idx_TK, 0, tok_N), recv, send,
                               what="dispatch expert ids")
        w_MK = em.collective(ALL_TO_ALL, em(D, aten.index_select.default, w_TK, 0, tok_N), recv, send,
                             what="dispatch routing weights")

        MK = em(D, operator.mul, M, K)
        local = em(D, aten.bitwise_and.Tensor, em(D, aten.ge.Scalar, idx_MK, lo), em(D, aten.lt.Scalar, idx_MK, hi))
        flat_MK = em(D, aten.view.default, em(D, aten.arange.default, MK, device=device), [-1, K])  # m*K + k
        expert_key = em(D, aten.add.Tensor, em(D, aten.mul.Scalar, em(D, aten.sub.Scalar, idx_MK, lo), MK), flat_MK)
        keys2 = em(D, aten.reshape.default, em(D, aten.where.ScalarOther, local, expert_key, em(D, operator.mul, MK, L)),
                   [-1])
        ordered = em(D, aten.narrow.default, em(D, operator.getitem, em(D, aten.sort.default, keys2), 0), 0, 0,
                     _total(em, mine))
        row_src = em(D, aten.remainder.Scalar, ordered, MK)  # expert-major, like the permute's rows
        expert_R = em(D, aten.div.Scalar_mode, ordered, MK, rounding_mode="floor")
        sizes_L = em(D, aten.index_add.default, em(D, aten.new_zeros.default, ordered, [L]), 0, expert_R,
                     em(D, aten.ones_like.default, ordered))
        x_in = em(D, aten.index_select.default, x_MH, 0, em(D, aten.div.Scalar_mode, row_src, K, rounding_mode="floor"))
        w_in, w_old = None, block.row_weights
        if w_old is not None:  # the glu applies them: my rows' weights, from the arrived tokens'
            w_in = em.row_weights(D, row_src, w_MK, anchor=block.experts[0])
    rewire_experts(block, x_in, sizes_L, w_in)

    with em.at(block.unpermute):
        partial_MH = em(CC, mc.unpermute.default, block.expert_out, row_src, w_MK, M, w_in is None)
        back_NH = em.collective(ALL_TO_ALL, partial_MH, send, recv, what="combine")
        y_TH = em(CC, aten.index_add.default, em(CC, aten.zeros_like.default, x_TH), 0, tok_N, back_NH)
    block.unpermute.replace_all_uses_with(y_TH)
    erase_local_permute(gm, block, w_old)
