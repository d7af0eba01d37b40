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


# each kind against its oracle on 4 gloo ranks: training like one process per rank, a checkpoint resumed at another
# layout, the plan's CUDA-graph runner bitwise on emulated graphs, compile=True like eager
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("kind, n, seed", [("train", 8, 191), ("resume", 4, 1), ("graphs", 3, 31), ("compile", 3, 12)])
def test_random_plans_keep_their_oracle_on_four_ranks(kind, n, seed):
    assert run(kind, n, seed=seed) == []
