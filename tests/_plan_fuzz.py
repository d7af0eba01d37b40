"""Random plans: every pass and runtime option at once, against the oracles that do not depend on the plan.

    python tests/_plan_fuzz.py train N SEED     # 4 gloo ranks, each plan against one process per rank
    python tests/_plan_fuzz.py inspect N SEED   # one process posing as rank 1 of 4: convert and inspect
    python tests/_plan_fuzz.py single N SEED    # one process, any zoo model: the dense model's oracles
    python tests/_plan_fuzz.py resume N SEED    # 4 gloo ranks: a checkpoint of one layout resumed at another
    python tests/_plan_fuzz.py graphs N SEED    # 4 gloo ranks: a captured step (emulated CUDA graphs) vs eager
    python tests/_plan_fuzz.py compile N SEED   # 4 gloo ranks: compile=True vs the eager step

``train``: losses, gradient norms and expert loads step for step equal to the same experts trained as plain
data parallelism (ep 1, no overlap / recompute / ZeRO / offload), in fp32 or bf16. Expert parallelism sums an expert's
gradient over other rows in another order than the data-parallel all-reduce, so equality is to round-off,
which AdamW and FP8 casts can grow over steps; a plan with FP8 or etp slices gets a looser bound.
``inspect``: the conversion, ``report()``, the capture-safety scans (``cuda_graph: partial``'s static region
must always be safe, and a static-dispatch step wholly), the memory estimate, the planner's profile and
``mc.visualize``. ``single``: any zoo model (MoEs adopted with their own experts) upcycled function-preserving
must give the dense (or Hugging Face MoE) model's logits at init, and recompute / activation offload / overlap
chunks must give the plain conversion's loss and gradients. ``resume``: 2 steps at one random layout (ep x etp,
dispatcher, ZeRO level, offload), ``step.save``, then the third step there and, loaded, at another layout: the
same loss, gradient norm and loads. ``graphs``: the plan's ``cuda_graph`` runner (``full`` for a static dispatch,
else ``partial``) on emulated CUDA graphs (tests/_graph_emulator.py), fp32 or bf16, must replay the eager step
bitwise. ``compile``: ``compile=True`` (mostly AOTAutograd without Inductor's code generation, which is slow on
CPU and tested on its own) must track the eager step to round-off. A plan the rules refuse is a ``PlanError`` and is skipped. Each found bug
became a test of its own; this finds the next.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import tempfile
import traceback
from typing import Any

GLOBAL_BATCH, SEQ, STEPS = 8, 16, 3
RECOMPUTABLE = ["router", "moe_act", "layernorm", "shared_experts", "moe", "attention"]
DENSE = ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-mistral", "tiny-gemma", "tiny-phi3", "tiny-olmo2", "tiny-gpt2"]
MOE = ["tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-deepseek-v3", "tiny-ernie4.5-moe", "tiny-granite-moe",
       "tiny-nemotron-h", "tiny-llama4", "tiny-gpt-oss"]


def random_plan(rng: random.Random) -> tuple[dict, str, int]:
    """(plan, zoo model, sequences a forward) drawn over every section."""
    G = rng.choice([1, 1, 2])
    E = rng.choice([4, 8])
    k = rng.choice([2, 4]) if G == 2 else rng.choice([1, 2, 2, 3])
    experts: dict[str, Any] = {
        "num_experts": E, "top_k": k, "granularity": G, "shared_experts": rng.choice([0, 0, 1]),
        "score": rng.choice(["softmax", "sigmoid"]), "apply_weights": rng.choice(["auto", "combine"]),
        "aux_loss": rng.choice(["none", "aux", "seq_aux", "global_aux"]), "z_loss_coeff": rng.choice([0.0, 1e-3]),
        "expert_bias": rng.random() < 0.3, "expert_bias_rate": 0.01, "route_scale": rng.choice([1.0, 1.0, 2.5])}
    if E == 8 and rng.random() < 0.3:
        experts.update(route_groups=2, route_group_top_k=1)
    dispatcher = rng.choice(["alltoall", "allgather", "alltoall_dedup"])
    mode = "dropless" if dispatcher == "alltoall_dedup" else rng.choice(["dropless", "static"])
    if mode == "static":
        experts.update(capacity_factor=rng.choice([1.0, 1.5]), drop_policy=rng.choice(["probs", "position"]))
    ep, etp = rng.choice([(2, 1), (4, 1), (1, 2), (2, 2), (4, 1), (2, 1)])
    parallel: dict[str, Any] = {"ep": ep, "etp": etp, "dispatcher": dispatcher, "dispatch_mode": mode}
    if dispatcher == "alltoall_dedup" and ep * etp == 4 and rng.random() < 0.5:
        parallel["node_ranks"] = 2
    zero = _zero(rng.choice([0, 0, 1, 2, 3]), parallel)
    if 1 <= zero <= 2 and rng.random() < 0.5:
        parallel["overlap_param_gather"] = True
    if rng.random() < 0.25:
        parallel["offload_optimizer"] = rng.choice([0.5, 1.0])
    if rng.random() < 0.3:
        parallel["overlap_grad_reduce"] = True
    plan: dict[str, Any] = {"experts": experts, "parallel": parallel}
    if rng.random() < 0.5:
        plan["overlap"] = {"enabled": True, "chunks": rng.choice([1, 2, 3]), "backward": rng.random() < 0.7,
                           "shared_expert": rng.random() < 0.7}
    if rng.random() < 0.3:
        plan["recompute"] = {"modules": rng.sample(RECOMPUTABLE, rng.choice([1, 2, 3]))}
    if rng.random() < 0.2:
        plan["fp8"] = {"recipe": "blockwise", "block_size": 16}
    micro = rng.choice([1, 2])  # a rank's 2 sequences as 1 or 2 micro-batches
    model = rng.choice(["tiny-llama", "tiny-llama", "tiny-qwen3", "tiny-gpt2", "imported"])
    if model == "imported":  # a Hugging Face MoE's own experts, adopted: its routing, the drawn losses
        from moecompile.models import load_config, own_experts

        model = rng.choice(MOE)
        keep = ("aux_loss", "z_loss_coeff", "capacity_factor", "drop_policy")
        experts = {**own_experts(load_config(model)), **{k: v for k, v in experts.items() if k in keep}}
        plan["experts"] = experts
    return plan, model, micro


def _zero(level: int, parallel: dict) -> int:
    """ZeRO ``level`` (0-3) as ``parallel`` fields; the level."""
    for at, field in enumerate(("shard_optimizer", "shard_gradients", "shard_parameters"), start=1):
        if level >= at:
            parallel[field] = True
    return level


def reference(plan: dict) -> dict:
    """The same experts (and FP8 casts) as plain data parallelism."""
    return {"experts": plan["experts"], **({"fp8": plan["fp8"]} if "fp8" in plan else {})}


def tolerance(plan: dict, precision: str = "fp32") -> float:
    """Relative bound on the losses and gradient norms: round-off, grown by FP8 casts or by expert slices
    whose partial outputs add up in another order, or bf16's (a sum in another order rounds to another bf16)."""
    if precision == "bf16":
        return 1e-2
    return 2e-3 if "fp8" in plan or plan["parallel"].get("etp", 1) > 1 else 1e-4


def _model(model: str, micro: int) -> tuple[Any, Any]:
    from moecompile.models import build_model

    return build_model(model, vocab_size=256, batch_size=micro, seq_len=SEQ)


def train(plan: dict, rank: int, world: int, model: str, micro: int, runner: str | None = None,
          **options: Any) -> list[dict]:
    """STEPS steps of ``plan``; ``runner`` forces a CUDA-graph runner (on emulated graphs), ``options`` go to the step."""
    import torch

    import moecompile as mc
    import moecompile.cuda_graphs as cg
    from moecompile.data import ByteBatches, stdlib_bytes

    dense, (ids,) = _model(model, micro)
    capturable = "cuda_graph" in plan  # eager and captured alike, so both step the same AdamW
    step = mc.build_train_step(mc.convert(dense, plan, (ids,)), clip_grad_norm=1.0,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3, capturable=capturable), **options)
    if runner is not None:
        step.runner = {"full": cg.FullGraphRunner, "partial": cg.PartialGraphRunner}[runner](step)
    stream = ByteBatches(stdlib_bytes(300_000), GLOBAL_BATCH, SEQ, seed=0)
    out = []
    for i in range(STEPS):
        m = step(stream.shard(i, rank, world))
        out.append({"loss": m.loss, "grad_norm": m.grad_norm, "load": m.expert_load})
    return out


def train_worker(rank: int, world: int, plan: dict, model: str, micro: int, precision: str = "fp32") -> dict:
    return {"got": train(plan, rank, world, model, micro, precision=precision),
            "want": train(reference(plan), rank, world, model, micro, precision=precision)}


def graphs_worker(rank: int, world: int, plan: dict, model: str, micro: int, precision: str) -> dict:
    """The plan eager and through its CUDA-graph runner, both on emulated graphs."""
    from _graph_emulator import emulated_cuda_graphs

    with emulated_cuda_graphs() as graphs:
        want = train(plan, rank, world, model, micro, precision=precision)
        got = train(plan, rank, world, model, micro, runner=plan["cuda_graph"]["mode"], precision=precision)
    return {"got": got, "want": want, "replays": [g.replays for g in graphs]}


def compile_worker(rank: int, world: int, plan: dict, model: str, micro: int, options: dict) -> dict:
    return {"got": train(plan, rank, world, model, micro, compile=options), "want": train(plan, rank, world, model, micro)}


def with_cuda_graph(plan: dict, rng: random.Random) -> dict:
    """The plan captured: whole when the dispatch is static (mostly), else its static regions."""
    static = plan["parallel"]["dispatch_mode"] == "static"
    # what the capture rules refuse (parameters gathered from Python hooks) is left out rather than drawn again
    parallel = {k: v for k, v in plan["parallel"].items() if k not in ("shard_parameters", "overlap_param_gather")}
    return {**plan, "parallel": parallel,
            "cuda_graph": {"mode": "full" if static and rng.random() < 0.7 else "partial", "warmup_steps": 1}}


def mismatches(got: list[dict], want: list[dict], rel: float) -> list[str]:
    """Step 0 within ``rel`` and the same expert loads. Later steps within 10 x ``rel`` and at most one token per
    layer routed elsewhere: AdamW turns round-off in a near-zero gradient entry into a whole lr's move (ZeRO's
    reduce-scatter sums in another order than an all-reduce), which can tip a near-tie token. ``rel`` 0: bitwise."""
    bad = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        bound = rel if i == 0 else 10 * rel
        for key in ("loss", "grad_norm"):
            if abs(g[key] - w[key]) > bound * abs(w[key]):
                bad.append(f"step {i} {key} {g[key]} vs {w[key]}")
        if rel >= 1e-3:  # FP8 / slices / bf16 may move near-tie tokens to other experts
            continue
        moved = {k: sum(abs(a - b) for a, b in zip(g["load"][k], w["load"][k])) for k in w["load"]}
        if g["load"].keys() != w["load"].keys() or any(m > (0 if i == 0 or rel == 0 else 2) for m in moved.values()):
            bad.append(f"step {i} expert loads differ: {g['load']} vs {w['load']}")
    return bad


def inspect(plan: dict, model: str, micro: int) -> list[str]:
    """Problems the inspection tools find with one rank's conversion (run inside a fake process group)."""
    import moecompile as mc
    from moecompile.cuda_graphs import check_capture_safety
    from moecompile.planner import profile_result

    dense, (ids,) = _model(model, micro)
    result = mc.convert(dense, plan, (ids,))
    problems = []
    result.report()
    static = check_capture_safety(result, region="static")
    if not static.safe:
        problems.append(f"static region unsafe: {static}")
    par = result.plan.parallel
    if par.dispatch_mode == "static":
        whole = check_capture_safety(result, backward=False)
        if not whole.safe:
            problems.append(f"static dispatch, yet the step is unsafe: {whole}")
    if mc.estimate_memory(result).activations <= 0:
        problems.append("no activations estimated")
    if profile_result(result).flops <= 0:
        problems.append("the profile counts no FLOPs")
    with tempfile.TemporaryDirectory() as d:
        mc.visualize(result, d + "/graph.html")
    return problems


def random_single(rng: random.Random) -> tuple[str, dict, dict]:
    """(zoo model, function-preserving experts, a memory / schedule variant) for one process."""
    from moecompile.models import load_config, own_experts

    model = rng.choice(DENSE + MOE)
    if model in MOE:
        experts = dict(own_experts(load_config(model)))
    else:
        G = rng.choice([1, 1, 2, 4])
        E = G * rng.choice([2, 4])
        experts = {"num_experts": E, "top_k": G * rng.choice([1, 2]), "granularity": G,
                   "shared_experts": rng.choice([0, 0, 1]), "score": rng.choice(["softmax", "sigmoid"]),
                   "aux_loss": rng.choice(["none", "aux", "seq_aux"]), "z_loss_coeff": rng.choice([0.0, 1e-2]),
                   "layers": rng.choice(["all", "all", "every:2"])}
        if E // G >= 2 and experts["top_k"] <= E // 2 and rng.random() < 0.25:
            experts.update(route_groups=2, route_group_top_k=rng.choice([1, 2]))
    variant: dict[str, Any] = {}
    kinds = RECOMPUTABLE + ["mlp"]
    if rng.random() < 0.6:
        variant["recompute"] = {"modules": rng.sample(kinds, rng.choice([1, 2, 3]))}
    if rng.random() < 0.3:
        left = [k for k in kinds if k not in variant.get("recompute", {}).get("modules", [])]
        variant["recompute"] = {**variant.get("recompute", {}), "offload": [rng.choice(left)],
                                "offload_min_bytes": rng.choice([0, 65536])}
    if rng.random() < 0.5:
        variant["overlap"] = {"enabled": True, "chunks": rng.choice([1, 2, 3])}
    return model, experts, variant


def _loss_and_grads(result: Any, ids: Any) -> tuple[Any, dict]:
    import torch.nn.functional as F

    result.module.zero_grad(set_to_none=True)
    logits = result.module(ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    (loss + result.router_loss()).backward()
    return logits.detach(), {k: p.grad.clone() for k, p in result.module.named_parameters() if p.grad is not None}


def single(model: str, experts: dict, variant: dict) -> list[str]:
    import torch

    import moecompile as mc

    def close(a: Any, b: Any, rel: float) -> bool:
        return torch.allclose(a, b, rtol=rel, atol=rel * max(1e-6, b.abs().max().item()))

    dense, (ids,) = _model(model, 2)
    ids = ids % 128
    plain = mc.convert(dense, {"experts": experts}, (ids,))
    problems = []
    with torch.no_grad():
        want = dense(ids).logits
    logits, grads = _loss_and_grads(plain, ids)
    if not close(logits, want, 1e-4):
        problems.append(f"logits at init differ from the model's by {(logits - want).abs().max().item():.3g}")
    got_logits, got = _loss_and_grads(mc.convert(dense, {"experts": experts, **variant}, (ids,)), ids)
    if not close(got_logits, logits, 1e-5):
        problems.append(f"{variant} changes the logits by {(got_logits - logits).abs().max().item():.3g}")
    wrong = [k for k in grads if k not in got or not close(got[k], grads[k], 1e-4)]
    if wrong or got.keys() != grads.keys():
        problems.append(f"{variant} changes the gradients of {wrong[:3] or set(got) ^ set(grads)}")
    return problems


def random_layout(rng: random.Random) -> dict:
    """A ``parallel`` section of 4 ranks."""
    ep, etp = rng.choice([(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
    out: dict[str, Any] = {"ep": ep, "etp": etp, "dispatcher": rng.choice(["alltoall", "allgather", "alltoall_dedup"])}
    _zero(rng.choice([0, 1, 2, 3]), out)
    if rng.random() < 0.3:
        out["offload_optimizer"] = rng.choice([0.5, 1.0])
    return out


def resume_worker(rank: int, world: int, experts: dict, a: dict, b: dict, model: str, micro: int, path: str) -> dict:
    import torch

    import moecompile as mc
    from moecompile.data import ByteBatches, stdlib_bytes

    def make(parallel: dict) -> Any:
        dense, (ids,) = _model(model, micro)
        return mc.build_train_step(mc.convert(dense, {"experts": experts, "parallel": parallel}, (ids,)),
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3), clip_grad_norm=1.0)

    def metrics(m: Any) -> dict:
        return {"loss": m.loss, "grad_norm": m.grad_norm, "load": m.expert_load}

    stream = ByteBatches(stdlib_bytes(300_000), GLOBAL_BATCH, SEQ, seed=0)
    step = make(a)
    for i in range(2):
        step(stream.shard(i, rank, world))
    step.save(path)
    want = metrics(step(stream.shard(2, rank, world)))
    resumed = make(b)
    resumed.load(path)
    return {"got": [metrics(resumed(stream.shard(2, rank, world)))], "want": [want]}


def draw(rng: random.Random) -> tuple[dict, str, int] | None:
    """A plan the rules accept, or None."""
    plan, model, micro = random_plan(rng)
    return None if _refused(plan) else (plan, model, micro)


def _refused(plan: dict) -> bool:
    """Does a rule refuse the plan? (Then it says which, and the draw is skipped.)"""
    import moecompile as mc

    try:
        mc.Plan.from_dict(plan)
    except mc.PlanError as e:
        print(f"refused: {str(e)[:160]}")
        return True
    return False


def run(kind: str, n: int, seed: int) -> list[str]:
    """``n`` draws from ``seed``; what failed, one line each with its plan."""
    from _dist import fake_rank, spawn

    rng, failed = random.Random(seed), []
    with fake_rank(1, 4, ep_step=True) if kind == "inspect" else contextlib.nullcontext():
        for c in range(n):
            extra: dict = {}
            if kind == "single":
                model, experts, variant = random_single(rng)
                plan, micro = {"experts": experts, **variant}, 2
                if _refused(plan):
                    continue
            elif kind == "resume":
                experts = {"num_experts": rng.choice([4, 8]), "top_k": 2, "shared_experts": rng.choice([0, 1]),
                           "aux_loss": rng.choice(["aux", "global_aux"]), "expert_bias": rng.random() < 0.3}
                layouts = (random_layout(rng), random_layout(rng))
                plan, micro = {"experts": experts, "parallel": layouts}, 2
                model = rng.choice(["tiny-llama", "tiny-gpt2"])
                if any(_refused({"experts": experts, "parallel": layout}) for layout in layouts):
                    continue
            else:
                drawn = draw(rng)
                if drawn is None:
                    continue
                plan, model, micro = drawn
                if kind == "graphs":
                    plan, precision = with_cuda_graph(plan, rng), rng.choice(["fp32", "bf16"])
                    extra = {"precision": precision}
                    if _refused(plan):
                        continue
                elif kind == "train":
                    extra = {"precision": rng.choice(["fp32", "fp32", "bf16"])}
                elif kind == "compile":  # Inductor's C++ code generation takes minutes a draw here
                    options = {} if rng.random() < 0.15 else {"backend": "aot_eager"}
                    extra = {"compile": options}
            try:
                if kind == "single":
                    bad = single(model, experts, variant)
                elif kind == "resume":
                    with tempfile.TemporaryDirectory() as d:
                        ranks = spawn(resume_worker, 4, (experts, *layouts, model, micro, d + "/ckpt"), timeout=300)
                    bad = [b for r in ranks for b in mismatches(r["got"], r["want"], 1e-4)]
                elif kind == "graphs":
                    ranks = spawn(graphs_worker, 4, (plan, model, micro, precision), timeout=600)
                    bad = [b for r in ranks for b in mismatches(r["got"], r["want"], 0.0)]
                    bad += [f"rank {i} replayed no graph: {r['replays']}" for i, r in enumerate(ranks)
                            if not r["replays"] or min(r["replays"]) < STEPS - 1]  # 1 warm-up step
                elif kind == "compile":
                    ranks = spawn(compile_worker, 4, (plan, model, micro, options), timeout=900)
                    bad = [b for r in ranks for b in mismatches(r["got"], r["want"], tolerance(plan))]
                elif kind == "train":
                    ranks = spawn(train_worker, 4, (plan, model, micro, extra["precision"]), timeout=300)
                    rel = tolerance(plan, extra["precision"])
                    bad = [b for r in ranks for b in mismatches(r["got"], r["want"], rel)]
                else:
                    bad = inspect(plan, model, micro)
            except Exception:
                bad = [traceback.format_exc()[-1500:]]
            verdict = "ok" if not bad else "FAILED " + "; ".join(bad[:3])
            line = f"[{c}] {verdict}\n    {json.dumps([model, micro, plan, extra])}"
            print(line, flush=True)
            if bad:
                failed.append(line)
    return failed


if __name__ == "__main__":
    sys.exit(1 if run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])) else 0)
