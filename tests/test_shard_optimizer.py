"""parallel.shard_optimizer (ZeRO-1): the same training as unsharded, optimizer memory / ranks, portable checkpoints."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moecompile as mc
from moecompile.checkpoint_shards import boxes, chunk_crcs, combine, crc32, crc32_combine, sharded
from moecompile.grad_sync import Shard
from moecompile.optimizer import build_optimizer, updates_for

# ---------------------------------------------------------------- chunks and checksums


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_boxes_tile_a_flat_range_in_order(shape, draw):
    n = math.prod(shape)
    lo = draw.draw(st.integers(0, n))
    hi = draw.draw(st.integers(lo, n))
    t = torch.arange(n).view(shape)
    seen = []
    for off, size, start in boxes(shape, lo, hi):
        box = t[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1).tolist()
        assert box == list(range(start, start + len(box)))  # each box is one contiguous run
        seen += box
    assert seen == list(range(lo, hi))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.binary(max_size=64))
def test_crc32_combine_is_the_crc_of_the_concatenation(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_a_tensor_split_over_ranks_has_the_checksum_of_the_whole():
    t = torch.randn(3, 4, 5)
    parts = [(0, 7), (7, 7), (7, 41), (41, 60)]  # an empty part, parts across rows and planes
    chunks = []
    for k in range(len(parts)):
        lo, hi = parts[k]
        s = sharded(t.reshape(-1)[lo:hi], t.shape, parts, k)
        chunks += chunk_crcs(s)
    assert combine(chunks) == crc32(t)
    assert combine(chunks[1:]) is None  # a missing run is not silently a checksum


# ---------------------------------------------------------------- the optimizer over shards


def _half_shards(params: dict[str, torch.nn.Parameter]) -> list[Shard]:
    """Rank 0's part of each parameter when it is split in two."""
    out = []
    for name, p in params.items():
        n = p.numel()
        out.append(Shard(name, p, 0, n // 2, torch.zeros(n // 2), ((0, n // 2), (n // 2, n)), 0))
    return out


def test_sharded_optimizer_keeps_the_factorys_groups_over_the_parts():
    params = {"w": torch.nn.Parameter(torch.randn(4, 6)), "b": torch.nn.Parameter(torch.randn(6))}
    updates = updates_for(_half_shards(params), masters=False)
    opt = build_optimizer(lambda ps: torch.optim.AdamW([{"params": [ps[0]], "weight_decay": 0.1},
                                                        {"params": [ps[1]], "weight_decay": 0.0}], lr=1e-3),
                          list(params.values()), updates, sharded=True)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [[tuple(t.shape) for t in g["params"]] for g in opt.param_groups] == [[(12,)], [(3,)]]
    before = params["w"].detach().clone().view(-1)
    with torch.no_grad():
        opt.param_groups[0]["params"][0].add_(1.0)  # a part shares its parameter's storage
    after = params["w"].detach().view(-1)
    assert torch.equal(after[:12], before[:12] + 1.0) and torch.equal(after[12:], before[12:])


def test_sharded_optimizer_refuses_one_that_is_not_elementwise():
    params = {"w": torch.nn.Parameter(torch.randn(4, 6))}
    updates = updates_for(_half_shards(params), masters=False)
    with pytest.raises(mc.MoecompileError, match="does not update element by element.*shard_optimizer: false"):
        build_optimizer(lambda ps: torch.optim.LBFGS(ps), list(params.values()), updates, sharded=True)
    sgd = build_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1), list(params.values()), updates, sharded=True)
    assert [t for g in sgd.param_groups for t in g["params"]] == [updates[0].tensor]


def test_adagrad_state_built_at_construction_is_built_again_over_the_parts():
    params = {"w": torch.nn.Parameter(torch.randn(4, 6))}
    updates = updates_for(_half_shards(params), masters=True)
    opt = build_optimizer(lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.5),
                          list(params.values()), updates, sharded=True)
    (state,) = opt.state.values()
    assert state["sum"].shape == (12,) and bool((state["sum"] == 0.5).all())


def test_one_process_ignores_shard_optimizer():
    from moecompile.models import build_model

    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=2, seq_len=8)
    result = mc.convert(dense, {"experts": {"num_experts": 4, "top_k": 2}, "parallel": {"shard_optimizer": True}},
                        (ids,))
    step = mc.build_train_step(result)
    assert not step.sharded and all(u.shard.whole for u in step.updates)


# ---------------------------------------------------------------- two and four ranks (spawned)


def _assert_same_training(unsharded: dict, sharded_: dict) -> None:
    for a, b in zip(unsharded["metrics"], sharded_["metrics"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)  # the norm sums in another order
        assert b["load"] == a["load"]
    for name, p in unsharded["params"].items():
        torch.testing.assert_close(sharded_["params"][name], p, rtol=1e-5, atol=1e-6, msg=name)
    assert sharded_["decay"] == unsharded["decay"] == [0.1, 0.0]
    assert sharded_["misaligned"] == []


@pytest.mark.distributed
@pytest.mark.parametrize("setting", ["dp2", "ep2", "dp2_bf16", "nccl_forms", "dp2_zero2_micro", "ep2_zero2_bf16",
                                     "nccl_forms_zero2_micro"])
def test_two_ranks_train_the_same_and_keep_half_the_optimizer(setting):
    from _shard_scenario import two_ranks

    _, ranks = two_ranks()
    for r in ranks:
        _assert_same_training(r[setting][False], r[setting][True])
    full = ranks[0][setting][False]["bytes"]
    assert full == ranks[1][setting][False]["bytes"]
    mine = [r[setting][True]["bytes"] for r in ranks]
    if setting.startswith("ep2"):  # experts are not replicated at ep=2 on 2 ranks (edp=1): only the dense state splits
        assert all(m < full for m in mine)
    else:
        assert sum(mine) == full and max(mine) <= full // 2 + 4096  # halves, up to one aligned run
    # a reduce-scatter and an all-gather per sharded bucket, in place of one all-reduce
    assert ranks[0][setting][True]["collectives"] > ranks[0][setting][False]["collectives"]
    # gloo reduce-scatters by an all-to-all exchange; NCCL (emulated here) by its own reduce_scatter
    assert (ranks[0][setting]["reduce_scatters"] > 0) == setting.startswith("nccl_forms")
    unsharded, sharded_ = ranks[0][setting][False], ranks[0][setting][True]
    if "micro" in setting:
        assert sharded_["micro_batches"] == unsharded["micro_batches"] == 2
    if "zero2" in setting and setting.startswith("ep2"):
        pass  # only the small dense part splits (edp=1): the buckets in flight outweigh it at this size
    elif "zero2" in setting:  # a rank keeps its range of the gradients and the buckets in flight, not all
        kept = unsharded["grad_bytes"] / 2 + sharded_["in_flight_peak"]
        assert sharded_["grad_bytes"] <= kept, (sharded_["grad_bytes"], unsharded["grad_bytes"])
    if "zero2" in setting:  # the estimator runs the runtime's pool over the graph's backward order: exactly its peak
        for r in ranks:
            assert r[setting][True]["in_flight_estimate"] == r[setting][True]["in_flight_peak"] > 0
    else:
        assert sharded_["grad_bytes"] >= unsharded["grad_bytes"]


@pytest.mark.distributed
def test_a_sharded_checkpoint_resumes_bitwise():
    from _shard_scenario import two_ranks

    _, ranks = two_ranks()
    for r in ranks:
        assert r["resumed"] == r["continued"]


@pytest.mark.distributed
def test_a_sharded_checkpoint_loads_in_one_unsharded_process():
    from _shard_scenario import one_process_from_checkpoint, two_ranks

    _, ranks = two_ranks()
    got = one_process_from_checkpoint()
    for a, b in zip(got, ranks[0]["continued"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.distributed
def test_four_ranks_shard_experts_over_edp_and_load_a_two_rank_checkpoint():
    from _shard_scenario import four_ranks, two_ranks

    _, two = two_ranks()
    ranks = four_ranks()
    for r in ranks:
        _assert_same_training(r["ep2"][False], r["ep2"][True])
        assert r["ep2"][True]["bytes"] < r["ep2"][False]["bytes"] * 0.6  # dense / 4, experts / 2
        assert r["loaded"][0]["loss"] == pytest.approx(two[0]["continued"][0]["loss"], rel=1e-5)


def test_sharded_gradients_need_the_sharded_optimizer():
    with pytest.raises(mc.PlanError, match="shard_gradients.*shard_optimizer: true"):
        mc.Plan.from_dict({"parallel": {"shard_gradients": True}})
    assert mc.Plan.from_dict({"parallel": {"shard_optimizer": True, "shard_gradients": True}}).parallel.shard_gradients


@pytest.mark.distributed
def test_a_second_step_on_the_same_module_takes_the_gradient_hooks_over():
    from _shard_scenario import rebuilt_worker
    from _dist import spawn

    for r in spawn(rebuilt_worker, 2, timeout=200):
        assert r[True] == pytest.approx(r[False], rel=1e-6) and len(r[True]) == 3
