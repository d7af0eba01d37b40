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

**Node level** (``parallel.node_ranks`` = G > 1; DeepEP's internode dispatch): the same exchange twice. First
over the *rail* group (the ep group's ranks with this rank's local index, one per node), each token once per
node holding one of its experts (destination ``idx // (L*G)``); then, inside the node group, each arrived
token once per local rank holding one of its experts (``idx // L - node*G``; other nodes' experts: nowhere).
The partial sums come back the same two ways, each hop adding what it fanned out. A token crosses the slow
links once per node, not once per rank (nor per expert), at the price of a second, fast hop.

Dropless: per hop one count exchange of (tokens, routed pairs) per destination and one host sync for every
split. Bytes ~ 2 * T * H * (distinct ranks per token) * (P-1)/P per rank, plus the ids and weights (2K numbers
a token). The local permute's ``load_E`` becomes a count over the local idx_TK, as under allgather.
Legend: P ep ranks, L = E/P local experts, T local tokens, K top-k, H hidden, M tokens received, G ranks a node.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
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


def _missed(allowed: int, held: int, K: int) -> float:
    """Chance that K of ``allowed`` experts, drawn uniformly, miss all ``held`` of them."""
    return math.comb(allowed - held, K) / math.comb(allowed, K) if K <= allowed - held else 0.0


def ranks_reached(E: int, K: int, P: int) -> float:
    """Expected distinct ranks a token's K experts sit on under uniform routing, P ranks of E/P experts each: a
    rank is missed when none of the K is among its E/P, with probability C(E - E/P, K) / C(E, K)."""
    return P * (1.0 - _missed(E, E // P, K))


@functools.lru_cache(maxsize=None)  # the planner asks for the same few layouts of every candidate
def nodes_reached(E: int, K: int, ep: int, etp: int = 1, G: int = 1, groups: int = 1, group_k: int = 1) -> float:
    """Expected distinct nodes (G consecutive ranks of the ep x etp group) a token's K experts' slices sit on,
    under uniform routing: node n is missed when none of the K is among the whole experts U_n it holds a slice
    of, with probability C(E - |U_n|, K) / C(E, K). G = 1 counts ranks (etp x ranks_reached). Group-limited
    routing (``groups`` contiguous groups, a token's K among ``group_k`` of them, DeepSeek-V3's node-limited
    routing): the same over the experts of every equally likely choice of groups."""
    P, per, size = ep * etp, E // ep, E // groups
    choices = [range(E)] if groups == 1 or group_k >= groups else [
        [e for g in gs for e in range(g * size, (g + 1) * size)]
        for gs in itertools.combinations(range(groups), group_k)]
    total = 0.0
    for n in range(P // G):
        held = {e for r in range(n * G, (n + 1) * G) for e in range((r % ep) * per, (r % ep + 1) * per)}
        total += 1.0 - sum(_missed(len(c), len(held.intersection(c)), K) for c in choices) / len(choices)
    return total


def balanced_counts(T: int, K: int, E: int, P: int) -> tuple[int, int]:
    """(tokens, routed pairs) a rank sends each rank under uniform routing."""
    return round(T * ranks_reached(E, K, P) / P), round(T * K / P)


@dataclasses.dataclass
class Hop:
    """One de-duplicated exchange: which source rows went where, and what arrived."""

    what: str  # the exchange's label ("dispatch", "dispatch to nodes", ...)
    group: str
    tok_N: fx.Node  # source row of each row sent, destination-major
    send: list[fx.Node]  # rows to each destination (SymInts)
    recv: list[fx.Node]  # rows from each source
    pairs: list[fx.Node]  # routed (row, expert) pairs that came with them, from each source
    x: fx.Node  # arrived rows [M, H], their expert ids [M, K] and routing weights [M, K]
    idx: fx.Node
    w: fx.Node

    def back(self, em: Emit, partial_MH: fx.Node, like: fx.Node) -> fx.Node:
        """The arrived rows' partial sums returned to their sources and added per source row."""
        what = self.what.replace("dispatch", "combine").replace(" to ", " from ")
        back_NH = em.collective(ALL_TO_ALL, partial_MH, self.send, self.recv, what=what, group=self.group)
        # in the partials' dtype (bf16 under autocast), as unpermute's output is: ``like`` stays fp32
        rows = [em(CC, aten.sym_size.int, like, 0), em(CC, aten.sym_size.int, back_NH, 1)]
        return em(CC, aten.index_add.default, em(CC, aten.new_zeros.default, back_NH, rows), 0, self.tok_N, back_NH)


def _hop(em: Emit, x: fx.Node, idx: fx.Node, w: fx.Node, dest: fx.Node, P: int, group: str,
         balanced: tuple[float, float], what: str, device: torch.device, routed_rows: int | None = None) -> Hop:
    """Send each row of ``x`` (with its ``idx`` / ``w``) once to every destination in [0, P) that ``dest`` (one
    per routed choice; P: none) names, over ``group``. ``balanced``: (rows, pairs) a destination gets under
    uniform routing, for the memory estimator; ``routed_rows``: the routed pairs the rows stand for, for costs."""
    T = em(D, aten.sym_size.int, x, 0)
    need = em(D, aten.narrow.default, em(D, aten.scatter.value, em(D, aten.new_zeros.default, idx, [T, P + 1]), 1,
                                         dest, 1), 1, 0, P)
    tokens_P = em(D, aten.sum.dim_IntList, need, [0])  # distinct rows for each destination
    dest_A = em(D, aten.reshape.default, dest, [-1])
    pairs_P = em(D, aten.narrow.default, em(D, aten.index_add.default, em(D, aten.new_zeros.default, dest_A, [P + 1]),
                                            0, dest_A, em(D, aten.ones_like.default, dest_A)), 0, 0, P)
    PT = em(D, operator.mul, T, P)
    keys_PT = em(D, aten.view.default, em(D, aten.arange.default, PT, device=device), [P, T])  # p*T + t
    keys = em(D, aten.reshape.default, em(D, aten.where.ScalarOther, em(D, aten.ne.Scalar, em(D, aten.t.default, need),
                                                                         0), keys_PT, PT), [-1])
    sorted_keys = em(D, operator.getitem, em(D, aten.sort.default, keys), 0)

    sent = em(D, aten.reshape.default, em(D, aten.stack.default, [tokens_P, pairs_P], 1), [-1])
    got = em.collective(ALL_TO_ALL, sent, [2] * P, [2] * P, what=f"{what} counts", group=group)
    ints = em.host_ints(D, em(D, aten.cat.default, [tokens_P, got]), list(range(3 * P)))  # the hop's one host sync
    for i, n in enumerate(ints):  # what memory_estimate takes for these data-dependent counts
        n.meta["moe"]["balanced"] = balanced[0] if i < P or (i - P) % 2 == 0 else balanced[1]
    send, recv, pairs = ints[:P], ints[P::2], ints[P + 1::2]
    tok_N = em(D, aten.remainder.Scalar, em(D, aten.narrow.default, sorted_keys, 0, 0, _total(em, send)), T)
    x_N = em(D, aten.index_select.default, x, 0, tok_N)
    if routed_rows is not None:  # the rows the permute had: costs and the planner's profile size the layer here
        x_N.meta["moe"]["routed_rows"] = routed_rows
    arrived = [em.collective(ALL_TO_ALL, t, recv, send, what=f"{what}{label}", group=group) for t, label in (
        (x_N, ""), (em(D, aten.index_select.default, idx, 0, tok_N), " expert ids"),
        (em(D, aten.index_select.default, w, 0, tok_N), " routing weights"))]
    return Hop(what, group, tok_N, send, recv, pairs, *arrived)


def _dispatch(em: Emit, world: World, x_TH: fx.Node, idx_TK: fx.Node, w_TK: fx.Node, E: int, top_k: int) -> list[Hop]:
    """The hops a token takes to the ranks of its experts: one over the ep group, or at node level over the rail
    to each node needed, then inside the node to each rank needed (other nodes' experts: nowhere, G)."""
    P, G, L = world.ep, world.node_ranks, E // world.ep
    T, device = int(x_TH.meta["val"].shape[0]), x_TH.meta["val"].device
    if G == 1:
        dest_TK = em(D, aten.div.Scalar_mode, idx_TK, L, rounding_mode="floor")
        return [_hop(em, x_TH, idx_TK, w_TK, dest_TK, P, em.group, balanced_counts(T, top_k, E, P), "dispatch",
                     device, T * top_k)]
    N, node = world.nodes, world.ep_rank // G
    rail = _hop(em, x_TH, idx_TK, w_TK, em(D, aten.div.Scalar_mode, idx_TK, L * G, rounding_mode="floor"), N,
                world.rail_group.group_name, (T * ranks_reached(E, top_k, N) / N, T * top_k / N), "dispatch to nodes",
                device, T * top_k)
    local = em(D, aten.sub.Scalar, em(D, aten.div.Scalar_mode, rail.idx, L, rounding_mode="floor"), node * G)
    on_node = em(D, aten.bitwise_and.Tensor, em(D, aten.ge.Scalar, local, 0), em(D, aten.lt.Scalar, local, G))
    # balanced: a rank gets its T x ranks-reached tokens and T x k pairs from its G node peers
    return [rail, _hop(em, rail.x, rail.idx, rail.w, em(D, aten.where.ScalarOther, on_node, local, G), G,
                       world.node_group.group_name, (T * ranks_reached(E, top_k, P) / G, T * top_k / G),
                       "dispatch in node", device)]


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
        hops = _dispatch(em, world, x_TH, idx_TK, w_TK, E, top_k)
        last = hops[-1]
        x_MH, idx_MK, w_MK = last.x, last.idx, last.w
        M, K = _total(em, last.recv), em(D, aten.sym_size.int, idx_MK, 1)
        MK = em(D, operator.mul, M, K)
        mine = em(D, aten.bitwise_and.Tensor, em(D, aten.ge.Scalar, idx_MK, lo), em(D, aten.lt.Scalar, idx_MK, hi))
        flat_MK = em(D, aten.view.default, em(D, aten.arange.default, MK, device=device), [-1, K])  # m*K + k
        expert_key = em(D, aten.add.Tensor, em(D, aten.mul.Scalar, em(D, aten.sub.Scalar, idx_MK, lo), MK), flat_MK)
        keys2 = em(D, aten.reshape.default, em(D, aten.where.ScalarOther, mine, expert_key, em(D, operator.mul, MK, L)),
                   [-1])
        ordered = em(D, aten.narrow.default, em(D, operator.getitem, em(D, aten.sort.default, keys2), 0), 0, 0,
                     _total(em, last.pairs))
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
        y = em(CC, mc.unpermute.default, block.expert_out, row_src, w_MK, M, w_in is None)
        for hop, rows in zip(hops[::-1], [h.x for h in hops[-2::-1]] + [x_TH]):  # each hop's partials to its rows
            y = hop.back(em, y, rows)
    block.unpermute.replace_all_uses_with(y)
    erase_local_permute(gm, block, w_old)
