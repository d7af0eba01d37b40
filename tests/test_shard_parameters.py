"""ZeRO-3 (parallel.shard_parameters): the same training as unsharded, with a rank keeping a range of the parameters.

The oracle is the unsharded step on the same ranks, init and batches (tests/_shard_scenario.py).
"""

from __future__ import annotations

import pytest
import torch

import moecompile as mc
from test_shard_optimizer import _assert_same_training


def test_shard_parameters_needs_sharded_gradients_and_no_capture():
    with pytest.raises(mc.PlanError, match="shard_parameters.*shard_gradients: true"):
        mc.Plan.from_dict({"parallel": {"shard_optimizer": True, "shard_parameters": True}})
    zero3 = {"shard_optimizer": True, "shard_gradients": True, "shard_parameters": True}
    with pytest.raises(mc.PlanError, match="cuda_graph.mode.*shard_parameters"):
        mc.Plan.from_dict({"parallel": zero3, "cuda_graph": {"mode": "partial"}})
    assert mc.Plan.from_dict({"parallel": zero3}).parallel.shard_parameters


def test_one_process_keeps_its_parameters_whole():
    from moecompile.models import build_model

    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=2, seq_len=8)
    zero3 = {"shard_optimizer": True, "shard_gradients": True, "shard_parameters": True}
    result = mc.convert(dense, {"experts": {"num_experts": 4, "top_k": 2}, "parallel": zero3}, (ids,))
    step = mc.build_train_step(result)
    assert step.buckets.param_shards is None
    assert step.param_bytes() == sum(p.numel() * p.element_size() for p in result.module.parameters())
    assert "gather_bucket" not in result.module.code


@pytest.mark.distributed
@pytest.mark.parametrize("setting", ["dp2", "ep2_bf16", "dp2_micro", "dp2_recompute", "dp2_recompute_shared",
                                     "nccl_forms"])
def test_two_ranks_train_the_same_keeping_a_range_of_the_parameters(setting):
    from _shard_scenario import zero3_two_ranks

    _, ranks = zero3_two_ranks()
    for r in ranks:
        unsharded, sharded = r[setting][False], r[setting][True]
        _assert_same_training(unsharded, sharded)
        peak, whole = sharded["gathered_peak"], sharded["whole_bytes"]
        if setting.startswith("ep2"):  # edp=1: only the dense parameters split, two small buckets
            assert sharded["param_bytes"] < unsharded["param_bytes"] and 0 < peak <= whole
        else:  # half, up to the alignment of each parameter in its bucket
            assert sharded["param_bytes"] <= unsharded["param_bytes"] / 2 + 4096
            # gathered buckets never all alive at once: each is released after its last read, in forward and in
            # backward (2-3 of 6 here; gloo's worker thread may keep a finished broadcast's buffer a while longer)
            assert 0 < peak < whole, (peak, whole)
    if setting.endswith("micro"):
        assert ranks[0][setting][True]["micro_batches"] == 2


@pytest.mark.distributed
def test_a_compiled_zero3_step_with_recompute_trains_as_the_eager_one():
    from _shard_scenario import zero3_two_ranks

    _, ranks = zero3_two_ranks()
    for r in ranks:  # the run itself raised had dynamo hit a recompile limit
        eager = r["dp2_recompute"][True]["metrics"]
        for got, want in zip(r["compiled_recompute"], eager, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["load"] == want["load"]


@pytest.mark.distributed
def test_a_zero3_checkpoint_resumes_bitwise_and_a_later_step_takes_the_parameters_back():
    from _shard_scenario import zero3_two_ranks

    _, ranks = zero3_two_ranks()
    for r in ranks:
        assert r["resumed"] == r["continued"]
        assert r["taken_over"]  # a step built later on the module holds the gathered values, whole
        assert all(torch.isfinite(torch.tensor(m["loss"])) for m in r["after_takeover"])


@pytest.mark.distributed
def test_the_bucket_read_last_stays_whole_into_backward_not_gathered_again():
    from _shard_scenario import zero3_two_ranks

    _, ranks = zero3_two_ranks()
    for r in ranks:
        # one micro-batch: each bucket gathered for forward and again for backward, but the last one read
        assert r["gathers_a_step"] == 2 * r["buckets"] - 1
        assert r["whole_after_forward"] == [r["first_in_backward"]]
        assert r["whole_after_no_grad_forward"] == []


@pytest.mark.distributed
def test_the_module_state_dict_and_export_read_inside_gathered_only():
    from _shard_scenario import zero3_two_ranks

    _, ranks = zero3_two_ranks()
    for r in ranks:
        assert "step.gathered()" in r["state_dict_outside"] and "export_hf" in r["export_outside"]
        assert all(torch.isfinite(v).all() for v in r["state_dict"].values() if v.is_floating_point())
    for k, v in ranks[0]["state_dict"].items():  # the same whole parameters on both ranks
        torch.testing.assert_close(ranks[1]["state_dict"][k], v, rtol=0, atol=0, msg=k)


@pytest.mark.distributed
def test_a_zero3_checkpoint_loads_in_one_unsharded_process():
    from _shard_scenario import STEPS, _train, make_step, zero3_two_ranks

    out, ranks = zero3_two_ranks()
    _, step = make_step(1, 1, False)
    step.load(out / "ckpt")
    got = _train(step, 0, 1, STEPS, STEPS)
    for a, b in zip(got, ranks[0]["continued"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.distributed
def test_four_ranks_shard_expert_parameters_over_edp():
    from _shard_scenario import four_ranks

    for r in four_ranks():
        unsharded, sharded = r["ep2_zero3"][False], r["ep2_zero3"][True]
        _assert_same_training(unsharded, sharded)
        assert sharded["param_bytes"] < unsharded["param_bytes"] * 0.55  # dense / 4, experts / 2
