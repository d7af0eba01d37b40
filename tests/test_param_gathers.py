"""parallel.overlap_param_gather: ZeRO-1/2's all-gather after the optimizer left running into the next forward.

The oracle is the same sharded step without the overlap, on the same ranks, init and batches: the same
collectives waited for later, so every loss, norm and parameter is bitwise the same
(tests/_param_gather_scenario.py).
"""

from __future__ import annotations

import pytest
import torch

import moecompile as mc

SETTINGS = ["zero1", "zero1_bf16", "zero2_micro", "nccl_forms_zero2"]


def test_overlap_param_gather_needs_a_sharded_optimizer_no_zero3_and_no_capture():
    with pytest.raises(mc.PlanError, match="overlap_param_gather.*shard_optimizer: true"):
        mc.Plan.from_dict({"parallel": {"overlap_param_gather": True}})
    zero3 = {"shard_optimizer": True, "shard_gradients": True, "shard_parameters": True}
    with pytest.raises(mc.PlanError, match="overlap_param_gather.*no all-gather after the optimizer"):
        mc.Plan.from_dict({"parallel": {**zero3, "overlap_param_gather": True}})
    zero1 = {"shard_optimizer": True, "overlap_param_gather": True}
    with pytest.raises(mc.PlanError, match="cuda_graph.mode.*overlap_param_gather"):
        mc.Plan.from_dict({"parallel": zero1, "cuda_graph": {"mode": "full"}})
    assert mc.Plan.from_dict({"parallel": zero1}).parallel.overlap_param_gather


def test_one_process_has_nothing_to_gather():
    from moecompile.models import build_model

    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=2, seq_len=8)
    plan = {"experts": {"num_experts": 4, "top_k": 2}, "parallel": {"shard_optimizer": True,
                                                                    "overlap_param_gather": True}}
    result = mc.convert(dense, plan, (ids,))
    step = mc.build_train_step(result)
    assert step.buckets.param_gathers is None
    assert "wait_for_bucket" not in result.module.code


@pytest.mark.distributed
@pytest.mark.parametrize("setting", SETTINGS)
def test_two_ranks_train_bitwise_the_same_with_the_gather_left_running(setting):
    from _param_gather_scenario import overlap_two_ranks

    _, ranks = overlap_two_ranks()
    for r in ranks:
        waited, overlapped = r[setting][False], r[setting][True]
        assert overlapped["metrics"] == waited["metrics"]
        for name, p in waited["params"].items():
            assert torch.equal(overlapped["params"][name], p), name
        # the step returned with every sharded bucket's all-gather still running; reading them waited for all
        assert overlapped["running"] == list(range(len(overlapped["buckets"]))) and overlapped["buckets"]
        assert overlapped["running_after"] == []
        # each bucket is waited for before any node reads one of its parameters
        assert overlapped["misplaced"] == []


@pytest.mark.distributed
def test_reads_outside_the_step_wait_and_a_checkpoint_resumes_bitwise():
    from _param_gather_scenario import overlap_two_ranks

    _, ranks = overlap_two_ranks()
    for r in ranks:
        torch.testing.assert_close(r["eval", True], r["eval", False], rtol=0, atol=0)
        assert r["running_after_eval"] == []  # the graph's wait nodes waited for every bucket
        assert r["running_before_state_dict"] and r["running_after_state_dict"] == []
        assert r["resumed"] == r["continued"]


@pytest.mark.distributed
def test_a_later_step_replaces_the_wait_nodes_and_export_and_load_state_dict_wait():
    from _param_gather_scenario import overlap_two_ranks

    _, ranks = overlap_two_ranks()
    for r in ranks:
        assert r["waits_after_takeover"] == r["new_key_waits"] == r["new_buckets"] > 0
        assert r["after_takeover"][0]["loss"] > 0
        # export and load_state_dict wait for the gathers the later step left running
        assert r["running_before_export"] and r["running_after_export"] == []
        assert r["running_before_load_state_dict"] and r["running_after_load_state_dict"] == []
