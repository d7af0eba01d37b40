"""parallel.overlap_grad_reduce: each gradient bucket's collective launched from backward once it is complete.

The oracle is the same step summing every bucket after backward, on the same ranks, init and batches: the same
collectives on the same buffers, so every loss, norm and parameter is bitwise the same
(tests/_grad_overlap_scenario.py).
"""

from __future__ import annotations

import re

import pytest
import torch

import moecompile as mc

SETTINGS = ["dp2", "ep2", "dp2_micro", "zero1", "nccl_forms_zero1_micro", "dp2_unused", "zero2_micro"]


def test_overlap_grad_reduce_is_the_backends_choice_by_default():
    assert mc.Plan().parallel.overlap_grad_reduce is None  # on with NCCL, off with gloo (see the field's doc)
    assert not mc.Plan.from_dict({"parallel": {"overlap_grad_reduce": False}}).parallel.overlap_grad_reduce


@pytest.mark.distributed
def test_on_gloo_the_default_sums_after_backward():
    from _grad_overlap_scenario import grad_overlap_two_ranks

    assert not any(r["default_overlaps"] for r in grad_overlap_two_ranks())


@pytest.mark.distributed
@pytest.mark.parametrize("setting", SETTINGS)
def test_two_ranks_train_bitwise_the_same_reducing_from_backward(setting):
    from _grad_overlap_scenario import grad_overlap_two_ranks

    for r in grad_overlap_two_ranks():
        after, during = r[setting][False], r[setting][True]
        assert during["metrics"] == after["metrics"]
        for name, p in after["params"].items():
            assert torch.equal(during["params"][name], p), name
        assert after["reduced"] is None
        if setting.startswith("zero"):  # gloo's ZeRO-1 reduce-scatter is a blocking exchange: it stays after
            assert during["reduced"] is None  # backward; ZeRO-2 reduce-scatters from backward either way
            continue
        assert during["reduced"] > 0
        # buckets launched by the end of each micro-batch's backward: none before the last; in the last, every
        # bucket (or, with a parameter backward never reaches, all before its bucket)
        *earlier, last = during["launched"]
        assert earlier == [0] * (during["micro_batches"] - 1)
        if setting.endswith("unused"):
            assert 0 < last < during["reduced"]
        else:
            assert last == during["reduced"]
    if setting.endswith("micro"):  # whatever a step that raised midway left behind, the next one starts clean
        assert grad_overlap_two_ranks()[0][setting][True]["micro_batches"] == 2


FAULT_TIMEOUT_S = 5.0


def _a_peer_dies_before_the_step(rank: int, world_size: int, parallel: dict) -> dict:
    """Rank 1 builds the step, then dies; rank 0's step must end in a DistributedError naming the collective."""
    import os
    import time

    from _shard_scenario import make_step

    _, step = make_step(world_size, 1, False, **parallel, timeout_s=FAULT_TIMEOUT_S)
    if rank == 1:
        os._exit(3)
    from _ep_scenario import data

    start = time.monotonic()
    try:
        step(data().shard(0, rank, world_size))
    except mc.DistributedError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    raise AssertionError("rank 0 finished a step its data-parallel peer never joined")


@pytest.mark.distributed
@pytest.mark.parametrize("parallel, collective", [({}, "gradient sum"),
                                                  ({"shard_optimizer": True, "shard_gradients": True},
                                                   "gradient reduce-scatter")])
def test_a_dead_peer_ends_the_step_in_an_error_naming_the_bucket(parallel, collective):
    from _dist import spawn

    got = spawn(_a_peer_dies_before_the_step, 2, args=(parallel,), timeout=120, may_exit=(1,))[0]
    assert f"{collective} '" in got["error"] and "bucket of" in got["error"], got
    assert re.search(r"on process group 'e?dp' \(c10d name .*ranks \[0, 1\]", got["error"]), got
    assert "failed on rank 0" in got["error"] and "A peer rank raised, died" in got["error"], got
    assert got["seconds"] < FAULT_TIMEOUT_S + 10, got  # bounded by parallel.timeout_s, never a hang
