"""planner/host_bench.py: the offloaded optimizer's CPU update measured on this host, and the planner priced from it
(``moecompile plan --host-efficiency F|measure``) instead of the assumed half of the DRAM spec."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from moecompile.errors import MoecompileError
from moecompile.planner import estimate, preset
from moecompile.planner.cluster import GB
from moecompile.planner.cost_model import host_update_bytes
from moecompile.planner.host_bench import HostRate, _update_rank, measure_host_update

from test_planner import tiny_cluster, tiny_profile  # noqa: F401 (a fixture)
from test_planner_offload import _cand


def test_the_bytes_an_update_moves_follow_the_dtypes():
    # fp32 master and 2 moments read + written (24 with fp32 moments), the fp32 gradient read (4)
    assert host_update_bytes(4, 4, 4) == 28
    # + a bf16 gradient cast into the fp32 one (2 + 4) and the new value cast out of the master (4 + 2)
    assert host_update_bytes(2, 2, 4) == 40
    # bf16 moments are moecompile.AdamW's: on the CPU the same fused pass, its moments 2 B each way (20 B)
    assert host_update_bytes(2, 2, 2) == 12 + 20


def test_the_update_timed_is_the_runtimes_host_path_with_the_fused_kernel(monkeypatch):
    import torch.optim.adam as adam

    calls = []
    fused = adam._fused_adam
    spy = lambda params, *a, **k: calls.append(len(params)) or fused(params, *a, **k)  # noqa: E731
    monkeypatch.setattr(adam, "_fused_adam", spy)
    seconds = _update_rank(0, 1, 4096, torch.bfloat16, torch.float32, repeats=2)
    assert seconds > 0 and calls == [1, 1, 1]  # one untimed run builds the state, then the timed ones


def test_a_measured_rate_sets_the_clusters_host_efficiency():
    rate = measure_host_update(2, elements=2**16, repeats=2, timeout_s=120)
    assert rate.processes == 2 and rate.elements == 2**16 and rate.seconds > 0 and rate.bytes_per_element == 40
    assert rate.bandwidth_per_gpu == pytest.approx(2**16 * 40 / rate.seconds)
    host = dataclasses.replace(preset("gb200", 72), host_bandwidth=10 * rate.bandwidth_per_gpu)  # 2 GPUs a host
    measured = rate.applied_to(host)
    assert measured.host_efficiency == pytest.approx(0.1)
    assert measured.host_stream_bandwidth == pytest.approx(rate.bandwidth_per_gpu)
    assert "2 processes" in rate.describe(host) and "0.10 of gb200" in rate.describe(host)


def _rate(gb_per_s: float, processes: int = 8) -> HostRate:
    return HostRate(processes, 2, 10**9, 40 / gb_per_s, 40, torch.bfloat16, torch.float32, "node (224 cores)")


def test_a_rate_from_another_kind_of_host_is_refused():
    h100 = preset("h100", 64)  # 8 GPUs a host, 76.8 GB/s of DRAM each
    assert _rate(30.0).applied_to(h100).host_efficiency == pytest.approx(30 / 76.8)
    with pytest.raises(MoecompileError, match="measured with 2 processes.*serves 8 GPUs.*processes=8"):
        _rate(30.0, processes=2).applied_to(h100)
    with pytest.raises(MoecompileError, match="more than 'h100'.s host DRAM spec.*not a host of that cluster"):
        _rate(100.0).applied_to(h100)
    with pytest.raises(MoecompileError, match="no host_bandwidth"):
        _rate(30.0).applied_to(dataclasses.replace(h100, host_bandwidth=0.0))


def test_the_offloaded_update_is_priced_at_the_host_efficiency(tiny_profile):
    cand = _cand(tiny_profile, 2, 1.0)
    times = {}
    for eff in (0.5, 0.25):
        cl = dataclasses.replace(tiny_cluster(8), host_efficiency=eff)
        term = next(t for t in estimate(tiny_profile, cl, cand, 8).terms if t.name == "optimizer offload")
        assert f"at {cl.host_stream_bandwidth / GB:.2f} GB/s" in term.detail
        times[eff] = term
    assert times[0.25].value > times[0.5].value > 0


def test_the_cli_takes_a_host_efficiency_or_measures_it(monkeypatch, capsys):
    from moecompile.commands import plan as cli

    h100 = preset("h100", 16)
    assert cli._with_host_efficiency(h100, None, "fp32") == h100
    assert cli._with_host_efficiency(h100, "0.25", "fp32").host_efficiency == 0.25
    for bad in ("1.5", "fast"):
        with pytest.raises(MoecompileError, match="host_efficiency|--host-efficiency"):
            cli._with_host_efficiency(h100, bad, "fp32")
    asked = {}

    def measured(processes: int, moment_dtype: torch.dtype, **_) -> HostRate:
        asked.update(processes=processes, moments=moment_dtype)
        return _rate(19.2, processes)

    monkeypatch.setattr("moecompile.planner.host_bench.measure_host_update", measured)
    out = cli._with_host_efficiency(h100, "measure", "bf16")
    assert asked == {"processes": 8, "moments": torch.bfloat16} and out.host_efficiency == pytest.approx(0.25)
    assert "19.20 GB/s per GPU" in capsys.readouterr().out
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert parser.parse_args(["--model", "m", "--global-batch", "8", "--seq-len", "16", "--host-efficiency",
                              "measure"]).host_efficiency == "measure"
