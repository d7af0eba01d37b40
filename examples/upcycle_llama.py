"""Upcycle a small Llama (built from a config) into an 8-expert top-2 MoE and train it on CPU.

Shows the whole foundation: the report of every pass, identical logits at init
(G = 1 and G = 2), then a few training steps of a byte-level language model on
text that is on every machine: the Python standard library's own source.

    python examples/upcycle_llama.py [--steps 30] [--granularity 2]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import transformers

import moecompile as mc
from moecompile.data import batches, stdlib_bytes

logging.getLogger("transformers").setLevel(logging.ERROR)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--granularity", type=int, default=1, choices=[1, 2, 4])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    dense = transformers.LlamaForCausalLM(config)
    data = stdlib_bytes()
    stream = batches(data, args.batch, args.seq)
    ids, _ = next(stream)

    for G in sorted({1, args.granularity}):
        plan = mc.Plan.from_dict({"experts": {"num_experts": 8, "top_k": 2 * G, "granularity": G,
                                              "aux_loss": "aux", "aux_loss_coeff": 1e-2}})
        result = mc.convert(dense, plan, (ids,))
        diff = (result.module(ids).logits - dense(ids).logits).abs().max().item()
        print(f"\n== granularity {G}: 8 experts, top-{2 * G} ==")
        print(result.report())
        print(f"max |MoE logits - dense logits| at init: {diff:.2e}")

    print(f"\ntraining the G={args.granularity} model for {args.steps} steps "
          f"(batch {args.batch} x {args.seq} bytes of the Python stdlib source)")
    model = result.module
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(stream)
        logits = model(x).logits
        lm = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss = lm + result.router_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 or step % 10 == 0 or step == args.steps:
            load = result.expert_load()["model.layers.0.mlp"]
            print(f"step {step:4d}  lm loss {lm.item():.3f}  layer-0 load {load.tolist()}")
    tokens = args.steps * args.batch * args.seq
    print(f"{tokens / (time.perf_counter() - start):,.0f} tokens/s")


if __name__ == "__main__":
    main()
