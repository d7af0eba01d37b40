"""Seeded random plans through every pass and runtime option (tests/_plan_fuzz.py). Run the tool with other
seeds to look for the next interaction bug, e.g. ``python tests/_plan_fuzz.py train 50 7``: the recompute,
offload, cost and capture-scan bugs of stop 41 were found that way, and stop 42's bf16 dedup crash, FP8 GEMMs
rounded to bf16 under autocast, and ZeRO-3 x recompute recompiling under ``compile=True``."""

from __future__ import annotations

import pytest

from _plan_fuzz import run


def test_random_plans_convert_and_every_inspection_tool_takes_them():
    assert run("inspect", 4, seed=84) == []


def test_random_upcycled_zoo_models_keep_their_oracles_under_memory_and_schedule_options():
    assert run("single", 6, seed=5) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_random_plans_train_like_one_process_per_rank():
    assert run("train", 8, seed=191) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_random_checkpoints_resume_at_random_layouts():
    assert run("resume", 4, seed=1) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_random_plans_replay_their_cuda_graph_runner_bitwise_on_emulated_graphs():
    assert run("graphs", 3, seed=31) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_random_plans_train_compiled_like_eager():
    assert run("compile", 3, seed=12) == []
