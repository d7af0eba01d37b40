"""A full training step of an upcycled small Llama: moecompile against Hugging Face's Mixtral and the dense model.

A fixed setting of ``moecompile bench`` (see ``moecompile/bench.py``): every variant trains the
same tokens from the same converted weights in its own processes, with the same loop (forward,
cross-entropy, backward, AdamW); ``hf_*`` is the export loaded back as ``MixtralForCausalLM``
with that ``experts_implementation``; ``moecompile_ep2`` is 2 gloo ranks with half the batch and
half the threads each, experts sharded 2 ways (slowest rank's time, largest rank's memory).
Rounds of fresh processes are interleaved; the table pools their timed steps.

    python benchmarks/train_step.py [--steps 6] [--rounds 3] [--batch 8] [--seq 256] [--hidden 256] [--ffn 512]
                                    [--host-memory keep|system]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from moecompile.bench import BenchSpec, bench, render

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+",
                    default=["dense", "moecompile", "moecompile_ep2", "hf_eager", "hf_grouped_mm"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--host-memory", choices=["keep", "system"], default="keep",
                    help="keep (what build_train_step does on CPU): every variant's process reuses freed heap; "
                         "system: glibc's default malloc for every variant")
    a = ap.parse_args()
    spec = BenchSpec(
        model="tiny-llama", steps=a.steps, warmup=a.warmup, rounds=a.rounds, batch=a.batch, seq=a.seq,
        config={"vocab_size": 256, "hidden_size": a.hidden, "intermediate_size": a.ffn, "num_hidden_layers": a.layers,
                "max_position_embeddings": a.seq},
        plan={"experts": {"num_experts": a.experts, "top_k": a.top_k, "aux_loss": "none"}},
        keep_host_memory=a.host_memory == "keep",
    )
    start = time.perf_counter()
    rows = bench(spec, tuple(a.variants), threads=a.threads)
    print(f"Llama {a.layers} layers H={a.hidden} F={a.ffn}, fp32, {a.threads} threads, host memory: {a.host_memory} ({time.perf_counter() - start:.0f} s)")
    print(render(spec, rows))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_step.json").write_text(json.dumps(
        {"spec": dataclasses.asdict(spec), "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
