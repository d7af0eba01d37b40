"""Benchmark: activation memory and step time of recompute, FP8 and offload on a converted Llama (CPU).

    python benchmarks/memory.py                       # bf16 small-llama, 2 x 256 tokens, every variant
    python benchmarks/memory.py --dtype float32 --rounds 5 --quality 200 --json out.json

The model is the zoo's ``small-llama`` (4 layers, hidden 256, FFN 688, vocab 1024)
upcycled to 8 experts top-2 with one shared expert in layers 1-3 (layer 0 stays
dense, as DeepSeek keeps its first layers). Per variant (one plan section changed):

- ``est``: ``estimate_memory(...).activations`` — fake tensors, nothing runs;
- ``measured``: bytes allocated during a real forward and still alive when it ends
  (``measure_memory``: CPU allocator events from ``torch.profiler``), the same quantity;
- ``err``: est vs measured; ``Δ``: measured vs the baseline. With offload the estimate splits
  device activations (``est``) from host copies (``host MiB``); on a CPU run host *is* the
  device, so ``err`` compares est + host MiB with what the CPU allocator saw;
- ``step peak``: highest allocation above the start over forward + backward;
- ``step``: forward + loss + backward + AdamW step, best of ``--rounds`` rounds of
  ``--steps`` steps, variants interleaved round-robin so machine drift hits all alike;
  ``CPU ms`` is the process CPU time of a step (all threads), which other jobs on a shared
  machine disturb far less than wall time; ``Δ step`` compares CPU time;
- ``expert GEMM saved``: bytes the expert GEMMs keep for backward, and ``expert W``: bytes of
  the expert weights as the GEMMs read them (the param, or its float8 copy + scales),
  both measured on real tensors.

``--quality N`` also trains a tiny Llama N steps per FP8 recipe and prints how far its
(10-step smoothed) loss curve strays from float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

import moecompile as mc
from moecompile.kernels.fp8_linear import _quantize
from moecompile.memory import profile_activations
from moecompile.memory_estimate import example_inputs
from moecompile.models import build_model

EXPERTS = {"num_experts": 8, "top_k": 2, "shared_experts": 1, "layers": [r"model\.layers\.[1-9]\d*\.mlp"]}
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    **{f"recompute {k}": {"recompute": {"modules": [k]}}
       for k in ("router", "moe_act", "layernorm", "shared_experts", "moe", "attention", "mlp")},
    "recompute moe_act+layernorm": {"recompute": {"modules": ["moe_act", "layernorm"]}},
    "budget 50%": {"recompute": {"budget": 0.5}},
    "fp8 tensorwise": {"fp8": {"recipe": "tensorwise"}},
    "fp8 blockwise": {"fp8": {"recipe": "blockwise"}},
    "offload moe+attention": {"recompute": {"offload": ["moe", "attention"]}},
}


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _step_fn(result: Any, ids: torch.Tensor, opt: torch.optim.Optimizer):
    def step() -> None:
        logits = result.module(ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        (loss + result.router_loss()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _expert_bytes(result: Any, ids: torch.Tensor) -> tuple[int | None, int | None]:
    """(bytes the expert GEMMs save for backward, bytes of the expert weights as those GEMMs read them)."""
    gm = result.module
    if any(getattr(m, "memory_region", None) for m in gm.children()):
        return None, None  # the expert GEMMs may sit inside a region's own graph: not compared
    prof = profile_activations(gm.graph, gm, example_inputs(result), real=True)
    saved = weights = 0
    for n in gm.graph.nodes:
        target = str(n.target)
        if n.op != "call_function" or "moecompile" not in target or "grouped" not in target or "wgrad" in target:
            continue
        saved += sum(t.nbytes for t in prof.tensors.values() if n.name in t.savers and t.nbytes > 64)
        w = n.args[1]
        w_val = gm.get_parameter(str(w.target)) if w.op == "get_attr" else None
        if w_val is None:
            continue
        if "fp8" in target:
            recipe, block, hist = n.args[5], n.args[7], n.args[4]
            hist = gm.get_buffer(str(hist.target)) if hist is not None else None
            q, s, _ = _quantize(w_val.detach(), "weight", recipe, "e4m3", block, hist, 1)
            weights += q.nbytes + s.nbytes
        else:
            weights += w_val.nbytes
    return saved, weights


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    model, (ids,) = build_model("small-llama", batch_size=args.batch, seq_len=args.seq, dtype=args.dtype)
    names = [v for v in VARIANTS if not args.only or any(o in v for o in args.only)]
    rows, steps = [], {}
    for name in names:
        plan = {"experts": EXPERTS, **VARIANTS[name]}
        t0 = time.perf_counter()
        result = mc.convert(model, plan, (ids,))
        t1 = time.perf_counter()
        est = mc.estimate_memory(result, by_pass=False)
        t2 = time.perf_counter()
        measured = mc.measure_memory(lambda: result.module(ids).logits, lambda out: out.float().sum().backward())
        result.module.zero_grad(set_to_none=True)
        saved, weights = _expert_bytes(result, ids)
        rec = result.record("recompute").decisions + result.record("fp8").decisions
        rows.append({"variant": name, "est": est.activations, "measured": measured.retained, "peak": measured.peak,
                     "offloaded": est.offloaded, "expert_saved": saved, "expert_weights": weights,
                     "convert_s": t1 - t0, "estimate_s": t2 - t1, "decisions": rec})
        opt = torch.optim.AdamW(result.module.parameters(), lr=1e-4)
        steps[name] = (_step_fn(result, ids, opt), [])
        steps[name][0]()  # warm-up (allocations, optimizer state)
        print(f"  converted {name} ({t1 - t0:.1f} s, estimate {t2 - t1:.1f} s)", file=sys.stderr)
    for r in range(args.rounds):
        for name in names:
            fn, times = steps[name]
            t, c = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                fn()
            times.append(((time.perf_counter() - t) / args.steps, (time.process_time() - c) / args.steps))
        print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)
    for row in rows:
        times = steps[row["variant"]][1]
        row |= {"step_wall_s": min(w for w, _ in times), "step_s": min(c for _, c in times),
                "step_cpu_median_s": statistics.median(c for _, c in times)}
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0] if rows and rows[0]["variant"] == "baseline" else None
    head = ("variant", "est MiB", "measured", "err", "Δ act", "step peak", "wall ms", "CPU ms", "Δ step",
            "expert GEMM saved", "expert W", "host MiB")
    out = []
    for r in rows:
        d_act = f"{r['measured'] / base['measured'] - 1:+.1%}" if base else "-"
        d_t = f"{r['step_s'] / base['step_s'] - 1:+.1%}" if base else "-"
        out.append((r["variant"], mib(r["est"]), mib(r["measured"]), f"{r['est_vs_measured']:+.1%}", d_act,
                    mib(r["peak"]), f"{r['step_wall_s'] * 1e3:.0f}", f"{r['step_s'] * 1e3:.0f}", d_t, mib(r["expert_saved"]), mib(r["expert_weights"]),
                    mib(r["offloaded"])))
    widths = [max(len(str(x[i])) for x in [head, *out]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(x, widths)))
             for x in [head, *out]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def quality(steps: int) -> list[str]:
    """A tiny Llama learning a bigram language, float32 vs each FP8 recipe; the worst curve deviation."""
    import transformers as T

    def train(recipe: str) -> list[float]:
        torch.manual_seed(0)
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        table_ = torch.randint(0, 64, (64, 2), generator=torch.Generator().manual_seed(1))

        def batch(step: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(100 + step)
            x = torch.zeros(8, 33, dtype=torch.long)
            x[:, 0] = torch.randint(0, 64, (8,), generator=g)
            for t in range(1, 33):
                x[:, t] = table_[x[:, t - 1], torch.randint(0, 2, (8,), generator=g)]
            return x

        result = mc.convert(model, {"experts": {"num_experts": 4, "top_k": 2}, "fp8": {"recipe": recipe, "block_size": 32}},
                            (batch(0)[:, :-1],))
        opt = torch.optim.AdamW(result.module.parameters(), lr=3e-3)
        losses = []
        for s in range(steps):
            b = batch(s)
            loss = F.cross_entropy(result.module(b[:, :-1]).logits.reshape(-1, 64), b[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return [sum(losses[max(0, i - 9): i + 1]) / len(losses[max(0, i - 9): i + 1]) for i in range(steps)]

    base = train("none")
    lines = [f"quality, {steps} steps: float32 loss {base[0]:.3f} -> {base[-1]:.3f}"]
    for recipe in ("tensorwise", "delayed", "blockwise"):
        curve = train(recipe)
        worst = max(abs(a - b) / b for a, b in zip(curve, base))
        lines.append(f"  fp8 {recipe:10s} final {curve[-1]:.3f}  worst deviation of the smoothed curve {worst:.2%}")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    p.add_argument("--only", nargs="*", help="run only variants whose name contains one of these")
    p.add_argument("--quality", type=int, default=0, help="also run the FP8 loss-curve check for N steps")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    print(f"small-llama {args.dtype}, {args.batch} x {args.seq} tokens, {torch.get_num_threads()} threads", file=sys.stderr)
    rows = run(args)
    for r in rows:  # CPU: offloaded copies land in the same memory the measurement sees
        r["est_vs_measured"] = (r["est"] + (r["offloaded"] or 0)) / r["measured"] - 1
    print(f"\nactivation memory and step time (small-llama, {args.dtype}, {args.batch}x{args.seq} tokens, "
          f"experts {EXPERTS['num_experts']} top-{EXPERTS['top_k']} + {EXPERTS['shared_experts']} shared, layers 1-3)")
    print(table(rows))
    errors = [abs(r["est_vs_measured"]) for r in rows]
    print(f"\nestimator vs measured: worst {max(errors):.2%}, mean {statistics.mean(errors):.2%} (target: within 15%)")
    by = {r["variant"]: r for r in rows}
    if "baseline" in by and "recompute moe_act+layernorm" in by:
        b, r = by["baseline"], by["recompute moe_act+layernorm"]
        print(f"moe_act+layernorm recompute: activations {r['measured'] / b['measured'] - 1:+.1%} (target <= -30%), "
              f"step CPU time {r['step_s'] / b['step_s'] - 1:+.1%} (target <= +10%)")
    for recipe in ("fp8 tensorwise", "fp8 blockwise"):
        if "baseline" in by and recipe in by and by["baseline"]["expert_saved"]:
            b, r = by["baseline"], by[recipe]
            print(f"{recipe}: expert GEMM saved activations x{r['expert_saved'] / b['expert_saved']:.3f}, expert weights "
                  f"as read x{r['expert_weights'] / b['expert_weights']:.3f} vs {args.dtype} (target x0.5 vs bf16)")
    if args.quality:
        print("\n" + "\n".join(quality(args.quality)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2, default=str)


if __name__ == "__main__":
    main()
