"""``moecompile plan``: which plan fits a cluster, how fast it should run, and a plan.yaml for convert.

    moecompile plan --model deepseek-v3 --cluster h100 --gpus 256 --global-batch 1024 --seq-len 4096
    moecompile plan --model tiny-llama --experts '{"num_experts": 8, "top_k": 2}' --cluster h100 \\
        --gpus 8 --global-batch 64 --seq-len 128 --explain --out plan.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..planner import Cluster

HELP = "Rank the plans that fit a cluster by predicted step time; write the best as plan.yaml."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="deepseek-v3 | qwen3-235b-a22b | a zoo name | a Hugging Face config.json")
    p.add_argument("--cluster", default="h100", help="preset: h100, h200, gb200 (default h100)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in the cluster (default: one node)")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--experts", default=None, help="experts plan as JSON, for a dense model (or to override an MoE's)")
    p.add_argument("--micro-batches", default="1,2,4", help="micro-batch sizes to try (sequences), comma-separated")
    p.add_argument("--etp", default=None,
                   help="parallel.etp sizes to try, comma-separated (default 1,2,4,8: more than 1 only where ep x "
                        "etp is not a legal ep); 1 never cuts experts into slices")
    p.add_argument("--fp8", default=None, help="FP8 recipes to try, e.g. none,blockwise (default: all the pass has)")
    p.add_argument("--shard-optimizer", choices=("auto", "on", "off"), default="auto",
                   help="parallel.shard_optimizer (ZeRO-1): auto tries both on more than one GPU; off for an "
                        "optimizer that is not elementwise")
    p.add_argument("--shard-gradients", choices=("auto", "on", "off"), default="auto",
                   help="parallel.shard_gradients (ZeRO-2, on top of ZeRO-1): auto tries both wherever the optimizer "
                        "is sharded; on shards both in every plan")
    p.add_argument("--shard-parameters", choices=("auto", "on", "off"), default="auto",
                   help="parallel.shard_parameters (ZeRO-3 / FSDP, on top of ZeRO-2): auto tries both wherever the "
                        "gradients are sharded; on shards all three in every plan")
    p.add_argument("--adam-moments", choices=("fp32", "bf16"), default="fp32",
                   help="AdamW's moments in every plan: fp32 (torch.optim.AdamW) or bf16 (moecompile.AdamW, "
                        "DeepSeek-V3's recipe: 4 bytes a parameter less optimizer state)")
    p.add_argument("--offload-optimizer", choices=("auto", "off"), default="auto",
                   help="parallel.offload_optimizer: auto gives a plan that does not fit otherwise the least share "
                        "of its optimizer in host memory that makes it fit (slower: PCIe and a CPU update); off "
                        "keeps every plan's optimizer on the GPU")
    p.add_argument("--host-efficiency", default=None, metavar="F|measure",
                   help="the share of the host's DRAM bandwidth a CPU optimizer update reaches, which prices "
                        "offload (default: the preset's assumption, 0.5); measure: time this machine's update, as "
                        "a host of the cluster serving its GPUs (run it on one of the cluster's nodes)")
    p.add_argument("--top", type=int, default=5, help="plans to show")
    p.add_argument("--explain", action="store_true", help="print every term of the best plan's estimate")
    p.add_argument("--out", default=None, help="write the best plan here (plan.yaml)")


def run(args: argparse.Namespace) -> int:
    from ..errors import MoecompileError
    from ..planner import SearchSpace, plan_for, preset

    try:
        experts = json.loads(args.experts) if args.experts else None
        overrides = {"micro_batches": tuple(int(x) for x in args.micro_batches.split(",") if x)}
        space = SearchSpace.available(**overrides)
        if args.etp:
            etps = tuple(int(x) for x in args.etp.split(",") if x.strip().isdigit())
            if not etps or min(etps) < 1 or len(etps) != len([x for x in args.etp.split(",") if x]):
                raise MoecompileError(f"--etp {args.etp}: give sizes >= 1, comma-separated (e.g. 1,2)")
            space = dataclasses.replace(space, etps=etps)
        if args.fp8:
            space = dataclasses.replace(space, fp8_recipes=tuple(r for r in args.fp8.split(",") if r))
        if args.shard_gradients == "on" and args.shard_optimizer == "off":
            raise MoecompileError("--shard-gradients on needs the sharded optimizer (its ranges are the gradients' "
                                  "ranges): drop --shard-optimizer off, or use --shard-gradients off")
        if args.shard_parameters == "on" and "off" in (args.shard_optimizer, args.shard_gradients):
            raise MoecompileError("--shard-parameters on needs the sharded optimizer and gradients (ZeRO-3 shards "
                                  "the parameters of their ranges): drop --shard-optimizer off / --shard-gradients "
                                  "off, or use --shard-parameters off")
        grads = "on" if args.shard_parameters == "on" else args.shard_gradients  # ZeRO-3 implies ZeRO-2 and -1
        if args.shard_optimizer != "auto" or grads == "on":
            space = dataclasses.replace(space, shard_optimizer=(args.shard_optimizer != "off",))
        if grads != "auto":
            space = dataclasses.replace(space, shard_gradients=(grads == "on",))
        if args.shard_parameters != "auto":
            space = dataclasses.replace(space, shard_parameters=(args.shard_parameters == "on",))
        if args.adam_moments == "bf16":
            space = dataclasses.replace(space, moment_bytes=2)
        if args.offload_optimizer == "off":
            space = dataclasses.replace(space, offload_optimizer=False)
        cluster = _with_host_efficiency(preset(args.cluster, args.gpus), args.host_efficiency, args.adam_moments)
        report = plan_for(args.model, cluster, global_batch=args.global_batch,
                          seq_len=args.seq_len, experts=experts, space=space,
                          progress=lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
    except (MoecompileError, json.JSONDecodeError) as e:
        print(f"moecompile plan: {e}", file=sys.stderr)
        return 2
    print(report.table(args.top))
    if not report.ranked:
        return 1
    if args.explain:
        print()
        print(report.explain())
    if args.out:
        report.save(args.out)
        print(f"\nwrote the best plan to {args.out}")
        mb, per_gpu = report.best.candidate.micro_batch, args.global_batch // report.cluster.gpus
        if mb < per_gpu:  # the plan holds no batch: the graph's traced batch is the micro-batch
            print(f"it trains in micro-batches of {mb} of the {per_gpu} sequences per GPU: convert with example "
                  f"inputs of {mb} and step on all {per_gpu}, the step accumulates (moecompile train --micro-batch {mb})")
        if report.best.candidate.moment_bytes == 2:  # the optimizer is build_train_step's, not the plan's
            print("its optimizer keeps AdamW's moments in bf16: build_train_step(..., optimizer=lambda ps: "
                  "moecompile.AdamW(ps, moment_dtype=torch.bfloat16)) (moecompile train --adam-moments bf16)")
    return 0


def _with_host_efficiency(cluster: Cluster, value: str | None, moments: str) -> Cluster:
    """The cluster with ``--host-efficiency``: given, measured on this machine (said on stdout), or the preset's."""
    import torch

    from ..errors import MoecompileError
    from ..planner.host_bench import measure_host_update

    if value is None:
        return cluster
    if value == "measure":
        print(f"... timing the offloaded optimizer update as {cluster.host_gpus} GPUs' ranks would run it on this "
              "host", file=sys.stderr, flush=True)
        rate = measure_host_update(cluster.host_gpus,
                                   moment_dtype=torch.bfloat16 if moments == "bf16" else torch.float32)
        print(rate.describe(cluster))
        return rate.applied_to(cluster)
    try:
        return dataclasses.replace(cluster, host_efficiency=float(value))
    except ValueError:
        raise MoecompileError(f"--host-efficiency {value!r} must be a share in (0, 1] or 'measure'") from None
