"""``moecompile bench``: one model's training step under moecompile, beside the dense model and HF's own MoE.

    moecompile bench                                            # small-llama, 8 experts top-2, 8 x 128 tokens
    moecompile bench --model path/to/llama --set experts.num_experts=16 --nproc 2
    moecompile bench --model tiny-qwen3 --config vocab_size=256 --variants moecompile,hf_grouped_mm --json out.json

Each variant is a separate process training the same tokens from the same weights (see
``moecompile.bench``): ``dense`` (the source model), ``moecompile`` (``build_train_step``),
``moecompile_epN`` with ``--nproc N`` (N ranks over gloo, batch / N each), and ``hf_eager`` /
``hf_grouped_mm`` (the converted model exported and loaded back as Hugging Face's Mixtral or
Qwen3-MoE). The one-process variants take their steps in turn inside one process (per round),
because a process's speed on a shared machine drifts more than the differences measured; each
also runs alone once for its memory. They all hold their weights at once: budget about four
copies of the model and its optimizer state. The table gives the median step after warm-up over
all rounds, tokens/s, the ratio against the
fastest Hugging Face MoE and against dense, peak RSS growth, and the first / last lm loss (the
MoE variants start from the same function, so their first losses agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

HELP = "Time the training step of a model under a plan: moecompile vs the dense model vs Hugging Face's MoE classes."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench import EXTRA_VARIANTS, VARIANTS, BenchSpec
    from ..devices import CHOICES as DEVICES

    d = BenchSpec()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n\n", 1)[1]
    p.add_argument("--model", default=d.model, metavar="NAME|CONFIG|DIR",
                   help=f"zoo model, config.json or save_pretrained directory (default {d.model})")
    p.add_argument("--config", dest="configs", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the model's config (repeatable)")
    p.add_argument("--plan", default=None, metavar="PLAN.yaml", help="the plan (default: 8 experts top-2)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="change one plan field (repeatable)")
    p.add_argument("--variants", default=",".join(VARIANTS), metavar="NAME,...",
                   help=f"what to time (default {','.join(VARIANTS)}; also {','.join(EXTRA_VARIANTS)}; --nproc N adds "
                        "moecompile_epN)")
    p.add_argument("--nproc", type=int, default=1, help="also time moecompile at ep = N over N local ranks")
    p.add_argument("--batch", type=int, default=d.batch, help=f"sequences per step (default {d.batch})")
    p.add_argument("--seq", type=int, default=d.seq, help=f"tokens per sequence (default {d.seq})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"timed steps (default {d.steps})")
    p.add_argument("--warmup", type=int, default=d.warmup, help=f"untimed steps first (default {d.warmup})")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help=f"fresh processes to pool steps from; 3 or more on a shared machine (default {d.rounds})")
    p.add_argument("--threads", type=int, default=0, help="torch threads in all (default: every core); "
                   "moecompile_epN gives each rank threads / N")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--device", choices=DEVICES, default=d.device,
                   help="cuda: every variant on GPUs (rank r of an ep variant on GPU r, NCCL); cpu: gloo; auto: cuda "
                        "when each rank of the widest variant has a GPU (default auto)")


def run(args: argparse.Namespace) -> int:
    from ..bench import BenchSpec, bench, render
    from ..errors import MoecompileError
    from ..models import load_config, own_experts
    from .inspect import _key_value, apply_sets, load_plan

    defaults = dataclasses.asdict(BenchSpec())["plan"]["experts"]
    model = args.model or BenchSpec().model
    overrides = dict(_key_value(c, "--config") for c in args.configs)
    plan = load_plan(args.plan, [], experts={**defaults, **own_experts(load_config(model, **overrides))})
    plan = apply_sets(plan, args.sets).to_dict()
    if plan["parallel"]["ep"] != 1:
        raise MoecompileError("bench sets the expert-parallel size itself (ep = 1, and N for --nproc N); "
                              "leave parallel.ep at 1")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.nproc > 1 and f"moecompile_ep{args.nproc}" not in variants:
        variants.append(f"moecompile_ep{args.nproc}")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        raise MoecompileError(f"--steps and --rounds must be >= 1 and --warmup >= 0, got {args.steps}, "
                              f"{args.rounds} and {args.warmup}")
    spec = BenchSpec(model=model, plan=plan, config=overrides,
                     batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                     device=args.device)
    rows = bench(spec, tuple(variants), threads=args.threads or None)
    print(render(spec, rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": dataclasses.asdict(spec),
                                               "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    return 0
