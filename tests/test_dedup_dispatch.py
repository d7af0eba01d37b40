"""The ``alltoall_dedup`` dispatcher: a token goes once to each rank holding one of its experts.

Oracles: the same run in one process per rank (data parallel, ep = 1): losses, gradient norms and
expert loads step for step; and the routing itself: the rows a rank sends are exactly its tokens'
distinct (token, other rank) pairs, where the alltoall dispatcher sends every routed copy.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moecompile as mc
from moecompile.bucket_layout import moe_blocks
from moecompile.errors import PlanError

from _dist import spawn
from test_expert_tensor_parallel import EXPERTS, GLOBAL_BATCH, STEPS, _data, _run, _same_run, _step

_A2A = torch.ops._c10d_functional.all_to_all_single.default


class RowsSent(TorchDispatchMode):
    """Rows of hidden states each all-to-all hands to other ranks (a forward's dispatches and combines, in turn:
    [N, H], or [N, H + 1] with the routing weights packed in), and the routing the step computed."""

    def __init__(self, rank: int, hidden: int):
        super().__init__()
        self.rank, self.hidden, self.rows, self.idx = rank, hidden, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        x = args[0] if args else None
        if func is _A2A and x.dim() == 2 and x.shape[1] in (self.hidden, self.hidden + 1) and x.is_floating_point():
            self.rows.append(sum(int(s) for j, s in enumerate(args[2]) if j != self.rank))
        if func is torch.ops.moecompile.route.default:
            self.idx.append(out[1].clone())
        return out


def _rows_sent(result, ids, rank: int, ranks: int) -> tuple[int, int, int]:
    """(rows the dispatch sent off-rank, distinct (token, other rank) pairs, routed copies to other ranks)."""
    hidden = next(p for n, p in result.module.named_parameters() if n.endswith("experts.w_down")).shape[1]
    meter = RowsSent(rank, hidden)
    with torch.no_grad(), meter:
        result.module(ids)
    info = next(iter(moe_blocks(result.module).values()))
    L = info["num_experts"] // ranks
    distinct = copies = 0
    for idx in meter.idx:
        if info.get("slices", 1) > 1:  # a token goes to each slice of its experts
            E = info["num_experts"] // info["slices"]
            idx = torch.cat([idx + q * E for q in range(info["slices"])], 1)
        dest = idx // L
        copies += int((dest != rank).sum())
        distinct += sum(len(set(row.tolist()) - {rank}) for row in dest)
    return sum(meter.rows[0::2]), distinct, copies  # each layer's dispatch, then its combine


def dedup_worker(rank: int, world: int) -> dict:
    combine = {**EXPERTS, "apply_weights": "combine"}
    res = {"dp": _run({"experts": EXPERTS}, rank, world, STEPS), "dp_combine": _run({"experts": combine}, rank, world,
                                                                                      STEPS)}
    for name, parallel in (("dedup", {"ep": world, "dispatcher": "alltoall_dedup"}),
                           ("dedup_etp", {"ep": world // 2, "etp": 2, "dispatcher": "alltoall_dedup"}),
                           ("alltoall", {"ep": world})):
        for weights in ("auto", "combine"):
            experts = {**EXPERTS, "apply_weights": weights}
            _, result, step = _step({"experts": experts, "parallel": parallel}, GLOBAL_BATCH // world)
            res[name, weights] = _run({}, rank, world, STEPS, step)
            ids = _data().shard(0, rank, world)[0]
            res[name, weights, "rows"] = _rows_sent(result, ids, rank, world)
    # overlapped in 3 token chunks (both directions); global_aux: the load all-reduced over the chunks' sum
    for name, dispatcher in (("dedup", "alltoall_dedup"), ("alltoall", "alltoall")):
        plan = {"experts": EXPERTS, "parallel": {"ep": world, "dispatcher": dispatcher},
                "overlap": {"enabled": True, "chunks": 3}}
        res[name, "chunks"] = _run(plan, rank, world, STEPS)
    return res


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_dedup_trains_like_one_process_and_sends_each_token_once_per_rank(world):
    for r in spawn(dedup_worker, world, (), timeout=400):
        for name in ("dedup", "dedup_etp", "alltoall"):
            _same_run(r[name, "auto"], r["dp"])
            _same_run(r[name, "combine"], r["dp_combine"])
        _same_run(r["dedup", "chunks"], r["dp"])
        _same_run(r["alltoall", "chunks"], r["dp"])
        sent, distinct, copies = r["dedup", "auto", "rows"]
        assert sent == distinct
        # 2 ranks of 2 experts: some tokens have both of theirs on one rank; 4 ranks of 1: none can
        assert distinct < copies if world == 2 else distinct == copies
        sent, distinct, copies = r["alltoall", "auto", "rows"]
        assert sent == copies
        sent, distinct, copies = r["dedup_etp", "auto", "rows"]
        assert sent == distinct <= copies


def test_dedup_is_dropless():
    with pytest.raises(PlanError, match="'alltoall_dedup' sends a variable number.*dropless only"):
        mc.Plan.from_dict({"experts": {**EXPERTS, "capacity_factor": 1.0},
                           "parallel": {"ep": 2, "dispatcher": "alltoall_dedup", "dispatch_mode": "static"}})


@pytest.mark.parametrize("dispatcher", ["alltoall", "alltoall_dedup"])
def test_chunks_split_global_aux_layers_and_cost_what_the_whole_layer_does(dispatcher):
    """Every layer is cut into the chunks asked for, global_aux's all-reduce of the expert load included (it is a
    wait of the layer, not its combine); the chunks' routed rows and balanced splits add up to the whole layer's, so
    the FLOPs and dispatch bytes a chunked graph is costed at are the unchunked graph's."""
    from moecompile.costs import layer_rows
    from moecompile.models import build_model
    from moecompile.planner import profile_result

    from _dist import fake_rank

    out = {}
    with fake_rank(0, 2, ep_step=True):
        for chunks in (0, 2):
            dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=2, seq_len=16)
            plan = mc.Plan.from_dict({"experts": EXPERTS, "parallel": {"ep": 2, "dispatcher": dispatcher},
                                      "overlap": {"enabled": chunks > 0, "chunks": max(chunks, 1)}})
            mc.distributed.init(plan)
            result = mc.convert(dense, plan, (ids,))
            graph = result.module.graph
            balanced = sum(n.meta["moe"].get("balanced", 0) for n in graph.nodes if "moe" in n.meta)
            out[chunks] = (profile_result(result).flops, layer_rows(graph), balanced)
            if chunks:
                record = next(r for r in result.history if r.name == "overlap")
                assert record.data["chunks"] == {f"model.layers.{i}.mlp": 2 for i in range(2)}, record.decisions
    (flops, rows, balanced), (flops_c, rows_c, balanced_c) = out[0], out[2]
    assert flops_c == flops
    assert {k: 2 * v for k, v in rows_c.items()} == rows  # each chunk's GEMMs take half the layer's rows
    assert balanced_c == pytest.approx(balanced)


# ---------------------------------------------------------------- the planner


@pytest.mark.parametrize("E,k,ep,etp", [(8, 2, 2, 1), (8, 2, 4, 1), (12, 3, 3, 1), (8, 2, 2, 2), (6, 6, 3, 1)])
def test_the_planner_counts_a_tokens_distinct_ranks_exactly(E, k, ep, etp):
    """distinct_ranks: the mean over every set of k experts of the ranks they sit on (slices on etp more)."""
    import itertools

    from moecompile.planner.cost_model import distinct_ranks

    sets = list(itertools.combinations(range(E), k))
    mean = sum(len({e // (E // ep) for e in s}) for s in sets) / len(sets)
    assert distinct_ranks(E, k, ep, etp) == pytest.approx(etp * mean)


def test_the_planner_prices_dedup_by_the_distinct_ranks_and_searches_it_dropless():
    import transformers

    from moecompile.planner import Candidate, SearchSpace, enumerate_candidates, estimate, preset, profile_config
    from moecompile.planner.cost_model import distinct_ranks

    fine = {"num_experts": 64, "top_k": 8}
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=1024, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=8)
    prof = profile_config(cfg, seq_len=4096, experts=fine)  # bandwidth-bound exchanges, not latency
    cluster = preset("h100", 4)
    terms = {}
    for d in ("alltoall", "alltoall_dedup"):
        plan = mc.Plan.from_dict({"experts": fine, "parallel": {"ep": 4, "dispatcher": d}})
        est = estimate(prof, cluster, Candidate(plan), global_batch=4)
        terms[d] = est.term("dispatch+combine")
    ratio = distinct_ranks(64, 8, 4) / 8  # ~0.46 of the copies; the ids and weights and latencies on top
    assert ratio < terms["alltoall_dedup"] / terms["alltoall"] < ratio + 0.15
    cands, _ = enumerate_candidates(fine, cluster, 4, SearchSpace(expert_parallel=True, micro_batches=(1,)))
    modes = {c.plan.parallel.dispatch_mode for c in cands if c.plan.parallel.dispatcher == "alltoall_dedup"}
    assert modes == {"dropless"}


def _estimated(ranks: int, parallel: dict) -> tuple[int, float, list]:
    """(activations the memory estimator keeps, profile FLOPs, dispatch bytes per layer) of rank 0's graph of
    ``ranks``, which must also be capture-safe outside the expert path (partial CUDA graphs: the sorts, gathers
    and host syncs stay eager)."""
    from moecompile.cuda_graphs import check_capture_safety
    from moecompile.models import build_model
    from moecompile.planner import profile_result

    from _dist import fake_rank

    with fake_rank(0, ranks, ep_step=True):
        dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=2, seq_len=16)
        plan = mc.Plan.from_dict({"experts": EXPERTS, "parallel": parallel})
        mc.distributed.init(plan)
        result = mc.convert(dense, plan, (ids,))
        prof = profile_result(result)
        assert check_capture_safety(result, region="static").safe
        return mc.estimate_memory(result).activations, prof.flops, [lp.dispatch_bytes for lp in prof.layers]


def test_a_dedup_graph_is_estimated_and_profiled_as_the_alltoall_one():
    """The memory estimator takes balanced counts for its data-dependent splits (the dispatcher states them), and
    the planner's profile finds the routed rows it stands for: the same bytes and FLOPs as the alltoall graph."""
    out = {d: _estimated(2, {"ep": 2, "dispatcher": d}) for d in ("alltoall", "alltoall_dedup")}
    (act, flops, rows), (act_d, flops_d, rows_d) = out["alltoall"], out["alltoall_dedup"]
    assert flops_d == flops and rows_d == rows and rows[1] > 0
    assert 0.8 * act < act_d < 1.25 * act  # its own buffers: the ids, weights and sort keys of the tokens it sends


# ---------------------------------------------------------------- node level (parallel.node_ranks)


class HopRows(TorchDispatchMode):
    """Per all-to-all of hidden rows: the c10d group it ran on and the rows it handed to other members."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden, self.calls, self.idx = hidden, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        x = args[0] if args else None
        if func is _A2A and x.dim() == 2 and x.shape[1] == self.hidden and x.is_floating_point():
            self.calls.append((args[3], [int(s) for s in args[2]]))
        if func is torch.ops.moecompile.route.default:
            self.idx.append(out[1].clone())
        return out


def node_worker(rank: int, world: int) -> dict:
    res = {"dp": _run({"experts": EXPERTS}, rank, world, STEPS)}
    for name, parallel in (("node", {"ep": world, "node_ranks": 2}), ("node_etp", {"ep": 2, "etp": 2, "node_ranks": 2})):
        plan = {"experts": EXPERTS, "parallel": {**parallel, "dispatcher": "alltoall_dedup"}}
        _, result, step = _step(plan, GLOBAL_BATCH // world)
        if name == "node":  # what crossed between nodes, before training moves the router
            hidden = next(p for n, p in result.module.named_parameters() if n.endswith("experts.w_down")).shape[1]
            meter = HopRows(hidden)
            with torch.no_grad(), meter:
                result.module(_data().shard(0, rank, world)[0])
            w = mc.distributed.world_from_plan(mc.Plan.from_dict(plan))
            rail, node = w.rail_group.group_name, w.node_group.group_name
            groups = [g for g, _ in meter.calls]
            assert groups == [rail, node, node, rail] * len(meter.idx), groups  # per layer: 2 hops there, 2 back
            me = rank // 2
            res["rail_rows"] = sum(sum(s for j, s in enumerate(splits) if j != me) for g, splits in meter.calls[0::4])
            res["node_pairs"] = sum(len(set((row // 2).tolist()) - {me}) for idx in meter.idx for row in idx)
            res["rank_pairs"] = sum(len(set(row.tolist()) - {rank}) for idx in meter.idx for row in idx)
            res["decision"] = next(r for r in result.history if r.name == "expert_parallel").decisions[0]
        res[name] = _run({}, rank, world, STEPS, step)
    chunked = {"experts": EXPERTS, "parallel": {"ep": world, "node_ranks": 2, "dispatcher": "alltoall_dedup"},
               "overlap": {"enabled": True, "chunks": 2}}  # both hops of each chunk, the backward's too
    res["node_chunks"] = _run(chunked, rank, world, STEPS)
    return res


@pytest.mark.distributed
def test_node_level_dedup_crosses_nodes_once_per_token_and_trains_like_one_process():
    """4 ranks as 2 nodes of 2: a token goes once to each other node holding one of its experts (then fans out
    inside it), and the run equals one process per rank, also under etp and overlapped in chunks."""
    ranks = spawn(node_worker, 4, (), timeout=400)
    for r in ranks:
        for name in ("node", "node_etp", "node_chunks"):
            _same_run(r[name], r["dp"])
        assert r["rail_rows"] == r["node_pairs"] < r["rank_pairs"]
    assert [r["decision"].split("per node: ")[1] for r in ranks] == [
        "node (0, 1), rail (0, 2)", "node (0, 1), rail (1, 3)", "node (2, 3), rail (0, 2)", "node (2, 3), rail (1, 3)"]


def test_node_ranks_must_divide_the_ep_group_and_go_with_dedup():
    with pytest.raises(PlanError, match="node_ranks.*must divide the ep group's 4 ranks"):
        mc.Plan.from_dict({"experts": EXPERTS, "parallel": {"ep": 4, "dispatcher": "alltoall_dedup", "node_ranks": 3}})
    for ep in (1, 2):  # an ep group inside one node: rank level, so a plan written for 8 a node runs at ep 1 or 2
        mc.Plan.from_dict({"experts": EXPERTS, "parallel": {"ep": ep, "dispatcher": "alltoall_dedup", "node_ranks": 8}})
    with pytest.raises(PlanError, match="only dispatcher 'alltoall_dedup' does"):
        mc.Plan.from_dict({"experts": EXPERTS, "parallel": {"ep": 4, "node_ranks": 2}})

    from moecompile.models import build_model

    from _dist import fake_rank

    rank_level = mc.Plan.from_dict({"experts": EXPERTS, "parallel": {"ep": 4, "dispatcher": "alltoall_dedup"}})
    node_level = rank_level.replace(parallel=dataclasses.replace(rank_level.parallel, node_ranks=2))
    with fake_rank(0, 4):
        world = mc.distributed.init(rank_level)
        dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=1, seq_len=8)
        with pytest.raises(PlanError, match="built with 1 ranks per node; build it from this plan"):
            mc.convert(dense, node_level, (ids,), world=world)


@pytest.mark.parametrize("E,k,ep,etp,G", [(8, 2, 4, 1, 2), (16, 4, 8, 1, 4), (8, 2, 2, 2, 2), (8, 2, 2, 4, 4),
                                          (6, 2, 3, 2, 2), (8, 3, 4, 1, 1)])
def test_the_planner_counts_a_tokens_distinct_nodes_exactly(E, k, ep, etp, G):
    """nodes_reached: the mean over every set of k experts of the nodes (G consecutive ranks) holding a slice of
    one of them; rank r holds slice r // ep of experts [(r % ep) E/ep, (r % ep + 1) E/ep)."""
    import itertools

    from moecompile.passes.ep_dedup import nodes_reached

    per, P = E // ep, ep * etp
    sets = list(itertools.combinations(range(E), k))
    mean = sum(len({r // G for r in range(P) if any(e // per == r % ep for e in s)}) for s in sets) / len(sets)
    assert nodes_reached(E, k, ep, etp, G) == pytest.approx(mean)


def test_the_planner_prices_node_level_dedup_by_the_nodes_it_crosses_to():
    """16 H100s, 8 a node, E 64 top-8: rank level, a token reaches ~6.8 ranks, half of them off-node; node level,
    ~2 nodes, one off-node (0.3x the slow bytes), then the 6.8 ranks over NVLink, one hop after the other: about
    half the time. Searched only where the ep group spans nodes."""
    import transformers

    from moecompile.planner import Candidate, SearchSpace, enumerate_candidates, estimate, preset, profile_config

    fine = {"num_experts": 64, "top_k": 8}
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=1024, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=8)
    prof = profile_config(cfg, seq_len=4096, experts=fine)
    cluster = preset("h100", 16)
    terms = {}
    for node_ranks in (1, 8):
        plan = mc.Plan.from_dict({"experts": fine, "parallel": {"ep": 16, "dispatcher": "alltoall_dedup",
                                                                "node_ranks": node_ranks}})
        cand = Candidate(plan)
        terms[node_ranks] = estimate(prof, cluster, cand, global_batch=16).term("dispatch+combine")
        assert ("/node8" in cand.describe()) == (node_ranks == 8)
    assert 0.4 * terms[1] < terms[8] < 0.6 * terms[1]
    inside = mc.Plan.from_dict({"experts": fine, "parallel": {"ep": 4, "dispatcher": "alltoall_dedup", "node_ranks": 8}})
    rank_level = mc.Plan.from_dict({"experts": fine, "parallel": {"ep": 4, "dispatcher": "alltoall_dedup"}})
    assert Candidate(inside).node_ranks == 1  # 4 ranks inside a node of 8: priced as the runtime runs it
    assert estimate(prof, cluster, Candidate(inside), 16).step_s == estimate(prof, cluster, Candidate(rank_level), 16).step_s
    cands, _ = enumerate_candidates(fine, cluster, 16, SearchSpace(expert_parallel=True, micro_batches=(1,)))
    node_level = {(c.ep, c.plan.parallel.dispatcher) for c in cands if c.node_ranks > 1}
    assert node_level == {(16, "alltoall_dedup")}  # ep 8 fits one node: rank level only


def test_a_node_level_graph_is_estimated_and_profiled_as_the_rank_level_one():
    """The memory estimator takes each hop's balanced counts (a rank gets T x ranks / G rows from each node peer);
    the profile finds the routed rows once, on the first hop; the static region stays capture-safe."""
    out = {g: _estimated(4, {"ep": 4, "dispatcher": "alltoall_dedup", "node_ranks": g}) for g in (1, 2)}
    (act, flops, rows), (act_n, flops_n, rows_n) = out[1], out[2]
    assert flops_n == flops and rows_n == rows and rows[1] > 0
    assert act < act_n < 1.3 * act  # the second hop's buffers: each token's rows, ids and weights once more


@pytest.mark.parametrize("E,k,ep,G,groups,group_k", [(8, 2, 4, 2, 4, 2), (16, 4, 8, 2, 4, 2), (16, 3, 4, 1, 8, 2),
                                                      (12, 2, 6, 3, 3, 1)])
def test_group_limited_routing_reaches_the_nodes_its_groups_allow(E, k, ep, G, groups, group_k):
    """DeepSeek-V3's node-limited routing: a token's k experts among the experts of group_k of the groups (each
    choice of groups equally likely, then every k of their experts): the mean distinct nodes, enumerated."""
    import itertools

    from moecompile.passes.ep_dedup import nodes_reached

    per, size = E // ep, E // groups
    reached = []
    for gs in itertools.combinations(range(groups), group_k):
        allowed = [e for g in gs for e in range(g * size, (g + 1) * size)]
        reached += [sum(len({(e // per) // G for e in s}) for s in itertools.combinations(allowed, k))
                    / math.comb(len(allowed), k)]
    assert nodes_reached(E, k, ep, 1, G, groups, group_k) == pytest.approx(sum(reached) / len(reached))
