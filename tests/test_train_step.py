"""build_train_step: one call = forward, losses, backward, bucketed sync, clip, optimizer, expert bias, metrics."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import moecompile as mc
from moecompile.data import ByteBatches, stdlib_bytes
from moecompile.models import build_model

BATCH, SEQ = 4, 16


@pytest.fixture(scope="module")
def data() -> ByteBatches:
    return ByteBatches(stdlib_bytes(300_000), BATCH, SEQ, seed=0)


def convert(experts: dict, dtype: str | None = None, **plan) -> tuple[torch.nn.Module, mc.ConversionResult]:
    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=BATCH, seq_len=SEQ, dtype=dtype)
    return dense, mc.convert(dense, {"experts": {"num_experts": 4, "top_k": 2, **experts}, **plan}, (ids,))


def adamw(ps):
    return torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01)


def test_steps_lower_the_loss_and_report_metrics(data):
    _, result = convert({"aux_loss": "aux", "z_loss_coeff": 1e-3, "router_noise": 0.01})
    step = mc.build_train_step(result, optimizer=adamw)
    metrics = [step(data[i]) for i in range(20)]
    first, last = metrics[0], metrics[-1]
    assert sum(m.loss for m in metrics[-3:]) / 3 < first.loss - 0.7, [round(m.loss, 3) for m in metrics]
    assert set(last.router_losses) == {"aux_loss", "z_loss"}
    layers = 2  # router_losses are per-layer means; the loss sums the layers, weighted
    assert last.loss == pytest.approx(last.lm_loss + layers * (0.01 * last.router_losses["aux_loss"]
                                                               + 1e-3 * last.router_losses["z_loss"]), rel=1e-5)
    assert last.tokens == BATCH * SEQ and last.tokens_per_s > 0
    assert set(last.expert_load) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert all(sum(load) == BATCH * SEQ * 2 for load in last.expert_load.values())  # every token twice (top-2)
    assert all(1.0 <= b <= 2.0 for b in last.load_balance().values())  # max/mean: 4 experts, top-2
    assert step.step_count == 20


def test_step_equals_the_hand_written_loop(data):
    """Gradients live in bucket views; the result must be the plain loop's, bit for bit on CPU."""
    _, a = convert({"aux_loss": "aux", "router_noise": 0.01})
    _, b = convert({"aux_loss": "aux", "router_noise": 0.01})
    step = mc.build_train_step(a, optimizer=adamw, bucket_mb=0.01)  # tiny buckets: several of them
    assert len(step.buckets.buckets) > 2
    # adamw leaves the implementation to torch, so on a CPU the step runs the fused kernel (torch: the for-loop)
    opt = torch.optim.AdamW(list(b.module.parameters()), lr=3e-3, weight_decay=0.01, fused=True)
    for i in range(3):
        x, y = data[i]
        got = step(x, y)
        logits = b.module(x).logits
        loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)) + b.router_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert got.loss == loss.item()
    for (name, p), q in zip(a.module.named_parameters(), b.module.parameters()):
        assert torch.equal(p, q), name


def test_clipping_uses_the_global_norm(data):
    _, a = convert({})
    _, b = convert({})
    step = mc.build_train_step(a, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), clip_grad_norm=0.05)
    x, y = data[0]
    m = step(x, y)
    loss = F.cross_entropy(b.module(x).logits.reshape(-1, 256), y.reshape(-1))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(b.module.parameters(), 0.05)
    assert m.grad_norm == pytest.approx(norm.item(), rel=1e-5) and m.grad_norm > 0.05
    with torch.no_grad():
        for p in b.module.parameters():
            p -= 0.1 * p.grad
    for (name, p), q in zip(a.module.named_parameters(), b.module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


def test_expert_bias_moves_against_the_load(data):
    _, result = convert({"expert_bias": True, "expert_bias_rate": 0.01})
    step = mc.build_train_step(result, optimizer=adamw)
    assert set(step.biases) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    m = step(data[0])
    for layer, bias in step.biases.items():
        load = torch.tensor(m.expert_load[layer], dtype=torch.float32)
        torch.testing.assert_close(bias, 0.01 * torch.sign(load.mean() - load))
    before = {k: v.clone() for k, v in step.biases.items()}
    step(data[1])
    assert any(not torch.equal(before[k], v) for k, v in step.biases.items())


def test_bf16_autocast_keeps_fp32_master_weights(data):
    _, a = convert({})
    _, b = convert({})
    fp32 = mc.build_train_step(a, optimizer=adamw)
    bf16 = mc.build_train_step(b, optimizer=adamw, precision="bf16")
    for i in range(3):
        m32, m16 = fp32(data[i]), bf16(data[i])
        assert abs(m32.loss - m16.loss) < 0.05, (m32.loss, m16.loss)
    assert all(p.dtype == torch.float32 for p in b.module.parameters())
    assert not bf16.masters


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-deepseek-v3"])
def test_bf16_autocast_runs_models_that_upcast_inside(name, data):
    """Qwen3's q/k norms and DeepSeek-V3's MLA call .to(float32) on a linear's output; export asserted that output
    fp32 as traced, and under autocast (the CUDA default for an fp32 model) the step failed on the bf16 one."""
    from moecompile.models import load_config, own_experts

    def step(precision: str) -> mc.TrainStep:
        dense, (ids,) = build_model(name, vocab_size=256, batch_size=BATCH, seq_len=SEQ)
        plan = {"experts": own_experts(load_config(name)) or {"num_experts": 4, "top_k": 2}}
        return mc.build_train_step(mc.convert(dense, plan, (ids,)), optimizer=adamw, precision=precision)

    fp32, bf16 = step("fp32"), step("bf16")
    for i in range(2):
        m32, m16 = fp32(data[i]), bf16(data[i])
        assert abs(m32.loss - m16.loss) < 0.05, (m32.loss, m16.loss)


def test_bf16_autocast_casts_the_tokens_before_the_permute(data):
    """The permute copies each token k times and the dispatch sends the copies: under autocast they are bf16, as
    the expert GEMM would cast them anyway (before, fp32 rows were gathered, sent, then cast)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "moecompile":
                self.seen.setdefault(func.__name__.split(".")[0], args[0].dtype)
            return func(*args, **(kwargs or {}))

    _, result = convert({})
    step = mc.build_train_step(result, optimizer=adamw, precision="bf16")
    with step._autocast(), Dtypes() as mode:
        result.module(data[0][0])
    assert mode.seen["permute"] == torch.bfloat16 and mode.seen["grouped_mm"] == torch.bfloat16, mode.seen


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_evaluate_is_the_steps_loss_without_the_update(data, precision):
    """A held-out loss at the step's precision and micro-batches: the lm loss the step reports for that batch,
    measured before its update, exactly; the parameters untouched."""
    _, result = convert({})
    step = mc.build_train_step(result, optimizer=adamw, precision=precision)
    x, y = data[0]
    double = (torch.cat([x, x]), torch.cat([y, y]))  # two micro-batches of the traced batch
    before = {n: p.clone() for n, p in result.module.named_parameters()}
    loss, loss_micro = step.evaluate(x, y), step.evaluate(double)
    assert all(torch.equal(p, before[n]) for n, p in result.module.named_parameters())
    assert loss_micro == pytest.approx(loss, rel=1e-12)
    assert step(x, y).lm_loss == loss


def test_the_steps_tensor_work_stays_on_the_models_device():
    """A step on a GPU model must create nothing on the CPU (a stray CPU tensor fails there, or syncs). The meta
    device stands in for the GPU: the step's tensor work (``compute``, what a CUDA graph captures) runs on it."""
    model, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=BATCH, seq_len=SEQ)
    plan = {"experts": {"num_experts": 4, "top_k": 2, "expert_bias": True, "aux_loss": "aux"},
            "fp8": {"recipe": "delayed"}}
    result = mc.convert(model.to("meta"), plan, (ids.to("meta"),))
    step = mc.build_train_step(result, optimizer=lambda ps: mc.AdamW(ps), clip_grad_norm=1.0, keep_host_memory=False)
    out = step.compute(ids.to("meta"), ids.to("meta"))
    state = [t for s in step.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    grads = [p.grad for p in result.module.parameters() if p.grad is not None]
    assert state and grads and out["grad_norm"] is not None
    assert {t.device.type for t in [out["stats"], out["grad_norm"], *state, *grads, *step.biases.values()]} == {"meta"}


def test_bf16_model_trains_through_fp32_masters(data):
    _, result = convert({}, dtype="bfloat16")
    step = mc.build_train_step(result, optimizer=adamw, precision="bf16")
    assert step.masters and all(m.dtype == torch.float32 for m in step.masters.values())
    assert all(p.dtype == torch.float32 for g in step.optimizer.param_groups for p in g["params"])
    losses = [step(data[i]).loss for i in range(8)]
    assert losses[-1] < losses[0]
    for name, p in step.trainable.items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, step.masters[name].to(torch.bfloat16)), name


def test_a_batch_of_several_traced_batches_accumulates_their_gradient(data):
    """Traced at 2 sequences, stepped on 4: two micro-batches give the one-forward step on 4 sequences."""
    plan = {"experts": {"num_experts": 4, "top_k": 2, "router_noise": 0.01}}
    results = {}
    for traced in (BATCH // 2, BATCH):
        torch.manual_seed(0)
        dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=traced, seq_len=SEQ)
        results[traced] = mc.convert(dense, plan, (ids,))
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731
    micro, whole = (mc.build_train_step(results[t], optimizer=sgd) for t in (BATCH // 2, BATCH))
    assert len(micro.micro_batches(*data[0])) == 2 and len(whole.micro_batches(*data[0])) == 1
    for i in range(3):
        a, b = micro(data[i]), whole(data[i])
        assert (a.micro_batches, b.micro_batches) == (2, 1)
        assert a.loss == pytest.approx(b.loss, rel=1e-6) and a.tokens == b.tokens == BATCH * SEQ, i
        assert a.expert_load == b.expert_load, i
    for (name, p), q in zip(results[BATCH // 2].module.named_parameters(), results[BATCH].module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_batch_the_traced_one_does_not_divide_is_a_clear_error(data):
    _, result = convert({})
    step = mc.build_train_step(result)
    x, y = data[0]
    with pytest.raises(mc.MoecompileError, match=f"batch has 3 sequences but the graph was traced at {BATCH}"):
        step(x[:3], y[:3])
    doubled = torch.cat([x, x])
    with pytest.raises(mc.MoecompileError, match="targets of shape \\(4, 16\\)"):
        step(doubled, y)


def test_bad_optimizer_and_batch_are_clear_errors(data):
    _, result = convert({})
    with pytest.raises(mc.MoecompileError, match="factory"):
        mc.build_train_step(result, optimizer=lambda ps: "adam")
    step = mc.build_train_step(result)
    with pytest.raises(mc.MoecompileError, match="step\\(inputs, targets\\)"):
        step(data[0][0])
    with pytest.raises(mc.MoecompileError, match="precision"):
        mc.build_train_step(result, precision="fp8")


def test_a_compiled_step_tracks_the_eager_step(data):
    """compile=True: the same losses and weights as the eager step, to float32 round-off (Inductor's own
    kernels sum in another order; SGD, since Adam turns round-off in a near-zero gradient into a whole lr);
    micro-batches re-enter the compiled forward."""
    _, a = convert({"aux_loss": "aux", "z_loss_coeff": 1e-3})
    _, b = convert({"aux_loss": "aux", "z_loss_coeff": 1e-3})
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731
    eager, compiled = mc.build_train_step(a, optimizer=sgd), mc.build_train_step(b, optimizer=sgd, compile=True)
    assert compiled.forward_module is not compiled.module
    for i in range(3):
        x, y = data[i]
        want, got = eager(x, y), compiled(torch.cat([x, x]), torch.cat([y, y]))  # two micro-batches of the traced one
        assert got.micro_batches == 2
        assert got.loss == pytest.approx(want.loss, rel=1e-5), i
        assert got.expert_load == {k: [2 * n for n in v] for k, v in want.expert_load.items()}, i
    for (name, p), q in zip(a.module.named_parameters(), b.module.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)


def test_compile_refuses_to_share_the_forward_with_a_cuda_graph(monkeypatch):
    from moecompile import cuda_graphs

    class Capturing:  # what make_runner gives on CUDA for partial / full: it drives the forward itself
        def __init__(self, step):
            pass

    _, result = convert({})
    monkeypatch.setattr(cuda_graphs, "make_runner", lambda step, mode: Capturing(step))
    with pytest.raises(mc.MoecompileError, match=r"compile and cuda_graph.mode='partial' both take over.*overhead"):
        mc.build_train_step(result, cuda_graph="partial", compile=True)


# ---------------------------------------------------------------- expert parallel (spawned ranks)


@pytest.mark.distributed
def test_ep2_matches_ep1_step_for_step():
    """Same global batch, seed and init: ep=2 (alltoall, dropless) tracks ep=1 over several optimizer steps."""
    from _ep_scenario import ep1_reference, ep2_results

    _, ranks = ep2_results()
    _, _, ref = ep1_reference()
    for r in ranks:
        got = [*r["metrics"], r["after"]]
        assert len(got) == len(ref) == 4
        for i, (a, b) in enumerate(zip(got, ref)):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (i, a["loss"], b["loss"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), i  # global norm over shards
            assert a["load"] == b["load"] and a["tokens"] == b["tokens"] == BATCH * SEQ, i
        assert r["expert_shapes"]["model.layers.0.mlp.experts.w_gate_up"] == (2, 128, 32)  # 4 experts / ep 2
        assert r["collectives"] == 1  # all dense grads in one bucket; edp = 1 leaves experts local


@pytest.mark.distributed
def test_ep2_compiled_step_matches_the_one_process_step():
    """compile=True at ep = 2 tracks eager ep = 1, in one graph: the dropless splits' host reads are traced."""
    from _ep_scenario import ep1_reference, ep2_results

    _, ranks = ep2_results()
    ref = ep1_reference()[2]
    for r in ranks:
        assert r["compiled_breaks"] == 0, r["compiled_breaks"]
        for i, (a, b) in enumerate(zip(r["compiled_metrics"], ref)):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (i, a["loss"], b["loss"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), i
            assert a["load"] == b["load"], i


@pytest.mark.distributed
def test_ep2_micro_batches_of_one_sequence_match_the_one_process_step():
    """Traced at 1 sequence a rank, stepped on 2: gradients accumulate before the sync, z-loss means agree."""
    from _ep_scenario import ep1_reference, ep2_results

    _, ranks = ep2_results()
    ref = ep1_reference()[2]
    for r in ranks:
        assert r["micro_parts"] == 2
        for i, (a, b) in enumerate(zip(r["micro_metrics"], ref)):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (i, a["loss"], b["loss"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), i
            assert a["load"] == b["load"] and a["tokens"] == b["tokens"] == BATCH * SEQ, i


@pytest.mark.distributed
def test_global_aux_loss_at_ep2_is_the_one_process_loss():
    """global_aux counts the expert load over both ranks: loss, aux and gradients match ep=1; local aux does not."""
    from _ep_scenario import aux_runs, ep2_results

    _, ranks = ep2_results()
    ref = aux_runs()
    assert ref["aux"] == ref["global_aux"]  # one process: the same loss
    for r in ranks:
        assert len(r["aux"]["global_aux"]) == len(ref["global_aux"]) == 2
        for a, b in zip(r["aux"]["global_aux"], ref["global_aux"]):
            assert a["router_losses"]["aux_loss"] == pytest.approx(b["router_losses"]["aux_loss"], rel=1e-6)
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        local, single = r["aux"]["aux"][0]["router_losses"]["aux_loss"], ref["aux"][0]["router_losses"]["aux_loss"]
        assert local != pytest.approx(single, rel=1e-5)  # a mean of per-rank products is not the global product


@pytest.mark.distributed
def test_pure_data_parallel_matches_one_process():
    """ep=1 on 2 ranks: every expert on every rank, all grads reduced over dp; global_aux is the one-process loss."""
    from _ep_scenario import aux_runs, ep2_results

    _, ranks = ep2_results()
    ref = aux_runs()
    for r in ranks:
        for a, b in zip(r["aux_dp"]["global_aux"], ref["global_aux"], strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
            assert a["router_losses"]["aux_loss"] == pytest.approx(b["router_losses"]["aux_loss"], rel=1e-6)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
            assert a["load"] == b["load"]  # the reported load is the global one
        local, single = r["aux_dp"]["aux"][0]["router_losses"]["aux_loss"], ref["aux"][0]["router_losses"]["aux_loss"]
        assert local != pytest.approx(single, rel=1e-5)
    assert ranks[0]["aux_dp"] == ranks[1]["aux_dp"]  # replicated: both ranks report the same


@pytest.mark.distributed
def test_ep2_expert_bias_follows_the_global_load():
    from _ep_scenario import ep2_results

    _, ranks = ep2_results()
    a, b = ranks
    for layer in a["static_biases"]:
        assert torch.equal(a["static_biases"][layer], b["static_biases"][layer])  # replicated, never diverges
        want = torch.zeros(4)
        for m in a["static_metrics"]:
            load = torch.tensor(m["load"][layer], dtype=torch.float32)
            want += 0.01 * torch.sign(load.mean() - load)
        torch.testing.assert_close(a["static_biases"][layer], want)
    assert a["static_metrics"][0]["load"] == b["static_metrics"][0]["load"]  # both report the global load


_RSS_AFTER_FREE = """
import os, sys, torch
from moecompile.host_memory import keep_freed_memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
x = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
held = rss()
del x
print(int(kept), held - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_keep_freed_memory_keeps_a_freed_64_mib_tensor_resident():
    """glibc unmaps a freed 64 MiB block at once; with keep_freed_memory it stays for the next one."""
    def returned(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", _RSS_AFTER_FREE, mode], check=True, capture_output=True, text=True)
        kept, freed = out.stdout.split()
        return int(kept), int(freed)

    assert returned("system") == (0, pytest.approx(64 << 20, rel=0.1))
    kept, freed = returned("keep")
    assert kept == 1 and freed < 4 << 20
