"""The memory estimator (fake tensors, nothing runs) against memory measured on a real CPU step."""

from __future__ import annotations

import pytest
import torch

import moecompile as mc
from moecompile.memory import CATEGORIES, measure_memory

from _dist import fake_rank
from conftest import tiny_hf

EXPERTS = {"num_experts": 4, "top_k": 2, "shared_experts": 1}


@pytest.fixture(scope="module")
def model():
    return tiny_hf("llama")


@pytest.fixture(scope="module")
def batch():
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))


def _measured(result, batch) -> int:
    return measure_memory(lambda: result.module(batch).logits, lambda out: out.float().sum().backward()).retained


def test_measure_memory_counts_what_forward_keeps():
    x = torch.randn(256, 256, requires_grad=True)  # 256 KiB, made before the measurement
    m = measure_memory(lambda: (x * 2).sin(), lambda y: y.sum().backward())
    assert 0 <= m.retained - 2 * 256 * 256 * 4 <= 64  # x * 2 (saved by sin) and the output (+ a wrapped scalar)
    assert m.peak >= m.retained and x.grad is not None


@pytest.mark.parametrize("plan", [
    {},
    {"fp8": {"recipe": "tensorwise"}},
    {"fp8": {"recipe": "blockwise", "block_size": 16}},
    {"recompute": {"modules": ["moe_act", "layernorm"]}},
    {"recompute": {"budget": 0.5}},
], ids=["baseline", "fp8-tensorwise", "fp8-blockwise", "recompute", "budget"])
def test_estimate_matches_measured_peak_activations(model, batch, plan):
    result = mc.convert(model, {"experts": EXPERTS, **plan}, (batch,))
    est = mc.estimate_memory(result, by_pass=False)
    measured = _measured(result, batch)
    assert abs(est.activations - measured) / measured < 0.15, (est.activations, measured)


def test_breakdown_adds_up(model, batch):
    result = mc.convert(model, {"experts": EXPERTS}, (batch,))
    est = mc.estimate_memory(result)
    assert set(est.by_category) <= set(CATEGORIES)
    assert sum(est.by_category.values()) == est.activations
    assert sum(sum(d.values()) for d in est.by_layer.values()) == est.activations
    for cat in ("attention", "router", "experts", "permutation", "layernorm"):
        assert est.by_layer["model.layers.0"].get(cat, 0) > 0, cat
    params = sum(p.numel() * p.element_size() for p in result.module.parameters())
    assert est.params == est.grads == params and est.optimizer == 2 * params  # AdamW: two states
    assert mc.estimate_memory(result, optimizer="sgd", by_pass=False).optimizer == 0
    with pytest.raises(mc.MoecompileError, match="optimizer"):
        mc.estimate_memory(result, optimizer="lion")
    text = str(est)
    assert "model.layers.1" in text and "after pass" in text


def test_by_pass_shows_what_each_pass_changed(model, batch):
    result = mc.convert(model, {"experts": EXPERTS, "recompute": {"modules": ["moe"]}}, (batch,))
    est = mc.estimate_memory(result)
    by = {p.name: p for p in est.by_pass}
    assert list(by) == [r.name for r in result.history]
    assert by["trace"].activations == by["find_ffn"].activations  # an analysis pass changes nothing
    assert by["upcycle"].activations > by["find_ffn"].activations  # k copies of every token
    assert by["upcycle"].params > by["find_ffn"].params
    assert by["recompute"].activations == est.activations < by["upcycle"].activations


def test_fp8_halves_expert_gemm_activations_vs_bf16(batch):
    """What the expert GEMMs keep for backward: the bf16 input rows, or their float8 copy."""
    model = tiny_hf("llama").to(torch.bfloat16)
    runs = {}
    for name, fp8 in (("bf16", {}), ("fp8", {"recipe": "tensorwise", "modules": ["experts"]})):
        result = mc.convert(model, {"experts": EXPERTS, "fp8": fp8}, (batch,))
        est = mc.estimate_memory(result, by_pass=False)
        gemms = {n.name for n in result.module.graph.nodes if n.op == "call_function"
                 and "moecompile" in str(n.target) and "grouped" in str(n.target)}
        kept = sum(t.nbytes for t in est.profile.tensors.values() if t.savers & gemms and t.nbytes > 64)
        runs[name] = (kept, est.activations)
    assert runs["fp8"][0] == runs["bf16"][0] // 2
    assert runs["fp8"][1] < runs["bf16"][1]


def test_other_batch_sizes(model, batch):
    static = mc.convert(model, {"experts": EXPERTS}, (batch,))
    assert mc.estimate_memory(static, batch=2, by_pass=False).activations == mc.estimate_memory(static, by_pass=False).activations
    with pytest.raises(mc.MoecompileError, match="dynamic=True"):
        mc.estimate_memory(static, batch=4, by_pass=False)
    dynamic = mc.convert(model, {"experts": EXPERTS}, (batch,), dynamic=True)
    two, four = (mc.estimate_memory(dynamic, batch=b, by_pass=False) for b in (2, 4))
    assert 1.8 < four.activations / two.activations <= 2.0  # per-token activations double; rotary tables don't
    measured = measure_memory(lambda: dynamic.module(batch.repeat(2, 1)).logits, lambda o: o.float().sum().backward())
    assert abs(four.activations - measured.retained) / measured.retained < 0.15


def test_optimizer_state_dtype_and_fp32_masters(batch):
    """bf16 parameters: build_train_step keeps fp32 masters (+ their grads) and AdamW's two states in fp32."""
    model = tiny_hf("llama").to(torch.bfloat16)
    result = mc.convert(model, {"experts": EXPERTS}, (batch,))
    n = sum(p.numel() for p in result.module.parameters() if p.requires_grad)
    est = mc.estimate_memory(result, by_pass=False)  # default: what build_train_step keeps
    assert est.params == 2 * n
    assert est.optimizer == 8 * n  # two fp32 states per parameter
    assert est.masters == 4 * n and est.grads == 2 * n + 4 * n  # bf16 grads + the masters' fp32 grads
    assert est.total == est.params + est.grads + est.optimizer + est.masters + est.buffers + est.activations
    step = mc.build_train_step(result)
    assert sum(p.numel() * p.element_size() for p in step.masters.values()) == est.masters
    plain = mc.estimate_memory(result, master_weights=False, by_pass=False)  # pure bf16 training
    assert plain.masters == 0 and plain.optimizer == 2 * 2 * n and plain.grads == 2 * n
    explicit = mc.estimate_memory(result, master_weights=False, state_dtype=torch.float32, by_pass=False)
    assert explicit.optimizer == 8 * n
    assert mc.estimate_memory(result, optimizer="sgd_momentum", by_pass=False).optimizer == 4 * n
    with pytest.raises(mc.MoecompileError, match="state_dtype"):
        mc.estimate_memory(result, state_dtype="fp32", by_pass=False)


def test_fp32_parameters_have_no_masters(model, batch):
    result = mc.convert(model, {"experts": EXPERTS}, (batch,))
    est = mc.estimate_memory(result, by_pass=False)
    assert est.masters == 0 and est.optimizer == 2 * est.grads
    assert mc.estimate_memory(result, state_dtype=torch.bfloat16, by_pass=False).optimizer == est.grads


def _fake_world(world_size: int, ep_step: bool = False):
    """This one process posing as rank 0 of ``world_size``: no live collectives."""
    with fake_rank(0, world_size, ep_step):
        yield


@pytest.fixture()
def fake_world():
    """Rank 0 of a fake 2-process world: convert per rank."""
    yield from _fake_world(2)


@pytest.mark.parametrize("mode", ["dropless", "static"])
def test_expert_parallel_estimate_is_per_rank(model, batch, fake_world, mode):
    experts = {**EXPERTS, **({"capacity_factor": 1.0} if mode == "static" else {})}
    one = mc.estimate_memory(mc.convert(model, {"experts": experts}, (batch,)), by_pass=False)
    result = mc.convert(model, {"experts": experts, "parallel": {"ep": 2, "dispatch_mode": mode}}, (batch,))
    two = mc.estimate_memory(result)
    assert one.expert_params > 0 and two.expert_params * 2 == one.expert_params  # E/ep local experts
    assert two.params - two.expert_params == one.params - one.expert_params  # dense part replicated
    assert two.grads == two.params and two.optimizer == 2 * two.params  # fp32 AdamW on the local shard
    # the dispatched rows the experts keep: as many per rank as one process keeps (balanced routing)
    assert abs(two.by_category["permutation"] - one.by_category["permutation"]) / one.by_category["permutation"] < 0.1
    assert abs(two.activations - one.activations) / one.activations < 0.1  # balanced: the same rows per rank
    assert [p.name for p in two.by_pass] == [r.name for r in result.history]
    assert all(p.activations is not None for p in two.by_pass)


# --- parallel.shard_optimizer (ZeRO-1): a rank keeps optimizer state for its range only -------------------


def _counts(result) -> tuple[int, int]:
    """(dense, expert) trainable parameter elements, by name."""
    named = dict(result.module.named_parameters())
    expert = sum(p.numel() for n, p in named.items() if ".experts.w_" in n or ".experts.b_" in n)
    return sum(p.numel() for p in named.values()) - expert, expert


def test_sharded_optimizer_is_this_ranks_range_of_a_single_process_graph(batch):
    """dp=4 estimates one rank of a 4-rank ep=1 run: AdamW states, fp32 masters and their grads / 4."""
    import dataclasses

    model = tiny_hf("llama").to(torch.bfloat16)
    result = mc.convert(model, {"experts": EXPERTS, "parallel": {"shard_optimizer": True}}, (batch,))
    dense, expert = _counts(result)
    assert expert == 2 * 4 * 3 * 32 * 64  # 2 layers x E=4 x (gate, up, down) x H x F
    n = dense + expert
    share = -(-dense // 4) + -(-expert // 4)  # ep=1: the experts' ranks are the data-parallel ones too
    est = mc.estimate_memory(result, by_pass=False, dp=4)
    assert (est.shard_optimizer, est.dp, est.edp) == (True, 4, 4)
    # rank 0's ranges: an even share of the elements but for the aligned cuts between ranks (exact against the
    # step in test_sharded_estimate_matches_what_the_training_step_keeps)
    assert est.params == 2 * n and est.optimizer == pytest.approx(8 * share, rel=0.01)
    assert est.masters == est.optimizer / 2 and est.master_grads == est.masters
    assert est.grads == 2 * n + est.masters  # the bf16 buckets stay whole; the masters' fp32 grads are the range
    assert "dp=4" in str(est)
    whole = mc.estimate_memory(result, by_pass=False)  # a single process: no world, dp = 1
    assert whole.dp == 1 and whole.optimizer == 8 * n and whole.masters == 4 * n and whole.grads == 6 * n
    off = mc.estimate_memory(result, by_pass=False, dp=4, shard_optimizer=False)  # the keyword wins
    assert off.optimizer == 8 * n and off.grads == 6 * n
    unsharded = dataclasses.replace(result, plan=result.plan.replace(parallel={"shard_optimizer": False}))
    assert mc.estimate_memory(unsharded, by_pass=False, dp=4).optimizer == 8 * n  # the plan's field by default
    assert mc.estimate_memory(unsharded, by_pass=False, dp=4, shard_optimizer=True).optimizer == est.optimizer
    with pytest.raises(mc.MoecompileError, match="dp=0"):
        mc.estimate_memory(result, by_pass=False, dp=0)


@pytest.fixture()
def fake_world4():
    """Rank 0 of a fake 4-process world (ep=2: ep groups {0,1} {2,3}, edp groups {0,2} {1,3})."""
    yield from _fake_world(4)


@pytest.fixture()
def fake_world4_step():
    """``fake_world4`` for a test that runs the expert-parallel training step."""
    yield from _fake_world(4, ep_step=True)


def test_sharded_optimizer_splits_dense_over_dp_and_experts_over_edp(model, batch, fake_world4):
    result = mc.convert(model, {"experts": EXPERTS, "parallel": {"ep": 2, "shard_optimizer": True}}, (batch,))
    dense, expert = _counts(result)  # this rank's E/ep = 2 experts
    assert expert == 2 * 2 * 3 * 32 * 64
    est = mc.estimate_memory(result, by_pass=False)
    assert (est.dp, est.edp) == (4, 2)  # from the result's world
    # two fp32 states, dense / 4, experts / 2 (rank 0's ranges: up to the aligned cuts)
    assert est.optimizer == pytest.approx(2 * 4 * (-(-dense // 4) + -(-expert // 2)), rel=0.01)
    assert est.masters == 0 and est.grads == est.params == 4 * (dense + expert)  # fp32: its own master
    whole = mc.estimate_memory(result, by_pass=False, shard_optimizer=False)
    assert whole.optimizer == 2 * 4 * (dense + expert)
    with pytest.raises(mc.MoecompileError, match="multiple of parallel.ep=2"):
        mc.estimate_memory(result, by_pass=False, dp=3)


def test_sharded_estimate_matches_what_the_training_step_keeps(batch, fake_world4_step):
    """build_train_step under the same 4-rank world: its optimizer states + fp32 masters, and the masters' grads."""
    model = tiny_hf("llama").to(torch.bfloat16)
    result = mc.convert(model, {"experts": EXPERTS, "parallel": {"ep": 2, "shard_optimizer": True}}, (batch,))
    est = mc.estimate_memory(result, by_pass=False)
    step = mc.build_train_step(result, keep_host_memory=False)
    step(batch, batch)  # AdamW builds its states in the first step (the fake group moves no data)
    kept = step.optimizer_bytes()
    master_grads = sum(u.tensor.grad.numel() * 4 for u in step.updates if u.is_copy)
    whole = mc.estimate_memory(result, by_pass=False, shard_optimizer=False)
    assert kept < 0.6 * (whole.optimizer + whole.masters)  # sharded for real
    # this rank's parts of the parameters, as the step's ranges cut them (each parameter 256 B-aligned in its bucket)
    assert (est.optimizer + est.masters, est.master_grads) == (kept, master_grads)


# --- parallel.shard_gradients (ZeRO-2): a rank keeps its range of the gradients, + whole buckets in flight --


def _padded(params, d: int) -> int:
    """Bytes of one bf16 bucket of ``params`` split over d ranks: each parameter 128-element (256 B) aligned,
    the bucket a whole number of aligned ranges (grad_sync's layout)."""
    end = sum(-(-p.numel() // 128) * 128 for p in params)
    return -(-end // (128 * d)) * 128 * d * 2


def test_sharded_gradients_are_this_ranks_range_of_a_single_process_graph(batch):
    """dp=4, ep=1: bf16 grads, masters' fp32 grads, AdamW states and masters all / 4; + the buckets in flight."""
    model = tiny_hf("llama").to(torch.bfloat16)
    plan = {"experts": EXPERTS, "parallel": {"shard_optimizer": True, "shard_gradients": True}}
    result = mc.convert(model, plan, (batch,))
    dense, expert = _counts(result)
    n, share = dense + expert, -(-dense // 4) + -(-expert // 4)
    named = dict(result.module.named_parameters())
    experts = [p for name, p in named.items() if ".experts.w_" in name]
    whole_dense = [p for name, p in named.items() if ".experts.w_" not in name]
    est = mc.estimate_memory(result, by_pass=False, dp=4)
    assert est.shard_gradients and est.master_grads == pytest.approx(4 * share, rel=0.01)
    assert est.optimizer == 2 * est.master_grads
    # both kinds fit one 25 MiB bucket each, which backward fills side by side (the head's gradient opens the
    # dense one first). No world on CPU: gloo. The expert bucket completes first, and its exchange receives E / 4
    D, E = _padded(whole_dense, 4), _padded(experts, 4)
    assert est.in_flight_grads == D + E + E // 4
    # NCCL leaves both reduce-scatters in flight: both received ranges are alive together
    nccl = mc.estimate_memory(result, by_pass=False, dp=4, backend="nccl")
    assert nccl.in_flight_grads == D + E + E // 4 + D // 4
    ranges = D // 4 + E // 4  # bf16, each bucket padded to whole ranges
    assert est.grads == ranges + est.in_flight_grads + est.master_grads
    assert "in flight" in str(est) and "all grads" in str(est)
    # 1-byte buckets: every parameter a bucket of its own, complete as its gradient arrives. gloo: one at a time
    # (the largest: the embedding or the head) and the range it receives; NCCL: up to 2 more in flight
    small = mc.estimate_memory(result, by_pass=False, dp=4, bucket_mb=2**-20)
    largest = max(_padded([p], 4) for p in named.values())
    assert small.in_flight_grads == largest + largest // 4
    small_nccl = mc.estimate_memory(result, by_pass=False, dp=4, bucket_mb=2**-20, backend="nccl").in_flight_grads
    assert small.in_flight_grads < small_nccl <= 3 * (largest + largest // 4)
    with pytest.raises(mc.MoecompileError, match="backend='mpi' unknown"):
        mc.estimate_memory(result, by_pass=False, dp=4, backend="mpi")
    assert small.grads - small.in_flight_grads == sum(_padded([p], 4) // 4 for p in named.values()) + small.master_grads
    # ZeRO-1 keeps the bf16 grads whole; so does a single process (no world: dp = 1, nothing to shard over)
    zero1 = mc.estimate_memory(result, by_pass=False, dp=4, shard_gradients=False)
    assert zero1.grads == 2 * n + zero1.master_grads and zero1.in_flight_grads == 0 and not zero1.shard_gradients
    assert zero1.master_grads == est.master_grads  # the ranges are ZeRO-1's
    single = mc.estimate_memory(result, by_pass=False)
    assert single.grads == 6 * n and single.in_flight_grads == 0
    # shard_optimizer=False turns ZeRO-2 off too; asking for shard_gradients without it names both
    off = mc.estimate_memory(result, by_pass=False, dp=4, shard_optimizer=False)
    assert off.grads == 6 * n and not off.shard_gradients
    with pytest.raises(mc.MoecompileError, match="shard_gradients=True needs shard_optimizer"):
        mc.estimate_memory(result, by_pass=False, dp=4, shard_optimizer=False, shard_gradients=True)
    import dataclasses

    zero1_plan = dataclasses.replace(result, plan=result.plan.replace(parallel={"shard_gradients": False}))
    assert mc.estimate_memory(zero1_plan, by_pass=False, dp=4).grads == zero1.grads  # the plan's field by default
    assert mc.estimate_memory(zero1_plan, by_pass=False, dp=4, shard_gradients=True).grads == est.grads


@pytest.mark.parametrize("bucket_mb", [0.01, 25.0])
def test_sharded_gradients_estimate_matches_what_the_training_step_keeps(batch, fake_world4_step, bucket_mb):
    """build_train_step under the 4-rank world (ep=2: dense grads / 4, expert grads / 2): GradBuckets.grad_bytes,
    and the most whole gradient buckets alive at once (GradientShards.peak_bytes), exactly."""
    model = tiny_hf("llama").to(torch.bfloat16)
    plan = {"experts": EXPERTS, "parallel": {"ep": 2, "shard_optimizer": True, "shard_gradients": True}}
    result = mc.convert(model, plan, (batch,))
    est = mc.estimate_memory(result, by_pass=False, bucket_mb=bucket_mb)
    zero1 = mc.estimate_memory(result, by_pass=False, shard_gradients=False)
    step = mc.build_train_step(result, keep_host_memory=False, bucket_mb=bucket_mb)
    for _ in range(3):  # the pool of bucket buffers settles over steps
        step(batch, batch)
    buckets = step.buckets.buckets
    assert step.buckets.grad_shards is not None and all(b.shards > 1 for b in buckets)
    # the same bucket layout, the same pool, gradients arriving in the graph's backward order
    largest = max(b.numel * 2 for b in buckets)
    assert est.in_flight_grads == step.buckets.grad_shards.peak_bytes > largest, (est.in_flight_grads, largest)
    ranges = sum(b.grad.numel() * b.grad.element_size() for b in buckets)
    mine = est.grads - est.master_grads  # the bf16 gradients this rank keeps
    assert mine - est.in_flight_grads == ranges  # the same layout, padding included
    kept = step.buckets.grad_bytes()
    assert kept == ranges  # between steps: the ranges only, every whole buffer back to the allocator
    whole = zero1.grads - zero1.master_grads
    assert kept < whole  # ZeRO-1 keeps every bucket whole between steps
    if bucket_mb > 1:  # two buckets of a tiny model: in flight at the peak they outweigh the savings, and the
        assert mine > whole  # estimate says so


# --- parallel.shard_parameters (ZeRO-3): a rank keeps its range of the parameters, + 2 whole buckets gathered --


def test_sharded_parameters_are_this_ranks_range_plus_the_buckets_gathered(batch, fake_world4_step):
    """4 ranks, ep=2 (dense / dp=4, experts / edp=2): bf16 params are the range + the buckets whole at once;
    grads, optimizer and masters are ZeRO-2's; without ZeRO-2 it is an error naming the fix."""
    import dataclasses

    model = tiny_hf("llama").to(torch.bfloat16)
    plan = {"experts": EXPERTS, "parallel": {"ep": 2, "shard_optimizer": True, "shard_gradients": True,
                                             "shard_parameters": True}}
    result = mc.convert(model, plan, (batch,))
    dense, expert = _counts(result)  # this rank's E/ep = 2 experts
    named = dict(result.module.named_parameters())
    experts = [p for name, p in named.items() if ".experts.w_" in name]
    whole_dense = [p for name, p in named.items() if ".experts.w_" not in name]
    z3 = mc.estimate_memory(result, by_pass=False)
    z2 = mc.estimate_memory(result, by_pass=False, shard_parameters=False)
    assert (z3.shard_parameters, z3.dp, z3.edp) == (True, 4, 2) and not z2.shard_parameters
    # one 25 MiB bucket per kind: the dense one is read from the first node to the last, so both are whole at once
    assert z3.in_flight_params == _padded(whole_dense, 4) + _padded(experts, 2)
    assert z3.params == _padded(whole_dense, 4) // 4 + _padded(experts, 2) // 2 + z3.in_flight_params
    assert z2.params == 2 * (dense + expert) and z2.in_flight_params == 0
    assert (z3.grads, z3.optimizer, z3.masters, z3.in_flight_grads) == (z2.grads, z2.optimizer, z2.masters,
                                                                         z2.in_flight_grads)
    assert z3.total - z2.total == z3.params - z2.params
    text = str(z3)
    assert "whole parameter buckets gathered (ZeRO-3)" in text and "params, optimizer, masters and all grads" in text
    # 1-byte buckets: every parameter a bucket of its own, whole from its first read to its last: a few at once
    small = mc.estimate_memory(result, by_pass=False, bucket_mb=2**-20)
    sizes = {n: _padded([p], 2 if ".experts.w_" in n else 4) for n, p in named.items()}
    assert max(sizes.values()) < small.in_flight_params < sum(sizes.values()) / 2
    ranges = sum(size // (2 if ".experts.w_" in n else 4) for n, size in sizes.items())
    assert small.params - small.in_flight_params == ranges and small.params < z2.params
    # the plan's field by default, only where the gradients are sharded; asked for without them: an error
    zero2_plan = dataclasses.replace(result, plan=result.plan.replace(parallel={"shard_parameters": False}))
    assert mc.estimate_memory(zero2_plan, by_pass=False).params == z2.params
    assert mc.estimate_memory(zero2_plan, by_pass=False, shard_parameters=True).params == z3.params
    zero1 = mc.estimate_memory(result, by_pass=False, shard_gradients=False)
    assert not zero1.shard_parameters and zero1.params == z2.params
    with pytest.raises(mc.MoecompileError, match="shard_parameters=True needs shard_gradients"):
        mc.estimate_memory(result, by_pass=False, shard_gradients=False, shard_parameters=True)
    with pytest.raises(mc.MoecompileError, match="shard_parameters=True needs shard_gradients"):
        mc.estimate_memory(result, by_pass=False, shard_optimizer=False, shard_parameters=True)


def test_sharded_parameters_change_nothing_on_one_rank(batch):
    """A single process (dp = 1): no bucket is split, so the parameters stay whole and none is gathered."""
    model = tiny_hf("llama").to(torch.bfloat16)
    plan = {"experts": EXPERTS, "parallel": {"shard_optimizer": True, "shard_gradients": True,
                                             "shard_parameters": True}}
    result = mc.convert(model, plan, (batch,))
    dense, expert = _counts(result)
    one = mc.estimate_memory(result, by_pass=False)
    assert one.shard_parameters and one.params == 2 * (dense + expert) and one.in_flight_params == 0
    four = mc.estimate_memory(result, by_pass=False, dp=4)  # one rank of a 4-rank ep=1 run
    named = dict(result.module.named_parameters())
    kinds = [[p for n, p in named.items() if (".experts.w_" in n) == x] for x in (False, True)]
    assert four.params == sum(_padded(ps, 4) // 4 for ps in kinds) + four.in_flight_params
    assert four.params > one.params  # a tiny model: its two whole buckets (one per kind) outweigh what the range saves
    assert mc.estimate_memory(result, by_pass=False, dp=4, bucket_mb=2**-10).params < one.params  # small ones don't


def _zero3_step(batch, bucket_mb: float):
    """A ZeRO-3 step of the bf16 tiny model (ep=2) under the fake 4-rank world, after two steps, and its estimate."""
    model = tiny_hf("llama").to(torch.bfloat16)
    plan = {"experts": EXPERTS, "parallel": {"ep": 2, "shard_optimizer": True, "shard_gradients": True,
                                             "shard_parameters": True}}
    result = mc.convert(model, plan, (batch,))
    est = mc.estimate_memory(result, by_pass=False, bucket_mb=bucket_mb)
    step = mc.build_train_step(result, keep_host_memory=False, bucket_mb=bucket_mb)
    for _ in range(2):
        step(batch, batch)
    return est, step


@pytest.mark.parametrize("bucket_mb", [0.01, 25.0])
def test_sharded_parameters_estimate_matches_what_the_training_step_keeps(batch, fake_world4_step, bucket_mb):
    """The parameter ranges a rank keeps between steps, exactly (the same bucket layout), and the most whole
    buckets it held at once in forward and backward (ParameterShards.peak_bytes), against the simulation."""
    est, step = _zero3_step(batch, bucket_mb)
    shards = step.buckets.param_shards
    assert est.params - est.in_flight_params == step.param_bytes()
    assert est.in_flight_params == shards.peak_bytes, (est.in_flight_params, shards.peak_bytes)
    # estimated again on the graph the step instrumented: its gather / release nodes pass the parameters on,
    # nothing is gathered for real (before, the fake run gathered every bucket and left them alive)
    gathers, peak = shards.gathers, shards.peak_bytes
    again = mc.estimate_memory(step.result, by_pass=False, bucket_mb=bucket_mb)
    assert (again.params, again.grads, again.activations) == (est.params, est.grads, est.activations)
    assert (shards.gathers, shards.peak_bytes, shards.whole) == (gathers, peak, {})
    # and costed the same: the nodes reading a gathered parameter see its shape (they counted 0 FLOPs before)
    from moecompile import costs

    flops = [costs.graph_costs(g).flops for g in (step.result.history[-1].graph, step.result.module.graph)]
    assert flops[0] == flops[1] > 0


def test_sharded_parameters_after_a_forward_only_the_buckets_held_stay_alive(batch, fake_world4_step):
    """Saved tensors hold handles, so a released bucket's memory goes, views of it read late included."""
    import gc

    _, step = _zero3_step(batch, 0.01)
    shards = step.buckets.param_shards
    step.buckets.prepare()
    with shards.saving():
        out = step.result.module(batch)
    gc.collect()
    held = [*shards.whole.values(), *(buffer for buffer, _ in shards.pending.values())]
    assert shards.alive_bytes() == sum(t.numel() * t.element_size() for t in held)
    out.logits.float().sum().backward()  # and backward gathers what it needs again
    assert all(p.grad is None for p in step.result.module.parameters() if p.requires_grad)  # in the buckets
