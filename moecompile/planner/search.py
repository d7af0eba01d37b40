"""Enumerate the plans moecompile can run on a cluster, price each, keep those that fit, rank them.

    space = SearchSpace.available()                       # only what the registered passes implement
    cands, skipped = enumerate_candidates(experts, cluster, global_batch, space)
    report = search(profile_for, experts, cluster, global_batch)   # -> PlanReport (ranked + rejected)

Legal means: ``ep`` divides both the number of experts and the GPUs, every rank gets whole
micro-batches of whole sequences, and the ``Plan`` built from the choice validates. An illegal
combination is never produced; the EP sizes left out are listed in ``skipped`` with the reason.
``parallel.etp`` (experts cut into etp slices over ep x etp ranks) is tried where ep x etp divides the
GPUs but is not a legal ep itself (more GPUs than experts, or an ep the experts don't divide): where it
is, ep alone spreads the experts as far with etp times fewer bytes on the wire, so etp is never better.
An etp the experts' FFN width doesn't divide is left out when its graph is traced.
A plan that does not fit in memory is kept in ``rejected`` with its memory breakdown.
``parallel.shard_optimizer`` (ZeRO-1) is tried on and off on more than one GPU, where it is on
``parallel.shard_gradients`` (ZeRO-2) on and off, and where that is on ``parallel.shard_parameters``
(ZeRO-3) on and off: none changes the graph (no variant is traced for them), only the memory of the
parameters, optimizer and gradients and the time of their gathers, sync and update.
``parallel.offload_optimizer`` is given to a plan that does not fit otherwise, on a cluster with host
memory: the least share of its optimizer (a multiple of OFFLOAD_STEP) that brings it into the GPU's
memory, if the host's holds it; the offloaded plan is then ranked by its (slower) step time like any other.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable

from ..errors import MoecompileError, PlanError
from ..plan import Plan
from .cluster import Cluster
from .cost_model import Candidate, Estimate, estimate, static_memory
from .profile import ModelProfile

OFFLOAD_STEP = 0.05  # the offload shares the search gives a plan: the least multiple of this that fits

RECOMPUTE_SETS: tuple[tuple[str, ...], ...] = ((), ("moe_act", "layernorm"), ("moe",), ("moe", "attention"))
FP8_RECIPES: tuple[str, ...] = ("none", "tensorwise", "blockwise")


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """Which knobs to enumerate; ``available()`` switches off those whose pass is not registered."""

    expert_parallel: bool = True
    dispatchers: tuple[str, ...] = ("alltoall", "allgather", "alltoall_dedup")
    dispatch_modes: tuple[str, ...] = ("dropless", "static")
    capacity_factors: tuple[float, ...] = (1.0, 1.25)
    overlap_chunks: tuple[int, ...] = ()  # () while no overlap pass/section exists
    recompute_sets: tuple[tuple[str, ...], ...] = ((),)
    fp8_recipes: tuple[str, ...] = ("none",)
    micro_batches: tuple[int, ...] = (1, 2, 4)
    # parallel.etp (expert tensor parallel) sizes, where ep x etp is not a legal ep (see the module doc)
    etps: tuple[int, ...] = (1, 2, 4, 8)
    # experts.apply_weights tried under the alltoall dispatcher at ep > 1, the one place they differ in
    # time (activation sends each row's weight with it, combine keeps an [N, H] more for backward);
    # elsewhere "auto" only: equal time, and activation keeps less
    weight_placements: tuple[str, ...] = ("auto", "combine")
    # parallel.shard_optimizer tried on more than one GPU (on one it changes nothing: off only)
    shard_optimizer: tuple[bool, ...] = (False, True)
    # parallel.shard_gradients tried for each plan whose optimizer is sharded
    shard_gradients: tuple[bool, ...] = (False, True)
    # parallel.shard_parameters tried for each plan whose gradients are sharded
    shard_parameters: tuple[bool, ...] = (False, True)
    # bytes per AdamW moment element of every plan (not searched: bf16 moments change the numerics, a user's
    # choice, as DeepSeek-V3 made it): 4 torch.optim.AdamW, 2 moecompile.AdamW(moment_dtype=torch.bfloat16)
    moment_bytes: int = 4
    # parallel.offload_optimizer given, at the least share that fits, to a plan that does not fit without it
    offload_optimizer: bool = True
    notes: tuple[str, ...] = ()

    @classmethod
    def available(cls, **overrides: Any) -> "SearchSpace":
        """Everything the installed moecompile can execute: a knob is searched only if its pass exists."""
        import moecompile.passes  # noqa: F401  (registers the built-in passes)
        from ..pass_manager import registered_passes

        passes = registered_passes()
        sections = {f.name for f in dataclasses.fields(Plan)}
        notes = []
        fields: dict[str, Any] = {}
        if "expert_parallel" not in passes or "parallel" not in sections:
            fields["expert_parallel"] = False
            notes.append("expert_parallel pass not registered: only ep=1 is enumerated")
        if "etp" not in {f.name for f in dataclasses.fields(Plan().parallel)}:
            fields["etps"] = (1,)
            notes.append("parallel.etp not in the plan: experts are never cut into slices")
        if "overlap" in passes and "overlap" in sections:
            fields["overlap_chunks"] = (1, 2, 4)
        else:
            notes.append("overlap pass/section not available: dispatch and combine are priced as not overlapped")
        if "recompute" in passes and "recompute" in sections:
            fields["recompute_sets"] = RECOMPUTE_SETS
        else:
            notes.append("recompute pass not registered: no recompute sets enumerated")
        if "fp8" in passes and "fp8" in sections:
            fields["fp8_recipes"] = FP8_RECIPES
        else:
            notes.append("fp8 pass not registered: every GEMM stays in the model dtype")
        if "shard_optimizer" not in {f.name for f in dataclasses.fields(Plan().parallel)}:
            fields["shard_optimizer"] = (False,)
            notes.append("parallel.shard_optimizer not in the plan: the optimizer state is priced whole on every rank")
        if "shard_gradients" not in {f.name for f in dataclasses.fields(Plan().parallel)}:
            fields["shard_gradients"] = (False,)
            notes.append("parallel.shard_gradients not in the plan: gradients are priced whole on every rank")
        if "shard_parameters" not in {f.name for f in dataclasses.fields(Plan().parallel)}:
            fields["shard_parameters"] = (False,)
            notes.append("parallel.shard_parameters not in the plan: parameters are priced whole on every rank")
        if "offload_optimizer" not in {f.name for f in dataclasses.fields(Plan().parallel)}:
            fields["offload_optimizer"] = False
            notes.append("parallel.offload_optimizer not in the plan: the optimizer is never offloaded")
        fields.update(overrides)
        return cls(notes=tuple(notes), **fields)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def legal_ep_sizes(num_experts: int, gpus: int) -> tuple[list[int], list[str]]:
    """EP sizes that divide both the experts and the GPUs, and why the others were left out."""
    keep, skipped = [], []
    for ep in divisors(gpus):
        if ep > num_experts:
            skipped.append(f"ep={ep}: more ranks than the {num_experts} experts")
        elif num_experts % ep:
            skipped.append(f"ep={ep}: does not divide num_experts={num_experts}")
        else:
            keep.append(ep)
    return keep, skipped


def expert_groups(num_experts: int, gpus: int, etps: tuple[int, ...] = (1,)) -> tuple[list[tuple[int, int]], list[str]]:
    """(ep, etp) pairs to enumerate, and what was left out with why: every legal ep at each etp in ``etps``
    where ep x etp divides the GPUs, except, when etp 1 is tried too, those where ep x etp is a legal ep
    itself (see the module doc)."""
    eps, skipped = legal_ep_sizes(num_experts, gpus)
    pairs: list[tuple[int, int]] = []
    dominated: list[tuple[int, int]] = []
    for etp in sorted(set(etps)):
        for ep in eps:
            if gpus % (ep * etp):
                continue
            if etp > 1 and 1 in etps and ep * etp in eps:
                dominated.append((ep, etp))
            else:
                pairs.append((ep, etp))
    if dominated:
        which = ", ".join(f"ep={ep} x etp={etp}" for ep, etp in dominated) if len(dominated) <= 4 else \
            f"{len(dominated)} ep x etp pairs (etp " + ", ".join(str(t) for t in sorted({t for _, t in dominated})) + ")"
        skipped.append(f"{which}: ep x etp is a legal ep there, which spreads the experts as far sending "
                       "each routed row once instead of to every slice")
    return pairs, skipped


def _plan_dict(base: dict, experts: dict, ep: int, dispatcher: str, mode: str, cf: float | None,
               recompute: tuple[str, ...], fp8: str, chunks: int, weights: str | None = None, etp: int = 1,
               node_ranks: int = 1) -> dict:
    """``base`` (a plan as a dict) with the searched fields set; experts.capacity_factor goes (parallel owns it)."""
    plan: dict[str, Any] = {k: dict(v) for k, v in base.items()}
    plan["experts"] = {**plan.get("experts", {}), **experts, "capacity_factor": None}
    if weights is not None:
        plan["experts"]["apply_weights"] = weights
    plan["parallel"] = {**plan.get("parallel", {}), "ep": ep, "dispatcher": dispatcher, "dispatch_mode": mode,
                        "capacity_factor": cf if mode == "static" else None}
    if etp > 1 or "etp" in plan["parallel"]:
        plan["parallel"]["etp"] = etp
    if node_ranks > 1 or "node_ranks" in plan["parallel"]:
        plan["parallel"]["node_ranks"] = node_ranks
    for key in ("shard_optimizer", "shard_gradients", "shard_parameters"):  # searched: the sharded twins are added
        if key in plan["parallel"]:
            plan["parallel"][key] = False
    if "offload_optimizer" in plan["parallel"]:  # searched: given where a plan does not fit without it
        plan["parallel"]["offload_optimizer"] = 0.0
    if recompute or "recompute" in plan:
        plan["recompute"] = {**plan.get("recompute", {}), "modules": list(recompute)}
    if fp8 != "none" or "fp8" in plan:
        plan["fp8"] = {**plan.get("fp8", {}), "recipe": fp8}
    if chunks:
        plan["overlap"] = {**plan.get("overlap", {}), "enabled": True, "chunks": chunks}
    return plan


def enumerate_candidates(experts: dict, cluster: Cluster, global_batch: int, space: SearchSpace | None = None,
                         base: dict | None = None) -> tuple[list[Candidate], list[str]]:
    """Every legal candidate for ``cluster`` and ``global_batch`` sequences, and what was skipped (with why).

    ``base`` is a plan (as a dict) the candidates start from; the searched fields replace its own.
    """
    space = space or SearchSpace.available()
    E, G = int(experts["num_experts"]), cluster.gpus
    skipped: list[str] = []
    if global_batch % G:
        return [], [f"global batch {global_batch} does not split into whole sequences over {G} GPUs; "
                    f"use a multiple of {G}"]
    per_rank = global_batch // G
    mbs = [b for b in space.micro_batches if per_rank % b == 0]
    skipped += [f"micro-batch {b}: does not divide the {per_rank} sequences per GPU" for b in space.micro_batches
                if b not in mbs]
    groups, why = expert_groups(E, G, space.etps)
    skipped += why
    if not space.expert_parallel:
        skipped += [f"ep={ep}" + (f" x etp={etp}" if etp > 1 else "") + ": the expert_parallel pass is not available"
                    for ep, etp in groups if ep * etp > 1]
        groups = [(1, 1)]
    overlap_chunks = space.overlap_chunks
    if overlap_chunks and "overlap" not in {f.name for f in dataclasses.fields(Plan)}:
        skipped.append(f"overlap chunks {list(overlap_chunks)}: Plan has no 'overlap' section to hold them")
        overlap_chunks = ()
    placements = space.weight_placements if experts.get("apply_weights", "auto") == "auto" else (None,)
    # (shard_optimizer, shard_gradients, shard_parameters): sharding needs more than one GPU, gradients only with
    # the optimizer, parameters only with the gradients
    shard_opts = [(o, g, p) for o in (space.shard_optimizer if G > 1 else (False,))
                  for g in (space.shard_gradients if o else (False,))
                  for p in (space.shard_parameters if g else (False,))]
    sharded: dict[Any, Any] = {}  # one validated sharded parallel section per distinct unsharded one and level
    out: list[Candidate] = []
    ruled_out: dict[str, list[str]] = {}
    for ep, etp in groups:
        comm = [("alltoall", "dropless", None, None)]
        if ep * etp > 1:
            comm = [(d, m, cf, w) for d in space.dispatchers for m in space.dispatch_modes
                    if not (d == "alltoall_dedup" and m == "static")  # dropless only (a variable token count)
                    for cf in (space.capacity_factors if m == "static" else (None,))
                    for w in (placements if d == "alltoall" else placements[:1])]
        node = cluster.gpus_per_node  # dedup at node level where the ep group spans whole nodes
        nodes = [node] if 1 < node < ep * etp and (ep * etp) % node == 0 else []
        chunk_opts = [0] + [c for c in overlap_chunks if ep * etp > 1]
        comm = [(*c, 1) for c in comm] + [(*c, n) for c in comm if c[0] == "alltoall_dedup" for n in nodes]
        for (disp, mode, cf, weights, node_ranks), chunks, rc, fp8, mb in itertools.product(
                comm, chunk_opts, space.recompute_sets, space.fp8_recipes, mbs):
            try:
                plan = Plan.from_dict(_plan_dict(base or {}, experts, ep, disp, mode, cf, rc, fp8, chunks, weights, etp,
                                                 node_ranks))
            except PlanError as e:  # a rule between sections rules the combination out
                combo = (f"ep={ep}" + (f" etp={etp}" if etp > 1 else "") + f" {disp} {mode}"
                         + (f" overlap x{chunks}" if chunks else ""))
                ruled_out.setdefault(str(e), [])
                if combo not in ruled_out[str(e)]:
                    ruled_out[str(e)].append(combo)
                continue
            ov = getattr(plan, "overlap", None)
            for shard, grads, params in shard_opts:
                if shard:  # the same plan, sharded (Plan.replace validates it again)
                    level = (plan.parallel, grads, params)
                    if level not in sharded:
                        sharded[level] = dataclasses.replace(
                            plan.parallel, shard_optimizer=True, **({"shard_gradients": True} if grads else {}),
                            **({"shard_parameters": True} if params else {}),
                            # ZeRO-1/2's all-gather behind the next forward: no cost, a capture can't hold it
                            **({"overlap_param_gather": True} if not params and plan.cuda_graph.mode == "none"
                               else {}))
                    try:
                        plan_s = plan.replace(parallel=sharded[level])
                    except PlanError as e:  # e.g. zero3 under a base plan's CUDA-graph capture
                        combos = ruled_out.setdefault(str(e), [])
                        name = "zero3" if params else "zero2" if grads else "zero1"
                        if name not in combos:
                            combos.append(name)
                        continue
                else:
                    plan_s = plan
                out.append(Candidate(plan_s, micro_batch=mb, overlap_chunks=chunks,
                                     overlap_shared=bool(chunks and ov is not None and ov.shared_expert),
                                     overlap_backward=bool(chunks and ov is not None and ov.backward),
                                     moment_bytes=space.moment_bytes))
    skipped += [f"{', '.join(combos)}: {why}" for why, combos in ruled_out.items()]
    return out, skipped


def offloaded(est: Estimate, profile: ModelProfile, global_batch: int) -> Estimate | None:
    """``est``'s plan with the least share of its optimizer offloaded (a multiple of OFFLOAD_STEP) that fits the
    GPU's memory and the host's, or None if none does."""
    cand, cluster = est.candidate, est.cluster
    optimizer = sum(t.value for t in est.memory if t.name == "optimizer")
    excess = est.memory_bytes - cluster.usable_memory
    if optimizer <= 0 or excess > optimizer:
        return None
    share = min(1.0, round(math.ceil(max(excess, 0.0) / optimizer / OFFLOAD_STEP - 1e-9) * OFFLOAD_STEP, 4))
    try:
        plan = cand.plan.replace(parallel=dataclasses.replace(cand.plan.parallel, offload_optimizer=share))
    except PlanError:  # e.g. a base plan's full CUDA-graph capture, which cannot record a host step
        return None
    out = estimate(profile, cluster, dataclasses.replace(cand, plan=plan), global_batch)
    return out if out.fits else None


@dataclasses.dataclass
class PlanReport:
    """Ranked plans that fit, plans rejected (with the reason), and what the search left out."""

    profile: ModelProfile
    cluster: Cluster
    global_batch: int
    ranked: list[Estimate]
    rejected: list[tuple[Estimate, str]]
    skipped: list[str]
    notes: list[str]

    @property
    def best(self) -> Estimate:
        if not self.ranked:
            reasons = "; ".join(f"{e.candidate.describe()}: {why}" for e, why in self.rejected[:3]) or \
                "; ".join(self.skipped[:3])
            raise MoecompileError(
                f"no plan for {self.profile.name} fits {self.cluster.gpus} x {self.cluster.name} "
                f"({reasons}); add GPUs, lower the micro-batch or sequence length, or enable recompute / FP8")
        return self.ranked[0]

    def save(self, path: str) -> Plan:
        """Write the best plan as a plan.yaml that ``moecompile.convert`` accepts.

        A YAML file starts with comments on what the plan does not hold: the estimate, and the
        micro-batch (the batch to convert at; the training step accumulates over the rest).
        """
        from pathlib import Path

        from ..costs import human
        from .explain import _ms

        best = self.best
        best.plan.save(path)
        if Path(path).suffix != ".json":
            per_gpu = self.global_batch // self.cluster.gpus
            head = (f"# moecompile plan for {self.profile.name} on {self.cluster.gpus} x {self.cluster.name}, global batch "
                    f"{self.global_batch} x seq {self.profile.seq_len}: {best.candidate.describe()}\n"
                    f"# estimated {_ms(best.step_s)} a step, {human(best.memory_bytes, 'B', 1024)} per GPU\n"
                    f"# micro-batch {best.candidate.micro_batch} of the {per_gpu} sequences per GPU: convert with example "
                    f"inputs of {best.candidate.micro_batch} sequences and step on all {per_gpu}\n")
            Path(path).write_text(head + Path(path).read_text())
        return best.plan

    def table(self, top: int = 5) -> str:
        from .explain import table

        return table(self, top)

    def explain(self, top: int = 1) -> str:
        from .explain import explain

        return "\n\n".join(explain(e) for e in self.ranked[:top])


def search(profile_for: Callable[[Candidate], ModelProfile], experts: dict, cluster: Cluster, global_batch: int,
           space: SearchSpace | None = None, base: dict | None = None,
           baseline: ModelProfile | None = None) -> PlanReport:
    """Price every legal candidate with the profile of its graph, and rank those that fit by step time.

    ``profile_for(candidate)`` returns the profile of the graph converted with that candidate's
    recompute / fp8 sections (the search caches nothing itself; the profiler does). With a
    ``baseline`` profile, a candidate whose parameters and optimizer state alone overflow the GPU
    is rejected without profiling its variant (recompute and FP8 change activations, not those).
    """
    space = space or SearchSpace.available()
    if baseline is not None and not any(lp.row_weight_bytes for lp in baseline.layers):
        space = dataclasses.replace(space, weight_placements=("auto",))  # auto is combine already: no glu takes them
    cands, skipped = enumerate_candidates(experts, cluster, global_batch, space, base)
    if not cands:
        raise MoecompileError("no legal plan to price: " + "; ".join(skipped[:3]))
    fits: list[Estimate] = []
    rejected: list[tuple[Estimate, str]] = []
    profile = baseline
    failed: dict[str, list[str]] = {}
    pruned: set[tuple[int, int, int, str]] = set()
    n_pruned = 0
    offload = space.offload_optimizer and cluster.can_offload
    for cand in cands:
        if baseline is not None and static_memory(baseline, cand, cluster.gpus, offloadable=offload) > \
                cluster.usable_memory:
            n_pruned += 1
            key = (cand.ep, cand.etp, cand.micro_batch, cand.zero)
            if key not in pruned:  # one representative per EP x ETP size, micro-batch and sharding (zero1, 2, 3)
                pruned.add(key)
                # not traced with its slices: rejected on what slicing leaves unchanged, its activations unsliced
                est = estimate(dataclasses.replace(baseline, etp=cand.etp), cluster, cand, global_batch)
                static = static_memory(baseline, cand, cluster.gpus, offloadable=offload)
                what = ("parameters and gradients alone, the optimizer offloaded," if offload else
                        "parameters, gradients and optimizer state alone")
                rejected.append((est, f"{what} need {static / 2**30:.1f} GiB per GPU > "
                                      f"{cluster.usable_memory / 2**30:.1f} GiB usable, before activations "
                                      f"({est.misfit_reason().split(': ', 1)[1]})"))
            continue
        try:
            prof = profile_for(cand)
        except MoecompileError as e:
            failed.setdefault(str(e).splitlines()[0], []).append(cand.describe())
            continue
        profile = profile or prof
        est = estimate(prof, cluster, cand, global_batch)
        if not est.fits and offload:
            est = offloaded(est, prof, global_batch) or est
        if est.fits:
            fits.append(est)
        else:
            rejected.append((est, est.misfit_reason()))
    skipped += [f"{len(c)} plan(s) like '{c[0]}' could not be profiled: {why}" for why, c in failed.items()]
    if n_pruned > len(pruned):
        skipped.append(f"{n_pruned - len(pruned)} more plans rejected like the ones shown: their parameters and "
                       "optimizer state do not fit, whatever recompute / FP8 / overlap they use")
    if profile is None:
        raise MoecompileError("no candidate plan could be profiled: " + "; ".join(skipped[:3]))
    fits.sort(key=_rank_key)
    rejected.sort(key=lambda r: r[0].memory_bytes)
    notes = list(space.notes) + profile.notes
    if space.offload_optimizer and not cluster.can_offload:
        notes.append(f"cluster {cluster.name} gives no host memory, DRAM bandwidth or PCIe figures: the optimizer is "
                     "never offloaded (set Cluster.host_memory_bytes, host_bandwidth and pcie_bandwidth to price it)")
    return PlanReport(profile, cluster, global_batch, fits, rejected, skipped, notes)


TIE = 0.002  # step times within 0.2% are a tie: the model is not that precise


def _rank_key(est: Estimate) -> tuple:
    """Fastest first; on a tie prefer dropless (no drops), the weights in the activation (less memory), fewer
    chunks, no recompute, no FP8, less sharding (unsharded runs any torch optimizer; zero1 before zero2: the same
    bytes, without hooks copying every gradient into a bucket; zero2 before zero3: no hooks gathering parameters,
    and CUDA graphs allowed), less offload, larger micro-batch."""
    import math

    c = est.candidate
    return (math.floor(math.log(max(est.step_s, 1e-12)) / math.log1p(TIE)), c.plan.parallel.dispatch_mode != "dropless",
            c.plan.experts.apply_weights == "combine", c.overlap_chunks, len(c.plan.recompute.modules),
            c.plan.fp8.enabled, c.distributed_optimizer + c.shard_gradients + c.shard_parameters, c.offload,
            -c.micro_batch, est.step_s)


def iter_sections(cand: Candidate) -> dict:
    """The plan sections that change the graph, for profiling a candidate.

    Of experts only ``apply_weights``: the rest is the model's (the profile's own experts section). Of
    parallel only ``etp``: the experts' slices, traced on one process (the rest is priced, not traced).
    """
    d = cand.plan.to_dict()
    out = {k: d[k] for k in ("recompute", "fp8") if k in d and d[k] != Plan().to_dict()[k]}
    if cand.plan.experts.apply_weights != "auto":
        out["experts"] = {"apply_weights": cand.plan.experts.apply_weights}
    if cand.etp > 1:  # the experts traced in their slices, on one process
        out["parallel"] = {"etp": cand.etp}
    return out

