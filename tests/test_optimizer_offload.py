"""parallel.offload_optimizer: a share of the optimizer in host memory, stepped by the CPU.

The oracle is the same step without offload: the arithmetic is the same (fp32 masters, the same
optimizer implementation, chosen in the factory: foreach=False), so on CPU every loss and parameter
must match bit for bit, single-process and sharded over 2 ranks, and a checkpoint must move between
offloaded and not. Left to torch, the host part runs the fused CPU kernel instead.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.optim.optimizer import register_optimizer_step_post_hook

import moecompile as mc
from moecompile.data import ByteBatches, stdlib_bytes
from moecompile.models import build_model
from moecompile.optimizer_offload import HostUpdate, offloaded_count, offloaded_share

BATCH, SEQ, STEPS = 4, 16, 3


@pytest.fixture(scope="module")
def data() -> ByteBatches:
    return ByteBatches(stdlib_bytes(300_000), BATCH, SEQ, seed=0)


def grouped_adamw(params: list[torch.nn.Parameter], **implementation) -> torch.optim.Optimizer:
    """Two param groups (no decay on vectors); the for-loop implementation on both sides unless told otherwise."""
    vectors = [p for p in params if p.dim() < 2]
    matrices = [p for p in params if p.dim() >= 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                             lr=3e-3, **(implementation or {"foreach": False}))


def make_step(offload: float, dtype: str | None = None, world_size: int = 1, optimizer=grouped_adamw,
              **parallel) -> tuple[mc.ConversionResult, mc.TrainStep]:
    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=BATCH // world_size, seq_len=SEQ, dtype=dtype)
    plan = {"experts": {"num_experts": 4, "top_k": 2, "z_loss_coeff": 1e-3},
            "parallel": {"offload_optimizer": offload, **parallel}}
    result = mc.convert(dense, plan, (ids,))
    return result, mc.build_train_step(result, optimizer=optimizer, clip_grad_norm=1.0, bucket_mb=0.01)


def train(step: mc.TrainStep, data: ByteBatches, first: int, count: int) -> list[float]:
    return [step(data[i]).loss for i in range(first, first + count)]


def params(result: mc.ConversionResult) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in result.module.named_parameters()}


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=30), st.floats(0, 1))
def test_the_host_share_is_the_fewest_leading_tensors_that_reach_it(sizes, fraction):
    n = offloaded_count(sizes, fraction)
    assert sum(sizes[:n]) >= fraction * sum(sizes) - 1e-6 * sum(sizes)  # reached
    assert n == 0 or sum(sizes[: n - 1]) < fraction * sum(sizes)  # with no tensor to spare
    assert offloaded_share(sizes, fraction) >= fraction - 1e-9


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
@pytest.mark.parametrize("offload", [0.3, 1.0])
def test_offloaded_steps_equal_the_device_steps_bitwise(data, dtype, offload):
    plain_result, plain = make_step(0.0, dtype)
    result, step = make_step(offload, dtype)
    host = [u for u in step.updates if isinstance(u, HostUpdate)]
    assert 0 < len(host) <= len(step.updates) and (len(host) == len(step.updates)) == (offload == 1.0)
    for u in host:  # an fp32 master of its own, even where the parameter is fp32, with an fp32 gradient
        assert u.tensor is not u.shard.param and u.tensor.dtype == torch.float32 and u.tensor.grad is not None
    assert train(step, data, 0, STEPS) == train(plain, data, 0, STEPS)
    got, want = params(result), params(plain_result)
    assert all(torch.equal(got[n], want[n]) for n in want)
    # the offloaded elements' state, masters and master grads left the device's figure for the host's
    assert step.optimizer_bytes() < plain.optimizer_bytes()
    per_element = 8 + 4 + 4  # two fp32 moments, the master, its gradient
    assert step.host_optimizer_bytes() == per_element * sum(u.tensor.numel() for u in host)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_the_estimator_prices_what_the_runtime_keeps_on_each_side(data, dtype):
    result, step = make_step(0.3, dtype)
    train(step, data, 0, 1)  # the optimizer's state exists after a step
    est = mc.estimate_memory(result, by_pass=False)
    host = [u for u in step.updates if isinstance(u, HostUpdate)]
    assert est.offload_optimizer == sum(u.tensor.numel() for u in host) / sum(u.tensor.numel() for u in step.updates)
    assert est.host_optimizer == step.host_optimizer_bytes() > 0
    assert est.optimizer + est.masters == step.optimizer_bytes()
    device_master_grads = sum(u.tensor.grad.numel() * 4 for u in step.updates if u.is_copy and u not in host)
    assert est.master_grads == device_master_grads
    whole = mc.estimate_memory(result, by_pass=False, offload_optimizer=0.0)
    assert est.total < whole.total and est.host_optimizer >= (whole.optimizer + whole.masters) * 0.3
    assert "in host memory" in est.table()


def test_a_checkpoint_moves_between_offloaded_and_device_steps(data, tmp_path):
    _, step = make_step(0.5)
    train(step, data, 0, STEPS)
    step.save(tmp_path / "offloaded")
    continued = train(step, data, STEPS, STEPS)
    _, device = make_step(0.0)
    device.load(tmp_path / "offloaded")
    assert train(device, data, STEPS, STEPS) == continued  # and back: a device checkpoint into an offloaded step
    _, plain = make_step(0.0)
    train(plain, data, 0, STEPS)
    plain.save(tmp_path / "device")
    _, offloaded = make_step(1.0)
    offloaded.load(tmp_path / "device")
    assert train(offloaded, data, STEPS, STEPS) == train(plain, data, STEPS, STEPS)


def test_an_optimizer_that_reads_every_tensor_at_once_is_refused():
    with pytest.raises(mc.MoecompileError, match="LBFGS updates all parameters as one vector"):
        make_step(0.5, optimizer=lambda ps: torch.optim.LBFGS(ps))
    make_step(0.0, optimizer=lambda ps: torch.optim.LBFGS(ps))  # nothing offloaded: one part, as before


def test_step_hooks_run_once_a_step_over_all_the_tensors_as_without_offload(data, recwarn):
    """The two parts are two step()s inside; a hook, a global hook and a scheduler see one, over every tensor."""

    def hooked(offload: float) -> tuple[mc.TrainStep, list, dict]:
        _, step = make_step(offload)
        opt, calls, ema = step.optimizer, [], {}

        def seen(o: torch.optim.Optimizer) -> int:
            return sum(p.grad is not None for g in o.param_groups for p in g["params"])

        def decay(o: torch.optim.Optimizer, args, kwargs) -> None:  # an EMA of the weights, as a post-hook keeps one
            calls.append(("post", seen(o)))
            for p in (p for g in o.param_groups for p in g["params"]):
                k = id(p)
                ema[k] = p.detach().clone() if k not in ema else 0.9 * ema[k] + 0.1 * p.detach()

        handles = [opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", seen(o)))),
                   opt.register_step_post_hook(decay),
                   register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global", 0)))]
        schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        try:
            for i in range(STEPS):
                step(data[i])
                schedule.step()
        finally:
            for h in handles:
                h.remove()
        return step, calls, ema

    plain, plain_calls, plain_ema = hooked(0.0)
    offloaded, calls, ema = hooked(0.5)
    assert any(isinstance(u, HostUpdate) for u in offloaded.updates)
    assert calls == plain_calls == [("pre", len(plain.updates)), ("post", len(plain.updates)), ("global", 0)] * STEPS
    assert [torch.equal(a, b) for a, b in zip(ema.values(), plain_ema.values())] == [True] * len(plain_ema)
    assert [g["lr"] for g in offloaded.optimizer.param_groups] == [g["lr"] for g in plain.optimizer.param_groups]
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)]  # the scheduler saw the optimizer step


def test_a_share_outside_0_to_1_or_a_full_capture_is_a_plan_error():
    with pytest.raises(mc.PlanError, match="offload_optimizer.*from 0 .none. to 1 .all."):
        mc.Plan(parallel={"offload_optimizer": 1.5})
    with pytest.raises(mc.PlanError, match="cuda_graph.mode.*offload_optimizer runs part of it on the CPU"):
        mc.Plan(parallel={"offload_optimizer": 0.5, "dispatch_mode": "static", "capacity_factor": 1.25},
                cuda_graph={"mode": "full"})
    mc.Plan(parallel={"offload_optimizer": 0.5}, cuda_graph={"mode": "partial"})  # the optimizer runs eagerly there


def test_left_to_torch_every_part_on_a_cpu_runs_the_fused_cpu_kernel(data, monkeypatch):
    """The host part, and on a CPU device the device part too: torch would run its for-loop AdamW there."""
    import torch.optim.adam as adam

    calls = []
    fused = adam._fused_adam
    monkeypatch.setattr(adam, "_fused_adam", lambda params, *a, **k: calls.append(len(params)) or fused(params, *a, **k))
    torch_default = lambda ps: grouped_adamw(ps, foreach=None)  # noqa: E731  (fused, foreach: None)
    result, loop = make_step(0.0)  # the factory chose foreach=False: kept
    want = train(loop, data, 0, STEPS)
    assert not calls
    tensors = sum(1 for p in result.module.parameters() if p.requires_grad)
    for offload in (0.0, 0.5):
        _, step = make_step(offload, optimizer=torch_default)
        got = train(step, data, 0, STEPS)
        assert 0 < sum(isinstance(u, HostUpdate) for u in step.updates) < tensors or not offload
        assert sum(calls) == tensors * STEPS  # every tensor, each step: host part and CPU device part alike
        assert got == pytest.approx(want, rel=1e-5)  # fused rounds an ulp apart
        assert all(g["fused"] is None and g["foreach"] is None for g in step.optimizer.param_groups)  # restored
        calls.clear()


def offload_worker(rank: int, world_size: int) -> dict:
    """Two ranks, sharded (ZeRO-2 at ep=2 in bf16, ZeRO-3, ZeRO-1 gathering behind the next forward): each setting
    with and without offload."""
    from _shard_scenario import _whole_params

    out = {}
    stream = ByteBatches(stdlib_bytes(300_000), BATCH, SEQ, seed=0)
    for name, ep, dtype, extra in (("ep2_zero2_bf16", 2, "bfloat16", {"shard_gradients": True}),
                                   ("dp2_zero3", 1, None, {"shard_gradients": True, "shard_parameters": True}),
                                   ("dp2_zero1_gather_behind", 1, None, {"overlap_param_gather": True})):
        runs = {}
        for offload in (0.0, 0.6):
            result, step = make_step(offload, dtype, world_size, ep=ep, shard_optimizer=True, **extra)
            batches = [stream.shard(i, rank, world_size) for i in range(STEPS)]
            runs[offload] = {"losses": [step(b).loss for b in batches],
                             "params": _whole_params(step, result), "device": step.optimizer_bytes(),
                             "host": step.host_optimizer_bytes(),
                             "estimate": (lambda e: (e.host_optimizer, e.optimizer + e.masters))(
                                 mc.estimate_memory(result, by_pass=False, bucket_mb=0.01))}
        out[name] = runs
    return out


@pytest.mark.distributed
def test_two_sharded_ranks_offload_their_ranges_and_train_the_same():
    from _dist import spawn

    for r in spawn(offload_worker, 2, timeout=300):
        for name, runs in r.items():
            plain, offloaded = runs[0.0], runs[0.6]
            assert offloaded["losses"] == plain["losses"], name
            assert all(torch.equal(offloaded["params"][n], p) for n, p in plain["params"].items()), name
            assert offloaded["device"] < plain["device"] and plain["host"] == 0 < offloaded["host"], name
            # the estimator picks the host part from this rank's ranges, as the runtime does: host and device exact
            assert offloaded["estimate"] == (offloaded["host"], offloaded["device"]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_host_part_is_pinned_and_trains_as_the_device_does(data):
    def on_cuda(offload: float) -> tuple[mc.ConversionResult, mc.TrainStep]:
        dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=BATCH, seq_len=SEQ, dtype="bfloat16")
        dense = dense.cuda()
        plan = {"experts": {"num_experts": 4, "top_k": 2}, "parallel": {"offload_optimizer": offload}}
        result = mc.convert(dense, plan, (ids.cuda(),))
        return result, mc.build_train_step(result, optimizer=grouped_adamw, bucket_mb=0.01)

    (r0, plain), (r1, step) = on_cuda(0.0), on_cuda(0.5)
    host = [u for u in step.updates if isinstance(u, HostUpdate)]
    assert host and all(u.tensor.device.type == "cpu" and u.tensor.is_pinned() and u.grad_in.is_pinned()
                        and u.values_out.is_pinned() for u in host)
    for i in range(STEPS):
        x, y = (t.cuda() for t in data[i])
        a, b = plain(x, y), step(x, y)
        assert b.loss == pytest.approx(a.loss, rel=1e-3)  # CPU and CUDA AdamW round differently
    for (n, p), q in zip(r0.module.named_parameters(), r1.module.parameters()):
        torch.testing.assert_close(q.float(), p.float(), rtol=2e-2, atol=2e-3, msg=n)
    assert all(s["exp_avg"].device.type == "cpu" for u in host for s in [step.optimizer.state[u.tensor]])
    with pytest.raises(mc.PlanError, match="offload_optimizer runs part of it on the CPU"):  # the plan's rule
        mc.build_train_step(r1, optimizer=grouped_adamw, cuda_graph="full")
