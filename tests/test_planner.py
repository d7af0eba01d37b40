"""The planner: legal plans only, plans that can't fit rejected with the reason, plan.yaml round-trips."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moecompile as mc
from moecompile.errors import MoecompileError
from moecompile.planner.search import TIE
from moecompile.planner import (Candidate, Cluster, Link, SearchSpace, enumerate_candidates, estimate, legal_ep_sizes,
                                plan_for, preset, profile_config)

TINY = {"num_experts": 8, "top_k": 2}
MANY = {"num_experts": 64, "top_k": 2}  # experts dominate the tiny model's parameters
# offload_optimizer off: these tests price what fits on the GPU alone (tests/test_planner_offload.py gives it)
EVERYTHING = SearchSpace(expert_parallel=True, recompute_sets=((), ("moe_act",)), fp8_recipes=("none", "blockwise"),
                         micro_batches=(1, 2, 4), offload_optimizer=False)


def tiny_cluster(gpus: int, gpus_per_node: int = 8, memory_gb: float = 80.0) -> Cluster:
    return preset("h100", gpus, gpus_per_node=gpus_per_node, memory_bytes=memory_gb * 1e9)


@pytest.fixture(scope="module")
def tiny_profile():
    return profile_config("tiny-llama", seq_len=8, experts=MANY)


# --- the enumerator never returns an illegal plan --------------------------------------------------


SPACE = SearchSpace(expert_parallel=True, micro_batches=(1, 2, 4), offload_optimizer=False)


@settings(max_examples=40, deadline=None)
@given(experts=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 60, 64, 128, 256]),
       nodes=st.integers(1, 8), per_node=st.sampled_from([1, 2, 4, 6, 8]),
       per_gpu=st.integers(1, 4), odd=st.booleans())
def test_enumerator_never_returns_an_illegal_plan(experts, nodes, per_node, per_gpu, odd):
    gpus = nodes * per_node
    cluster = tiny_cluster(gpus, per_node)
    global_batch = gpus * per_gpu + (1 if odd and gpus > 1 else 0)
    cands, skipped = enumerate_candidates({"num_experts": experts, "top_k": 1}, cluster, global_batch, SPACE)
    if global_batch % gpus:
        assert cands == [] and "whole sequences" in skipped[0]
        return
    seen_eps = set()
    for c in cands:
        ep = c.plan.parallel.ep
        seen_eps.add(ep)
        assert experts % ep == 0 and gpus % c.expert_ranks == 0, c.describe()
        if c.etp > 1:  # only where ep alone cannot spread the experts over ep x etp ranks
            assert experts % c.expert_ranks or c.expert_ranks > experts, c.describe()
        assert global_batch % (gpus * c.micro_batch) == 0
        assert mc.Plan.from_dict(c.plan.to_dict()) == c.plan  # validates and round-trips
        if c.plan.parallel.dispatch_mode == "static":
            assert c.expert_ranks > 1 and c.plan.parallel.capacity_factor
        assert c.plan.experts.capacity_factor is None
    # complete: every EP size that divides both is offered, and every other divisor of the GPUs is explained
    assert seen_eps == {d for d in range(1, gpus + 1) if gpus % d == 0 and experts % d == 0}
    for d in range(2, gpus + 1):
        if gpus % d == 0 and experts % d:
            assert any(s.startswith(f"ep={d}:") for s in skipped)


def test_legal_ep_sizes_name_the_reason():
    keep, skipped = legal_ep_sizes(num_experts=6, gpus=8)
    assert keep == [1, 2]
    assert "ep=4: does not divide num_experts=6" in skipped
    assert "ep=8: more ranks than the 6 experts" in skipped


def test_without_the_expert_parallel_pass_only_ep1():
    cands, skipped = enumerate_candidates(TINY, tiny_cluster(8), 16, dataclasses.replace(EVERYTHING, expert_parallel=False))
    assert {c.ep for c in cands} == {1}
    assert any("expert_parallel pass is not available" in s for s in skipped)


# --- plans that can't fit are rejected with the reason ----------------------------------------------


def _search(profile, cluster, global_batch, space):
    from moecompile.planner import search

    return search(lambda cand: profile, profile.plan.experts.to_dict(), cluster, global_batch, space)


def test_plans_that_cannot_fit_are_rejected_with_the_reason(tiny_profile):
    space = dataclasses.replace(EVERYTHING, recompute_sets=((),), fp8_recipes=("none",), micro_batches=(1,),
                                shard_optimizer=(False,))  # sharding the optimizer would fit ep=2 (tested below)
    big = tiny_cluster(8)
    by_ep = {}
    for c in enumerate_candidates(tiny_profile.plan.experts.to_dict(), big, 8, space)[0]:
        by_ep.setdefault(c.ep, estimate(tiny_profile, big, c, 8).memory_bytes)
    assert by_ep[1] > by_ep[8]  # experts are sharded: more EP, less memory per rank
    # a GPU just too small for ep=1 and ep=2, big enough for ep>=4
    mem = (by_ep[2] + by_ep[4]) / 2 / big.usable_memory_fraction
    report = _search(tiny_profile, dataclasses.replace(big, memory_bytes=mem), 8, space)
    assert report.ranked and all(e.candidate.ep >= 4 for e in report.ranked)
    rejected_eps = {e.candidate.ep for e, _ in report.rejected}
    assert rejected_eps == {1, 2}
    for est, why in report.rejected:
        assert not est.fits and why.startswith("needs ") and "GiB usable" in why and "activations" in why
    steps = [e.step_s for e in report.ranked]
    assert steps[0] <= min(steps) * (1 + TIE)  # fastest first (ties within TIE go to the simpler plan)


def test_nothing_fits_raises_with_the_reasons(tiny_profile):
    space = dataclasses.replace(EVERYTHING, recompute_sets=((),), fp8_recipes=("none",), micro_batches=(1,))
    report = _search(tiny_profile, tiny_cluster(8, memory_gb=1e-6), 8, space)
    assert not report.ranked and report.rejected
    with pytest.raises(MoecompileError, match="no plan .* fits .*needs"):
        report.best
    assert "no plan fits in memory" in report.table()


# --- the cost model's terms move the right way ---------------------------------------------------------


def _est(profile, cluster, ep, **kw):
    plan = mc.Plan.from_dict({"experts": profile.plan.experts.to_dict(), "parallel": {"ep": ep}})
    return estimate(profile, cluster, Candidate(plan, **kw), cluster.gpus)


def test_dispatch_costs_more_across_nodes_and_overlap_hides_it(tiny_profile):
    cl = tiny_cluster(16)
    intra, inter = _est(tiny_profile, cl, 8), _est(tiny_profile, cl, 16)
    rows = tiny_profile.layers[1].dispatch_bytes
    assert rows == tiny_profile.tokens * 2 * 32 * tiny_profile.elem_bytes  # T*k*H elements of the routed rows
    assert inter.term("dispatch+combine") > intra.term("dispatch+combine") > 0
    assert _est(tiny_profile, cl, 1).term("dispatch+combine") == 0
    slow = dataclasses.replace(cl, intra=Link(1e7, 1e-6), bf16_flops=1e8)  # exchange and experts both take ms
    plain = _est(tiny_profile, slow, 8)
    hidden = _est(tiny_profile, slow, 8, overlap_chunks=4, overlap_backward=True)
    assert hidden.term("dispatch+combine") < plain.term("dispatch+combine")
    assert hidden.step_s < plain.step_s


def test_routing_weights_travel_with_the_rows_under_alltoall(tiny_profile):
    """tiny-llama's GLU experts take the weights in the activation, so ep moves N of them each way."""
    moe = tiny_profile.layers[1]
    assert moe.row_weight_bytes == tiny_profile.tokens * 2 * 4  # T*k fp32 routing weights
    layers = [dataclasses.replace(lp, row_weight_bytes=0.0) for lp in tiny_profile.layers]
    without = dataclasses.replace(tiny_profile, layers=layers)
    cl = tiny_cluster(8)
    moved, not_moved = _est(tiny_profile, cl, 8), _est(without, cl, 8)
    assert moved.term("dispatch+combine") > not_moved.term("dispatch+combine")
    assert "routing weights" in next(t.detail for t in moved.terms if t.name == "dispatch+combine")
    assert _est(tiny_profile, cl, 1).term("dispatch+combine") == 0


def test_packed_routing_weights_save_the_latency_of_their_own_exchange(tiny_profile):
    """Small rows: the weights as a column of the dispatch cost bytes and copies, not two more collectives."""
    cl = tiny_cluster(8)
    plan = mc.Plan.from_dict({"experts": tiny_profile.plan.experts.to_dict(), "parallel": {"ep": 8}})
    by_pack = {pack: estimate(tiny_profile, cl, Candidate(plan.replace(parallel={"ep": 8, "pack_routing_weights": pack})),
                              cl.gpus) for pack in (None, True, False)}
    assert by_pack[None].term("dispatch+combine") == by_pack[True].term("dispatch+combine")  # tiny rows pack
    assert by_pack[True].term("dispatch+combine") < by_pack[False].term("dispatch+combine")
    detail = {k: next(t.detail for t in e.terms if t.name == "dispatch+combine") for k, e in by_pack.items()}
    assert "packed into the dispatch" in detail[True] and "routing weights' 2" in detail[False]


def test_the_search_prices_where_the_routing_weights_go():
    """Under alltoall at ep > 1 both placements are priced: combine sends no weights, but keeps the rows."""
    report = plan_for("tiny-llama", tiny_cluster(8), global_batch=8, seq_len=8, experts=MANY,
                      space=SearchSpace(expert_parallel=True, micro_batches=(1,)))
    ests = report.ranked + [e for e, _ in report.rejected]
    by = {(e.candidate.describe().replace(" weights@combine", ""), e.candidate.plan.experts.apply_weights): e
          for e in ests}
    for (what, where), e in by.items():
        c = e.candidate
        alltoall = c.ep > 1 and c.plan.parallel.dispatcher == "alltoall"
        assert where == "auto" or (where == "combine" and alltoall), what  # elsewhere only the cheaper memory
        if where == "combine":
            act = by[(what, "auto")]
            assert e.term("dispatch+combine") < act.term("dispatch+combine"), what
            rows = report.profile.layers[1].dispatch_bytes * report.profile.moe_layers  # [N, H] kept per layer
            assert 0.5 * rows < e.memory_bytes - act.memory_bytes <= rows, what  # less the weights glu kept
    assert sum(w == "combine" for _, w in by) == sum(w == "auto" and " alltoall " in d for d, w in by) > 0


def test_without_a_glu_to_take_them_the_weights_are_not_searched(tiny_profile):
    """A graph whose glu takes no weights (non-GLU or biased experts): auto is combine already."""
    from moecompile.planner import search

    without = dataclasses.replace(tiny_profile, layers=[dataclasses.replace(lp, row_weight_bytes=0.0)
                                                        for lp in tiny_profile.layers])
    space = SearchSpace(expert_parallel=True, micro_batches=(1,))
    placements = lambda prof: {e.candidate.plan.experts.apply_weights  # noqa: E731
                               for e in search(lambda c: prof, MANY, tiny_cluster(8), 8, space, baseline=prof).ranked}
    assert placements(tiny_profile) == {"auto", "combine"}
    assert placements(without) == {"auto"}


def _ep_profiles(rank: int, world_size: int) -> dict:
    from moecompile.models import build_model
    from moecompile.planner import profile_result
    from moecompile.planner.profile import node_costs

    ops = torch.ops.moecompile
    out = {}
    for ep in (1, world_size):
        plan = mc.Plan.from_dict({"experts": TINY, "parallel": {"ep": ep}})
        model, (ids,) = build_model("tiny-llama", batch_size=2, seq_len=8)
        result = mc.convert(model, plan, (ids,))
        gm = result.module
        packs = sum(n.target in (ops.pack_row_weights.default, ops.unpack_row_weights.default) for n in gm.graph.nodes)
        priced = sum(n.target in (ops.pack_row_weights.default, ops.unpack_row_weights.default)
                     for n, _ in node_costs(gm))
        moe = profile_result(result).layers[1]
        out[ep] = {"rows": moe.dispatch_bytes, "weights": moe.row_weight_bytes, "packs": packs, "priced": priced}
    return out


@pytest.mark.distributed
def test_an_expert_parallel_graph_profiles_its_routing_weights_like_the_single_process_one():
    """Dropless ep=2: w_N's length is data-dependent, and its packing is the exchange's (priced there, not twice)."""
    from _dist import spawn

    by_ep = spawn(_ep_profiles, 2, timeout=180)[0]
    assert by_ep[1]["weights"] == 2 * 8 * 2 * 4 > 0  # T*k fp32 weights
    assert by_ep[2]["rows"] == by_ep[1]["rows"] and by_ep[2]["weights"] == by_ep[1]["weights"]
    assert by_ep[2]["packs"] == 2 * 2 and by_ep[2]["priced"] == 0  # pack + unpack, 2 layers


def test_explain_prints_every_term(tiny_profile):
    from moecompile.planner.explain import explain

    est = _est(tiny_profile, tiny_cluster(8), 8)
    text = explain(est)
    for t in est.terms + est.memory:
        assert t.name in text
    assert "= step" in text and "fits" in text


@pytest.mark.parametrize("micro_batch, fp8", [(1, False), (4, True)])
def test_op_seconds_are_the_ops_the_forward_term_sums(tiny_profile, micro_batch, fp8):
    """A validation that times each op against its price (benchmarks/planner_validation.py) checks the estimate."""
    from moecompile.planner.cost_model import op_seconds

    plan = mc.Plan.from_dict({"experts": MANY, "fp8": {"recipe": "blockwise" if fp8 else "none"}})
    cand = Candidate(plan, micro_batch=micro_batch, assume_fp8=fp8)
    cluster = tiny_cluster(8)
    est = estimate(tiny_profile, cluster, cand, 8 * micro_batch)
    price = op_seconds(tiny_profile, cluster, cand)
    assert sum(price(nc) * lp.count for lp in tiny_profile.layers for nc in lp.nodes) == pytest.approx(
        est.term("forward"))


@pytest.mark.parametrize("elem_bytes, per_param", [(2, 2 * (4 + 8) + 2 + 2), (4, 2 * (4 + 8) + 4)])
def test_the_optimizer_streams_a_separate_parameter_only_for_a_low_precision_model(tiny_profile, elem_bytes,
                                                                                   per_param):
    """bf16: the fp32 master and both moments read and written, the bf16 gradient read and the bf16 parameter
    written; fp32: the parameter is the master (read and written with the moments), and its gradient read."""
    from moecompile.planner.cost_model import optimizer_params

    profile = dataclasses.replace(tiny_profile, elem_bytes=elem_bytes)
    cluster = tiny_cluster(1)
    cand = Candidate(mc.Plan.from_dict({"experts": MANY}), micro_batch=1)
    est = estimate(profile, cluster, cand, 1)
    want = optimizer_params(profile, cand, 1) * per_param / cluster.memory_bandwidth
    assert est.term("optimizer") == pytest.approx(want)


def test_layer_scaling_is_exact_for_flops():
    """One traced layer scaled to 3 gives the same FLOPs and parameters as converting all 3 layers."""
    import transformers

    from moecompile.costs import graph_costs
    from moecompile.planner.profile import _meta_convert

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    prof = profile_config(cfg, seq_len=16, experts=TINY)
    full = _meta_convert(cfg, {"experts": TINY}, 1, 16)
    assert math.isclose(prof.flops, graph_costs(full.history[-1].graph).flops, rel_tol=1e-9)
    assert math.isclose(prof.dense_params + prof.expert_params, sum(p.numel() for p in full.module.parameters()))


# --- parallel.shard_optimizer (ZeRO-1): the optimizer's memory is the rank's range ------------------------


def _zero1(profile, ep: int, shard: bool, **kw) -> Candidate:
    plan = mc.Plan.from_dict({"experts": profile.plan.experts.to_dict(), "parallel": {"ep": ep, "shard_optimizer": shard}})
    return Candidate(plan, **kw)


def test_sharded_optimizer_memory_is_the_ranks_range(tiny_profile):
    """bf16: params 2 B and grads 2 B whole; masters 4 + their grads 4 + AdamW 8 = 16 B over dp (dense) / edp (experts)."""
    from moecompile.planner.cost_model import static_memory

    assert tiny_profile.elem_bytes == 2 and tiny_profile.state_bytes == (2.0, 16.0)  # from the memory estimator
    D, X = tiny_profile.dense_params, tiny_profile.expert_params
    cl = tiny_cluster(8)  # ep=2: dp=8, edp=4
    mem = {shard: {t.name: t.value for t in estimate(tiny_profile, cl, _zero1(tiny_profile, 2, shard), 8).memory}
           for shard in (False, True)}
    held = D + X / 2
    for shard in (False, True):
        assert mem[shard]["params"] == mem[shard]["grads"] == held * 2
    assert mem[False]["optimizer"] == held * 16
    assert mem[True]["optimizer"] == pytest.approx((D / 8 + X / 2 / 4) * 16)
    assert static_memory(tiny_profile, _zero1(tiny_profile, 2, True), 8) == pytest.approx(held * 4 + (D / 8 + X / 8) * 16)
    assert "zero1" in _zero1(tiny_profile, 2, True).describe() and "zero1" not in _zero1(tiny_profile, 2, False).describe()
    # on one GPU it changes nothing; at ep = GPUs the experts have no replicas to split over (edp = 1)
    one = tiny_cluster(1)
    assert (static_memory(tiny_profile, _zero1(tiny_profile, 1, True), 1)
            == static_memory(tiny_profile, _zero1(tiny_profile, 1, False), 1))
    full_ep = estimate(tiny_profile, cl, _zero1(tiny_profile, 8, True), 8)
    assert next(t.value for t in full_ep.memory if t.name == "optimizer") == pytest.approx((D / 8 + X / 8) * 16)
    # without the estimator: the same default; Megatron's fp32 gradients are the masters' own (no fp32 copy)
    bare = dataclasses.replace(tiny_profile, state_bytes=None)
    fp32_grads = {t.name: t.value for t in estimate(bare, one, _zero1(bare, 1, True, grad_bytes=4), 1).memory}
    assert fp32_grads["grads"] == (D + X) * 4 and fp32_grads["optimizer"] == (D + X) * (4 + 8)
    assert static_memory(bare, _zero1(bare, 1, False), 1) == (D + X) * (2 + 2 + 16)


def test_sharding_never_costs_time_and_saves_memory(tiny_profile):
    """Gradients in the parameter dtype: reduce-scatter + all-gather move the all-reduce's bytes; the update is the range's."""
    cl = tiny_cluster(16)
    for ep in (1, 2, 16):
        off, on = (estimate(tiny_profile, cl, _zero1(tiny_profile, ep, s), 16) for s in (False, True))
        assert on.term("gradient sync") == pytest.approx(off.term("gradient sync"))
        assert on.term("optimizer") < off.term("optimizer") and on.step_s < off.step_s
        assert on.memory_bytes < off.memory_bytes
        assert "reduce-scatter + all-gather" in next(t.detail for t in on.terms if t.name == "gradient sync")


def _tight_memory(profile, gpus: int) -> float:
    """GPU bytes between the smallest sharded plan (fits) and the smallest unsharded one (does not)."""
    from moecompile.planner.cost_model import static_memory

    on = min(estimate(profile, tiny_cluster(gpus), _zero1(profile, ep, True), gpus).memory_bytes for ep in (1, 2, 4, 8))
    off = min(static_memory(profile, _zero1(profile, ep, False), gpus) for ep in (1, 2, 4, 8))
    assert on < off
    return (on + off) / 2 / tiny_cluster(gpus).usable_memory_fraction


def test_the_search_shards_the_optimizer_when_only_that_fits(tiny_profile):
    space = dataclasses.replace(EVERYTHING, recompute_sets=((),), fp8_recipes=("none",), micro_batches=(1,))
    cl = dataclasses.replace(tiny_cluster(8), memory_bytes=_tight_memory(tiny_profile, 8))
    report = _search(tiny_profile, cl, 8, space)
    assert report.ranked and all(e.candidate.plan.parallel.shard_optimizer for e in report.ranked)
    assert {e.candidate.distributed_optimizer for e, _ in report.rejected} == {False, True}
    assert "zero1" in report.table()
    with pytest.raises(MoecompileError, match="no plan"):  # without it nothing fits
        _search(tiny_profile, cl, 8, dataclasses.replace(space, shard_optimizer=(False,))).best
    # on a tie the unsharded plan ranks first (it runs any torch optimizer); faster beyond the tie, the sharded one
    from moecompile.planner.search import _rank_key

    off = estimate(tiny_profile, tiny_cluster(8), _zero1(tiny_profile, 8, False), 8)
    on = dataclasses.replace(estimate(tiny_profile, tiny_cluster(8), _zero1(tiny_profile, 8, True), 8), step_s=off.step_s)
    assert sorted([on, off], key=_rank_key)[0] is off
    assert sorted([dataclasses.replace(on, step_s=off.step_s / (1 + 3 * TIE)), off], key=_rank_key)[1] is off
    roomy = _search(tiny_profile, tiny_cluster(8), 8, space)
    ranked = {(e.candidate.ep, e.candidate.plan.parallel.dispatcher, e.candidate.plan.parallel.dispatch_mode,
               e.candidate.plan.parallel.capacity_factor, e.candidate.plan.experts.apply_weights,
               e.candidate.distributed_optimizer): e for e in roomy.ranked}
    best = roomy.best.candidate
    twin = ranked[(best.ep, best.plan.parallel.dispatcher, best.plan.parallel.dispatch_mode,
                   best.plan.parallel.capacity_factor, best.plan.experts.apply_weights, not best.distributed_optimizer)]
    if best.distributed_optimizer:  # chosen for time: faster than its unsharded twin beyond the tie
        assert twin.step_s > roomy.best.step_s * (1 + TIE)
    else:
        assert twin.step_s >= roomy.best.step_s / (1 + TIE) ** 2


def test_one_gpu_never_shards_the_optimizer():
    cands, _ = enumerate_candidates(TINY, tiny_cluster(1), 2, SPACE)
    assert cands and not any(c.plan.parallel.shard_optimizer for c in cands)
    cands, _ = enumerate_candidates(TINY, tiny_cluster(8), 8, SPACE)
    levels = {z: [c for c in cands if c.zero == z] for z in ("", "zero1", "zero2", "zero3")}
    assert len(levels[""]) * 4 == len(cands)  # every plan unsharded, zero1, zero2 and zero3
    unshard = {"shard_parameters": False, "shard_gradients": False, "shard_optimizer": False, "overlap_param_gather": False}
    key = lambda c: (repr(c.plan.replace(parallel=unshard)), c.micro_batch)  # noqa: E731
    for z in ("zero1", "zero2", "zero3"):
        assert sorted(map(key, levels[z])) == sorted(map(key, levels[""])), z
    # sharding is the cost model's alone: a sharded plan profiles (traces) the graph of its unsharded twin
    from moecompile.planner.search import iter_sections

    sections = {key(c): iter_sections(c) for c in levels[""]}
    assert all(iter_sections(c) == sections[key(c)] for z in ("zero1", "zero2", "zero3") for c in levels[z])
    no_zero2 = enumerate_candidates(TINY, tiny_cluster(8), 8, dataclasses.replace(SPACE, shard_gradients=(False,)))[0]
    assert len(no_zero2) * 4 == len(cands) * 2 and not any(c.shard_gradients for c in no_zero2)


def test_cli_plan_writes_shard_optimizer_when_it_is_what_fits(tmp_path, capsys, monkeypatch, tiny_profile):
    """moecompile plan on GPUs where only a sharded optimizer fits writes parallel.shard_optimizer: true."""
    import moecompile.planner as planner
    from moecompile.cli import main

    memory = _tight_memory(tiny_profile, 8)
    monkeypatch.setattr(planner, "preset", lambda name, gpus=None: tiny_cluster(gpus, memory_gb=memory / 1e9))
    out = tmp_path / "p.yaml"
    args = ["plan", "--model", "tiny-llama", "--experts", '{"num_experts": 64, "top_k": 2}', "--gpus", "8",
            "--global-batch", "8", "--seq-len", "8", "--micro-batches", "1", "--fp8", "none", "--offload-optimizer", "off",
            "--out", str(out)]
    rc = main(args)
    text = capsys.readouterr().out
    assert rc == 0 and "zero1" in text
    assert "shard_optimizer: true" in out.read_text()
    loaded = mc.Plan.from_file(out)
    assert loaded.parallel.shard_optimizer and mc.Plan.from_dict(loaded.to_dict()) == loaded
    assert main(args[:-2] + ["--shard-optimizer", "off"]) == 1  # an optimizer that must stay whole: nothing fits
    assert "no plan fits in memory" in capsys.readouterr().out


# --- parallel.shard_gradients (ZeRO-2): a rank's range of the gradients, reduce-scattered per micro-batch --


def _zero2(profile, ep: int, **kw) -> Candidate:
    plan = mc.Plan.from_dict({"experts": profile.plan.experts.to_dict(),
                              "parallel": {"ep": ep, "shard_optimizer": True, "shard_gradients": True}})
    return Candidate(plan, **kw)


def _mem(est) -> dict:
    return {t.name: t.value for t in est.memory}


def test_sharded_gradients_are_the_ranks_range_plus_the_buckets_in_flight(tiny_profile):
    """bf16 grads 2 B: dense / dp, experts / edp, + the whole buckets in flight at their peak: the runtime's
    GradientShards run over the model's parameter layout in NCCL's form (planner/whole_buckets.py)."""
    from moecompile.planner.cost_model import in_flight_bytes, static_memory

    D, X = tiny_profile.dense_params, tiny_profile.expert_params
    assert (D, X) == (18592, 2 * 64 * 3 * 32 * 64)  # tiny-llama: 2 layers x E=64 x (gate, up, down) x H x F
    assert tiny_profile.largest_params == (128 * 32, 64 * 2 * 64 * 32)  # the embedding; one layer's w_gate_up
    cl, MiB = tiny_cluster(8), 2**20
    z1, z2 = (_mem(estimate(tiny_profile, cl, c, 8)) for c in (_zero1(tiny_profile, 2, True), _zero2(tiny_profile, 2)))
    in_flight = in_flight_bytes(tiny_profile, _zero2(tiny_profile, 2), 8)
    # ep=2 on 8 GPUs: dp=8, edp=4; one bucket per kind (each less than 25 MiB), which backward fills side by
    # side, then both reduce-scatters in flight with the ranges they receive (up to the alignment padding)
    assert in_flight == pytest.approx(2 * D * (1 + 1 / 8) + X * (1 + 1 / 4), rel=0.01)
    assert z1["grads"] == (D + X / 2) * 2
    assert z2["grads"] == pytest.approx((D / 8 + X / 2 / 4) * 2 + in_flight)
    assert z2["params"] == z1["params"] and z2["optimizer"] == z1["optimizer"]  # only the gradients change
    assert z2["grads"] > z1["grads"]  # a tiny model: the buckets in flight outweigh what the range saves
    # buckets of one parameter each (bucket_mb ~ 0): a few at once, the largest a rank's w_gate_up
    largest = 64 * 2 * 64 * 32 / 2 * 2
    tiny_buckets = in_flight_bytes(tiny_profile, _zero2(tiny_profile, 2, bucket_mb=1e-6), 8)
    assert largest < tiny_buckets < 3 * largest * (1 + 1 / 4)
    # ep=8 on 8 GPUs: experts have no replica (edp=1), their grads stay whole and no expert bucket is in flight
    full_ep = _mem(estimate(tiny_profile, cl, _zero2(tiny_profile, 8), 8))
    assert in_flight_bytes(tiny_profile, _zero2(tiny_profile, 8), 8) == pytest.approx(2 * D * (1 + 1 / 8), rel=0.05)
    assert full_ep["grads"] == pytest.approx((D / 8 + X / 8) * 2 + in_flight_bytes(tiny_profile, _zero2(tiny_profile, 8), 8))
    # past the bucket size, sharding saves: 2000 MoE layers (D, X ~ 10 M, 786 M elements), 25 MiB buckets: a dense
    # and an expert bucket filling side by side, up to two more being reduce-scattered
    big = _deep(tiny_profile, 1000)
    Db, Xb = big.dense_params, big.expert_params
    z1b, z2b = (_mem(estimate(big, cl, c, 8)) for c in (_zero1(big, 1, True), _zero2(big, 1)))
    in_flight_b = in_flight_bytes(big, _zero2(big, 1), 8)
    assert 2 * 25 * MiB < in_flight_b <= 4 * 25 * MiB * (1 + 1 / 8)
    assert z2b["grads"] == pytest.approx((Db + Xb) / 8 * 2 + in_flight_b)
    assert z1b["grads"] - z2b["grads"] > 1e9
    assert (static_memory(big, _zero1(big, 1, True), 8) - static_memory(big, _zero2(big, 1), 8)
            == pytest.approx(z1b["grads"] - z2b["grads"]))
    assert "zero2" in _zero2(big, 1).describe() and "zero1" not in _zero2(big, 1).describe()
    detail = next(t.detail for t in estimate(big, cl, _zero2(big, 1), 8).memory if t.name == "grads")
    assert "whole buckets in flight" in detail and "at the peak" in detail
    # without the layout (a pipeline stage holds part of it) the approximation: 3 of the largest
    staged = dataclasses.replace(_zero2(big, 1), pp=2)
    assert "3 of the largest" in next(t.detail for t in estimate(big, cl, staged, 8).memory if t.name == "grads")


def test_bf16_adam_moments_keep_4_bytes_a_parameter_less(tiny_profile):
    """moment_bytes=2 (moecompile.AdamW in bf16): the optimizer state of every element a rank updates loses 2 x 2 B,
    nothing else moves but the optimizer's streamed bytes; it is every plan's (plan --adam-moments bf16)."""
    from moecompile.planner.cost_model import optimizer_params

    cl = tiny_cluster(8)
    for cand in (_zero1(tiny_profile, 2, False), _zero1(tiny_profile, 2, True), _zero2(tiny_profile, 2)):
        fp32, bf16 = (estimate(tiny_profile, cl, dataclasses.replace(cand, moment_bytes=b), 8) for b in (4, 2))
        assert _mem(fp32)["optimizer"] - _mem(bf16)["optimizer"] == pytest.approx(4 * optimizer_params(tiny_profile,
                                                                                                        cand, 8))
        assert [_mem(e)[k] for e in (fp32, bf16) for k in ("params", "grads", "activations")] == \
            [_mem(fp32)[k] for k in ("params", "grads", "activations")] * 2
        assert bf16.term("optimizer") < fp32.term("optimizer") and bf16.term("forward") == fp32.term("forward")
    assert "bf16 moments" in dataclasses.replace(cand, moment_bytes=2).describe() and "moments" not in cand.describe()
    space = dataclasses.replace(SPACE, moment_bytes=2)
    cands, _ = enumerate_candidates(MANY, tiny_cluster(2), 2, space)
    assert cands and all(c.moment_bytes == 2 for c in cands)


def test_the_planner_prices_the_buckets_in_flight_as_the_memory_estimator_does():
    """The oracle: a profile of a converted graph (every layer read as it is) prices ZeRO-2's buckets in flight
    exactly as estimate_memory does on that graph (NCCL's form), and ZeRO-3's buckets gathered as it does too
    (the planner takes a parameter as read where it is first read; estimate_memory follows every read), and a
    config's profile (one layer traced, scaled by count) lays the same model's parameters out in the same order."""
    from moecompile.models import build_model
    from moecompile.planner import whole_buckets
    from moecompile.planner.cost_model import gathered_bytes, in_flight_bytes
    from moecompile.planner.profile import profile_result

    dense, (ids,) = build_model("tiny-llama", batch_size=1, seq_len=8, dtype="bfloat16")
    result = mc.convert(dense, {"experts": MANY}, (ids,))
    graph = profile_result(result)
    assert whole_buckets.model_order(graph) == whole_buckets.model_order(profile_config("tiny-llama", seq_len=8,
                                                                                        experts=MANY))
    for bucket_mb in (25.0, 0.05):
        est = mc.estimate_memory(result, by_pass=False, dp=8, shard_optimizer=True, shard_gradients=True,
                                 backend="nccl", bucket_mb=bucket_mb)
        assert in_flight_bytes(graph, _zero2(graph, 1, bucket_mb=bucket_mb), 8) == est.in_flight_grads > 0
        zero3 = dataclasses.replace(_zero2(graph, 1, bucket_mb=bucket_mb),
                                    plan=_zero2(graph, 1).plan.replace(parallel={"shard_parameters": True}))
        z3 = mc.estimate_memory(result, by_pass=False, dp=8, shard_optimizer=True, shard_gradients=True,
                                shard_parameters=True, bucket_mb=bucket_mb)
        assert gathered_bytes(graph, zero3, 8) == z3.in_flight_params > 0


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen2"])
def test_a_config_with_per_layer_attention_kinds_is_rebuilt_at_fewer_layers(model):
    """Qwen2/3 configs list each layer's attention kind (layer_types); the 1-layer rebuild keeps the first one
    (it had raised transformers' own validation error for 1 layer against 2 kinds)."""
    prof = profile_config(model, seq_len=8, experts=TINY)
    assert prof.num_layers == 2 and prof.flops == profile_config("tiny-llama", seq_len=8, experts=TINY).flops


@pytest.mark.parametrize("sections", [
    {"fp8": {"recipe": "tensorwise"}}, {"fp8": {"recipe": "blockwise"}}, {"recompute": {"modules": ["moe"]}},
    {"experts": {"apply_weights": "combine"}}, {"parallel": {"etp": 2}},
    {"parallel": {"etp": 2}, "fp8": {"recipe": "blockwise", "modules": ["experts", "attention_proj"]}},
])
def test_no_graph_variant_changes_the_forward_flops(sections):
    """Recompute, FP8, where the routing weights go and expert slices change how the work is done, not how much:
    a variant's profile counts the FLOPs of the plain graph (FP8 GEMMs had counted none)."""
    plain = profile_config("tiny-llama", seq_len=8, experts=TINY)
    variant = profile_config("tiny-llama", seq_len=8, experts=TINY, sections=sections)
    assert variant.flops == plain.flops
    assert [lp.flops for lp in variant.layers] == [lp.flops for lp in plain.layers]


def test_a_gpt2_config_is_profiled_layer_by_layer():
    """GPT-2 keeps its blocks in transformer.h and its FFN width in n_inner (None: 4 x hidden): the profile finds
    both (it had counted every op once, in the base, and no experts), and lays the parameters out as the graph."""
    from moecompile.models import build_model
    from moecompile.planner import whole_buckets
    from moecompile.planner.profile import profile_result

    prof = profile_config("tiny-gpt2", seq_len=8, experts=MANY)
    moe = next(lp for lp in prof.layers if lp.kind == "moe")
    dense, (ids,) = build_model("tiny-gpt2", batch_size=1, seq_len=8)
    graph = profile_result(mc.convert(dense, {"experts": MANY}, (ids,)))
    assert moe.count == 2 and moe.flops > 0 and moe.expert_params == 64 * (2 * 32 * 128 + 128 + 32)  # c_fc, c_proj and their biases
    assert whole_buckets.model_order(prof) == whole_buckets.model_order(graph) != []


def _deep(profile, factor: int):
    """``profile`` with ``factor`` x its MoE layers: many parameters, none larger than before."""
    layers = [dataclasses.replace(lp, count=lp.count * factor) if lp.kind == "moe" else lp for lp in profile.layers]
    return dataclasses.replace(profile, layers=layers)


def test_sharded_gradients_reduce_scatter_every_micro_batch(tiny_profile):
    """m micro-batches: m reduce-scatters of the gradients and one all-gather; one micro-batch: ZeRO-1's sync."""
    cl = tiny_cluster(16)
    for ep in (1, 2, 16):
        sync = {}
        for mb in (1, 2, 4):  # 4 sequences per GPU: m = 4, 2, 1
            z1, z2 = (estimate(tiny_profile, cl, c, 64) for c in (_zero1(tiny_profile, ep, True, micro_batch=mb),
                                                                  _zero2(tiny_profile, ep, micro_batch=mb)))
            sync[mb] = z2.term("gradient sync")
            assert z2.term("optimizer") == z1.term("optimizer") and z2.term("backward") == z1.term("backward")
            if mb == 4:
                assert z2.term("gradient sync") == z1.term("gradient sync") and z2.step_s == z1.step_s
            else:
                assert z2.term("gradient sync") > z1.term("gradient sync") and z2.step_s > z1.step_s
            assert f"per micro-batch (x{4 // mb})" in next(t.detail for t in z2.terms if t.name == "gradient sync")
        # linear in m: each more micro-batch adds one more reduce-scatter of the same bytes
        assert sync[1] - sync[2] == pytest.approx(2 * (sync[2] - sync[4]))
        assert sync[2] > sync[4]


def _zero2_memory(big, gpus: int) -> float:
    """GPU bytes between the smallest zero2 plan (fits) and the smallest zero1 one (does not)."""
    z2 = min(estimate(big, tiny_cluster(gpus), _zero2(big, ep), gpus).memory_bytes for ep in (1, 2, 4, 8))
    z1 = min(estimate(big, tiny_cluster(gpus), _zero1(big, ep, True), gpus).memory_bytes for ep in (1, 2, 4, 8))
    assert z2 < z1  # at ep=8 (edp=1) only the dense grads shard: 104 M elements, 180 MB more than 3 buckets
    return (z1 + z2) / 2 / tiny_cluster(gpus).usable_memory_fraction


def test_the_search_shards_the_gradients_when_only_that_fits(tiny_profile):
    big = _deep(tiny_profile, 10000)
    space = dataclasses.replace(EVERYTHING, recompute_sets=((),), fp8_recipes=("none",), micro_batches=(1,))
    cl = dataclasses.replace(tiny_cluster(8), memory_bytes=_zero2_memory(big, 8))
    report = _search(big, cl, 8, space)
    assert report.ranked and all(e.candidate.shard_gradients for e in report.ranked)
    assert "zero2" in report.table()
    assert any(e.candidate.distributed_optimizer and not e.candidate.shard_gradients for e, _ in report.rejected)
    with pytest.raises(MoecompileError, match="no plan"):  # without it nothing fits
        _search(big, cl, 8, dataclasses.replace(space, shard_gradients=(False,))).best
    # one micro-batch: zero2 costs what zero1 does, and on the tie the less sharded plan ranks first
    from moecompile.planner.search import _rank_key

    z2, z1, off = (estimate(big, tiny_cluster(8), c, 8) for c in (_zero2(big, 4), _zero1(big, 4, True),
                                                                 _zero1(big, 4, False)))
    assert z2.step_s == z1.step_s
    ordered = sorted([z2, z1, dataclasses.replace(off, step_s=z1.step_s)], key=_rank_key)
    assert [(e.candidate.distributed_optimizer, e.candidate.shard_gradients) for e in ordered] == \
        [(False, False), (True, False), (True, True)]
    assert sorted([dataclasses.replace(z2, step_s=z1.step_s / (1 + 3 * TIE)), z1], key=_rank_key)[0] is not z1


def test_cli_plan_shard_gradients(tmp_path, capsys, monkeypatch, tiny_profile):
    """--shard-gradients on writes parallel.shard_gradients: true; auto chooses it where only it fits."""
    from moecompile.cli import main

    out = tmp_path / "p.yaml"
    args = ["plan", "--model", "tiny-llama", "--experts", '{"num_experts": 64, "top_k": 2}', "--gpus", "8",
            "--global-batch", "8", "--seq-len", "8", "--micro-batches", "1", "--fp8", "none", "--offload-optimizer", "off",
            "--out", str(out)]
    assert main(args + ["--shard-gradients", "on"]) == 0
    assert "zero2" in capsys.readouterr().out and "zero1" not in out.read_text()
    loaded = mc.Plan.from_file(out)
    assert loaded.parallel.shard_gradients and loaded.parallel.shard_optimizer
    assert "shard_gradients: true" in out.read_text()
    assert main(args + ["--shard-gradients", "on", "--shard-optimizer", "off"]) == 2
    assert "--shard-gradients on needs the sharded optimizer" in capsys.readouterr().err
    big = _deep(tiny_profile, 10000)
    only_sharding_fits(monkeypatch, capsys, args, out, big, _zero2_memory(big, 8), "zero2", "shard_gradients")
    # --adam-moments bf16: every plan keeps bf16 moments, and the written plan says how to train it
    monkeypatch.undo()
    assert main(args + ["--adam-moments", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "bf16 moments" in text and "moecompile.AdamW(ps, moment_dtype=torch.bfloat16)" in text, text


def only_sharding_fits(monkeypatch, capsys, args: list[str], out, big, memory: float, level: str, field: str) -> None:
    """`plan` of the deep profile ``big`` on GPUs of ``memory`` bytes, where only ``level`` fits: auto picks it and
    writes ``parallel.<field>``; with ``--<field> off`` (kept whole) nothing fits."""
    import moecompile.planner as planner
    from moecompile.cli import main

    monkeypatch.setattr(planner, "preset", lambda name, gpus=None: tiny_cluster(gpus, memory_gb=memory / 1e9))
    monkeypatch.setattr(planner, "profile_config", lambda *a, **k: big)
    assert main(args) == 0
    assert level in capsys.readouterr().out and getattr(mc.Plan.from_file(out).parallel, field)
    assert main(args + ["--" + field.replace("_", "-"), "off"]) == 1
    assert "no plan fits in memory" in capsys.readouterr().out


# --- plan.yaml round-trips through convert -------------------------------------------------------------


def test_written_plan_round_trips_through_convert(tmp_path, llama, ids):
    report = plan_for("tiny-llama", "h100", gpus=1, global_batch=4, seq_len=8, experts=MANY,
                      space=SearchSpace(expert_parallel=True, micro_batches=(1, 2)))
    path = tmp_path / "plan.yaml"
    plan = report.save(str(path))
    loaded = mc.Plan.from_file(path)
    assert loaded == plan == report.best.plan
    assert f"# micro-batch {report.best.candidate.micro_batch} of the 4 sequences per GPU" in path.read_text()
    result = mc.convert(llama, loaded, (ids,))
    assert result.plan == loaded
    assert result.module(ids).logits.shape == (2, 8, 128)
    assert "experts.w_gate_up" in "".join(n for n, _ in result.module.named_parameters())


def test_multi_gpu_plan_yaml_parses_back(tmp_path, tiny_profile):
    space = dataclasses.replace(EVERYTHING, recompute_sets=((),), fp8_recipes=("none",))
    report = _search(tiny_profile, tiny_cluster(16, memory_gb=1.0), 32, space)
    best = report.best
    assert best.candidate.ep > 1  # experts cost memory and compute: the planner spreads them
    path = tmp_path / "plan.yaml"
    report.save(str(path))
    assert mc.Plan.from_file(path) == best.plan


def test_cli_plan_writes_a_plan(tmp_path, capsys):
    from moecompile.cli import main

    out = tmp_path / "p.yaml"
    rc = main(["plan", "--model", "tiny-llama", "--experts", '{"num_experts": 64, "top_k": 2}', "--cluster", "h100",
               "--gpus", "1", "--global-batch", "2", "--seq-len", "8", "--micro-batches", "1", "--fp8", "none",
               "--explain", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and out.exists()
    assert "plans that fit" in text and "step time per rank" in text and "memory per rank" in text
    assert mc.Plan.from_file(out).experts.num_experts == 64


def test_cli_plan_names_a_bad_batch(capsys):
    from moecompile.cli import main

    rc = main(["plan", "--model", "tiny-llama", "--experts", '{"num_experts": 64, "top_k": 2}', "--gpus", "8",
               "--global-batch", "3", "--seq-len", "8", "--fp8", "none"])
    assert rc == 2
    assert "multiple of 8" in capsys.readouterr().err


# --- clusters ------------------------------------------------------------------------------------------


def test_presets_and_spans():
    h = preset("h100", 256)
    assert h.bf16_flops == pytest.approx(989.4e12) and h.fp8_flops == pytest.approx(2 * h.bf16_flops, rel=1e-3)
    assert h.span(8) == "intra" and h.span(16) == "inter" and h.span(1) == "local"
    assert h.peers_off_node(16) == 0.5 and h.peers_off_node(8) == 0.0
    g = preset("gb200", 256)
    assert g.span(64) == "intra" and g.memory_bytes > preset("h200").memory_bytes > h.memory_bytes
    for name in ("h100", "h200", "gb200"):
        assert preset(name).source
    with pytest.raises(MoecompileError, match="unknown cluster preset"):
        preset("a100")


def test_cpu_cluster_is_measured():
    from moecompile.planner.microbench import cluster_from, measure_rank

    torch.set_num_threads(1)
    c = cluster_from([measure_rank(1)], threads=1)
    assert c.bf16_flops > 1e8 and c.hbm_bandwidth > 1e8 and 0 < c.op_overhead_s < 1e-3
    assert "measured" in c.source


@pytest.mark.slow
@pytest.mark.distributed
def test_gloo_all_to_all_is_measured():
    from moecompile.planner.microbench import measure_cpu_cluster

    c = measure_cpu_cluster(world=2, threads=1, timeout_s=120)
    assert c.gpus == 2 and 0 < c.intra.bandwidth < float("inf") and c.intra.latency >= 0


def test_deepseek_v3_is_rebuilt_with_its_own_router():
    """The planner's DeepSeek-V3 routes as the model does: sigmoid in fp32, a selection bias, 4 of 8 groups, x2.5."""
    from moecompile.planner.arch import load_model_config, moe_arch

    arch = moe_arch(load_model_config("deepseek-v3"))
    assert arch.experts == {"num_experts": 256, "top_k": 8, "normalize": True, "score": "sigmoid",
                            "expert_bias": True, "router_dtype": "float32", "route_groups": 8, "route_group_top_k": 4,
                            "route_scale": 2.5, "shared_experts": 1}
    assert (arch.n_dense, arch.n_moe, arch.moe_intermediate) == (3, 58, 2048)
    mc.Plan.from_dict({"experts": arch.experts})  # a valid plan
