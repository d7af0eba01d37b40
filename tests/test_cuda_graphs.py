"""CUDA graphs: the plan rule, the CPU-checkable capture-safety proof, the region split, and (GPU) capture."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
import torch.fx as fx

import moecompile as mc
from moecompile.cuda_graphs import check_capture_safety, scan_graph, split_static_regions
from moecompile.data import ByteBatches, stdlib_bytes
from moecompile.models import build_model

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BATCH, SEQ = 4, 16
STATIC = {"experts": {"num_experts": 4, "top_k": 2, "capacity_factor": 1.0, "aux_loss": "aux"},
          "parallel": {"dispatch_mode": "static"}}


def convert(plan: dict, device: str = "cpu", passes=None, model: str = "tiny-llama") -> tuple[mc.ConversionResult,
                                                                                             torch.Tensor]:
    dense, (ids,) = build_model(model, vocab_size=256, batch_size=BATCH, seq_len=SEQ)
    dense, ids = dense.to(device), ids.to(device)
    return mc.convert(dense, plan, (ids,), passes=passes), ids


def test_full_capture_needs_static_dispatch():
    with pytest.raises(mc.PlanError, match=r"cuda_graph.mode.*'full'.*parallel.dispatch_mode='dropless'.*"
                                           r"Set parallel.dispatch_mode: static"):
        mc.Plan.from_dict({"cuda_graph": {"mode": "full"}})
    plan = mc.Plan.from_dict({**STATIC, "cuda_graph": {"mode": "full"}})
    assert plan.cuda_graph.mode == "full"
    mc.Plan.from_dict({"cuda_graph": {"mode": "partial"}})  # partial keeps the experts eager: any dispatch


def test_a_static_plan_is_capture_safe_forward_and_backward():
    result, _ = convert(STATIC)
    report = check_capture_safety(result)
    assert report.safe and report.backward_checked, str(report)
    report.raise_if_unsafe()


def _sync_in_router(gm: fx.GraphModule, ctx) -> None:
    """A user pass that reads the router's top choice on the host (what dropless dispatch must do)."""
    from moecompile.meta import Role

    for n in list(gm.graph.nodes):
        if n.meta.get("moe", {}).get("role") == Role.ROUTE and n.target is torch.ops.moecompile.route.default:
            with gm.graph.inserting_after(n):
                idx = gm.graph.call_function(operator.getitem, (n, 1))
            with gm.graph.inserting_after(idx):
                host = gm.graph.call_method("tolist", (idx,))
            host.meta["moe"] = {"layer": n.meta["moe"]["layer"], "role": Role.DISPATCH}
            return


def test_a_host_read_in_the_graph_is_found_and_named():
    result, _ = convert(STATIC, passes=[_sync_in_router])
    report = check_capture_safety(result, backward=False)
    assert not report.safe
    assert any(".tolist()" in f.op and f.layer == "model.layers.0.mlp" and f.role == "dispatch"
               for f in report.findings), str(report)
    with pytest.raises(mc.MoecompileError, match="(?s)not capture-safe.*tolist.*dispatch_mode: static"):
        report.raise_if_unsafe()
    # the host read sits on the expert path, which partial capture leaves eager
    assert check_capture_safety(result, region="static").safe



@pytest.mark.parametrize("dispatcher", ["alltoall", "alltoall_dedup"])
def test_a_region_holding_routed_and_shared_activations_keeps_the_static_part_safe(dispatcher):
    """``recompute: [moe_act]`` outlines the routed experts' and the shared expert's activations into one region;
    at ep 2 its output tuple holds rows of a run-time size. The getitem that picks the shared expert's static
    [T, F] from it was once taken for a dynamic split, so the static region looked unsafe; the one that picks the
    routed rows has a data-dependent shape of its own and is still found by the whole-step scan."""
    from _dist import fake_rank

    plan = {"experts": {"num_experts": 4, "top_k": 2, "shared_experts": 1},
            "parallel": {"ep": 2, "dispatcher": dispatcher}, "recompute": {"modules": ["moe_act"]}}
    with fake_rank(0, 2, ep_step=True):
        result, _ = convert(plan)
    assert check_capture_safety(result, region="static").safe
    assert any(f.op == "getitem" and f.reason.startswith("has a data-dependent shape")
               for f in check_capture_safety(result, backward=False).findings)


class _HostNorm(torch.autograd.Function):
    """Identity forward; the backward reads the gradient norm on the host (a sync autograd hides)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g / max(1.0, float(g.norm()))


def test_a_sync_inside_backward_is_found_by_the_joint_trace():
    result, ids = convert(STATIC)
    module = result.module

    def loss_fn(out, targets):
        logits = _HostNorm.apply(out.logits)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))

    assert scan_graph(module.graph) == []  # the forward graph alone looks clean
    report = check_capture_safety(result, loss_fn=loss_fn)
    assert not report.safe and "forward + backward" in str(report), str(report)


def test_split_regions_compute_the_same_and_share_parameters():
    result, ids = convert({"experts": {"num_experts": 4, "top_k": 2, "aux_loss": "aux"}})
    gm = result.module
    split = split_static_regions(gm)
    kinds = [n.target.split("_")[0] for n in split.graph.nodes if n.op == "call_module"]
    assert kinds[0] == "static" and kinds.count("dynamic") == 2  # one expert path per MoE layer
    assert all(a != b for a, b in zip(kinds, kinds[1:]))  # regions alternate
    ours = {id(p) for p in gm.parameters()}
    assert {id(p) for p in split.parameters()} <= ours  # no copies: optimizer and checkpoints see the same tensors
    for name, sub in split.named_children():
        assert check_capture_safety_of(sub) or name.startswith("dynamic")
    want = gm(ids).logits
    model_out, side = split(ids, use_cache=False)
    torch.testing.assert_close(model_out.logits, want, rtol=0, atol=0)
    (model_out.logits.sum() + sum(v["aux_loss"] for v in side.values())).backward()
    g_split = {n: p.grad.clone() for n, p in gm.named_parameters()}
    gm.zero_grad()
    (gm(ids).logits.sum() + result.router_loss() / 0.01).backward()
    for n, p in gm.named_parameters():
        torch.testing.assert_close(g_split[n], p.grad, msg=n)


def check_capture_safety_of(sub: fx.GraphModule) -> bool:
    return not scan_graph(sub.graph)


def test_cpu_runs_eagerly_and_says_so_once():
    result, ids = convert(STATIC)
    data = ByteBatches(stdlib_bytes(100_000), BATCH, SEQ)
    import moecompile.cuda_graphs as cg

    cg._SAID.discard("cpu-full")
    with pytest.warns(UserWarning, match="cuda_graph.mode='full'.*runs eagerly"):
        step = mc.build_train_step(result, cuda_graph="full")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mc.build_train_step(result, cuda_graph="full")  # said once already
    assert type(step.runner).__name__ == "EagerRunner"
    assert step(data[0]).loss > 0


# ---------------------------------------------------------------- expert parallel (spawned ranks)


@pytest.mark.distributed
def test_dropless_ep2_is_not_capture_safe_but_its_static_regions_are():
    from _ep_scenario import ep2_results

    _, ranks = ep2_results()
    for r in ranks:
        safe, text = r["dropless_full"]
        assert not safe and "dispatch" in text, text  # the count exchange is read on the host
        safe, text = r["dropless_static_region"]
        assert safe, text
        safe, text = r["static_full"]
        assert safe, text  # static capacity: fixed splits, nothing read on the host


# ---------------------------------------------------------------- the runners, on emulated CUDA graphs
# tests/_graph_emulator.py records each capture at the ATen level and replays it with no
# Python, as a CUDA graph does: what the runners get wrong there, they get wrong on a GPU.


def _emulated(plan: dict, runner: str | None, n: int = 5, precision: str = "fp32", optimizer=None, schedule=None,
              loss_fn=None, batch: int = BATCH, by_name: bool = False, model: str = "tiny-llama") -> tuple[list, list]:
    """Each step's (loss, gradient norm) and the graphs made: the norm sees the backward, which a loss sees late."""
    from _graph_emulator import emulated_cuda_graphs

    import moecompile.cuda_graphs as cg

    plan = {**plan, "cuda_graph": {"warmup_steps": 2}}
    optimizer = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=3e-3, capturable=True))
    data = ByteBatches(stdlib_bytes(100_000), batch, SEQ)
    with emulated_cuda_graphs() as graphs:
        torch.manual_seed(0)
        result, _ = convert(plan, model=model)
        step = mc.build_train_step(result, optimizer=optimizer, precision=precision, loss_fn=loss_fn,
                                   clip_grad_norm=1.0)
        if runner is not None:
            step.runner = {"full": cg.FullGraphRunner, "partial": cg.PartialGraphRunner}[runner](step)
        sched = schedule(step.optimizer) if schedule else None
        losses = []
        for i in range(n):
            x, y = data[i]
            m = step({"input_ids": x} if by_name else x, y)
            losses.append((m.loss, m.grad_norm))
            if sched:
                sched.step()
    return losses, graphs


DROPLESS = {"experts": {"num_experts": 4, "top_k": 2, "aux_loss": "aux"}}


def test_full_capture_replays_the_eager_step_on_emulated_graphs():
    eager, _ = _emulated(STATIC, None)
    full, graphs = _emulated(STATIC, "full")
    assert [g.replays for g in graphs] == [3]  # 2 warm-up steps, then one capture replayed for steps 3..5
    assert full == eager  # bitwise: the replay runs the kernels the eager step runs


def test_full_capture_follows_an_lr_schedule():
    halve = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)  # noqa: E731
    eager, _ = _emulated(STATIC, None, n=6, schedule=halve)
    full, _ = _emulated(STATIC, "full", n=6, schedule=halve)
    assert full == eager  # a Python-float lr would be frozen at its capture-time value


def test_full_capture_refuses_a_changed_python_hyperparameter():
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731  (SGD: lr stays a Python float)
    halve = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)  # noqa: E731
    with pytest.raises(mc.MoecompileError, match=r"param_groups\[0\]\['lr'\] changed from 0.025 to 0.0125 after the "
                                                 r"step was captured"):
        _emulated(STATIC, "full", n=6, optimizer=sgd, schedule=halve)


def test_full_capture_names_a_host_sync_found_in_the_last_warmup_step():
    def loss_fn(out, targets):
        logits = _HostNorm.apply(out.logits)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))

    with pytest.raises(mc.MoecompileError, match="mode=full: the step synchronises with the host"):
        _emulated(STATIC, "full", loss_fn=loss_fn)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_partial_capture_replays_the_eager_step_on_emulated_graphs(precision):
    eager, _ = _emulated(DROPLESS, None, precision=precision)
    partial, graphs = _emulated(DROPLESS, "partial", precision=precision)
    # 3 static regions (embedding + attention, between the two MoE layers, the head): a forward
    # and a backward graph each, replayed on steps 3..5 while the dropless experts run eagerly
    assert [g.replays for g in graphs] == [3] * 6
    assert partial == eager  # bitwise; in bf16 only if the regions were captured under autocast


def test_partial_capture_of_fp32_attention_in_bf16_replays_the_eager_step():
    """DeepSeek-V3's MLA attention runs its score bmm in fp32 inside the bf16 step: the captured backward must
    compute its gradient as the eager backward does, outside autocast (it ran in bf16: step 1's norm 1.8e-4 off)."""
    from moecompile.models import load_config, own_experts

    plan = {"experts": own_experts(load_config("tiny-deepseek-v3"))}
    eager, _ = _emulated(plan, None, n=4, precision="bf16", model="tiny-deepseek-v3")
    partial, graphs = _emulated(plan, "partial", n=4, precision="bf16", model="tiny-deepseek-v3")
    assert graphs and all(g.replays == 2 for g in graphs)
    assert partial == eager


def test_an_emulated_replay_runs_the_captured_kernels_under_the_callers_autocast():
    """A replay launches kernels; it does not dispatch again, so autocast around it changes nothing."""
    from _graph_emulator import emulated_cuda_graphs

    def region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):  # an fp32 island, as models keep attention scores or rotary
            return torch.bmm(x.exp(), w)

    a, b = torch.randn(2, 8, 8), torch.randn(2, 8, 8)
    static = torch.zeros_like(a)
    with emulated_cuda_graphs(), torch.autocast("cpu", torch.bfloat16):
        want = region(a, b)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = region(static, b)
        static.copy_(a)
        graph.replay()
    assert out.dtype == torch.float32 and torch.equal(out, want)


@pytest.mark.parametrize("runner", ["full", "partial"])
def test_captured_steps_keep_fp8_scaling_state_recompute_and_offload(runner):
    """Delayed fp8 scaling keeps an amax history across steps: it must live in tensors a replay updates."""
    plan = {**STATIC, "experts": {**STATIC["experts"], "expert_bias": True, "z_loss_coeff": 1e-3},
            "fp8": {"recipe": "delayed", "modules": ["experts", "dense"]},
            "recompute": {"modules": ["moe_act", "layernorm"], "offload": ["attention"]}}
    eager, _ = _emulated(plan, None)
    captured, graphs = _emulated(plan, runner)
    assert graphs and all(g.replays == 3 for g in graphs)
    assert captured == eager


@pytest.mark.parametrize("runner, plan", [("full", STATIC), ("partial", DROPLESS)])
def test_captured_micro_batches_replay_the_eager_step(runner, plan):
    """Twice the traced batch: two micro-batches a step, both in the capture (full) or through the regions."""
    eager, _ = _emulated(plan, None, batch=2 * BATCH)
    captured, graphs = _emulated(plan, runner, batch=2 * BATCH, by_name=True)  # and a dict batch
    per_step = 1 if runner == "full" else 2  # one graph of the step, or each region once per micro-batch
    assert graphs and all(g.replays == 3 * per_step for g in graphs)
    assert captured == eager


def test_partial_capture_refuses_another_shape():
    from _graph_emulator import emulated_cuda_graphs

    import moecompile.cuda_graphs as cg

    with emulated_cuda_graphs():
        result, _ = convert({**DROPLESS, "cuda_graph": {"warmup_steps": 1}})
        step = mc.build_train_step(result, optimizer=lambda ps: torch.optim.AdamW(ps, capturable=True))
        step.runner = cg.PartialGraphRunner(step)
        step(ByteBatches(stdlib_bytes(100_000), BATCH, SEQ)[0])
        step(ByteBatches(stdlib_bytes(100_000), BATCH, SEQ)[1])  # captured here
        with pytest.raises(mc.MoecompileError, match=r"mode=partial: region static_0 was captured with argument 0 = "
                                                     r"\(4, 16\) torch.int64, got \(4, 8\)"):
            step(ByteBatches(stdlib_bytes(100_000), BATCH, 8)[0])


@pytest.mark.distributed
def test_ep2_steps_replay_on_emulated_graphs():
    """Gradient sync, the static all-to-all, the global_aux load all-reduce and the expert bias in one captured step."""
    from _graph_scenario import ep2_graphs_worker
    from _dist import spawn

    for r in spawn(ep2_graphs_worker, 2, timeout=300):
        assert r["full_replays"] == [3]
        assert r["full"] == r["static_eager"]
        assert r["partial_replays"] and set(r["partial_replays"]) == {3}
        assert r["partial"] == r["dropless_eager"]
        assert r["zero1_full"] == r["zero1_eager"]  # the capture must undo its collectives' writes too


# ---------------------------------------------------------------- on a GPU


# eager uses AdamW as given, a capture its capturable form (same math, other rounding); bf16 may
# then round a few activations the other way
_REL = {"fp32": 1e-4, "bf16": 5e-3}


def _steps(mode: str, precision: str, n: int = 6, plan: dict = STATIC, model: str = "tiny-llama") -> list[float]:
    plan = {**plan, "cuda_graph": {"mode": mode, "warmup_steps": 2}}
    result, _ = convert(plan, "cuda", model=model)
    step = mc.build_train_step(result, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3), precision=precision)
    data = ByteBatches(stdlib_bytes(100_000), BATCH, SEQ)
    return [step(tuple(t.cuda() for t in data[i])).loss for i in range(n)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_full_capture_replays_the_eager_step(precision):
    eager, full = _steps("none", precision), _steps("full", precision)
    assert full == pytest.approx(eager, rel=_REL[precision], abs=1e-5)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_partial_capture_replays_the_eager_step(precision):
    eager, partial = _steps("none", precision), _steps("partial", precision)
    assert partial == pytest.approx(eager, rel=_REL[precision], abs=1e-5)


@pytest.mark.gpu
@gpu
def test_partial_capture_of_an_imported_deepseek_v3_replays_its_eager_bf16_step():
    """Its MLA attention keeps fp32 islands in the bf16 step: the captured backward must run them as eager does."""
    from moecompile.models import load_config, own_experts

    plan = {"experts": own_experts(load_config("tiny-deepseek-v3"))}
    eager = _steps("none", "bf16", plan=plan, model="tiny-deepseek-v3")
    partial = _steps("partial", "bf16", plan=plan, model="tiny-deepseek-v3")
    assert partial == pytest.approx(eager, rel=_REL["bf16"], abs=1e-5)
