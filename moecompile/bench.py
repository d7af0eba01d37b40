"""``moecompile.bench``: time one model's training step as moecompile runs it and as its peers would.

    rows = bench(BenchSpec("small-llama", plan={"experts": {"num_experts": 8, "top_k": 2}}))

Every variant trains the same tokens from the same weights with the same loop (forward,
next-token cross-entropy plus the router loss where the plan has one, backward, AdamW). The
one-process variants take their steps in turn inside one spawned process per round, so machine
drift hits them alike; each also runs alone once for its peak memory:

- ``dense``: the source model, the cost floor of the same attention without experts;
- ``moecompile``: ``build_train_step`` on the converted graph (``moecompile_epN``: N ranks over
  gloo, each with batch / N, experts sharded N ways; a step's time is the slowest rank's;
  ``moecompile_compiled`` / ``moecompile_compiled_epN``: the same step with ``compile=True``, compiled
  during the warm-up);
- ``hf_eager``, ``hf_grouped_mm``: the converted model exported with ``export_hf`` and loaded
  back as Hugging Face's own Mixtral / Qwen3-MoE with that ``experts_implementation``: the
  peer a user would otherwise pick, holding identical weights (the first losses agree).
"""

from __future__ import annotations

import dataclasses
import re
import resource
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .errors import MoecompileError

VARIANTS = ("dense", "moecompile", "hf_eager", "hf_grouped_mm")  # the default set
EXTRA_VARIANTS = ("moecompile_compiled",)  # asked for by name: compiling adds 12-15 s (ad hoc) to each round


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    """What to measure: the model (zoo name, config or checkpoint), the plan and the step's shape."""

    model: str = "small-llama"
    plan: dict = dataclasses.field(default_factory=lambda: {"experts": {"num_experts": 8, "top_k": 2}})
    config: dict = dataclasses.field(default_factory=dict)  # overrides of the model's config fields
    batch: int = 8
    seq: int = 128
    steps: int = 5
    warmup: int = 2
    rounds: int = 1  # fresh processes, each running every variant
    lr: float = 1e-3
    seed: int = 0
    keep_host_memory: bool = True  # every variant's process: host_memory.keep_freed_memory(), as the step does
    device: str = "auto"  # "cpu", "cuda" (rank r on GPU r, NCCL), or auto: cuda if each rank of the widest variant has a GPU


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One variant's timed steps (after warm-up)."""

    variant: str
    ms: float  # median of every timed step of every round
    ms_min: float
    ms_max: float
    tokens_per_s: float
    peak_rss_growth_mb: float  # the largest rank's, over its step loop, run alone (on CUDA: peak allocated growth)
    losses: tuple[float, ...]  # lm (cross-entropy) loss of every step, warm-up included
    device: str = "cpu"  # where it ran: "cpu" or "cuda"


def bench(spec: BenchSpec, variants: tuple[str, ...] = VARIANTS, threads: int | None = None,
          timeout_s: float = 1800.0) -> list[BenchRow]:
    """Time every variant over ``spec.rounds`` fresh processes; ``moecompile_epN`` runs on N ranks of its own.

    The one-process variants share a process and take their steps in turn (dense, moecompile, hf...,
    dense, ...): a process's speed on a shared machine drifts by more than the differences being
    measured, and turn-taking exposes every variant to the same drift. Memory needs a process of
    its own, so each of them is run once more alone for its peak RSS growth over two steps.
    """
    from .devices import backend_for, resolve_device
    from .planner.microbench import run_ranks, threads_per_rank

    threads = threads or threads_per_rank(1)
    worlds = {v: _world(v, spec) for v in variants}
    device = resolve_device(spec.device, 0, max(worlds.values()))  # one device for every row: the table compares
    spec = dataclasses.replace(spec, device=device.type)
    groups = [tuple(v for v, w in worlds.items() if w == 1)] + [(v,) for v, w in worlds.items() if w > 1]
    groups = [g for g in groups if g]
    timed: dict[str, list[float]] = {v: [] for v in variants}
    rss: dict[str, float] = dict.fromkeys(variants, 0.0)
    losses: dict[str, tuple[float, ...]] = {}

    def run(group: tuple[str, ...], s: BenchSpec) -> dict[str, dict[str, Any]]:
        world = worlds[group[0]]
        ranks = run_ranks(_measure, world, (group, s), threads=max(1, threads // world), timeout_s=timeout_s,
                          backend=backend_for(device))
        return {v: {"times": [max(t) for t in zip(*(r[v]["times"] for r in ranks))],  # a step ends with its
                    "losses": ranks[0][v]["losses"],                                   # slowest rank
                    "rss_mb": max(r[v]["rss_mb"] for r in ranks)} for v in group}

    for _ in range(spec.rounds):
        for group in groups:
            for v, r in run(group, spec).items():
                timed[v] += r["times"][spec.warmup:]
                losses[v] = tuple(r["losses"])
                if len(group) == 1:
                    rss[v] = max(rss[v], r["rss_mb"])
    for group in groups:
        if len(group) > 1:
            for v in group:
                rss[v] = run((v,), dataclasses.replace(spec, warmup=1, steps=1))[v]["rss_mb"]
    return [BenchRow(v, 1e3 * statistics.median(t), 1e3 * min(t), 1e3 * max(t),
                     spec.batch * spec.seq / statistics.median(t), rss[v], losses[v], device.type)
            for v, t in timed.items()]


def _world(variant: str, spec: BenchSpec) -> int:
    if variant in VARIANTS + EXTRA_VARIANTS:
        return 1
    match = re.fullmatch(r"moecompile(?:_compiled)?_ep(\d+)", variant)
    if match is None or int(match.group(1)) < 1:
        known = ", ".join(VARIANTS + EXTRA_VARIANTS)
        raise MoecompileError(f"unknown bench variant {variant!r}; choose from {known}, moecompile_epN or "
                              "moecompile_compiled_epN (N ranks)")
    ep = match.group(1)
    if spec.batch % int(ep):
        raise MoecompileError(f"{variant}: the batch of {spec.batch} sequences does not split over {ep} ranks; "
                              f"use a batch that is a multiple of {ep}")
    return int(ep)


def _measure(rank: int, world: int, variants: tuple[str, ...], spec: BenchSpec) -> dict[str, dict[str, Any]]:
    """Build the variants, then run warm-up + timed steps, the variants in turn; times, losses, RSS growth.

    RSS growth (peak over the loop minus peak before it) is only a variant's own when it runs alone; on a
    GPU the growth of the peak allocated device memory stands in for it.
    """
    if spec.keep_host_memory:  # before any variant allocates, so all of them run on the same malloc
        from .host_memory import keep_freed_memory

        keep_freed_memory()
    device = torch.device("cuda", rank) if spec.device == "cuda" else torch.device("cpu")  # bench() resolved it
    torch.manual_seed(spec.seed)
    x, y = (t.to(device) for t in _tokens(spec, rank, world))
    steps = {v: _build(v, spec, world, x) for v in variants}
    out: dict[str, dict[str, Any]] = {v: {"times": [], "losses": []} for v in variants}
    base = _memory_mb(device, peak=False)
    for _ in range(spec.warmup + spec.steps):
        for v, step in steps.items():
            if world > 1:
                torch.distributed.barrier()
            start = time.perf_counter()
            out[v]["losses"].append(step(x, y))  # returns a float: the step has finished
            out[v]["times"].append(time.perf_counter() - start)
    peak = _memory_mb(device, peak=True)
    for v in variants:
        out[v]["rss_mb"] = peak - base
    return out


def _memory_mb(device: torch.device, peak: bool) -> float:
    """The process's peak RSS (CPU), or the device's allocated memory now / at its peak since now (CUDA)."""
    if device.type != "cuda":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if peak:
        return torch.cuda.max_memory_allocated(device) / 2**20
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / 2**20


def _tokens(spec: BenchSpec, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    from .models import load_config

    vocab = load_config(spec.model).vocab_size if "vocab_size" not in spec.config else spec.config["vocab_size"]
    g = torch.Generator().manual_seed(spec.seed + 1)
    ids = torch.randint(0, vocab, (spec.batch, spec.seq + 1), generator=g).chunk(world)[rank]
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _build(variant: str, spec: BenchSpec, world: int, x: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], float]:
    from . import convert, distributed
    from .models import build_model
    from .plan import Plan
    from .train_step import build_train_step

    plan = Plan.from_dict({**spec.plan, "parallel": {**spec.plan.get("parallel", {}), "ep": world}})
    world_obj = distributed.init(plan) if world > 1 else None
    dense, _ = build_model(spec.model, batch_size=x.shape[0], seq_len=x.shape[1], seed=spec.seed, **spec.config)
    dense = dense.to(x.device)
    if variant == "dense":
        return _plain_step(dense, spec.lr, aux_coeff=0.0)
    result = convert(dense, plan, (x,), world=world_obj)
    if variant.startswith("moecompile"):
        step = build_train_step(result, optimizer=lambda ps: torch.optim.AdamW(ps, lr=spec.lr), precision="fp32",
                                world=world_obj, keep_host_memory=spec.keep_host_memory,
                                compile=variant.startswith("moecompile_compiled"))
        return lambda x, y: step(x, y).lm_loss
    aux = plan.experts.aux_loss != "none"
    peer = _hf_peer(result, dense.config, variant.removeprefix("hf_"), aux).to(x.device)
    return _plain_step(peer, spec.lr, aux_coeff=plan.experts.aux_loss_coeff if aux else 0.0)


def _hf_peer(result: Any, config: Any, experts_implementation: str, aux: bool) -> torch.nn.Module:
    """The converted model as Hugging Face's own MoE class, loaded from an export of the same weights."""
    from transformers import AutoModelForCausalLM

    from .export_hf import arch_for, export_hf
    from .models import quiet_transformers

    with tempfile.TemporaryDirectory() as tmp, quiet_transformers():
        export_hf(result, tmp, arch=arch_for(getattr(config, "model_type", None)), config=config)
        model = AutoModelForCausalLM.from_pretrained(tmp, experts_implementation=experts_implementation,
                                                     dtype=torch.float32)
    model.config.output_router_logits = aux  # then it computes its load-balancing loss, as the plan does
    return model.train()


def _plain_step(model: torch.nn.Module, lr: float, aux_coeff: float) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """The loop a user writes by hand: forward, cross-entropy (+ HF's aux loss), backward, AdamW (on a CPU its fused
    kernel, which build_train_step runs there too: the rows differ in the model, not the optimizer's code)."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True if on_cpu else None)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        out = model(x)
        lm = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1))
        aux = getattr(out, "aux_loss", None)
        loss = lm + aux_coeff * aux if aux_coeff and aux is not None else lm
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return lm.item()

    return step


def render(spec: BenchSpec, rows: list[BenchRow]) -> str:
    """The table: one line per variant, ratios against the fastest HF MoE and against dense."""
    e = spec.plan["experts"]
    by = {r.variant: r for r in rows}
    hf = [r for r in rows if r.variant.startswith("hf_")]
    fastest_hf = max(hf, key=lambda r: r.tokens_per_s) if hf else None
    dense = by.get("dense")
    w = max([18, *(len(r.variant) + 1 for r in rows)])  # moecompile_compiled_ep2 is wider than the rest
    on = rows[0].device if rows else "cpu"
    lines = [f"{spec.model}: {e['num_experts']} experts top-{e['top_k']}, batch {spec.batch} x {spec.seq} tokens, "
             f"median of {spec.steps} steps after {spec.warmup} warm-up, {spec.rounds} round(s) of fresh processes, "
             f"on {on}",
             f"{'variant':<{w}}{'ms/step':>9}{'min..max':>17}{'tokens/s':>10}{'vs HF':>8}{'vs dense':>9}"
             f"{'GPU +MB' if on == 'cuda' else 'RSS +MB':>9}  lm loss first -> last"]
    for r in rows:
        vs_hf = f"{r.tokens_per_s / fastest_hf.tokens_per_s:.2f}x" if fastest_hf else "-"
        vs_dense = f"{r.tokens_per_s / dense.tokens_per_s:.2f}x" if dense else "-"
        lines.append(f"{r.variant:<{w}}{r.ms:9.1f}{f'{r.ms_min:.1f}..{r.ms_max:.1f}':>17}{r.tokens_per_s:10,.0f}"
                     f"{vs_hf:>8}{vs_dense:>9}{r.peak_rss_growth_mb:9.1f}  {r.losses[0]:.4f} -> {r.losses[-1]:.4f}")
    if fastest_hf:
        from .models import load_config, own_experts

        source = ("the source model as Hugging Face runs it (an MoE already)"
                  if own_experts(load_config(spec.model, **spec.config)) else "the source model without experts")
        lines.append(f"vs HF: tokens/s over the fastest Hugging Face MoE ({fastest_hf.variant}); vs dense: over {source}")
    return "\n".join(lines)
