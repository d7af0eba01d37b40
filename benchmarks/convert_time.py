"""How long `moecompile.convert` takes, by pass, as a model gets deeper, beside the export it starts from.

    python benchmarks/convert_time.py [--layers 2,8,32] [--hidden 256] [--repeats 2]

A Llama built from a config (no download) is upcycled into 8 experts top-2 (one process). For each
depth it prints the best of ``--repeats`` converts, the part of it that is `torch.export` of the
dense model (the floor: what tracing alone costs, timed on its own in the same run), each pass's
wall time from the conversion's own records, and the per-layer slope between the shallowest and the
deepest model. A warm-up convert of a 1-layer model runs first, so no row pays the first-call costs.
"""
from __future__ import annotations

import argparse
import time

import torch
import transformers

import moecompile as mc


def _model(layers: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg)


def _best(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,8,32")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    plan = {"experts": {"num_experts": 8, "top_k": 2}}
    ids = torch.randint(0, 1024, (1, args.seq), generator=torch.Generator().manual_seed(0))
    mc.convert(_model(1, args.hidden), plan, (ids,))  # warm-up: first-call costs of torch and the passes
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}; "
          f"Llama hidden {args.hidden}, seq {args.seq}, 8 experts top-2; best of {args.repeats}")
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        model = _model(layers, args.hidden)
        export_s, _ = _best(lambda: torch.export.export(model, (ids,), {"use_cache": False}, strict=False),
                            args.repeats)
        convert_s, result = _best(lambda: mc.convert(model, plan, (ids,)), args.repeats)
        passes = {r.name: r.wall_s for r in result.history[1:]}
        rows.append((layers, convert_s))
        by_pass = ", ".join(f"{name} {s:.2f}" for name, s in passes.items() if s >= 0.005)
        print(f"{layers:3d} layers: convert {convert_s:6.2f} s = {convert_s / export_s:4.1f}x torch.export "
              f"({export_s:.2f} s); passes (s): {by_pass}")
    if len(rows) > 1:
        (l0, s0), (l1, s1) = rows[0], rows[-1]
        print(f"per layer: {(s1 - s0) / (l1 - l0) * 1e3:.0f} ms of convert")


if __name__ == "__main__":
    main()
