"""moecompile.AdamW: torch.optim.AdamW's update with its moments stored in bf16 (DeepSeek-V3's recipe).

Oracles: torch.optim.AdamW (fp32 moments: the same update to fp32 round-off), the update applied to a
whole tensor (elementwise: its halves updated apart are bitwise the same, what parallel.shard_optimizer
relies on), and the step's own checkpoint (resume is bitwise).
"""

from __future__ import annotations

import pytest
import torch

import moecompile as mc
from moecompile.data import ByteBatches, stdlib_bytes
from moecompile.models import build_model


def _trajectory(make, w0: torch.Tensor, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    p = torch.nn.Parameter(w0.clone())
    opt = make([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


@pytest.fixture(scope="module")
def problem() -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4096, generator=gen), [torch.randn(4096, generator=gen) for _ in range(30)]


def test_fp32_moments_are_torch_adamw(problem):
    w0, grads = problem
    ref, _ = _trajectory(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False), w0, grads)
    got, opt = _trajectory(lambda ps: mc.AdamW(ps, lr=1e-2, weight_decay=0.1, moment_dtype=torch.float32), w0, grads)
    assert (ref - w0).abs().max() > 0.1  # the weights moved
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    state = next(iter(opt.state.values()))
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32 and int(state["step"]) == 30


def test_bf16_moments_keep_half_the_state_and_follow_fp32(problem):
    w0, grads = problem
    ref, fp32 = _trajectory(lambda ps: mc.AdamW(ps, lr=1e-2, moment_dtype=torch.float32), w0, grads)
    got, bf16 = _trajectory(lambda ps: mc.AdamW(ps, lr=1e-2), w0, grads)
    moments = [next(iter(o.state.values())) for o in (fp32, bf16)]
    nbytes = [sum(s[k].numel() * s[k].element_size() for k in ("exp_avg", "exp_avg_sq")) for s in moments]
    assert moments[1]["exp_avg"].dtype == torch.bfloat16 and nbytes[1] * 2 == nbytes[0]
    # bf16's 8 mantissa bits round each stored moment by <= 2^-9 of it: the weights stay within a few lr of fp32's
    moved = (ref - w0).abs().max()
    assert 0 < (got - ref).abs().max() < 0.02 * moved


def test_the_update_is_elementwise_so_a_range_updates_alone(problem):
    """What parallel.shard_optimizer needs: the two halves of a tensor, updated by two optimizers, are bitwise
    the whole tensor's update (a bf16 parameter included: fp32 math, rounded once on write-back)."""
    w0, grads = problem
    for dtype in (torch.float32, torch.bfloat16):
        whole, _ = _trajectory(lambda ps: mc.AdamW(ps, lr=1e-2), w0.to(dtype), [g.to(dtype) for g in grads])
        halves = [_trajectory(lambda ps: mc.AdamW(ps, lr=1e-2), part.to(dtype), [g[sl].to(dtype) for g in grads])[0]
                  for sl, part in ((slice(0, 2048), w0[:2048]), (slice(2048, None), w0[2048:]))]
        assert torch.equal(torch.cat(halves), whole), dtype


@pytest.mark.parametrize("moments", [torch.bfloat16, torch.float32])
def test_the_host_body_is_torchs_fused_kernel_and_follows_the_reference(moments, monkeypatch):
    """On CPU tensors the update is torch's fused AdamW kernel, over CHUNK slices where moments (or value) are
    widened: several chunks here, cut at a point no vector width divides, is bitwise the whole tensor's update
    (shards update alone), and it follows the one-op-a-pass reference to fp32 round-off in its moments."""
    from moecompile.kernels import backend
    from moecompile.kernels.adamw import CHUNK

    gen = torch.Generator().manual_seed(1)
    n, cut = 2 * CHUNK + 77, CHUNK + 1001
    w0, grads = torch.randn(n, generator=gen), [torch.randn(n, generator=gen) for _ in range(3)]
    calls = []
    fused = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(a[0][0].numel()) or fused(*a, **k))
    make = lambda ps: mc.AdamW(ps, lr=1e-2, moment_dtype=moments)  # noqa: E731
    whole, opt = _trajectory(make, w0, grads)
    assert calls[:3] == ([CHUNK, CHUNK, 77] if moments == torch.bfloat16 else [n, n, n])
    parts = [_trajectory(make, w0[sl], [g[sl] for g in grads])[0] for sl in (slice(0, cut), slice(cut, None))]
    assert torch.equal(torch.cat(parts), whole)
    with backend.use("reference"):
        ref, ref_opt = _trajectory(make, w0, grads)
    torch.testing.assert_close(whole, ref, rtol=0, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq"):  # the same fp32 moment, rounded once: at most one ulp of the stored dtype
        got, want = next(iter(opt.state.values()))[key], next(iter(ref_opt.state.values()))[key]
        torch.testing.assert_close(got, want, rtol=torch.finfo(moments).eps, atol=1e-12)


def test_bad_arguments_are_clear_errors():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(mc.MoecompileError, match="moment_dtype=torch.int8 must be a floating"):
        mc.AdamW(p, moment_dtype=torch.int8)
    with pytest.raises(mc.MoecompileError, match="betas=\\(0.9, 1.0\\) in \\[0, 1\\)"):
        mc.AdamW(p, betas=(0.9, 1.0))


def test_a_sharded_step_takes_it():
    """parallel.shard_optimizer accepts it (elementwise): rank 0 of a fake 2-rank world keeps half the moments."""
    from test_memory import _fake_world

    world = _fake_world(2)
    next(world)
    try:
        dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=4, seq_len=16)
        result = mc.convert(dense, {"experts": {"num_experts": 4, "top_k": 2}, "parallel": {"shard_optimizer": True}},
                            (ids,))
        step = mc.build_train_step(result, optimizer=lambda ps: mc.AdamW(ps, lr=3e-3), keep_host_memory=False)
        step(ids, ids)
        moments = sum(p.numel() for p in result.module.parameters() if p.requires_grad) * 2 * 2  # 2 x bf16
        assert step.sharded and moments / 2 <= step.optimizer_bytes() < moments / 2 * 1.05  # + alignment padding
    finally:
        next(world, None)


def test_the_training_step_trains_and_resumes_bitwise_with_bf16_moments(tmp_path):
    """A step keeps half of torch AdamW's state with it, and its checkpoint resumes bitwise."""
    data = ByteBatches(stdlib_bytes(100_000), 4, 16, seed=0)

    def step_for(optimizer):
        dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=4, seq_len=16)
        torch.manual_seed(0)
        result = mc.convert(dense, {"experts": {"num_experts": 4, "top_k": 2}}, (ids,))
        return mc.build_train_step(result, optimizer=optimizer)

    step = step_for(lambda ps: mc.AdamW(ps, lr=3e-3))
    losses = [step(data[i]).loss for i in range(6)]
    assert losses[-1] < losses[0]
    plain = step_for(lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    plain(data[0])
    assert step.optimizer_bytes() * 2 == plain.optimizer_bytes()  # the moments (fp32 model: no masters)
    estimated = mc.estimate_memory(step.result, by_pass=False, state_dtype=torch.bfloat16)
    assert estimated.optimizer == step.optimizer_bytes()  # the estimator's state_dtype prices it
    step.save(tmp_path / "ckpt")
    continued = [step(data[i]).loss for i in range(6, 9)]
    again = step_for(lambda ps: mc.AdamW(ps, lr=3e-3))
    again.load(tmp_path / "ckpt")
    assert [again(data[i]).loss for i in range(6, 9)] == continued
