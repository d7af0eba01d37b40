"""``moecompile train``: the main job. Upcycle a dense model and train it, expert-parallel, on real text.

    moecompile train                                  # small Llama -> 8 experts top-2, ep=2 on 2 local ranks
    moecompile train --steps 300 --nproc 4            # ep=4 (the plan's ep defaults to --nproc)
    moecompile train --model tiny-qwen3 --plan plan.yaml --set experts.top_k=1
    torchrun --nproc-per-node 2 -m moecompile train   # the same under torchrun

A byte-level language model over the Python standard library's own source (offline, on
every machine). Rank 0 shows a progress bar, a loss / expert-load line every --log-every
steps, and a summary; a checkpoint is written at the end (--resume continues from it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

HELP = "Upcycle a dense model into an MoE and train it (ep over local ranks or torchrun, CPU or GPU) on byte-level text."

DEFAULT_MODEL = "tiny-llama"
DEFAULT_MODEL_CONFIG = {"hidden_size": 128, "intermediate_size": 256}  # only when --model is not given
DEFAULT_PLAN = {"experts": {"num_experts": 8, "top_k": 2, "aux_loss": "global_aux", "aux_loss_coeff": 1e-2,
                            "router_noise": 0.01}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..devices import CHOICES as DEVICES

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n\n", 1)[1]
    p.add_argument("--model", default=None, metavar="NAME|CONFIG",
                   help=f"zoo model, Hugging Face config.json, or a save_pretrained directory whose weights are "
                        f"upcycled (default: {DEFAULT_MODEL} with hidden 128, FFN 256)")
    p.add_argument("--config", dest="configs", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the model's config (repeatable), e.g. num_hidden_layers=4")
    p.add_argument("--plan", default=None, metavar="PLAN.yaml",
                   help="the plan (default: 8 experts top-2, aux loss 0.01, router noise 0.01; ep = --nproc; a model "
                        "with MoE layers of its own keeps its experts)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="change one plan field (repeatable), e.g. parallel.dispatcher=allgather")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn, over gloo on the CPU or NCCL on "
                   "GPUs (see --device; default 2; ignored under torchrun, which sets the world)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in total (default 300)")
    p.add_argument("--batch", type=int, default=8, help="global batch, split over the ranks (default 8)")
    p.add_argument("--seq", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--micro-batch", type=int, default=None, metavar="N",
                   help="sequences per forward on each rank (default: the rank's whole batch); the step "
                        "accumulates gradients over batch / ranks / N micro-batches")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (default 3e-3)")
    p.add_argument("--adam-moments", choices=["fp32", "bf16"], default="fp32",
                   help="AdamW's two moments in fp32 (torch.optim.AdamW) or bf16 (moecompile.AdamW, DeepSeek-V3's "
                        "recipe: half the optimizer state; default fp32)")
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                   help="learning rate after the warm-up: cosine decay to --min-lr x lr at the last step, or "
                        "constant (default cosine)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps of linear warm-up from 0 (default: a tenth of --steps, at most 10)")
    p.add_argument("--min-lr", type=float, default=0.1, help="cosine's final lr as a fraction of --lr (default 0.1)")
    p.add_argument("--compile", action="store_true",
                   help="run the forward under torch.compile (TorchInductor; the first step compiles it)")
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (0: off; default 1)")
    p.add_argument("--log-every", type=int, default=25, help="print loss and expert load every N steps (default 25)")
    p.add_argument("--out", default="out/train", metavar="DIR", help="checkpoint and plan go here (default out/train)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out if there is one")
    p.add_argument("--export-hf", default=None, metavar="DIR", help="also write a Hugging Face model (mixtral or "
                   "qwen3_moe, from the source architecture) at the end")
    p.add_argument("--data", default=None, metavar="DIR", help="directory of *.py text (default: the Python stdlib)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order (default 0)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where each rank trains: cuda (GPU <local rank>, NCCL) or cpu (gloo); auto: cuda when every "
                        "rank on this machine has a GPU of its own, else cpu (default auto)")


def run(args: argparse.Namespace) -> int:
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun or args.nproc == 1:
        train(args, rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
        return 0
    preflight(args, args.nproc)  # a bad argument is one message here, not one per rank and then "a rank died"
    return _spawn(args)


def _spawn(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    from ..distributed import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    try:
        mp.start_processes(_worker, args=(args, args.nproc), nprocs=args.nproc, start_method="spawn")
    except mp.ProcessRaisedException as e:
        print(f"moecompile train: a rank failed:\n{e}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"moecompile train: a rank died: {e}", file=sys.stderr)
        return 1
    return 0


def _worker(rank: int, args: argparse.Namespace, world_size: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    from ..errors import MoecompileError

    try:
        train(args, rank, world_size)
    except MoecompileError as e:  # a clean message, not a traceback through multiprocessing
        print(f"moecompile train (rank {rank}): {e}", file=sys.stderr)
        raise SystemExit(2) from e


@dataclasses.dataclass
class _Setup:
    plan: Any
    dense: Any
    result: Any
    step: Any
    world: Any


@dataclasses.dataclass
class _Checked:
    model: str
    overrides: dict[str, Any]
    plan: Any
    micro: int  # sequences per forward on a rank


def preflight(args: argparse.Namespace, world_size: int) -> _Checked:
    """Everything the arguments alone decide, checked before any rank starts or trains: the plan (file,
    ``--set``s, ep), the batch split, and whether ``--export-hf`` can express the model (a run must not
    train for an hour to fail at its export)."""
    from ..devices import resolve_device
    from ..errors import MoecompileError
    from ..export_hf import arch_for, check_exportable
    from ..models import load_config, own_experts
    from .inspect import _key_value, apply_sets, load_plan

    overrides = dict(_key_value(c, "--config") for c in args.configs)
    model = args.model or DEFAULT_MODEL
    if args.model is None:
        overrides = {**DEFAULT_MODEL_CONFIG, **overrides}
    config = load_config(model, **overrides)
    # a model with MoE layers of its own (Mixtral, Qwen3-MoE) fixes the experts fields of the default plan
    plan = load_plan(args.plan, [], experts={**DEFAULT_PLAN["experts"], **own_experts(config)})
    if args.sets:
        plan = apply_sets(plan, args.sets)
    if world_size > 1 and not _plan_sets_ep(args):  # one expert shard (or slice, under etp) per rank unless told
        plan = apply_sets(plan, [f"parallel.ep={max(world_size // plan.parallel.etp, 1)}"])
    if world_size > 1:
        from ..distributed import check_ep

        check_ep(plan.parallel.ep, world_size, plan.parallel.etp)
    if args.batch % world_size:
        raise MoecompileError(f"--batch {args.batch} must be a multiple of the {world_size} ranks")
    per_rank = args.batch // world_size
    micro = args.micro_batch if args.micro_batch is not None else per_rank
    if micro < 1 or per_rank % micro:
        raise MoecompileError(f"--micro-batch {args.micro_batch} must divide the {per_rank} sequences each rank "
                              f"gets (--batch {args.batch} over {world_size} ranks)")
    if args.export_hf:
        check_exportable(arch_for(getattr(config, "model_type", None)), plan, config)
    resolve_device(args.device, 0, world_size)  # --device cuda without a GPU per rank fails here, once
    return _Checked(model, overrides, plan, micro)


def _setup(args: argparse.Namespace, rank: int, world_size: int) -> _Setup:
    import torch

    from .. import convert
    from .. import distributed
    from ..devices import backend_for, resolve_device
    from ..errors import MoecompileError
    from ..models import build_model, has_weights, load_config
    from ..train_step import build_train_step

    checked = preflight(args, world_size)
    model, overrides, plan, micro = checked.model, checked.overrides, checked.plan, checked.micro
    threads = args.threads or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device, rank, world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = None
    if world_size > 1:
        world = distributed.init(plan, backend=backend_for(device))
    if has_weights(model):  # a trained checkpoint fixes its shapes: check instead of overriding
        if load_config(model).vocab_size < 256:
            raise MoecompileError(f"{model} has a vocabulary of {load_config(model).vocab_size} tokens; the "
                                  "byte-level text needs at least 256")
    else:
        if load_config(model).vocab_size < 256:
            overrides.setdefault("vocab_size", 256)  # byte-level data
        overrides.setdefault("max_position_embeddings", max(args.seq, 128))
    dense, (ids,) = build_model(model, batch_size=micro, seq_len=args.seq, seed=args.seed,
                                **overrides)
    dense, ids = dense.to(device), ids.to(device)
    result = convert(dense, plan, (ids,), world=world)
    clip = args.clip if args.clip > 0 else None
    step = build_train_step(result, optimizer=_adamw(args), clip_grad_norm=clip, world=world, compile=args.compile)
    return _Setup(plan, dense, result, step, world)


def _adamw(args: argparse.Namespace) -> Any:
    """The optimizer factory --lr and --adam-moments ask for."""
    import torch

    if args.adam_moments == "bf16":
        from ..adamw import AdamW

        return lambda ps: AdamW(ps, lr=args.lr, weight_decay=0.01, moment_dtype=torch.bfloat16)
    return lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=0.01)


def _plan_sets_ep(args: argparse.Namespace) -> bool:
    if any(item.replace(" ", "").startswith("parallel.ep=") for item in args.sets):
        return True
    if not args.plan:
        return False
    import json

    import yaml

    text = Path(args.plan).read_text()
    raw = json.loads(text) if args.plan.endswith(".json") else yaml.safe_load(text)
    return isinstance(raw, dict) and "ep" in (raw.get("parallel") or {})


def train(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    """Set up, train, checkpoint and summarise on this rank; returns the summary (rank 0 prints it)."""
    from tqdm import tqdm

    from ..data import ByteBatches, stdlib_bytes

    logging.getLogger("transformers").setLevel(logging.ERROR)
    s = _setup(args, rank, world_size)
    out = Path(args.out)
    ckpt = out / "checkpoint"
    if args.resume and (ckpt / "moecompile.json").exists():
        s.step.load(ckpt)
    sched = lr_scheduler(s.step.optimizer, args, s.step.step_count)
    text = stdlib_bytes(root=args.data) if args.data else stdlib_bytes()
    split = int(len(text) * 0.95)
    train_data = ByteBatches(text[:split], args.batch, args.seq, seed=args.seed)
    held_out = ByteBatches(text[split:], args.batch, args.seq, seed=args.seed + 1)
    lead = rank == 0
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        s.plan.save(out / "plan.yaml")
        e = s.plan.experts
        n_params = sum(p.numel() for p in s.result.module.parameters())
        from ..models import has_weights

        source = f"{args.model} (weights loaded)" if has_weights(args.model or "") else args.model or DEFAULT_MODEL
        adopted = bool(s.result.record("import_moe").data.get("layers"))
        how = "its own MoE layers: " if adopted else "-> "
        groups = f" within {e.route_group_top_k} of {e.route_groups} groups" if e.route_groups > 1 else ""
        par = s.plan.parallel
        layout = f"ep={par.ep}" + (f" x etp={par.etp}" if par.etp > 1 else "")
        print(f"moecompile train: {source} {how}{e.num_experts} experts top-{e.top_k}{groups}"
              f"{'' if adopted else f' (G={e.granularity})'}, {layout} over {world_size} rank(s) "
              f"({par.dispatcher}{f' per node of {par.node_ranks}' if par.node_level_ranks > 1 else ''}, "
              f"{par.dispatch_mode}) on {s.step.device.type}; "
              f"{n_params:,} parameters on this rank; "
              f"batch {args.batch} x {args.seq} bytes of {len(text):,} bytes of text"
              + (f", micro-batches of {args.micro_batch} per rank" if args.micro_batch else "")
              + ("; forward under torch.compile" if args.compile else ""), flush=True)
    history: list[Any] = []
    start, first = time.perf_counter(), s.step.step_count
    bar = tqdm(total=args.steps, initial=first, disable=not lead, unit="step", dynamic_ncols=True, file=sys.stderr,
               mininterval=0.2 if sys.stderr.isatty() else 15.0)  # a log file gets a bar line now and then
    while s.step.step_count < args.steps:
        i = s.step.step_count
        m = s.step(train_data.shard(i, rank, world_size))
        sched.step()
        history.append(m)
        bar.update(1)
        bar.set_postfix(loss=f"{m.loss:.3f}", tok_s=f"{m.tokens_per_s:,.0f}")
        if lead and (m.step % args.log_every == 0 or m.step == first + 1 or m.step == args.steps):
            bar.write(_line(m, sched.get_last_lr()[0]))
    bar.close()
    seconds = time.perf_counter() - start
    s.step.save(ckpt)
    val = _held_out_loss(s, held_out, rank, world_size)
    summary = _summary(history, seconds, val, ckpt)
    if args.compile and len(history) > 1:  # the first step compiled the forward: say what the rest ran at
        rest = history[1:]
        summary["compiled"] = (history[0].time_s, sum(m.tokens for m in rest) / sum(m.time_s for m in rest))
    summary["optimizer"] = _optimizer_line(s.step, world_size)
    if s.step.buckets.grad_shards is not None:
        ranges = sum(b.grad.numel() * b.grad.element_size() for b in s.step.buckets.grad_shards.buckets)
        summary["gradients"] = (f"{ranges / 2**20:.2f} MiB on rank 0 between steps, its ranges "
                                f"(parallel.shard_gradients; peak in flight "
                                f"{s.step.buckets.grad_shards.peak_bytes / 2**20:.2f} MiB)")
    if s.step.buckets.param_shards is not None:
        summary["parameters"] = (f"{s.step.param_bytes() / 2**20:.2f} MiB on rank 0 between steps, its ranges "
                                 f"(parallel.shard_parameters; peak gathered {s.step.buckets.param_shards.peak_bytes / 2**20:.2f} MiB)")
    if args.export_hf:
        from ..export_hf import arch_for, export_hf

        arch = arch_for(getattr(s.dense.config, "model_type", None))
        with s.step.gathered():  # parameters sharded (parallel.shard_parameters): whole on every rank for this
            export_hf(s.result, args.export_hf, arch=arch, config=s.dense.config, world=s.world)
        summary["exported"] = f"{args.export_hf} ({arch})"
    if lead:
        print(_format_summary(summary), flush=True)
    if s.world is not None:
        from ..distributed import shutdown

        del s  # the step and its groups go first
        shutdown()
    return summary


def lr_factor(step: int, schedule: str, warmup: int, total: int, min_lr: float) -> float:
    """The lr of optimizer step ``step`` (0-based) as a fraction of the peak: linear warm-up, then
    constant or cosine down to ``min_lr`` at the last step (Megatron-Core's and torchtitan's shape)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup + 1:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup - 1))
    return min_lr + (1 - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_scheduler(optimizer: Any, args: argparse.Namespace, done: int) -> Any:
    """A LambdaLR over the run's steps, positioned after the ``done`` steps a checkpoint already took."""
    from torch.optim.lr_scheduler import LambdaLR

    warmup = args.warmup if args.warmup is not None else min(10, args.steps // 10)
    for group in optimizer.param_groups:  # this run's --lr, also over a checkpoint's
        group["initial_lr"] = args.lr
    return LambdaLR(optimizer, lambda i: lr_factor(i, args.schedule, warmup, args.steps, args.min_lr),
                    last_epoch=done - 1)


def _line(m: Any, next_lr: float) -> str:
    router = "  ".join(f"{k} {v:.3f}" for k, v in sorted(m.router_losses.items()))
    loads = "  ".join(f"L{_layer_index(layer)} {load}" for layer, load in m.expert_load.items())
    return (f"step {m.step:5d}  loss {m.loss:.4f}  lm {m.lm_loss:.4f}  {router}  next lr {next_lr:.2e}  "
            f"{m.tokens_per_s:,.0f} tok/s  max/mean load {max(m.load_balance().values()):.2f}  load {loads}")


def _layer_index(layer: str) -> str:
    parts = [p for p in layer.split(".") if p.isdigit()]
    return parts[0] if parts else layer


def _held_out_loss(s: _Setup, data: Any, rank: int, world_size: int, batches: int = 4) -> float:
    """Mean next-byte loss on text the run never trained on (the last 5% of the corpus), at the step's precision."""
    import torch
    import torch.distributed as dist

    local = sum(s.step.evaluate(data.shard(i, rank, world_size)) for i in range(batches))
    total = torch.tensor([local], dtype=torch.float64, device=s.step.device)
    if s.world is not None:
        dist.all_reduce(total, group=s.world.dp_group)
    return float(total) / (batches * world_size)


def _optimizer_line(step: Any, world_size: int) -> str:
    what = "state + fp32 masters" if step.masters else "state"
    moments = {g.get("moment_dtype") for g in step.optimizer.param_groups} - {None}
    what += f" ({', '.join(sorted(moments))} moments)" if moments else ""
    how = ("sharded over the ranks (parallel.shard_optimizer)" if step.sharded else
           "replicated" + ("; --set parallel.shard_optimizer=true shards it" if world_size > 1 else ""))
    line = f"{step.optimizer_bytes() / 2**20:.2f} MiB of {type(step.optimizer).__name__} {what} on rank 0, {how}"
    host = step.host_optimizer_bytes()
    if host:
        share = step.plan.parallel.offload_optimizer
        line += (f"; {host / 2**20:.2f} MiB more in host memory, stepped by the CPU (parallel.offload_optimizer="
                 f"{share:g}: masters, their grads and state" + (", all fp32" if not step.masters else "") + ")")
    return line


def _summary(history: list[Any], seconds: float, val: float, ckpt: Path) -> dict[str, Any]:
    if not history:
        return {"steps": 0, "checkpoint": str(ckpt), "held_out_loss": val}
    k = max(1, min(10, len(history) // 5))
    first = sum(m.lm_loss for m in history[:k]) / k
    last = sum(m.lm_loss for m in history[-k:]) / k
    tokens = sum(m.tokens for m in history)
    balance: dict[str, float] = {}
    for m in history[-k:]:
        for layer, b in m.load_balance().items():
            balance[layer] = balance.get(layer, 0.0) + b / k
    return {"steps": history[-1].step, "steps_run": len(history), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0, "first_loss": first, "final_loss": last,
            "held_out_loss": val, "load_balance": balance, "checkpoint": str(ckpt), "averaged_over": k}


def _format_summary(s: dict[str, Any]) -> str:
    if not s.get("steps_run"):
        return f"nothing to train (already at the last step); held-out loss {s['held_out_loss']:.4f}; checkpoint {s['checkpoint']}"
    balance = ", ".join(f"L{_layer_index(k)} {v:.2f}" for k, v in s["load_balance"].items())
    lines = [
        "summary",
        f"  steps            {s['steps_run']} (now at step {s['steps']}), {s['tokens']:,} tokens in "
        f"{datetime.timedelta(seconds=round(s['seconds']))}",
        f"  throughput       {s['tokens_per_s']:,.0f} tokens/s" + (
            f" ({s['compiled'][1]:,.0f} after the first step, which compiled the forward in "
            f"{s['compiled'][0]:.0f} s)" if "compiled" in s else ""),
        f"  lm loss          {s['first_loss']:.4f} -> {s['final_loss']:.4f} (mean of the first / last "
        f"{s['averaged_over']} steps; ln 256 = 5.545 is a uniform guess)",
        f"  held-out loss    {s['held_out_loss']:.4f} (text never trained on)",
        f"  load balance     max/mean expert load {balance} (1.00 is perfect)",
        f"  checkpoint       {s['checkpoint']}",
    ]
    if "optimizer" in s:
        lines.insert(-1, f"  optimizer        {s['optimizer']}")
    if "gradients" in s:
        lines.insert(-1, f"  gradients        {s['gradients']}")
    if "parameters" in s:
        lines.insert(-1, f"  parameters       {s['parameters']}")
    if "exported" in s:
        lines.append(f"  exported         {s['exported']}")
    return "\n".join(lines)
