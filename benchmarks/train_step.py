"""A full training step of a small upcycled Llama: moecompile against the HF Mixtral block swapped in.

Both models start from the same converted weights (the HF model gets a
`MixtralSparseMoeBlock` per layer loaded with moecompile's experts and router) and run
the same loop: forward, next-token cross-entropy, backward, AdamW step. Each runs in its
own process; peak memory is the growth of the process's peak RSS over the step loop.
`moecompile_ep2` is the product's own step (`build_train_step`) over gloo: 2 spawned ranks,
each with half of the same global batch and --threads / 2 threads, experts sharded 2 ways;
its time is the slowest rank's, its memory the largest rank's.

    python benchmarks/train_step.py [--steps 6] [--batch 8] [--seq 257] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import time

import torch

logging.getLogger("transformers").setLevel(logging.ERROR)


def _dense(a: argparse.Namespace):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=a.hidden, intermediate_size=a.ffn,
                                   num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=a.seq)
    dense = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    return dense, ids


def _experts(a: argparse.Namespace) -> dict:
    return {"num_experts": a.experts, "top_k": a.top_k, "aux_loss": "none"}


def build(impl: str, a: argparse.Namespace):
    import transformers

    import moecompile as mc

    dense, ids = _dense(a)
    plan = mc.Plan.from_dict({"experts": _experts(a)})
    result = mc.convert(dense, plan, (ids[:, :-1],))  # the loop feeds ids[:, :-1]
    if impl == "moecompile":
        return result.module, ids
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    params = dict(result.module.named_parameters())
    mcfg = transformers.MixtralConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_local_experts=a.experts,
                                      num_experts_per_tok=a.top_k, router_jitter_noise=0.0,
                                      experts_implementation=impl.removeprefix("hf_mixtral_"))
    for i, layer in enumerate(dense.model.layers):
        block = MixtralSparseMoeBlock(mcfg)
        p = f"model.layers.{i}.mlp."
        with torch.no_grad():
            block.experts.gate_up_proj.copy_(params[p + "experts.w_gate_up"])
            block.experts.down_proj.copy_(params[p + "experts.w_down"])
            block.gate.weight.copy_(params[p + "router.weight"])
        layer.mlp = block
    return dense.train(), ids


def _ep_rank(rank: int, world: int, a: argparse.Namespace) -> dict:
    """One rank of moecompile's own training step with experts sharded over ``world`` ranks."""
    import torch.distributed as dist

    import moecompile as mc

    plan = mc.Plan.from_dict({"experts": _experts(a), "parallel": {"ep": world}})
    mc.distributed.init(plan)
    dense, ids = _dense(a)
    ids = ids.chunk(world)[rank]
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    result = mc.convert(dense, plan, (x,))
    step = mc.build_train_step(result, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), precision="fp32")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, losses = [], []
    for _ in range(a.warmup + a.steps):
        dist.barrier()
        t = time.perf_counter()
        m = step(x, y)
        t = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
        losses.append(m.loss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"times": times[a.warmup:], "losses": losses, "rss_mb": (peak - base) / 1024, "tokens": x.numel() * world}


def _ep_worker(impl: str, a: argparse.Namespace) -> dict:
    from moecompile.planner.microbench import run_ranks

    world = int(impl.removeprefix("moecompile_ep"))
    ranks = run_ranks(_ep_rank, world, (a,), threads=max(1, a.threads // world), timeout_s=1800)
    r0 = ranks[0]
    return _row(impl, r0["times"], r0["tokens"], max(r["rss_mb"] for r in ranks), r0["losses"])


def _row(impl: str, times: list[float], tokens: int, rss_mb: float, losses: list[float]) -> dict:
    """One table row from the timed (post-warm-up) steps."""
    return {"impl": impl, "ms": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times),
            "ms_max": 1e3 * max(times), "tokens_per_s": tokens / statistics.median(times),
            "peak_rss_growth_mb": rss_mb, "first_loss": losses[0], "last_loss": losses[-1]}


def worker(impl: str, a: argparse.Namespace) -> dict:
    if impl.startswith("moecompile_ep"):
        return _ep_worker(impl, a)
    torch.set_num_threads(a.threads)
    model, ids = build(impl, a)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = ids[:, :-1], ids[:, 1:]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, losses = [], []
    for _ in range(a.warmup + a.steps):
        t = time.perf_counter()
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return _row(impl, times[a.warmup:], x.numel(), (peak - base) / 1024, losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", nargs="+", default=["moecompile", "moecompile_ep2", "hf_mixtral_eager",
                                                  "hf_mixtral_grouped_mm"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=257)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a)))
        return
    argv = [x for x in sys.argv[1:]]
    rows = []
    for impl in a.impls:
        p = subprocess.run([sys.executable, __file__, *argv, "--worker", impl], capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode or not lines:
            rows.append({"impl": impl, "error": (p.stderr.strip().splitlines() or ["no output"])[-1][:200]})
        else:
            rows.append(json.loads(lines[-1]))
    print(f"Llama {a.layers} layers H={a.hidden} F={a.ffn}, {a.experts} experts top-{a.top_k}, batch {a.batch} x "
          f"{a.seq - 1} tokens, fp32, {a.threads} threads, median of {a.steps} steps after {a.warmup} warm-up "
          "(moecompile_ep2: 2 ranks x batch/2, threads/2 each, gloo)")
    print(f"{'impl':24s} {'ms/step':>9s} {'spread':>17s} {'tok/s':>8s} {'peak RSS +MB':>12s} {'loss first->last':>18s}")
    mc_row = next((r for r in rows if r["impl"] == "moecompile" and "ms" in r), None)
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:24s} not run: {r['error']}")
            continue
        print(f"{r['impl']:24s} {r['ms']:9.1f} {r['ms_min']:8.1f}..{r['ms_max']:<8.1f} {r['tokens_per_s']:8.0f} "
              f"{r['peak_rss_growth_mb']:12.1f} {r['first_loss']:8.3f}->{r['last_loss']:<8.3f}"
              + (f"  moecompile {r['ms'] / mc_row['ms']:.2f}x" if mc_row and r is not mc_row else ""))


if __name__ == "__main__":
    main()
