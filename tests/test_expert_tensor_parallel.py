"""Expert tensor parallelism (``parallel.etp``): experts cut along their FFN width over etp ranks.

Oracles: the whole expert (a slice-expert sum must be it), and the same run at etp = 1 on the same
ranks (data parallel): losses, gradient norms and expert loads step for step, a checkpoint that
continues the run at another ep, and a Hugging Face export whose logits are the trained model's.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import moecompile as mc
from moecompile.errors import PlanError
from moecompile.expert_slices import cut_slices, join_slices

from _dist import spawn

GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3
EXPERTS = {"num_experts": 4, "top_k": 2, "aux_loss": "global_aux"}  # no router noise: runs share no RNG stream
STATIC = {**EXPERTS, "capacity_factor": 1.0, "expert_bias": True, "expert_bias_rate": 0.01}


# ---------------------------------------------------------------- slices, one process


def _expert(x, w_in, w_out, glu):
    h = x @ w_in.t()
    h = F.silu(h[:, : h.shape[1] // 2]) * h[:, h.shape[1] // 2:] if glu else F.gelu(h)
    return h @ w_out.t()


@pytest.mark.parametrize("glu", [True, False])
@pytest.mark.parametrize("Q", [2, 4])
def test_an_experts_slices_add_up_to_it(glu, Q):
    E, H, Fw = 3, 8, 16
    g = torch.Generator().manual_seed(0)
    w_in = torch.randn(E, (2 if glu else 1) * Fw, H, generator=g, dtype=torch.float64)
    w_out = torch.randn(E, H, Fw, generator=g, dtype=torch.float64)
    b_in = torch.randn(E, w_in.shape[1], generator=g, dtype=torch.float64)
    x = torch.randn(5, H, generator=g, dtype=torch.float64)
    s_in, s_out = cut_slices(w_in, "w_in", Q, glu), cut_slices(w_out, "w_out", Q, glu)
    assert s_in.shape == (Q * E, w_in.shape[1] // Q, H) and s_out.shape == (Q * E, H, Fw // Q)
    for e in range(E):
        parts = sum(_expert(x, s_in[q * E + e], s_out[q * E + e], glu) for q in range(Q))
        torch.testing.assert_close(parts, _expert(x, w_in[e], w_out[e], glu))
    for key, t in (("w_in", w_in), ("w_out", w_out), ("b_in", b_in)):
        assert torch.equal(join_slices(cut_slices(t, key, Q, glu), key, Q, glu), t)


@pytest.mark.parametrize("model,Q", [("tiny-llama", 2), ("tiny-llama", 4), ("tiny-gpt2", 2)])
def test_the_sliced_graph_on_one_process_computes_the_unsliced_one(model, Q):
    """slices_pass: the graph the planner prices etp on, whose every slice is local: the same logits, the
    whole experts' gradients when the slices' are joined, the same loads and router loss. GPT-2's experts have
    biases: the up projection's is cut with the width, the down projection's is added by slice 0 alone."""
    from moecompile.bucket_layout import moe_blocks
    from moecompile.models import build_model
    from moecompile.passes.ep_slices import slices_pass

    dense, (ids,) = build_model(model, vocab_size=256, batch_size=2, seq_len=8)
    plan = {"experts": EXPERTS}
    whole, sliced = mc.convert(dense, plan, (ids,)), mc.convert(dense, plan, (ids,), passes=[slices_pass(Q)])
    assert sliced.record("expert_slices").data["slices"] == Q
    outs = []
    for r in (whole, sliced):
        logits = r.module(ids).logits
        (logits.square().mean() + r.router_loss()).backward()
        outs.append((logits, r.router_loss(), r.expert_load()))
    torch.testing.assert_close(outs[1][0], outs[0][0])
    torch.testing.assert_close(outs[1][1], outs[0][1])
    assert {k: v.tolist() for k, v in outs[1][2].items()} == {k: v.tolist() for k, v in outs[0][2].items()}
    grads = {n: p.grad for n, p in sliced.module.named_parameters()}
    keys = {name: (key, info["glu"]) for info in moe_blocks(sliced.module).values()
            for key, name in info["params"].items() if key in ("w_in", "w_out", "b_in")}
    assert len(keys) == (6 if model == "tiny-gpt2" else 4)  # 2 layers: w_in, w_out (and b_in)
    for name, p in whole.module.named_parameters():
        g = join_slices(grads[name], keys[name][0], Q, keys[name][1]) if name in keys else grads[name]
        torch.testing.assert_close(g, p.grad, msg=name)


def test_etp_needs_its_ranks():
    with pytest.raises(PlanError, match="parallel.etp=3.*must divide the world size 4"):
        mc.distributed.check_ep(2, 4, etp=3)
    with pytest.raises(PlanError, match="parallel.etp"):
        mc.Plan.from_dict({"parallel": {"etp": 0}})
    from moecompile.models import build_model

    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=2, seq_len=8)
    with pytest.raises(mc.errors.DistributedError, match=r"parallel.ep=1 x parallel.etp=2 needs 2"):
        mc.convert(dense, {"experts": EXPERTS, "parallel": {"etp": 2}}, (ids,))


# ---------------------------------------------------------------- training, 2 and 4 ranks


def _step(plan: dict, batch: int, model: str = "tiny-llama"):
    from moecompile.models import build_model

    dense, (ids,) = build_model(model, vocab_size=256, batch_size=batch, seq_len=SEQ)
    result = mc.convert(dense, plan, (ids,))
    step = mc.build_train_step(result, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3), clip_grad_norm=1.0)
    return dense, result, step


def _data():
    from moecompile.data import ByteBatches, stdlib_bytes

    return ByteBatches(stdlib_bytes(300_000), GLOBAL_BATCH, SEQ, seed=0)


def _metrics(m) -> dict:
    return {"loss": m.loss, "grad_norm": m.grad_norm, "load": m.expert_load}


def _run(plan: dict, rank: int, world: int, steps: int, step=None) -> list[dict]:
    stream, step = _data(), step or _step(plan, GLOBAL_BATCH // world)[2]
    return [_metrics(step(stream.shard(i, rank, world))) for i in range(steps)]


def two_rank_worker(rank: int, world: int, out: str) -> dict:
    from moecompile.export_hf import export_hf

    res = {"dp": _run({"experts": EXPERTS}, rank, world, STEPS + 1)}
    dense, result, step = _step({"experts": EXPERTS, "parallel": {"etp": 2}}, GLOBAL_BATCH // world)
    res["etp"] = _run({}, rank, world, STEPS, step)
    res["shapes"] = {n: tuple(p.shape) for n, p in result.module.named_parameters() if ".experts." in n}
    res["profile"] = _profile_facts(result)
    step.save(Path(out) / "ckpt")
    export_hf(result, Path(out) / "hf", arch="mixtral", config=dense.config)  # the checkpoint's weights
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        res["logits"] = result.module(ids).logits
    res["after"] = _metrics(step(_data().shard(STEPS, rank, world)))
    aux = {**EXPERTS, "aux_loss": "aux"}  # global_aux's load exchange keeps overlap from chunking the layer
    res["aux_dp"] = _run({"experts": aux}, rank, world, STEPS)
    _, result, step = _step({"experts": aux, "parallel": {"etp": 2}, "overlap": {"enabled": True, "chunks": 2}},
                            GLOBAL_BATCH // world)
    res["aux_overlap"] = _run({}, rank, world, STEPS, step)
    res["chunks"] = {n.meta["moe"]["chunk"] for n in result.module.graph.nodes if "chunk" in n.meta.get("moe", {})}
    static = {"experts": STATIC, "parallel": {"dispatch_mode": "static"}}
    res["static_dp"] = _run(static, rank, world, 2)
    res["static_etp"] = _run({**static, "parallel": {"etp": 2, "dispatch_mode": "static", "dispatcher": "allgather"}},
                             rank, world, 2)
    return res


def four_rank_worker(rank: int, world: int, ckpt: str) -> dict:
    stream = _data()
    res = {"dp": _run({"experts": EXPERTS}, rank, world, 2)}
    res["ep2_etp2"] = _run({"experts": EXPERTS, "parallel": {"ep": 2, "etp": 2, "dispatcher": "allgather"}}, rank,
                           world, 2)
    _, result, step = _step({"experts": EXPERTS, "parallel": {"ep": 2, "etp": 2}}, GLOBAL_BATCH // world)
    step.load(ckpt)  # written at ep = 1, etp = 2 on two ranks
    res["resumed"] = _metrics(step(stream.shard(STEPS, rank, world)))
    _, _, step = _step({"experts": EXPERTS, "parallel": {"ep": 4}}, GLOBAL_BATCH // world)
    step.load(ckpt)  # etp = 1: whole experts from the slices
    res["resumed_etp1"] = _metrics(step(stream.shard(STEPS, rank, world)))
    _, _, step = _step({"experts": EXPERTS, "parallel": {"ep": 1, "etp": 4, "shard_optimizer": True}},
                       GLOBAL_BATCH // world)
    step.load(ckpt)  # four slices from two, the optimizer state in ranges
    res["resumed_etp4"] = _metrics(step(stream.shard(STEPS, rank, world)))
    return res


def etp1_worker(rank: int, world: int, out: str) -> dict:
    """The etp = 2 checkpoint through other layouts: re-saved at etp = 2 with the optimizer in ranges (slices of
    ranges), loaded at etp = 1 and saved there, loaded at etp = 2 again; each load then takes the next step."""
    stream, out = _data(), Path(out)
    _, _, step = _step({"experts": EXPERTS, "parallel": {"etp": 2, "shard_optimizer": True}}, GLOBAL_BATCH // world)
    step.load(out / "ckpt")
    step.save(out / "ckpt-etp2-zero")
    _, _, step = _step({"experts": EXPERTS}, GLOBAL_BATCH // world)
    step.load(out / "ckpt-etp2-zero")
    step.save(out / "ckpt-etp1")
    res = {"etp1": _metrics(step(stream.shard(STEPS, rank, world)))}
    _, _, step = _step({"experts": EXPERTS, "parallel": {"etp": 2}}, GLOBAL_BATCH // world)
    step.load(out / "ckpt-etp1")
    res["etp2"] = _metrics(step(stream.shard(STEPS, rank, world)))
    return res


@functools.lru_cache(maxsize=None)
def two_ranks() -> tuple[Path, list[dict]]:
    out = Path(tempfile.mkdtemp(prefix="moecompile-etp-"))
    atexit.register(shutil.rmtree, out, True)
    return out, spawn(two_rank_worker, 2, (str(out),), timeout=400)


def _same_run(got: list[dict], want: list[dict], rel: float = 1e-5) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["loss"] == pytest.approx(w["loss"], rel=rel), (i, g, w)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), (i, g, w)
        assert g["load"] == w["load"], (i, g["load"], w["load"])


@pytest.mark.distributed
def test_etp2_trains_step_for_step_like_etp1():
    _, ranks = two_ranks()
    for r in ranks:
        _same_run(r["etp"], r["dp"][:STEPS])
        _same_run([r["after"]], r["dp"][STEPS:])
        assert all(len(v) == 4 for v in r["etp"][0]["load"].values())  # whole experts, not slices
    # each rank holds one width-half of all 4 experts: w_gate_up [4, 2F/2, H], w_down [4, H, F/2]
    shapes = ranks[0]["shapes"]
    w_in = next(s for n, s in shapes.items() if n.endswith("w_gate_up"))
    w_out = next(s for n, s in shapes.items() if n.endswith("w_down"))
    from moecompile.models import load_config

    half = load_config("tiny-llama").intermediate_size // 2
    assert w_in[0] == w_out[0] == 4 and w_in[1] == 2 * half and w_out[2] == half


def _profile_facts(result) -> tuple:
    """What the planner reads off a graph for etp: its slices, the whole model's expert parameters, the routed
    rows' bytes a rank sends and the GEMMs' FLOPs."""
    from moecompile.planner import profile_result

    prof = profile_result(result)
    moe = [lp for lp in prof.layers if lp.kind == "moe"]
    return prof.etp, prof.expert_params, [lp.dispatch_bytes for lp in moe], [lp.flops for lp in moe]


@pytest.mark.distributed
def test_the_planner_reads_an_etp2_rank_as_the_one_process_graph_in_slices():
    """profile_result of a rank's etp = 2 graph (half of every expert, collectives in it) gives the planner what
    the one-process sliced graph does, which is what it prices etp plans on."""
    from moecompile.models import build_model
    from moecompile.passes.ep_slices import slices_pass

    _, ranks = two_ranks()
    dense, (ids,) = build_model("tiny-llama", vocab_size=256, batch_size=GLOBAL_BATCH // 2, seq_len=SEQ)
    one = _profile_facts(mc.convert(dense, {"experts": EXPERTS}, (ids,), passes=[slices_pass(2)]))
    assert one[0] == 2 and all(r["profile"] == one for r in ranks)  # expert rows priced balanced on a rank


@pytest.mark.distributed
def test_etp2_overlapped_in_chunks_trains_like_etp1():
    _, ranks = two_ranks()
    for r in ranks:
        assert r["chunks"] == {0, 1}
        _same_run(r["aux_overlap"], r["aux_dp"])


@pytest.mark.distributed
def test_etp2_static_allgather_trains_like_etp1():
    _, ranks = two_ranks()
    for r in ranks:
        _same_run(r["static_etp"], r["static_dp"])


@pytest.mark.distributed
def test_an_etp2_model_exports_whole_experts():
    from transformers import AutoModelForCausalLM

    out, ranks = two_ranks()
    hf = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert hf.config.num_local_experts == 4
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ranks[0]["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.distributed
def test_an_etp2_checkpoint_holds_whole_experts_as_export_writes_them():
    """Loaded in one process (etp = 1), the checkpoint's experts are the exported ones, not a permutation of
    their hidden units (which would train the same, but not read as the model it is)."""
    from transformers import AutoModelForCausalLM

    out, _ = two_ranks()
    hf = AutoModelForCausalLM.from_pretrained(out / "hf")
    _, result, step = _step({"experts": EXPERTS}, GLOBAL_BATCH)
    step.load(out / "ckpt")
    params = dict(result.module.named_parameters())
    for i, layer in enumerate(hf.model.layers):
        assert torch.equal(params[f"model.layers.{i}.mlp.experts.w_gate_up"], layer.mlp.experts.gate_up_proj)
        assert torch.equal(params[f"model.layers.{i}.mlp.experts.w_down"], layer.mlp.experts.down_proj)


@pytest.mark.distributed
def test_ep2_etp2_on_four_ranks_and_an_etp2_checkpoint_at_other_layouts():
    out, ranks = two_ranks()
    four = spawn(four_rank_worker, 4, (str(out / "ckpt"),), timeout=400)
    for r in four:
        _same_run(r["ep2_etp2"], r["dp"])
        for resumed in ("resumed", "resumed_etp1", "resumed_etp4"):
            _same_run([r[resumed]], ranks[0]["dp"][STEPS:])


@pytest.mark.distributed
def test_checkpoints_move_between_etp_and_the_sharded_optimizer():
    out, ranks = two_ranks()
    back = spawn(etp1_worker, 2, (str(out),), timeout=300)
    for r in back:
        _same_run([r["etp1"]], ranks[0]["dp"][STEPS:])
        _same_run([r["etp2"]], ranks[0]["dp"][STEPS:])


def adopted_worker(rank: int, world: int, model: str) -> dict:
    from moecompile.models import load_config, own_experts

    experts = own_experts(load_config(model))
    steps = {etp: _step({"experts": experts, "parallel": {"etp": etp}}, GLOBAL_BATCH // world, model)[2]
             for etp in (1, 2)}
    return {etp: _run({}, rank, world, 2, step) for etp, step in steps.items()}


@pytest.mark.distributed
def test_an_adopted_deepseek_v3_block_slices_too():
    """Sigmoid scores, route groups, a selection bias, a scale and a shared expert: routing is untouched, so only
    the routed experts are cut."""
    for r in spawn(adopted_worker, 2, ("tiny-deepseek-v3",), timeout=300):
        _same_run(r[2], r[1])


def gpt2_worker(rank: int, world: int, out: str) -> dict:
    """GPT-2's experts have an output bias: at etp = 2 on 4 ranks, ranks 0 and 2 (slice 0) hold it and add it,
    ranks 1 and 3 have none."""
    _, _, dp = _step({"experts": EXPERTS}, GLOBAL_BATCH // world, "tiny-gpt2")
    _, result, etp = _step({"experts": EXPERTS, "parallel": {"etp": 2}}, GLOBAL_BATCH // world, "tiny-gpt2")
    res = {"dp": _run({}, rank, world, STEPS + 1, dp), "etp": _run({}, rank, world, STEPS, etp),
           "biases": {n: tuple(p.shape) for n, p in result.module.named_parameters() if n.endswith("experts.b_down")}}
    etp.save(Path(out) / "gpt2")
    _, _, back = _step({"experts": EXPERTS}, GLOBAL_BATCH // world, "tiny-gpt2")
    back.load(Path(out) / "gpt2")  # etp = 1: each rank reads every expert's bias, written by rank 0
    res["resumed_etp1"] = _metrics(back(_data().shard(STEPS, rank, world)))
    _, _, zero = _step({"experts": EXPERTS, "parallel": {"etp": 2, "shard_optimizer": True}}, GLOBAL_BATCH // world,
                       "tiny-gpt2")
    zero.load(Path(out) / "gpt2")  # the bias and its optimizer state in ranges over slice 0's ranks (0 and 2)
    zero.save(Path(out) / "gpt2-zero")
    _, _, back = _step({"experts": EXPERTS}, GLOBAL_BATCH // world, "tiny-gpt2")
    back.load(Path(out) / "gpt2-zero")
    res["resumed_zero_etp1"] = _metrics(back(_data().shard(STEPS, rank, world)))
    return res


@pytest.mark.distributed
def test_experts_with_an_output_bias_slice_and_slice_zero_adds_it(tmp_path):
    ranks = spawn(gpt2_worker, 4, (str(tmp_path),), timeout=400)
    for r in ranks:
        _same_run(r["etp"], r["dp"][:STEPS])
        _same_run([r["resumed_etp1"]], r["dp"][STEPS:])
        _same_run([r["resumed_zero_etp1"]], r["dp"][STEPS:])
    for holder in (ranks[0], ranks[2]):  # both layers' [E, H], on slice 0's ranks
        assert sorted(holder["biases"].values()) == [(4, 32), (4, 32)]
    assert ranks[1]["biases"] == ranks[3]["biases"] == {}


@pytest.mark.parametrize("model,Q,error", [
    ("tiny-llama", 7, "parallel.etp=7 must divide each expert's FFN width"),
])
def test_experts_that_cannot_be_sliced_say_why(model, Q, error):
    from moecompile.models import build_model
    from moecompile.passes.ep_slices import slice_experts
    from moecompile.passes.expert_parallel import find_blocks

    dense, (ids,) = build_model(model, vocab_size=256, batch_size=2, seq_len=8)
    result = mc.convert(dense, {"experts": EXPERTS}, (ids,))
    with pytest.raises(ValueError, match=error):
        slice_experts(result.module, find_blocks(result.module)[0], Q)
