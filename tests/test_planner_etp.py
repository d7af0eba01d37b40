"""The planner and expert tensor parallelism (``parallel.etp``): where it is enumerated, the graph it is
priced on (every expert traced in its slices), and a search that picks it where nothing else fits."""

from __future__ import annotations

import dataclasses

import pytest

import moecompile as mc
from moecompile.errors import MoecompileError
from moecompile.planner import Candidate, SearchSpace, estimate, plan_for, preset, profile_config, profile_result
from moecompile.planner.cost_model import static_memory
from moecompile.planner.search import expert_groups, search

EIGHT = {"num_experts": 8, "top_k": 2}
# one graph variant per etp: no recompute / FP8 variants, no sharding or offload to fit by other means
NARROW = SearchSpace(expert_parallel=True, recompute_sets=((),), fp8_recipes=("none",), micro_batches=(1,),
                     shard_optimizer=(False,), offload_optimizer=False, overlap_chunks=(), etps=(1, 2))


@pytest.fixture(scope="module")
def profiles():
    return {Q: profile_config("tiny-llama", seq_len=8, experts=EIGHT, sections={"parallel": {"etp": Q}} if Q > 1
                              else None) for Q in (1, 2)}


def _cand(ep: int, etp: int = 1, **parallel) -> Candidate:
    return Candidate(mc.Plan.from_dict({"experts": EIGHT, "parallel": {"ep": ep, "etp": etp, **parallel}}))


def test_etp_is_tried_only_where_ep_alone_cannot_spread_the_experts():
    pairs, skipped = expert_groups(8, 16, (1, 2, 4, 8))
    assert sorted(p for p in pairs if p[1] > 1) == [(2, 8), (4, 4), (8, 2)]
    assert {p for p in pairs if p[1] == 1} == {(1, 1), (2, 1), (4, 1), (8, 1)}
    assert "6 ep x etp pairs (etp 2, 4, 8): ep x etp is a legal ep there" in "\n".join(skipped)
    assert any(s.startswith("ep=1 x etp=2, ep=2 x etp=2: ep x etp is a legal ep there") and
               "sending each routed row once" in s for s in expert_groups(8, 4, (1, 2))[1])
    assert "ep=16: more ranks than the 8 experts" in skipped
    # 6 experts on 4 GPUs: ep=4 does not divide them, ep=2 x etp=2 spreads them over all 4
    assert (2, 2) in expert_groups(6, 4, (1, 2))[0]
    # a converted graph's etp is pinned (etp 1 not tried): then nothing dominates it
    assert expert_groups(8, 8, (2,))[0] == [(1, 2), (2, 2), (4, 2)]


def test_the_sliced_profile_routes_etp_times_the_rows_for_the_same_flops(profiles):
    whole, sliced = profiles[1], profiles[2]
    assert (whole.etp, sliced.etp) == (1, 2)
    (w_moe,), (s_moe,) = ([lp for lp in p.layers if lp.kind == "moe"] for p in (whole, sliced))
    assert s_moe.dispatch_bytes == 2 * w_moe.dispatch_bytes  # each routed row to both slices of its expert
    assert s_moe.row_weight_bytes == 2 * w_moe.row_weight_bytes
    assert s_moe.flops == w_moe.flops  # half-width GEMMs over twice the rows
    assert s_moe.expert_params == w_moe.expert_params and sliced.expert_params == whole.expert_params
    assert s_moe.activation_bytes > w_moe.activation_bytes  # the routed rows kept for backward, twice


def test_etp_spreads_the_experts_like_ep_and_pays_in_bytes(profiles):
    cluster = preset("h100", 8)
    ep8 = estimate(profiles[1], cluster, _cand(8), global_batch=8)
    ep4_etp2 = estimate(profiles[2], cluster, _cand(4, 2), global_batch=8)
    mem = {e.candidate.describe(): {t.name: t.value for t in e.memory} for e in (ep8, ep4_etp2)}
    assert mem["ep=8 alltoall dropless mb=1"]["params"] == mem["ep=4 etp=2 alltoall dropless mb=1"]["params"]
    assert ep4_etp2.term("dispatch+combine") > ep8.term("dispatch+combine")
    assert "each routed row sent to its expert's 2 slices" in next(t.detail for t in ep4_etp2.terms
                                                                     if t.name == "dispatch+combine")
    ep4 = estimate(profiles[1], cluster, _cand(4), global_batch=8)
    assert mem["ep=4 etp=2 alltoall dropless mb=1"]["params"] < {t.name: t.value for t in ep4.memory}["params"]
    with pytest.raises(MoecompileError, match=r"traced with experts in 1 slice\(s\), the candidate has parallel.etp=2"):
        estimate(profiles[1], cluster, _cand(4, 2), global_batch=8)


def test_the_search_cuts_experts_into_slices_when_only_that_fits(profiles, tmp_path):
    cluster = preset("h100", 16)
    need = {ranks: static_memory(profiles[1], _cand(ranks), 16) for ranks in (8,)}
    need[16] = static_memory(profiles[2], _cand(8, 2), 16)
    assert need[16] < need[8]
    usable = (need[8] + need[16]) / 2 + profiles[2].activation_bytes  # room for ep x etp = 16's, not ep = 8's
    cluster = dataclasses.replace(cluster, memory_bytes=usable / cluster.usable_memory_fraction)

    def profile_for(cand):
        return profiles[cand.etp]

    report = search(profile_for, EIGHT, cluster, 16, NARROW, baseline=profiles[1])
    assert report.ranked and all(e.candidate.expert_ranks == 16 for e in report.ranked)
    best = report.best
    assert (best.candidate.ep, best.candidate.etp) == (8, 2)
    assert any(e.candidate.ep == 8 and e.candidate.etp == 1 for e, _ in report.rejected)
    path = tmp_path / "plan.yaml"
    report.save(str(path))
    loaded = mc.Plan.from_file(path)
    assert (loaded.parallel.ep, loaded.parallel.etp) == (8, 2) and loaded == best.plan


def test_cli_plan_tries_the_etp_it_is_given(tmp_path, capsys):
    from moecompile.cli import main

    out = tmp_path / "p.yaml"
    args = ["plan", "--model", "tiny-llama", "--experts", '{"num_experts": 8, "top_k": 2}', "--gpus", "16",
            "--global-batch", "16", "--seq-len", "8", "--micro-batches", "1", "--fp8", "none", "--shard-optimizer",
            "off", "--offload-optimizer", "off"]
    assert main(args + ["--etp", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert " etp=2 " in text and mc.Plan.from_file(out).parallel.etp == 2
    assert main(args + ["--etp", "1,0"]) == 2
    assert "--etp 1,0: give sizes >= 1" in capsys.readouterr().err


def test_a_converted_etp_graph_is_priced_at_its_own_etp():
    from moecompile.models import build_model
    from moecompile.passes.ep_slices import slices_pass

    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=2, seq_len=8)
    result = mc.convert(dense, {"experts": EIGHT}, (ids,), passes=[slices_pass(2)])
    prof = profile_result(result)
    assert prof.etp == 2 and prof.expert_params == profile_result(mc.convert(dense, {"experts": EIGHT}, (ids,))
                                                                  ).expert_params
    report = plan_for(result, "h100", gpus=4, global_batch=8,
                      space=dataclasses.replace(NARROW, etps=(1, 2, 4)))
    assert report.ranked and {e.candidate.etp for e in report.ranked} == {2}
    assert {e.candidate.ep for e in report.ranked} == {1, 2}
