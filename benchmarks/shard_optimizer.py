"""Parameter, gradient and optimizer memory per rank, and the step's time, with and without ZeRO sharding, on N CPU ranks.

    python benchmarks/shard_optimizer.py [--nproc 2] [--model small-llama] [--batch 8] [--seq 128]
                                         [--steps 5] [--warmup 2] [--rounds 2] [--bucket-mb 25]
    python benchmarks/shard_optimizer.py --variants moecompile_reduce_overlap [--steps 20]   # an A/B
    python benchmarks/shard_optimizer.py --collectives [--nproc 2]

``--collectives`` times, per bucket size, the ways a sharded bucket can be synced on gloo: an
all-reduce (the unsharded step's), torch's reduce_scatter_single and all_gather_single, and the
forms moecompile.grad_sync uses on gloo (an all-to-all plus a local sum; a broadcast from each owner).

The zoo's model upcycled to 8 experts top-2 (fp32, AdamW, dropless, no aux loss), trained on N
gloo ranks of batch / N sequences each, pure data parallelism (every rank holds every expert, so
all of the optimizer can shard), the variants taking turns step by step in one process group:

- ``moecompile``: ``build_train_step``, bucketed all-reduce, the optimizer replicated;
- ``moecompile_reduce_overlap``: the same with ``parallel.overlap_grad_reduce: true``: each bucket all-reduced
  from backward as soon as it is complete (the default, null, sums them after backward on gloo);
- ``moecompile_zero1``: the same with ``parallel.shard_optimizer`` (reduce-scatter, this rank's
  range of AdamW state, all-gather);
- ``moecompile_zero2``: also ``parallel.shard_gradients``: each bucket reduce-scattered as backward
  completes it, a rank keeping its range of the gradients and a few buckets in flight;
- ``moecompile_zero1_overlap`` / ``moecompile_zero2_overlap``: the same with ``parallel.overlap_param_gather``
  (the all-gather left running; the next forward waits for each bucket before its first read);
- ``moecompile_zero3``: also ``parallel.shard_parameters``: a rank keeps its range of the parameters,
  each bucket gathered before its first read in forward and again in backward;
- ``moecompile_epN_zero1``: experts sharded N ways (ep = N) and the dense optimizer state too;
- ``hf_ddp``: the converted model exported and loaded as Hugging Face's Mixtral (``grouped_mm``
  experts), wrapped in ``DistributedDataParallel`` with AdamW: the loop a user writes by hand;
- ``hf_ddp_zero``: the same with torch's ``ZeroRedundancyOptimizer`` over AdamW (whole
  parameters per rank): the library peer a user would pick to shard the optimizer;
- ``hf_fsdp2``: the same Hugging Face model under torch's FSDP2 (``fully_shard`` on every decoder
  layer and the root) with AdamW: the library peer a user would pick to shard the parameters.

Per variant: the largest rank's parameter bytes between steps, optimizer bytes (state tensors, + fp32 masters where there are
any) and gradient bytes held between steps (moecompile: its buckets, ranges and buffers in flight;
the peers: their ``.grad`` tensors, DDP's own bucket copies not counted), the step time (a step ends with its slowest rank; median over every timed step of every
round), the host time a ZeRO-1/2 step blocks on the parameters' all-gather (after the optimizer, or
in the forward's waits with the overlap: the exchange it does not hide), and the global mean loss of the first and last step, which must agree across the rows
that train the same function (all but the ep row, which only reorders the sums).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

EXPERTS = {"num_experts": 8, "top_k": 2, "aux_loss": "none"}


def _variants(n: int) -> tuple[str, ...]:
    return ("moecompile", "moecompile_reduce_overlap", "moecompile_zero1", "moecompile_zero1_overlap", "moecompile_zero2", "moecompile_zero2_overlap",
            "moecompile_zero3", f"moecompile_ep{n}_zero1", "hf_ddp", "hf_ddp_zero", "hf_fsdp2")


def _build(variant: str, args: Any, rank: int, world: int, x: torch.Tensor) -> tuple[Callable, Callable[[], int]]:
    """A step ``(x, y) -> global mean lm loss`` and a function giving this rank's (params, optimizer, grads) bytes."""
    import moecompile as mc
    from moecompile import distributed
    from moecompile.models import build_model

    ep = world if variant.startswith("moecompile_ep") else 1
    plan = mc.Plan.from_dict({"experts": EXPERTS, "parallel": {"ep": ep, "shard_optimizer": "zero" in variant,
                                                               "shard_gradients": "zero2" in variant or
                                                               "zero3" in variant, "shard_parameters": "zero3" in variant,
                                                               "overlap_param_gather": "zero" in variant and variant.endswith("_overlap"),
                                                               "overlap_grad_reduce": True if "reduce_overlap" in variant else None}})
    world_obj = distributed.world_from_plan(plan)
    dense, _ = build_model(args.model, batch_size=x.shape[0], seq_len=x.shape[1], seed=0)
    result = mc.convert(dense, plan, (x,), world=world_obj)
    if variant.startswith("moecompile"):
        ts = mc.build_train_step(result, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), precision="fp32",
                                 world=world_obj, bucket_mb=args.bucket_mb)
        return (lambda x, y: ts(x, y).lm_loss), lambda: (ts.param_bytes(), ts.optimizer_bytes(), ts.buckets.grad_bytes())
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    from moecompile.export_hf import export_hf
    from moecompile.models import quiet_transformers

    path = f"{args.tmp}/{variant}"  # every rank takes part in the export; rank 0 writes, all read
    with quiet_transformers():
        export_hf(result, path, arch="mixtral", config=dense.config, world=world_obj)
        dist.barrier()
        hf = AutoModelForCausalLM.from_pretrained(path, experts_implementation="grouped_mm", dtype=torch.float32)
    if variant == "hf_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in hf.model.layers:
            fully_shard(layer, mesh=mesh)
        model: Any = fully_shard(hf.train(), mesh=mesh)
    else:
        model = DistributedDataParallel(hf.train(), bucket_cap_mb=args.bucket_mb)
    # fused: the CPU kernel build_train_step runs there too, so the rows differ in sharding, not the optimizer's code
    if variant == "hf_ddp_zero":
        opt: Any = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, fused=True)
        local = opt.optim
    else:
        opt = local = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        logits = model(x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return mean.item() / world

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensors: this rank's shard
        return t.numel() * t.element_size()

    def optimizer_bytes() -> tuple[int, int, int]:
        state = sum(nbytes(t) for s in local.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
        return (sum(nbytes(p) for p in model.parameters()), state,
                sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None))

    return step, optimizer_bytes


_BLOCKED = [0.0]  # seconds this rank's host waited on the parameters' all-gather (ZeRO-1/2), this step


def _time_param_gathers() -> None:
    """Add the host time blocked on ZeRO-1/2's all-gather (after the optimizer, or in the forward's waits with
    overlap_param_gather) to _BLOCKED: what of the exchange the step does not hide (gloo blocks the host)."""
    from moecompile.grad_sync import GradBuckets
    from moecompile.param_gathers import InFlightGathers

    def timed(fn: Callable) -> Callable:
        def run(*a: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a)
            finally:
                _BLOCKED[0] += time.perf_counter() - start
        return run

    GradBuckets.gather_params = timed(GradBuckets.gather_params)
    InFlightGathers.wait = timed(InFlightGathers.wait)


def _measure(rank: int, world: int, args: Any) -> dict[str, dict[str, Any]]:
    from moecompile.host_memory import keep_freed_memory

    keep_freed_memory()  # every variant on the same malloc, as build_train_step sets it
    _time_param_gathers()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (args.batch, args.seq + 1), generator=g).chunk(world)[rank]
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    built = {v: _build(v, args, rank, world, x) for v in _variants(world) if not args.variants or v in (*args.variants, "moecompile")}
    out = {v: {"times": [], "losses": [], "blocked": []} for v in built}
    for _ in range(args.warmup + args.steps):
        for v, (step, _) in built.items():
            dist.barrier()
            _BLOCKED[0] = 0.0
            start = time.perf_counter()
            out[v]["losses"].append(step(x, y))
            out[v]["times"].append(time.perf_counter() - start)
            out[v]["blocked"].append(_BLOCKED[0])  # waits of this step's forward, on the previous step's gather
    for v, (_, nbytes) in built.items():
        out[v]["param_bytes"], out[v]["bytes"], out[v]["grad_bytes"] = nbytes()
        out[v]["times"] = out[v]["times"][args.warmup:]
        out[v]["blocked"] = out[v]["blocked"][args.warmup:]
    return out


def _collectives(rank: int, world: int, calls: int) -> dict[str, float]:
    """Mean ms per call of each way to sync one bucket, at 1, 25 and 70 MiB of fp32."""
    out = {}
    for mib in (1, 25, 70):
        n = mib * 2**20 // 4 // world * world
        x, received, size = torch.randn(n), torch.empty(n), n // world
        mine = slice(rank * size, (rank + 1) * size)

        def exchange() -> None:
            dist.all_to_all_single(received, x)
            torch.sum(received.view(world, size), dim=0, out=x[mine])

        def broadcasts() -> None:
            for h in [dist.broadcast(x[k * size : (k + 1) * size], group_src=k, async_op=True) for k in range(world)]:
                h.wait()

        forms = {"all_reduce": lambda: dist.all_reduce(x),
                 "reduce_scatter_single": lambda: dist.reduce_scatter_single(x[mine], x),
                 "all_to_all + sum": exchange,
                 "all_gather_single": lambda: dist.all_gather_single(x, x[mine]),
                 "broadcast from each": broadcasts}
        for name, fn in forms.items():
            fn()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            dist.barrier()
            out[f"{mib:>3} MiB  {name}"] = (time.perf_counter() - start) / calls * 1e3
    return out


def main() -> None:
    from moecompile.planner.microbench import run_ranks, threads_per_rank

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="fresh process groups")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size, moecompile's and DDP's")
    ap.add_argument("--variants", nargs="+", choices=_variants(2) + _variants(4), default=None,
                    help="only these rows and moecompile's, the baseline (an A/B of a few variants); default: all")
    ap.add_argument("--collectives", action="store_true", help="time the gloo forms of a sharded bucket's sync")
    a = ap.parse_args()
    if a.collectives:
        ranks = run_ranks(_collectives, a.nproc, (5,), threads=1, timeout_s=1800)
        print(f"gloo, {a.nproc} ranks, 1 thread each, mean of 5 calls (the slowest rank's)")
        for key in ranks[0]:
            print(f"{key:<36}{max(r[key] for r in ranks):8.1f} ms")
        return
    import tempfile

    a.tmp = tempfile.mkdtemp(prefix="moecompile-zero-bench-")
    times: dict[str, list[float]] = {}
    blocked: dict[str, list[float]] = {}
    rows: dict[str, dict[str, Any]] = {}
    for _ in range(a.rounds):
        ranks = run_ranks(_measure, a.nproc, (a,), threads=threads_per_rank(a.nproc), timeout_s=3600)
        for v in ranks[0]:
            times.setdefault(v, []).extend(max(t) for t in zip(*(r[v]["times"] for r in ranks)))
            blocked.setdefault(v, []).extend(max(t) for t in zip(*(r[v]["blocked"] for r in ranks)))
            rows[v] = {k: max(r[v][k] for r in ranks) for k in ("param_bytes", "bytes", "grad_bytes")}
            rows[v]["losses"] = ranks[0][v]["losses"]
    base = rows["moecompile"]["bytes"]
    fastest_hf = min((statistics.median(times[v]) for v in times if v.startswith("hf_")), default=None)
    print(f"{a.model} E{EXPERTS['num_experts']} top-{EXPERTS['top_k']}, fp32 AdamW, {a.nproc} gloo ranks, global batch "
          f"{a.batch} x {a.seq}, {a.bucket_mb:g} MB buckets; median of {a.rounds} x {a.steps} steps after {a.warmup} "
          "warm-up, variants in turn")
    print(f"{'variant':<26}{'params MiB/rank':>16}{'optimizer MiB/rank':>19}{'vs replicated':>14}{'grads MiB/rank':>15}"
          f"{'ms/step':>9}{'vs fastest HF':>14}{'gather wait ms':>15}  loss first -> last")
    for v, r in rows.items():
        ms = statistics.median(times[v])
        gathers = "zero1" in v or "zero2" in v  # ZeRO-1/2's all-gather after the optimizer (ZeRO-3 gathers in-graph)
        wait = f"{statistics.median(blocked[v]) * 1e3:.1f}" if gathers else "-"
        print(f"{v:<26}{r['param_bytes'] / 2**20:>16.2f}{r['bytes'] / 2**20:>19.2f}{r['bytes'] / base:>13.3f}x"
              f"{r['grad_bytes'] / 2**20:>15.2f}{ms * 1e3:>9.1f}"
              + (f"{fastest_hf / ms:>13.2f}x" if fastest_hf else f"{'-':>14}") + f"{wait:>15}  "
              f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")


if __name__ == "__main__":
    main()
