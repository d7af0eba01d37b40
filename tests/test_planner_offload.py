"""The planner with parallel.offload_optimizer: the offloaded share's optimizer memory moves to the host, its
update crosses PCIe and runs on the CPU beside the device's; a plan that does not fit otherwise gets the least
share that makes it fit; ``moecompile plan --offload-optimizer``."""

from __future__ import annotations

import dataclasses

import pytest

import moecompile as mc
from moecompile.errors import MoecompileError
from moecompile.planner import Candidate, SearchSpace, estimate
from moecompile.planner.cost_model import HOST_TERM, host_bytes_per_element, optimizer_params, static_memory
from moecompile.planner.search import OFFLOAD_STEP, offloaded

from test_planner import MANY, _search, tiny_cluster, tiny_profile  # noqa: F401 (a fixture)

SPACE = SearchSpace(expert_parallel=True, micro_batches=(1,), shard_optimizer=(False,))


def _cand(profile, ep: int = 1, offload: float = 0.0, **parallel) -> Candidate:
    plan = mc.Plan.from_dict({"experts": profile.plan.experts.to_dict(),
                              "parallel": {"ep": ep, "offload_optimizer": offload, **parallel}})
    return Candidate(plan)


def _mem(est) -> dict:
    return {t.name: t.value for t in est.memory}


def test_the_offloaded_share_of_the_optimizer_moves_to_the_host(tiny_profile):
    cl = tiny_cluster(8)
    whole, half, alls = (estimate(tiny_profile, cl, _cand(tiny_profile, 2, f), 8) for f in (0.0, 0.5, 1.0))
    owned = optimizer_params(tiny_profile, whole.candidate, 8)
    assert _mem(half)["optimizer"] == pytest.approx(_mem(whole)["optimizer"] / 2) and _mem(alls)["optimizer"] == 0
    # bf16: an fp32 master 4 + its grad 4 + AdamW 8 + the pinned bf16 gradient and value 2 + 2
    assert host_bytes_per_element(tiny_profile, half.candidate) == 20
    assert half.host_bytes == pytest.approx(owned / 2 * 20) and whole.host_bytes == 0
    assert half.memory_bytes == pytest.approx(whole.memory_bytes - _mem(whole)["optimizer"] / 2)  # the host's not counted
    assert not next(t for t in half.memory if t.name == HOST_TERM).counted
    # time: the device updates the rest; the host path (PCIe down, CPU AdamW, PCIe up) is paid beyond it
    assert alls.term("optimizer") == 0 < half.term("optimizer") < whole.term("optimizer")
    assert whole.term("optimizer offload") == 0 < half.term("optimizer offload") < alls.term("optimizer offload")
    assert alls.step_s > half.step_s > whole.step_s
    assert "offload 50%" in half.candidate.describe()
    from moecompile.planner.explain import explain

    text = explain(half)
    assert "CPU AdamW" in text and "= host" in text and "(not counted)" in text


def _tight(profile, gpus: int) -> float:
    """GPU bytes where ep=gpus alltoall dropless fits with 60 % of its optimizer offloaded, not with 55 %."""
    cl = tiny_cluster(gpus)
    need = [estimate(profile, cl, _cand(profile, gpus, f), gpus).memory_bytes for f in (0.55, 0.6)]
    return (need[0] + need[1]) / 2 / cl.usable_memory_fraction


def test_the_search_offloads_the_least_share_that_fits(tiny_profile):
    cl = dataclasses.replace(tiny_cluster(8), memory_bytes=_tight(tiny_profile, 8))
    report = _search(tiny_profile, cl, 8, SPACE)
    reference = _cand(tiny_profile, 8).describe()  # ep=8 alltoall dropless
    assert {e.candidate.offload for e in report.ranked if e.candidate.describe().startswith(reference[:-5])} == {0.6}
    for e in report.ranked:  # and each plan the least it needs: one step less does not fit
        assert e.fits and e.candidate.offload > 0
        less = e.candidate.offload - OFFLOAD_STEP
        plan = e.candidate.plan.replace(parallel=dataclasses.replace(e.candidate.plan.parallel, offload_optimizer=less))
        assert not estimate(report.profile, cl, dataclasses.replace(e.candidate, plan=plan), 8).fits
    assert "offload 60%" in report.table()
    with pytest.raises(MoecompileError, match="no plan"):  # without it nothing fits
        _search(tiny_profile, cl, 8, dataclasses.replace(SPACE, offload_optimizer=False)).best
    roomy = _search(tiny_profile, tiny_cluster(8), 8, SPACE)
    assert not any(e.candidate.offload for e in roomy.ranked)  # where the GPU holds it, nothing is offloaded


def test_offload_needs_host_memory_to_offload_to(tiny_profile):
    tight = _tight(tiny_profile, 8)
    no_host = dataclasses.replace(tiny_cluster(8), memory_bytes=tight, host_memory_bytes=0.0)
    assert not no_host.can_offload
    report = _search(tiny_profile, no_host, 8, SPACE)
    with pytest.raises(MoecompileError, match="no plan"):
        report.best
    assert any("never offloaded" in n for n in report.notes)
    est = estimate(tiny_profile, tiny_cluster(8), _cand(tiny_profile, 8, 1.0), 8)
    small_host = dataclasses.replace(tiny_cluster(8), host_memory_bytes=est.host_bytes / 2)
    est = dataclasses.replace(est, cluster=small_host)
    assert not est.fits and "of host memory per GPU" in est.misfit_reason()
    full = estimate(tiny_profile, dataclasses.replace(tiny_cluster(8), memory_bytes=tight), _cand(tiny_profile, 8), 8)
    assert offloaded(dataclasses.replace(full, cluster=dataclasses.replace(full.cluster, host_memory_bytes=1.0)),
                     tiny_profile, 8) is None
    # the static bound the search prunes with leaves the optimizer out where it may be offloaded
    c = _cand(tiny_profile, 8)
    assert static_memory(tiny_profile, c, 8, offloadable=True) == pytest.approx(
        static_memory(tiny_profile, c, 8) - _mem(estimate(tiny_profile, tiny_cluster(8), c, 8))["optimizer"])


def test_a_full_capture_is_never_offloaded(tiny_profile):
    base = {"cuda_graph": {"mode": "full"}, "parallel": {"dispatch_mode": "static", "capacity_factor": 1.25}}
    cl = dataclasses.replace(tiny_cluster(8), memory_bytes=_tight(tiny_profile, 8))
    from moecompile.planner import search

    space = dataclasses.replace(SPACE, dispatch_modes=("static",), capacity_factors=(1.25,))
    report = search(lambda cand: tiny_profile, tiny_profile.plan.experts.to_dict(), cl, 8, space, base=base)
    assert not any(e.candidate.offload for e in report.ranked)


def test_cli_plan_writes_the_share_and_it_trains(tmp_path, capsys, monkeypatch, tiny_profile):
    import moecompile.planner as planner
    from moecompile.cli import main
    from moecompile.models import build_model

    memory = _tight(tiny_profile, 8)
    monkeypatch.setattr(planner, "preset", lambda name, gpus=None: tiny_cluster(gpus, memory_gb=memory / 1e9))
    monkeypatch.setattr(planner, "profile_config", lambda *a, **k: tiny_profile)
    out = tmp_path / "p.yaml"
    args = ["plan", "--model", "tiny-llama", "--experts", '{"num_experts": 64, "top_k": 2}', "--gpus", "8",
            "--global-batch", "8", "--seq-len", "8", "--micro-batches", "1", "--fp8", "none",
            "--shard-optimizer", "off", "--explain", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "offload" in text and "CPU AdamW" in text
    plan = mc.Plan.from_file(out)
    assert plan.parallel.offload_optimizer > 0 and "offload_optimizer:" in out.read_text()
    assert main(args[:-2] + ["--offload-optimizer", "off"]) == 1 and "no plan fits" in capsys.readouterr().out
    # the written plan converts and trains on one process (ep folded to 1: one rank holds every expert)
    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=1, seq_len=8)
    plan = plan.replace(parallel=dataclasses.replace(plan.parallel, ep=1, dispatcher="alltoall",
                                                     dispatch_mode="dropless", capacity_factor=None))
    result = mc.convert(dense, plan, (ids,))
    step = mc.build_train_step(result)
    step(ids, ids)
    assert step.host_optimizer_bytes() > 0


@pytest.mark.slow
def test_qwen3_235b_on_64_h100s_fits_only_with_the_optimizer_offloaded():
    """The README's example: nothing fits on the GPUs alone; with offload the best plan fits both memories."""
    from moecompile.planner import plan_for

    report = plan_for("qwen3-235b-a22b", "h100", gpus=64, global_batch=256, seq_len=4096)
    best = report.best
    assert best.candidate.offload > 0 and best.fits and 0 < best.host_bytes <= report.cluster.usable_host_memory
    assert best.term("optimizer offload") > 0
    # the share is the least that fits: one step less keeps OFFLOAD_STEP more of the optimizer on the GPU
    whole = _mem(best)["optimizer"] / (1 - best.candidate.offload)
    assert best.memory_bytes + OFFLOAD_STEP * whole > report.cluster.usable_memory
