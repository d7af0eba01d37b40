"""The planner with parallel.shard_parameters (ZeRO-3, "zero3"): a rank's range of the parameters plus the whole
buckets gathered at once, two all-gathers per bucket a micro-batch; searched where the gradients are sharded, chosen only
when memory needs it; ``moecompile plan --shard-parameters``. (ZeRO-1/2 are tested in test_planner.py.)"""

from __future__ import annotations

import dataclasses

import pytest

import moecompile as mc
from moecompile.errors import MoecompileError
from moecompile.planner import Candidate, SearchSpace, enumerate_candidates, estimate
from moecompile.planner.search import TIE, _rank_key

from test_planner import MANY, _deep, only_sharding_fits, tiny_cluster, tiny_profile  # noqa: F401 (a fixture)

SPACE = SearchSpace(expert_parallel=True, micro_batches=(1,), offload_optimizer=False)


def _zero(profile, ep: int, level: int, **kw) -> Candidate:
    """ep and ZeRO ``level`` (0: unsharded, 1: optimizer, 2: + gradients, 3: + parameters)."""
    par = {"ep": ep, "shard_optimizer": level >= 1, "shard_gradients": level >= 2, "shard_parameters": level >= 3}
    return Candidate(mc.Plan.from_dict({"experts": profile.plan.experts.to_dict(), "parallel": par}), **kw)


def _mem(est) -> dict:
    return {t.name: t.value for t in est.memory}


def test_sharded_parameters_are_the_ranks_range_plus_the_buckets_gathered(tiny_profile):
    """bf16 params 2 B: dense / dp, experts / edp, + the most whole buckets gathered at once, the runtime's gather /
    release order over the model's parameter layout (planner/whole_buckets.py)."""
    from moecompile.planner.cost_model import gathered_bytes, static_memory

    D, X = tiny_profile.dense_params, tiny_profile.expert_params
    cl, MiB = tiny_cluster(8), 2**20
    z2, z3 = (_mem(estimate(tiny_profile, cl, _zero(tiny_profile, 2, level), 8)) for level in (2, 3))
    # ep=2 on 8 GPUs: dp=8, edp=4; one bucket per kind: the dense one is read from the embedding to the head, so
    # it is whole while the experts' is (up to the alignment padding)
    gathered = gathered_bytes(tiny_profile, _zero(tiny_profile, 2, 3), 8)
    assert gathered == pytest.approx(D * 2 + X, rel=0.01)
    assert z2["params"] == (D + X / 2) * 2
    assert z3["params"] == pytest.approx((D / 8 + X / 2 / 4) * 2 + gathered)
    assert (z3["grads"], z3["optimizer"], z3["activations"]) == (z2["grads"], z2["optimizer"], z2["activations"])
    # ep=8 on 8 GPUs: experts have no replica (edp=1): they stay whole, and only the dense bucket is gathered
    full_ep = _mem(estimate(tiny_profile, cl, _zero(tiny_profile, 8, 3), 8))
    gathered_ep = gathered_bytes(tiny_profile, _zero(tiny_profile, 8, 3), 8)
    assert gathered_ep == pytest.approx(D * 2, rel=0.05)
    assert full_ep["params"] == pytest.approx((D / 8 + X / 8) * 2 + gathered_ep)
    # past the bucket size the range saves: 2000 MoE layers (D, X ~ 10 M, 786 M elements), 25 MiB buckets
    big = _deep(tiny_profile, 1000)
    Db, Xb = big.dense_params, big.expert_params
    z2b, z3b = (_mem(estimate(big, cl, _zero(big, 1, level), 8)) for level in (2, 3))
    gathered_b = gathered_bytes(big, _zero(big, 1, 3), 8)
    assert 25 * MiB < gathered_b <= 3 * 25 * MiB
    assert z3b["params"] == pytest.approx((Db + Xb) / 8 * 2 + gathered_b)
    assert z2b["params"] - z3b["params"] > 1e9
    assert (static_memory(big, _zero(big, 1, 2), 8) - static_memory(big, _zero(big, 1, 3), 8)
            == pytest.approx(z2b["params"] - z3b["params"]))
    est = estimate(big, cl, _zero(big, 1, 3), 8)
    assert "zero3" in est.candidate.describe() and "zero2" not in est.candidate.describe()
    params = next(t.detail for t in est.memory if t.name == "params")
    assert "whole buckets gathered" in params and "at the peak" in params and "its range (zero3)" in params


def test_sharded_parameters_gather_twice_per_micro_batch(tiny_profile):
    """m micro-batches: m reduce-scatters of the gradients and 2m all-gathers of the parameters (ZeRO-2: m + 1)."""
    cl = tiny_cluster(16)
    for ep in (1, 2, 16):
        for mb in (1, 2, 4):  # 4 sequences per GPU: m = 4, 2, 1
            m = 4 // mb
            z2, z3 = (estimate(tiny_profile, cl, _zero(tiny_profile, ep, level, micro_batch=mb), 64) for level in (2, 3))
            for name in ("forward", "backward", "optimizer"):
                assert z3.term(name) == z2.term(name), name
            # bf16 grads and params: ZeRO-2's sync less one pass is ZeRO-3's; the gathers are 2m such passes
            one_pass = z2.term("gradient sync") - z3.term("gradient sync")
            latency = z3.term("gradient sync") - m * one_pass
            assert one_pass > 0 and latency >= 0
            assert z3.term("parameter gather") == pytest.approx(2 * m * one_pass + latency)
            assert z3.step_s > z2.step_s  # never faster: chosen for memory only
            assert f"(x{2 * m})" in next(t.detail for t in z3.terms if t.name == "parameter gather")
            assert "no all-gather after the step" in next(t.detail for t in z3.terms if t.name == "gradient sync")
            assert z2.term("parameter gather") == 0


def test_enumerator_tries_zero3_only_where_the_gradients_are_sharded():
    cands, _ = enumerate_candidates(MANY, tiny_cluster(1), 2, SPACE)
    assert cands and not any(c.shard_parameters for c in cands)  # one GPU: nothing to shard over
    cands, _ = enumerate_candidates(MANY, tiny_cluster(8), 8, SPACE)
    zero3 = [c for c in cands if c.shard_parameters]
    assert zero3 and all(c.zero == "zero3" and c.shard_gradients and c.distributed_optimizer for c in zero3)
    assert len(zero3) == len([c for c in cands if c.zero == "zero2"])  # one zero3 twin per zero2 plan
    no3, _ = enumerate_candidates(MANY, tiny_cluster(8), 8, dataclasses.replace(SPACE, shard_parameters=(False,)))
    assert len(no3) == len(cands) - len(zero3) and not any(c.shard_parameters for c in no3)
    no2, _ = enumerate_candidates(MANY, tiny_cluster(8), 8, dataclasses.replace(SPACE, shard_gradients=(False,)))
    assert not any(c.shard_parameters for c in no2)
    # a base plan that captures CUDA graphs rules zero3 out (its hooks would not replay), with the reason
    base = {"cuda_graph": {"mode": "partial"}}
    captured, skipped = enumerate_candidates(MANY, tiny_cluster(8), 8, SPACE, base)
    assert not any(c.shard_parameters for c in captured) and any(c.zero == "zero2" for c in captured)
    assert any(s.startswith("zero3: ") and "cuda_graph" in s for s in skipped)


def _zero3_memory(big, gpus: int) -> float:
    """GPU bytes between the smallest zero3 plan (fits) and the smallest zero2 one (does not)."""
    z3, z2 = (min(estimate(big, tiny_cluster(gpus), _zero(big, ep, level), gpus).memory_bytes for ep in (1, 2, 4, 8))
              for level in (3, 2))
    assert z3 < z2
    return (z2 + z3) / 2 / tiny_cluster(gpus).usable_memory_fraction


def _search(profile, cluster, global_batch, space):
    from moecompile.planner import search

    return search(lambda cand: profile, profile.plan.experts.to_dict(), cluster, global_batch, space)


def test_the_search_shards_the_parameters_only_when_that_fits(tiny_profile):
    big = _deep(tiny_profile, 10000)
    cl = dataclasses.replace(tiny_cluster(8), memory_bytes=_zero3_memory(big, 8))
    report = _search(big, cl, 8, SPACE)
    assert report.ranked and all(e.candidate.zero == "zero3" for e in report.ranked)
    assert "zero3" in report.table()
    assert any(e.candidate.zero == "zero2" for e, _ in report.rejected)
    with pytest.raises(MoecompileError, match="no plan"):  # without it nothing fits
        _search(big, cl, 8, dataclasses.replace(SPACE, shard_parameters=(False,))).best
    # room for zero2: zero3's gathers make it slower, so it is not chosen
    roomy = _search(big, tiny_cluster(8, memory_gb=1e4), 8, SPACE)
    assert roomy.best.candidate.zero != "zero3"
    assert any(e.candidate.zero == "zero3" for e in roomy.ranked)  # it fits, it is just slower
    # on a tie the less sharded plan ranks first: unsharded < zero1 < zero2 < zero3
    ests = [estimate(big, tiny_cluster(8), _zero(big, 4, level), 8) for level in (3, 2, 1, 0)]
    ordered = sorted([dataclasses.replace(e, step_s=ests[0].step_s) for e in ests], key=_rank_key)
    assert [e.candidate.zero for e in ordered] == ["", "zero1", "zero2", "zero3"]
    faster = dataclasses.replace(ests[0], step_s=ests[1].step_s / (1 + 3 * TIE))
    assert sorted([ests[1], faster], key=_rank_key)[0] is faster  # beyond the tie, the faster one


def test_cli_plan_shard_parameters(tmp_path, capsys, monkeypatch, tiny_profile):
    """--shard-parameters on writes all three fields; on with either of the others off is refused; auto chooses
    it where only it fits; off then fits nothing."""
    import moecompile.planner as planner
    from moecompile.cli import main

    out = tmp_path / "p.yaml"
    args = ["plan", "--model", "tiny-llama", "--experts", '{"num_experts": 64, "top_k": 2}', "--gpus", "8",
            "--global-batch", "8", "--seq-len", "8", "--micro-batches", "1", "--fp8", "none", "--offload-optimizer", "off",
            "--out", str(out)]
    monkeypatch.setattr(planner, "profile_config", lambda *a, **k: tiny_profile)
    assert main(args + ["--shard-parameters", "on"]) == 0
    assert "zero3" in capsys.readouterr().out
    loaded = mc.Plan.from_file(out)
    assert loaded.parallel.shard_parameters and loaded.parallel.shard_gradients and loaded.parallel.shard_optimizer
    assert "shard_parameters: true" in out.read_text() and mc.Plan.from_dict(loaded.to_dict()) == loaded
    for other in ("--shard-gradients", "--shard-optimizer"):
        assert main(args + ["--shard-parameters", "on", other, "off"]) == 2
        assert "--shard-parameters on needs the sharded optimizer and gradients" in capsys.readouterr().err
    assert main(args) == 0 and not mc.Plan.from_file(out).parallel.shard_parameters  # roomy: zero3 is slower
    big = _deep(tiny_profile, 10000)  # auto: a deep model on GPUs where only zero3 fits
    only_sharding_fits(monkeypatch, capsys, args, out, big, _zero3_memory(big, 8), "zero3", "shard_parameters")
