"""``moecompile convert``: upcycle a dense checkpoint into a Hugging Face MoE checkpoint, and prove it.

    moecompile convert --model path/to/llama --out out/mixtral                  # 8 experts top-2
    moecompile convert --model path/to/qwen3 --out out/moe --set experts.num_experts=16 \\
        --set experts.top_k=4 --set experts.granularity=2                        # fine-grained Qwen3-MoE
    moecompile convert --model tiny-llama --out out/mixtral                     # a zoo model (random weights)

``--model`` is a ``save_pretrained`` directory (its weights are loaded), a config.json or a zoo
name. The plan's ``experts`` section decides the upcycling; parallelism, overlap, FP8 and
recompute are training-time choices and are not applied here (the checkpoint holds every
expert). Two checks run on a batch of example tokens, and both figures are printed:

  init:       dense logits vs the upcycled graph's (sparse / granular upcycling preserves the
              dense function; a plan that drops tokens, adds shared experts or noise may not)
  round trip: the upcycled graph's logits vs the written checkpoint loaded back with
              AutoModelForCausalLM.from_pretrained (must agree, or the command fails)

``--out`` receives config.json and model.safetensors in the target's layout (mixtral for
Llama / Mistral sources, qwen3_moe for Qwen3; ``--arch`` to choose), plus moecompile_plan.yaml
and moecompile_report.md (what every pass did).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HELP = "Upcycle a dense Hugging Face checkpoint (or config) into a Mixtral / Qwen3-MoE checkpoint, checked end to end."

DEFAULT_EXPERTS = {"num_experts": 8, "top_k": 2}
_RTOL = {"float32": 1e-4, "float64": 1e-8}  # round trip, relative to the logits' scale; else bf16/fp16 round-off
_LOW_PRECISION_RTOL = 2e-2


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..export_hf import ARCHS

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n\n", 1)[1]
    p.add_argument("--model", required=True, metavar="DIR|CONFIG|NAME",
                   help="a save_pretrained directory (weights loaded), a config.json or a zoo model (random weights)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the Hugging Face MoE checkpoint is written")
    p.add_argument("--plan", default=None, metavar="PLAN.yaml",
                   help="a plan whose experts section is used (default: 8 experts top-2)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="experts.FIELD=VALUE",
                   help="change one experts field (repeatable), e.g. experts.num_experts=16")
    p.add_argument("--arch", choices=("auto", *ARCHS), default="auto",
                   help="target architecture (default auto: qwen3_moe for Qwen3, mixtral for Llama / Mistral)")
    p.add_argument("--config", dest="configs", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the model's config, e.g. num_hidden_layers=4 (shapes of a "
                        "checkpoint's weights cannot change)")
    p.add_argument("--dtype", default=None, metavar="DTYPE",
                   help="load and write weights in this dtype, e.g. bfloat16 (default float32)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences in the check batch (default 2)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per check sequence (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the check tokens and of random weights (the router's: experts.seed)")


def run(args: argparse.Namespace) -> int:
    summary = convert_checkpoint(args)
    for key, value in summary.items():
        print(f"  {key:<12}{value}")
    return 0


def convert_checkpoint(args: argparse.Namespace) -> dict[str, str]:
    """Build the dense model, upcycle it, check it, export it, load the export back, compare."""
    import torch

    from .. import convert
    from ..errors import MoecompileError
    from ..export_hf import arch_for, export_hf
    from ..costs import human
    from ..models import build_model, has_weights, load_config, own_experts
    from ..plan import Plan
    from ..report import render_markdown, report_rows
    from .inspect import _key_value, apply_sets

    ignored = [s for s in args.sets if not s.startswith("experts.")]
    if ignored:
        raise MoecompileError(f"--set {ignored[0]}: convert applies only the experts section; "
                              "parallel, overlap, fp8 and recompute are chosen when training")
    plan = Plan.from_file(args.plan) if args.plan else Plan.from_dict({"experts": DEFAULT_EXPERTS})
    plan = _experts_plan(apply_sets(plan, args.sets))
    out = Path(args.out)
    if has_weights(args.model) and out.resolve() == Path(args.model).resolve():
        raise MoecompileError(f"--out {out} is the source checkpoint; writing there would replace the dense "
                              "weights: choose another directory")
    overrides = dict(_key_value(item, "--config") for item in args.configs)
    own = own_experts(load_config(args.model, **overrides))
    if own:
        raise MoecompileError(f"{args.model} is an MoE already ({own['num_experts']} experts top-{own['top_k']}): "
                              f"there is no dense FFN to upcycle; train it as it is with "
                              f"`moecompile train --model {args.model}`")
    dense, (ids,) = build_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                                dtype=args.dtype, **overrides)
    arch = args.arch if args.arch != "auto" else arch_for(getattr(dense.config, "model_type", None))
    dense.eval()
    start = time.perf_counter()
    result = convert(dense, plan, (ids,))
    convert_s = time.perf_counter() - start
    with torch.no_grad():
        want = dense(ids).logits
        got = result.module(ids).logits
    init_delta = _max_rel(got, want)

    export_hf(result, out, arch=arch, config=dense.config)
    plan.save(out / "moecompile_plan.yaml")
    (out / "moecompile_report.md").write_text(render_markdown(report_rows(result)))
    reloaded = _load(out)
    with torch.no_grad():
        back = reloaded(ids).logits
    trip_delta = _max_rel(back, got)
    dtype = str(got.dtype).replace("torch.", "")
    tol = _RTOL.get(dtype, _LOW_PRECISION_RTOL)
    if trip_delta > tol:
        raise MoecompileError(
            f"the checkpoint written to {out} does not reproduce the upcycled model: max |delta logit| is "
            f"{trip_delta:.3g} of the logits' scale (allowed {tol:g}); "
            "this is a moecompile bug, please report it with moecompile_plan.yaml")

    e = plan.experts
    dense_params = sum(p.numel() for p in dense.parameters())
    moe_params = sum(p.numel() for p in reloaded.parameters())
    preserved = init_delta <= tol
    return {
        "source": f"{args.model} ({type(dense).__name__}, {'weights loaded' if has_weights(args.model) else 'random weights'})",
        "wrote": f"{out}/ as {arch} ({type(reloaded).__name__}): {len(result.record('upcycle').data.get('layers', []))} "
                 f"MoE layers, {e.num_experts} experts top-{e.top_k}, G={e.granularity}",
        "params": f"{human(dense_params)} dense -> {human(moe_params)} ({dtype})",
        "init": f"max |delta logit| vs dense {init_delta:.2e} of the logits' scale"
                + (" (function preserved)" if preserved else " (NOT function-preserving under this plan)"),
        "round trip": f"max |delta logit| vs from_pretrained {trip_delta:.2e} of the logits' scale",
        "time": f"convert {convert_s:.1f} s",
    }


def _experts_plan(plan: Any) -> Any:
    """Only the upcycling: a Hugging Face MoE checkpoint holds every expert and routes dropless."""
    from ..plan import Plan

    experts = plan.to_dict()["experts"]
    if experts.get("capacity_factor") is not None:
        print(f"moecompile convert: experts.capacity_factor={experts['capacity_factor']} is a training-time choice; "
              "the checkpoint routes dropless", file=sys.stderr)
        experts["capacity_factor"] = None
    return Plan.from_dict({"experts": experts})


def _max_rel(a: Any, b: Any) -> float:
    """max |a - b| over the scale of b: one number that reads the same for any vocabulary and dtype."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    from ..models import quiet_transformers

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model.eval()
