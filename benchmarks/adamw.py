"""One optimizer step over a model's parameters: torch.optim.AdamW against moecompile.AdamW (bf16 moments).

    python benchmarks/adamw.py [--model small-llama] [--experts 8] [--threads 2] [--steps 10] [--rounds 3]

The zoo model upcycled to E experts top-2 (fp32 parameters, as build_train_step's masters are), every
parameter given a fixed random gradient; each variant steps ``--steps`` times after one warm-up step, the
variants taking turns over ``--rounds`` rounds. Prints the median ms a step, the state bytes it keeps, and
the largest weight difference from torch.optim.AdamW's after the same steps (the for-loop implementation,
``foreach=False``: the same update, element by element).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import moecompile as mc
from moecompile.models import build_model

VARIANTS = {
    "torch_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    "torch_adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "moecompile_adamw_fp32": lambda ps: mc.AdamW(ps, lr=1e-3, moment_dtype=torch.float32),
    "moecompile_adamw_bf16": lambda ps: mc.AdamW(ps, lr=1e-3, moment_dtype=torch.bfloat16),
}


def _params(model: str, experts: int) -> list[torch.Tensor]:
    dense, (ids,) = build_model(model, batch_size=1, seq_len=16)
    result = mc.convert(dense, {"experts": {"num_experts": experts, "top_k": 2}}, (ids,))
    return [p.detach() for p in result.module.parameters() if p.requires_grad]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from moecompile.host_memory import keep_freed_memory

    keep_freed_memory()  # as build_train_step does on CPU: the temporaries' memory is reused, not page-faulted in
    torch.manual_seed(0)
    weights = _params(args.model, args.experts)
    grads = [torch.randn_like(w) for w in weights]
    built = {}
    for name, make in VARIANTS.items():
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(params, grads):
            p.grad = g
        opt = make(params)
        opt.step()  # warm-up: builds the state
        built[name] = (params, opt, [])
    for _ in range(args.rounds):
        for params, opt, times in built.values():
            start = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            times.append((time.perf_counter() - start) / args.steps)
    ref = built["torch_adamw"][0]
    n = sum(w.numel() for w in weights)
    print(f"{args.model} E{args.experts} top-2: {n / 1e6:.1f} M fp32 parameters, {args.threads} thread(s); median of "
          f"{args.rounds} rounds x {args.steps} steps after 1 warm-up, variants in turn")
    print(f"{'variant':<24} {'ms/step':>9} {'vs torch':>9} {'state MiB':>10} {'max |w - torch w|':>18}")
    base = statistics.median(built["torch_adamw"][2])
    for name, (params, opt, times) in built.items():
        ms = statistics.median(times)
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
        diff = max(float((p.detach() - r.detach()).abs().max()) for p, r in zip(params, ref))
        print(f"{name:<24} {1e3 * ms:>9.1f} {base / ms:>8.2f}x {state / 2**20:>10.2f} {diff:>18.2e}")


if __name__ == "__main__":
    main()
