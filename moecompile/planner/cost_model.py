"""One training step on one rank, term by term, from a model profile, a cluster and a candidate plan.

    est = estimate(profile, cluster, Candidate(plan, micro_batch=1), global_batch=1024)
    est.step_s, est.fits, est.terms        # every term is printed by --explain

The model, per micro-batch and rank (T tokens of the micro-batch, /tp with sequence parallelism):
- compute: each forward op takes max(FLOPs / achieved FLOP/s, bytes / achieved HBM bandwidth) plus
  the cluster's per-op host overhead (a roofline per op; FP8 GEMMs at the FP8 peak); backward is
  BACKWARD_FACTOR x forward; recompute re-runs the forward of the recomputed ops.
- dispatch/combine: bytes of the routed rows (the permute output in the graph: T*k*H elements)
  times the share that leaves the rank, split by where the peers are (NVLink vs NIC), plus a
  latency per exchange; forward dispatch + combine and their backward mirrors. ``alltoall_dedup``
  sends each token once per distinct rank of its experts (their expected number under uniform
  routing, :func:`distinct_ranks`, among the groups it may use under group-limited routing) with its k
  expert ids and weights; at node level (``node_ranks``)
  once per distinct node over the inter-node rail, then once per distinct rank inside the node
  (:func:`dedup_hops`); ``allgather`` every peer's tokens.
- overlap: with the overlap pass's N chunks the MoE block runs as a 3-stage pipeline
  (dispatch, experts, combine): (d + c + b)/N + (N-1)/N * max(c, d + b); what exceeds the expert
  compute c (and the shared experts, which are independent of the exchange) is exposed. Megatron's 1F1B overlap ("1f1b", validation only) hides a layer's
  exchanges behind the other micro-batch's whole layer.
- tensor/pipeline parallelism (validation only; moecompile has no TP/PP pass): sequence-parallel
  all-gather + reduce-scatter per attention / dense MLP, and the interleaved-1F1B bubble
  (pp-1)/vpp micro-batches.
- data parallel: gradient all-reduce of dense parameters over the dp ranks and of expert
  parameters over the expert-data-parallel ranks; the AdamW update streams every parameter.
  With ``parallel.shard_optimizer`` (ZeRO-1, "zero1") a reduce-scatter of the gradients and an
  all-gather of the parameters replace the all-reduce (the same bytes when gradients are in the
  parameter dtype), and each rank updates only its range: dense / dp, experts / edp. With
  ``parallel.shard_gradients`` too (ZeRO-2, "zero2") each bucket is reduce-scattered once per
  micro-batch, as backward completes it, instead of once per step: m micro-batches move m times
  ZeRO-1's reduce-scatter bytes (one micro-batch: exactly ZeRO-1's); the all-gather stays once a
  step. Counted as exposed, not hidden behind backward: nothing has measured how much of it NCCL
  overlaps while backward's kernels compete for the same SMs and HBM (gloo's exchange blocks), and
  ZeRO-1's sync after backward is counted exposed too, so ZeRO-2 never looks faster than ZeRO-1.
  With ``parallel.shard_parameters`` too (ZeRO-3, "zero3") every sharded bucket's parameters are
  all-gathered twice per micro-batch (before forward reads them, prefetched one bucket ahead, and
  again in backward) and the step's all-gather after the optimizer goes: m reduce-scatters in the
  gradient dtype + 2m all-gathers in the parameter dtype, against ZeRO-2's m + 1 (the bucket the forward
  reads last stays whole into backward, one all-gather fewer a micro-batch: not counted). The gathers are
  counted exposed for the reason ZeRO-2's reduce-scatters are: nothing has measured how much of
  them the prefetch hides, so ZeRO-3 never looks faster than ZeRO-2 and is chosen for memory only.
- expert tensor parallelism (``parallel.etp`` = Q): priced on the profile of the graph with every expert cut
  into Q slices (traced on one process, planner/profile.py), so its routed rows, dispatch bytes and kept
  activations are the sliced graph's (Q x the rows, Q x narrower expert GEMMs); experts, their exchange
  and their data-parallel group are then spread over ep x Q ranks wherever ep alone is above.
- memory: parameters, gradients and optimizer state per rank (experts / ep) and the activations
  the graph keeps for backward, from the memory estimator (or moecompile.costs when it is absent).
  Sharded, a rank keeps the AdamW states, fp32 masters and their grads of its range only; the
  parameters and the model-dtype gradient buckets stay whole, except under ZeRO-2: its range of the
  gradients plus the whole bucket buffers in flight (:func:`in_flight_bytes`), and under
  ZeRO-3 its range of the parameters plus the whole buckets gathered (:func:`gathered_bytes`).
- optimizer offload (``parallel.offload_optimizer`` = f): f of the elements a rank updates keep their
  optimizer state, fp32 master and its gradient in host memory (the device's optimizer memory x (1 - f)),
  and on the host an fp32 master and gradient whatever the model's dtype, plus, for a bf16 model, the pinned
  buffers their gradient and value cross PCIe in. Each step their gradient goes down and the new values come
  up over PCIe and a CPU AdamW streams them at the host's achieved bandwidth, while the device updates the
  rest: the step pays what the host path takes beyond the device's part. The host memory must fit too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..costs import human
from ..errors import MoecompileError
from ..kernels.adamw import host_traffic
from ..grad_shards import IN_FLIGHT
from ..memory_shards import IN_FLIGHT_PARAM_BUCKETS
from ..optimizer_offload import transfer_bytes
from ..passes.ep_dedup import nodes_reached
from .cluster import GiB, Cluster, Span
from . import whole_buckets
from .profile import LayerProfile, ModelProfile, NodeCost

# Assumptions of the step model, stated once (efficiencies of the hardware live in cluster.py).
BACKWARD_FACTOR = 2.0  # backward = dgrad + wgrad = 2x the forward's FLOPs and bytes (the usual 6N rule)
CAUSAL_FRACTION = 0.5  # causal attention kernels skip the masked half of the S x S scores
ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32 per parameter (build_train_step keeps fp32 masters)
# ZeRO-2's whole bucket buffers a rank holds, where a profile has no parameter layout to run the runtime over:
# NCCL's IN_FLIGHT reduce-scatters + the bucket backward fills. An approximation, not a bound (a second bucket
# may fill side by side, dense and expert, and the received ranges are alive too)
IN_FLIGHT_BUCKETS = IN_FLIGHT + 1
DEDUP_ID_BYTES = 12  # alltoall_dedup sends each token's k expert ids (int64) and routing weights (fp32)
HOST_TERM = "optimizer on host"  # the memory term in host memory (parallel.offload_optimizer), not the device's
_FP8_CATEGORY = {"experts": "experts", "shared_experts": "shared_experts", "dense": "dense_mlp",
                 "attention_proj": "attention_proj"}
_EXPERT_COMPUTE = {"experts"}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A plan moecompile can run, plus the execution choices around it that the plan does not hold."""

    plan: Any  # moecompile.Plan
    micro_batch: int = 1  # sequences per micro-batch (gradient accumulation over the rest)
    overlap_chunks: int = 0  # 0: no overlap pass; N >= 1: the overlap pass's chunks
    overlap_shared: bool = False  # shared experts also run while the dispatch is in flight
    overlap_backward: bool = False
    # modelled for validation against systems that have them; moecompile's enumerator keeps them at 1 / off
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep_overlap_1f1b: bool = False
    grad_sync_overlap: bool = False
    grad_bytes: float | None = None  # per element; None: the parameter dtype
    assume_recompute: tuple[str, ...] = ()  # regions treated as recomputed though the graph has no marks
    assume_fp8: bool = False  # treat plan.fp8.modules GEMMs as FP8 though the graph has no FP8 ops
    bucket_mb: float = 25.0  # build_train_step's gradient buckets (its default); ZeRO-2 keeps a few whole
    moment_bytes: int = 4  # per AdamW moment element: 4 (torch.optim.AdamW on fp32 masters), 2 (moecompile.AdamW bf16)

    @property
    def ep(self) -> int:
        return self.plan.parallel.ep

    @property
    def etp(self) -> int:
        """Slices each expert is cut into (``parallel.etp``): a routed row goes to all of them."""
        return getattr(self.plan.parallel, "etp", 1)

    @property
    def expert_ranks(self) -> int:
        """Ranks one layer's experts (their slices) are spread over: ep x etp."""
        return self.ep * self.etp

    @property
    def node_ranks(self) -> int:
        """alltoall_dedup's ranks per node where they cut the ep group (``parallel.node_level_ranks``); 1: rank level."""
        return getattr(self.plan.parallel, "node_level_ranks", 1)

    @property
    def distributed_optimizer(self) -> bool:
        """ZeRO-1 / Megatron-Core's distributed optimizer: the plan's ``parallel.shard_optimizer``."""
        return self.plan.parallel.shard_optimizer

    @property
    def shard_gradients(self) -> bool:
        """ZeRO-2: the plan's ``parallel.shard_gradients`` (it implies ``shard_optimizer``)."""
        return bool(getattr(self.plan.parallel, "shard_gradients", False))

    @property
    def shard_parameters(self) -> bool:
        """ZeRO-3: the plan's ``parallel.shard_parameters`` (it implies ``shard_gradients``)."""
        return bool(getattr(self.plan.parallel, "shard_parameters", False))

    @property
    def offload(self) -> float:
        """The plan's ``parallel.offload_optimizer``: the share of the optimizer a rank keeps in host memory."""
        return float(getattr(self.plan.parallel, "offload_optimizer", 0.0))

    @property
    def zero(self) -> str:
        """"zero3", "zero2", "zero1", or "" (unsharded): how much of the training state a rank shards."""
        if not self.distributed_optimizer:
            return ""
        return "zero3" if self.shard_parameters else "zero2" if self.shard_gradients else "zero1"

    def describe(self) -> str:
        p = self.plan
        parts = [f"ep={p.parallel.ep}" + (f" etp={self.etp}" if self.etp > 1 else "")]
        if self.expert_ranks > 1:
            mode = p.parallel.dispatch_mode
            if mode == "static":
                mode += f" cf={p.parallel.static_capacity_factor(p.experts)}"
            parts.append(f"{p.parallel.dispatcher}{f'/node{self.node_ranks}' if self.node_ranks > 1 else ''} {mode}")
        if self.tp > 1 or self.pp > 1:
            parts.append(f"tp={self.tp} pp={self.pp}" + (f" vpp={self.vpp}" if self.vpp > 1 else ""))
        if self.overlap_chunks:
            parts.append(f"overlap x{self.overlap_chunks}" + ("+shared" if self.overlap_shared else "")
                         + ("+bwd" if self.overlap_backward else ""))
        if self.ep_overlap_1f1b:
            parts.append("1f1b-a2a-overlap")
        if self.distributed_optimizer:
            parts.append(self.zero)
        if self.offload:
            parts.append(f"offload {self.offload:.0%}")
        mods = list(p.recompute.modules) + [m for m in self.assume_recompute if m not in p.recompute.modules]
        if self.expert_ranks > 1 and p.experts.apply_weights == "combine":
            parts.append("weights@combine")
        if mods:
            parts.append("recompute " + ",".join(mods))
        if p.fp8.enabled:
            parts.append(f"fp8 {p.fp8.recipe}")
        if self.moment_bytes != 4:
            parts.append("bf16 moments" if self.moment_bytes == 2 else f"{8 * self.moment_bytes}-bit moments")
        parts.append(f"mb={self.micro_batch}")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Term:
    name: str
    value: float  # seconds per step (time terms) or bytes per rank (memory terms)
    detail: str
    counted: bool = True  # False: shown but hidden behind other work


@dataclasses.dataclass
class Estimate:
    candidate: Candidate
    cluster: Cluster
    global_batch: int
    seq_len: int
    step_s: float
    terms: list[Term]
    memory: list[Term]
    model_flops: float  # 3 x forward FLOPs of the global batch, as traced (no recompute)

    @property
    def memory_bytes(self) -> float:
        """Device bytes per rank (the memory terms counted; the host's are shown, not counted)."""
        return sum(t.value for t in self.memory if t.counted)

    @property
    def host_bytes(self) -> float:
        """Host bytes per rank: the offloaded optimizer's (``parallel.offload_optimizer``)."""
        return sum(t.value for t in self.memory if t.name == HOST_TERM)

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.cluster.usable_memory and self.host_fits

    @property
    def host_fits(self) -> bool:
        return self.host_bytes <= self.cluster.usable_host_memory

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.global_batch * self.seq_len / self.step_s / self.cluster.gpus

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_s / self.cluster.gpus / 1e12

    def term(self, name: str) -> float:
        return sum(t.value for t in self.terms if t.name == name and t.counted)

    @property
    def plan(self) -> Any:
        return self.candidate.plan

    def misfit_reason(self) -> str:
        if not self.host_fits:
            return (f"the offloaded optimizer needs {self.host_bytes / GiB:.1f} GiB of host memory per GPU > "
                    f"{self.cluster.usable_host_memory / GiB:.1f} GiB usable ({self.cluster.host_memory_bytes / GiB:.0f}"
                    f" GiB x {self.cluster.host_usable_fraction})")
        parts = ", ".join(f"{t.name} {t.value / GiB:.1f}" for t in self.memory if t.counted)
        return (f"needs {self.memory_bytes / GiB:.1f} GiB per GPU > {self.cluster.usable_memory / GiB:.1f} GiB usable "
                f"({self.cluster.memory_bytes / GiB:.0f} GiB x {self.cluster.usable_memory_fraction}): {parts}")


# --- compute --------------------------------------------------------------------------------------


def _fp8_categories(cand: Candidate) -> set[str]:
    fp8 = cand.plan.fp8
    if not (cand.assume_fp8 and fp8.enabled):
        return set()
    return {_FP8_CATEGORY[m] for m in fp8.modules if m in _FP8_CATEGORY}


def _static_pad(profile: ModelProfile, cand: Candidate, tokens: float) -> float:
    """Rows the experts really process per routed row: E*C / (T*k) in static mode, 1 when dropless."""
    import math

    par = cand.plan.parallel
    cf = par.static_capacity_factor(cand.plan.experts) if cand.expert_ranks > 1 else cand.plan.experts.capacity_factor
    if not cf:
        return 1.0
    E, k = profile.num_experts, profile.top_k
    capacity = max(1, math.ceil(cf * tokens * k / E))
    return capacity * E / (tokens * k)


class _Times:
    """Per-op times of one micro-batch on one rank (before the pipeline split)."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, cand: Candidate):
        self.profile, self.cluster, self.cand = profile, cluster, cand
        self.scale = cand.micro_batch / profile.micro_batch
        tokens = profile.tokens * self.scale / cand.tp
        self.pad = _static_pad(profile, cand, tokens)
        self.fp8 = _fp8_categories(cand)
        self.recompute = set(cand.assume_recompute)

    def op(self, nc: NodeCost) -> float:
        c, cand = self.cluster, self.cand
        flops = nc.flops * self.scale / cand.tp
        act = (nc.bytes - nc.weight_bytes) * self.scale / cand.tp
        if nc.category == "attention_core":
            flops *= CAUSAL_FRACTION
        if nc.category == "experts":
            flops, act = flops * self.pad, act * self.pad
            weights = nc.weight_bytes / cand.expert_ranks
        else:
            weights = nc.weight_bytes / cand.tp
        fp8 = nc.fp8 or nc.category in self.fp8
        return max(flops / c.peak(fp8), (act + weights) / c.memory_bandwidth) + c.op_overhead_s

    def layer(self, lp: LayerProfile) -> dict[str, float]:
        """Forward seconds of one layer: total, its expert GEMMs, shared experts, recomputed ops."""
        out = {"total": 0.0, "experts": 0.0, "shared": 0.0, "recompute": 0.0}
        for nc in lp.nodes:
            t = self.op(nc)
            out["total"] += t
            if nc.category in _EXPERT_COMPUTE or "moe_act" in nc.tags:
                out["experts"] += t
            if "shared_experts" in nc.tags:
                out["shared"] += t
            if nc.recomputed or (nc.tags & self.recompute):
                out["recompute"] += t
        return out


def op_seconds(profile: ModelProfile, cluster: Cluster, cand: Candidate) -> Callable[[NodeCost], float]:
    """The forward price of one op of ``profile``'s graph, as :func:`estimate` sums it: for a check that times
    the ops themselves (``benchmarks/planner_validation.py``)."""
    return _Times(profile, cluster, cand).op


# --- communication --------------------------------------------------------------------------------


def _packs_weights(par: Any, cluster: Cluster, rows_bytes: float) -> bool:
    """The expert_parallel pass's rule (parallel.pack_routing_weights), on this cluster's device kind."""
    return par.packs_routing_weights(rows_bytes, "cpu" if cluster.name.startswith("cpu") else "cuda")


def distinct_ranks(num_experts: int, top_k: int, ep: int, etp: int = 1, groups: int = 1, group_k: int = 1) -> float:
    """Expected distinct ranks a token's k experts (their slices, under etp) sit on under uniform routing, among
    the ``group_k`` of ``groups`` groups it may use: ``ep_dedup.nodes_reached`` with one rank a node."""
    return nodes_reached(num_experts, top_k, ep, etp, 1, groups, group_k)


def dedup_hops(profile: ModelProfile, cand: Candidate, lp: LayerProfile, scale: float) -> list[tuple[float, int, int]]:
    """(bytes a rank sends, group size, rank stride) of each hop of ``alltoall_dedup``: one over the ep group, or
    at node level (``parallel.node_ranks`` = G) over the rail (one rank a node, stride G: the slow links), to each
    node a token needs, then inside the node to each rank it needs (as many rows as the rank-level exchange)."""
    tokens, G = lp.hidden_bytes * scale / cand.tp, cand.node_ranks
    ex = cand.plan.experts
    limit = (getattr(ex, "route_groups", 1), getattr(ex, "route_group_top_k", 1))  # DeepSeek-V3's node-limited routing
    ranks = tokens * distinct_ranks(profile.num_experts, profile.top_k, cand.ep, cand.etp, *limit)
    if G == 1:
        return [(ranks, cand.expert_ranks, 1)]
    nodes = nodes_reached(profile.num_experts, profile.top_k, cand.ep, cand.etp, G, *limit)
    return [(tokens * nodes, cand.expert_ranks // G, G), (ranks, G, 1)]


def _dispatch_payload(profile: ModelProfile, cand: Candidate, lp: LayerProfile, scale: float, pad: float) -> float:
    """Bytes of one dispatch (or combine) of the layer on one rank, before the share that stays on the rank."""
    par, tokens = cand.plan.parallel, lp.hidden_bytes * scale / cand.tp
    if par.dispatcher == "allgather":  # every peer's tokens gathered, the partial sums reduce-scattered back
        return tokens * cand.expert_ranks
    if par.dispatcher == "alltoall_dedup":  # each token once per distinct rank of its experts (first hop's)
        return dedup_hops(profile, cand, lp, scale)[0][0]
    return lp.dispatch_bytes * scale / cand.tp * pad  # every routed copy


def _exchange(cluster: Cluster, payload: float, size: int, stride: int = 1) -> tuple[float, str]:
    """An all-to-all-like exchange in a group: each rank sends ``payload`` x (size-1)/size to its peers."""
    if size <= 1 or payload <= 0:
        return 0.0, "no peers"
    off = cluster.peers_off_node(size, stride)
    on = (size - 1) / size - off
    intra, inter = cluster.link("intra"), cluster.link("inter")
    t_on = payload * on / intra.bandwidth
    t_off = payload * off / inter.bandwidth if off else 0.0
    span: Span = cluster.span(size, stride)
    latency = cluster.link(span).latency
    detail = (f"{payload / 1e6:.1f} MB x ({on:.2f} on-node @ {intra.bandwidth / 1e9:.0f} GB/s"
              + (f", {off:.2f} off-node @ {inter.bandwidth / 1e9:.0f} GB/s" if off else "") + f") + {latency * 1e6:.0f} us")
    return latency + max(t_on, t_off), detail


def _ring(cluster: Cluster, nbytes: float, size: int, stride: int, passes: float) -> float:
    """A reduction over ``size`` ranks: ``passes`` x (size-1)/size x nbytes through the slowest link it
    crosses (ring bandwidth), plus 2 log2(size) latencies (tree latency, as NCCL picks for small sizes)."""
    import math

    if size <= 1 or nbytes <= 0:
        return 0.0
    link = cluster.link(cluster.span(size, stride))
    return passes * (size - 1) / size * nbytes / link.bandwidth + 2 * math.ceil(math.log2(size)) * link.latency


def _pipe(d: float, c: float, b: float, n: int, latency: float) -> float:
    """dispatch -> compute -> combine over n chunks, sharing one link for d and b."""
    return (d + c + b) / n + (n - 1) / n * max(c, d + b) + (n - 1) * 2 * latency


# --- the step -------------------------------------------------------------------------------------


def estimate(profile: ModelProfile, cluster: Cluster, cand: Candidate, global_batch: int) -> Estimate:
    """Predicted step time and memory per rank of ``cand`` on ``cluster`` for ``global_batch`` sequences."""
    G, tp, pp, ep = cluster.gpus, cand.tp, cand.pp, cand.expert_ranks  # ep: the experts' group, ep x etp
    if profile.etp != cand.etp:
        raise MoecompileError(f"the profile was traced with experts in {profile.etp} slice(s), the candidate has "
                              f"parallel.etp={cand.etp}: profile the candidate's own graph (profile_config(..., "
                              f"sections={{'parallel': {{'etp': {cand.etp}}}}}))")
    dp = G // (tp * pp)
    edp = max(1, G // (ep * pp))
    seqs = global_batch / dp
    m = seqs / cand.micro_batch  # micro-batches per rank
    times = _Times(profile, cluster, cand)
    scale = times.scale
    terms: list[Term] = []

    fwd = rc = 0.0
    a2a_exposed = tp_comm = 0.0
    a2a_detail = weights_how = ""
    par = cand.plan.parallel
    for lp in profile.layers:
        lt = times.layer(lp)
        fwd += lt["total"] * lp.count
        rc += lt["recompute"] * lp.count
        if lp.kind == "moe" and ep > 1:
            payload = _dispatch_payload(profile, cand, lp, scale, times.pad)
            t, a2a_detail = _exchange(cluster, payload, ep)
            lat = cluster.link(cluster.span(ep)).latency
            count_x = lat if par.dispatch_mode == "dropless" and par.dispatcher != "allgather" else 0.0
            if par.dispatcher == "alltoall_dedup":  # per hop: its rows, each sent token's k expert ids and weights
                hops = dedup_hops(profile, cand, lp, scale)
                t = count_x = 0.0
                for nbytes, size, stride in hops:
                    t += _exchange(cluster, nbytes, size, stride)[0]
                    ids = nbytes / lp.hidden_bytes * profile.tokens * profile.top_k * DEDUP_ID_BYTES
                    count_x += (cluster.link(cluster.span(size, stride)).latency  # the hop's count exchange
                                + 2 * _exchange(cluster, ids, size, stride)[0])
                weights_how = f" + the tokens' expert ids and weights ({DEDUP_ID_BYTES} B each of k)"
                if len(hops) > 1:
                    a2a_detail = (_exchange(cluster, hops[0][0], hops[0][1], hops[0][2])[1] + " to the nodes, then "
                                  + _exchange(cluster, hops[1][0], hops[1][1])[1] + " inside them")
            if par.dispatcher == "alltoall" and lp.row_weight_bytes:  # each row's weight goes, its gradient returns
                w_bytes = lp.row_weight_bytes * scale / tp * times.pad
                weights_how = " + the routing weights' 2"
                if _packs_weights(par, cluster, payload):  # a column of the rows' exchange: bytes, and 3 copies
                    weights_how = " + the routing weights, packed into the dispatch (3 copies of the rows)"
                    count_x += 2 * w_bytes / cluster.link(cluster.span(ep)).bandwidth + 3 * 2 * payload / cluster.memory_bandwidth
                else:
                    count_x += 2 * _exchange(cluster, w_bytes, ep)[0]
            if cand.ep_overlap_1f1b:
                layer_fb = lt["total"] * (1 + BACKWARD_FACTOR)
                exposed = max(0.0, 4 * t - layer_fb) + count_x
            elif cand.overlap_chunks:
                n, c = cand.overlap_chunks, lt["experts"]
                s = lt["shared"] if cand.overlap_shared else 0.0  # independent: fills any exchange gap
                exposed = max(0.0, _pipe(t, c, t, n, lat) - c - s) + count_x
                if cand.overlap_backward:
                    f = BACKWARD_FACTOR
                    exposed += max(0.0, _pipe(t, f * c, t, n, lat) - f * c - f * s)
                else:
                    exposed += 2 * t
            else:
                exposed = 4 * t + count_x
            a2a_exposed += exposed * lp.count
        if tp > 1 and lp.kind != "base":
            n_coll = 2 if lp.kind == "moe" else 4  # attention (and dense MLP) all-gather + reduce-scatter
            t, _ = _exchange(cluster, lp.hidden_bytes * scale, tp)
            tp_comm += n_coll * (1 + 1) * t * lp.count  # forward and backward

    bwd = BACKWARD_FACTOR * fwd
    per_mb = (fwd + bwd + rc + a2a_exposed + tp_comm) / pp
    terms.append(Term("forward", m * fwd / pp, f"{m:g} micro-batches x {fwd / pp * 1e3:.3g} ms: per op max(FLOPs / "
                      f"{human(cluster.peak(False), 'FLOP/s')}, bytes / {human(cluster.memory_bandwidth, 'B/s')})"
                      + (f" + {cluster.op_overhead_s * 1e6:.1f} us" if cluster.op_overhead_s else "")
                      + (f", FP8 GEMMs at {human(cluster.peak(True), 'FLOP/s')}" if (times.fp8 or _has_fp8(profile)) else "")
                      + (f", /tp {tp}" if tp > 1 else "") + (f", /pp {pp}" if pp > 1 else "")))
    terms.append(Term("backward", m * bwd / pp, f"{BACKWARD_FACTOR:g} x forward"))
    if rc:
        terms.append(Term("recompute", m * rc / pp, "forward of the recomputed ops again in backward"))
    if ep > 1:
        how = ("1F1B: hidden behind the other micro-batch's layer" if cand.ep_overlap_1f1b else
               f"overlap pass, {cand.overlap_chunks} chunks" if cand.overlap_chunks else "not overlapped")
        terms.append(Term("dispatch+combine", m * a2a_exposed / pp,
                          f"exposed, {profile.moe_layers} MoE layers x 4 exchanges of {a2a_detail}"
                          + weights_how + f" ({how})" + (f"; in groups of ep x etp = {ep}, each routed row sent to "
                                                         f"its expert's {cand.etp} slices" if cand.etp > 1 else "")))
        if cand.overlap_chunks or cand.ep_overlap_1f1b:
            raw = sum(4 * _exchange(cluster, _dispatch_payload(profile, cand, lp, scale, times.pad), ep)[0] * lp.count
                      for lp in profile.layers if lp.kind == "moe")
            terms.append(Term("dispatch+combine hidden", m * max(0.0, raw - a2a_exposed) / pp,
                              "exchange time hidden behind compute", counted=False))
    if tp > 1:
        terms.append(Term("tensor-parallel comm", m * tp_comm / pp,
                          f"sequence-parallel all-gather/reduce-scatter in tp={tp} groups, not overlapped"))
    if pp > 1:
        bubble = (pp - 1) / cand.vpp * per_mb
        terms.append(Term("pipeline bubble", bubble, f"(pp-1)/vpp = {(pp - 1) / cand.vpp:.2f} micro-batches of "
                          f"{per_mb * 1e3:.1f} ms"))
        link = cluster.link(cluster.span(2, stride=G // pp))
        p2p = link.latency + profile.layers[0].hidden_bytes * scale / tp / link.bandwidth
        terms.append(Term("pipeline p2p", m * 2 * cand.vpp * p2p, f"{2 * cand.vpp} activation sends per "
                          "micro-batch" + (" (overlapped by the interleaved schedule)" if cand.vpp > 1 else ""),
                          counted=cand.vpp == 1))

    # gradients and optimizer
    dense_p = profile.dense_params / (tp * pp)
    expert_p = profile.expert_params / (ep * pp)
    gbytes = cand.grad_bytes or profile.elem_bytes
    # ring passes over the gradient bytes: all-reduce 2; reduce-scatter 1 (ZeRO-2: one per micro-batch) + the
    # parameters' all-gather in their own dtype (ZeRO-3: none after the step, two per micro-batch before use)
    rs = m if cand.shard_gradients else 1.0
    ag = 0.0 if cand.shard_parameters else profile.elem_bytes / gbytes
    passes = rs + ag if cand.distributed_optimizer else 2.0
    t_dense = _ring(cluster, dense_p * gbytes, dp, tp, passes)
    t_exp = _ring(cluster, expert_p * gbytes, edp, ep * tp, passes)
    t_dp = t_dense + t_exp
    hideable = bwd / pp if cand.grad_sync_overlap else 0.0
    terms.append(Term("gradient sync", max(0.0, t_dp - hideable),
                      f"dense {human(dense_p)} params over dp={dp}, experts {human(expert_p)} over edp={edp}, "
                      + (f"reduce-scatter per micro-batch (x{m:g}), no all-gather after the step (zero3 gathers "
                         "before use), not counted as hidden behind backward" if cand.shard_parameters else
                         f"reduce-scatter per micro-batch (x{m:g}) + all-gather, not counted as hidden behind "
                         "backward" if cand.shard_gradients else
                         "reduce-scatter + all-gather" if cand.distributed_optimizer else "all-reduce")
                      + (" (the all-gather runs behind the next forward, overlap_param_gather: counted exposed, "
                         "unmeasured on GPUs)" if getattr(cand.plan.parallel, "overlap_param_gather", False) else "")
                      + (", overlapped with the last backward" if cand.grad_sync_overlap else "")))
    if cand.shard_parameters:  # every sharded bucket gathered before forward reads it and again in backward
        e = profile.elem_bytes
        t_gather = _ring(cluster, dense_p * e, dp, tp, 2 * m) + _ring(cluster, expert_p * e, edp, ep * tp, 2 * m)
        terms.append(Term("parameter gather", t_gather,
                          f"all-gather of every sharded bucket's {e:g} B parameters twice per micro-batch (x{2 * m:g}): "
                          "before forward reads it (the next bucket prefetched) and again in backward; dense over "
                          f"dp={dp}, experts over edp={edp}; counted exposed: how much the prefetch hides behind "
                          "compute is not measured"))
    # AdamW reads and writes the fp32 master and both states, reads the gradient, and writes a low-precision model's
    # parameter (an fp32 model's parameter is its master: 28 B, not 32)
    e = profile.elem_bytes
    per_param = 2 * (4 + 2 * cand.moment_bytes) + gbytes + (e if e < 4 else 0)
    owned, f = optimizer_params(profile, cand, G), cand.offload
    opt_bytes = (1 - f) * owned * per_param
    t_device = opt_bytes / cluster.memory_bandwidth
    terms.append(Term("optimizer", t_device,
                      f"AdamW streams {human(opt_bytes, 'B')} at {human(cluster.memory_bandwidth, 'B/s')}"
                      + (f" (this rank's range: dense / dp={dp}, experts / edp={edp})" if cand.distributed_optimizer
                         else "") + (f", the {1 - f:.0%} on the device" if f else "")))
    if f:
        terms.append(_offload_term(profile, cluster, cand, f * owned, gbytes, t_device))

    step = sum(t.value for t in terms if t.counted)
    memory = _memory(profile, cand, G)
    model_flops = (1 + BACKWARD_FACTOR) * profile.flops * global_batch / profile.micro_batch
    return Estimate(cand, cluster, global_batch, profile.seq_len, step, terms, memory, model_flops)


def _has_fp8(profile: ModelProfile) -> bool:
    return any(nc.fp8 for lp in profile.layers for nc in lp.nodes)


def params_per_rank(profile: ModelProfile, cand: Candidate) -> float:
    """Parameter elements one rank holds: dense / (tp x pp), experts / (ep x etp x pp)."""
    return profile.dense_params / (cand.tp * cand.pp) + profile.expert_params / (cand.expert_ranks * cand.pp)


def dp_sizes(gpus: int, cand: Candidate) -> tuple[int, int]:
    """(dp, edp): the ranks a dense parameter and an expert parameter are replicated over."""
    return max(1, gpus // (cand.tp * cand.pp)), max(1, gpus // (cand.expert_ranks * cand.pp))


def optimizer_params(profile: ModelProfile, cand: Candidate, gpus: int) -> float:
    """Parameter elements whose optimizer state one rank keeps and updates: all it holds, or with
    ``parallel.shard_optimizer`` its range of them (dense / dp, experts / edp)."""
    dense, experts = profile.dense_params / (cand.tp * cand.pp), profile.expert_params / (cand.expert_ranks * cand.pp)
    if not cand.distributed_optimizer:
        return dense + experts
    dp, edp = dp_sizes(gpus, cand)
    return dense / dp + experts / edp


def grad_params(profile: ModelProfile, cand: Candidate, gpus: int) -> float:
    """Parameter elements whose model-dtype gradient one rank keeps: all it holds, or with
    ``parallel.shard_gradients`` its range of them (the optimizer's: dense / dp, experts / edp)."""
    return optimizer_params(profile, cand, gpus) if cand.shard_gradients else params_per_rank(profile, cand)


def in_flight_bytes(profile: ModelProfile, cand: Candidate, gpus: int) -> float:
    """ZeRO-2's whole gradient buffers one rank holds besides its range, at their peak in backward; 0 without
    ``parallel.shard_gradients``.

    The runtime's own code over the model's parameter layout (planner/whole_buckets.py): the buckets
    backward fills side by side and those being reduce-scattered, with their received ranges. Where
    the profile has no layout (or under pp), IN_FLIGHT_BUCKETS x the largest sharded bucket: at most
    ``bucket_mb``, or one parameter bigger than that, and at most all the gradients of its kind.
    """
    if not cand.shard_gradients:
        return 0.0
    grad = per_param_bytes(profile, cand)[0]
    exact = whole_buckets.in_flight(profile, cand, *dp_sizes(gpus, cand), grad)
    return float(exact) if exact is not None else IN_FLIGHT_BUCKETS * largest_bucket(profile, cand, gpus, grad)


def gathered_bytes(profile: ModelProfile, cand: Candidate, gpus: int) -> float:
    """ZeRO-3's whole parameter buckets one rank holds gathered besides its range, at their peak; 0 without
    ``parallel.shard_parameters``. The runtime's gather / release order over the model's parameter layout
    (planner/whole_buckets.py); without one, IN_FLIGHT_PARAM_BUCKETS (a layer's two expert tensors read
    together and the next bucket, prefetched) x the largest sharded bucket, in the parameter dtype."""
    if not cand.shard_parameters:
        return 0.0
    exact = whole_buckets.gathered(profile, cand, *dp_sizes(gpus, cand), profile.elem_bytes)
    if exact is not None:
        return float(exact)
    return IN_FLIGHT_PARAM_BUCKETS * largest_bucket(profile, cand, gpus, profile.elem_bytes)


def largest_bucket(profile: ModelProfile, cand: Candidate, gpus: int, nbytes: float) -> float:
    """Bytes of the largest bucket split over more than one rank, at ``nbytes`` per element: at most
    ``bucket_mb``, or one parameter bigger than that, and at most all the parameters of its kind; 0 if none."""
    dp, edp = dp_sizes(gpus, cand)
    limit = cand.bucket_mb * 2**20
    largest_dense, largest_expert = profile.largest_params
    sizes = [min(total * nbytes, max(limit, largest * nbytes)) for total, largest, d in (
        (profile.dense_params / (cand.tp * cand.pp), largest_dense / cand.tp, dp),
        (profile.expert_params / (cand.expert_ranks * cand.pp), largest_expert / cand.expert_ranks, edp)) if d > 1]
    return max(sizes, default=0.0)


def per_param_bytes(profile: ModelProfile, cand: Candidate) -> tuple[float, float, str]:
    """Bytes per parameter element besides the parameter: (the model-dtype gradient, which ZeRO-2 shards; the
    optimizer state ZeRO-1 shards: AdamW's two states, and for a low-precision model the fp32 master and its
    grad), and how.

    build_train_step keeps model-dtype gradient buckets and, for bf16, an fp32 copy as the master's .grad;
    with fp32 gradients (``grad_bytes=4``, Megatron's main_grad) the gradient is the master's own.
    """
    e = profile.elem_bytes
    moments = 2 * cand.moment_bytes  # AdamW's two moments; the estimator's figure holds them in fp32
    if profile.state_bytes is not None and cand.grad_bytes is None:
        grad, state = profile.state_bytes
        return grad, state - ADAMW_STATE_BYTES + moments, (
            "fp32 masters, their grads and AdamW states, from the moecompile.memory_estimate estimator"
            + (f", the moments in {cand.moment_bytes} B" if moments != ADAMW_STATE_BYTES else ""))
    grad = cand.grad_bytes or e
    master = 4 if e < 4 else 0
    master_grad = master if grad < 4 else 0
    return grad, master + master_grad + moments, f"fp32 master {master} + its grad {master_grad} + AdamW {moments}"


def _whole_how(profile: ModelProfile, cand: Candidate, nbytes: float, fallback: int) -> str:
    if whole_buckets.simulated(profile, cand, nbytes):
        return "at the peak, the runtime's order over the model's parameters"
    return f"{fallback} of the largest"


def static_memory(profile: ModelProfile, cand: Candidate, gpus: int, offloadable: bool = False) -> float:
    """Device bytes of parameters, gradients and optimizer state per rank (no activations) on ``gpus`` GPUs;
    ``offloadable``: without the optimizer's, the least they can be with the optimizer offloaded."""
    skip = {"activations", HOST_TERM} | ({"optimizer"} if offloadable else set())
    return sum(t.value for t in _memory(profile, cand, gpus) if t.name not in skip)


def _memory(profile: ModelProfile, cand: Candidate, gpus: int) -> list[Term]:
    e = profile.elem_bytes
    params_rank = params_per_rank(profile, cand)
    grad, state, how = per_param_bytes(profile, cand)
    owned = optimizer_params(profile, cand, gpus)
    where = "every parameter it holds"
    if cand.distributed_optimizer:
        dp, edp = dp_sizes(gpus, cand)
        where = f"its range ({cand.zero}): dense / dp={dp}, experts / edp={edp}"
    graded = grad_params(profile, cand, gpus)
    buckets = in_flight_bytes(profile, cand, gpus)
    grads_how = (f"{human(graded)} elements x {grad:g} B, {where}, + whole buckets in flight "
                 f"({human(buckets, 'B', 1024)}, {_whole_how(profile, cand, grad, IN_FLIGHT_BUCKETS)})"
                 if cand.shard_gradients else f"{human(graded)} elements x {grad:g} B, whole on every rank")
    gathered = gathered_bytes(profile, cand, gpus)
    params = (Term("params", owned * e + gathered, f"{human(owned)} elements x {e} B, {where}, + whole buckets "
                   f"gathered ({human(gathered, 'B', 1024)}, {_whole_how(profile, cand, e, IN_FLIGHT_PARAM_BUCKETS)})")
              if cand.shard_parameters else
              Term("params", params_rank * e, f"{human(params_rank)} elements x {e} B (experts / "
                   + (f"ep x etp={cand.expert_ranks})" if cand.etp > 1 else f"ep={cand.ep})")))
    act = profile.activation_bytes * cand.micro_batch / profile.micro_batch / cand.tp
    f = cand.offload
    out = [
        params,
        Term("grads", graded * grad + buckets, grads_how),
        Term("optimizer", (1 - f) * owned * state, f"{human((1 - f) * owned)} elements x {state:g} B ({how}), {where}"
             + (f"; the other {f:.0%} in host memory" if f else "")),
        Term("activations", act, f"kept for backward, micro-batch {cand.micro_batch} ({profile.memory_source})"),
    ]
    if f:
        host, pinned = host_bytes_per_element(profile, cand), transfer_bytes(profile.elem_bytes, cand.grad_bytes)
        out.append(Term(HOST_TERM, f * owned * host,
                        f"{human(f * owned)} elements x {host:g} B: fp32 master 4 + its grad 4 + AdamW "
                        f"{2 * cand.moment_bytes}" + (f" + pinned transfer buffers {pinned:g}" if pinned else "")
                        + " (host memory, not the GPU's)", counted=False))
    return out


def host_bytes_per_element(profile: ModelProfile, cand: Candidate) -> float:
    """Host bytes of an offloaded element (moecompile.optimizer_offload.to_host): an fp32 master and its gradient
    whatever the model's dtype, the AdamW moments, and for a low-precision model the pinned buffers its gradient
    and its new value cross PCIe in."""
    return 4 + 4 + 2 * cand.moment_bytes + transfer_bytes(profile.elem_bytes, cand.grad_bytes)


def host_update_bytes(elem_bytes: float, grad_bytes: float, moment_bytes: float) -> float:
    """DRAM bytes the CPU moves to update one offloaded element (moecompile.optimizer_offload.update_on_host, then
    the value staged): the received gradient and the new value cast where the model's dtype is not fp32, and the
    optimizer's update, one pass: the fp32 master and the moments read and written and the fp32 gradient read.
    fp32 moments are torch.optim.AdamW's, fused on the host; bf16 ones moecompile.AdamW's, whose host body is the
    same fused kernel over cache-sized chunks widened to fp32 (kernels/adamw.py host_traffic: 28 B, 20 in bf16)."""
    casts = (grad_bytes + 4 if grad_bytes < 4 else 0) + (4 + elem_bytes if elem_bytes < 4 else 0)
    return casts + host_traffic(moment_bytes)


def _offload_term(profile: ModelProfile, cluster: Cluster, cand: Candidate, elements: float, gbytes: float,
                  t_device: float) -> Term:
    """The offloaded part of the step: gradients down, a CPU AdamW, values up, beyond the device's part it runs
    beside (moecompile.optimizer_offload.step)."""
    e = profile.elem_bytes
    link, host = cluster.host_link_bandwidth, cluster.host_stream_bandwidth
    if link <= 0 or host <= 0:
        return Term("optimizer offload", float("inf"), f"{cluster.name} has no host memory or link to offload to")
    down, up = elements * gbytes / link, elements * e / link
    per = host_update_bytes(e, gbytes, cand.moment_bytes)
    t_host = elements * per / host
    path = down + t_host + up
    return Term("optimizer offload", max(0.0, path - t_device),
                f"{human(elements)} elements: gradients down {_s(down)} + CPU AdamW {_s(t_host)} ({per:g} B an "
                f"element at {human(host, 'B/s')}) + values up {_s(up)} over {human(link, 'B/s')}, beyond the "
                f"device's {_s(t_device)} beside it")


def _s(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
