"""Plan section ``parallel``: how experts are spread over ranks and how tokens reach them.

Static capacity is per source rank (GShard's "group" is one rank's micro-batch):
each rank keeps at most ``C = ceil(capacity_factor * T_local * top_k / num_experts)``
of its own tokens per expert, chosen by ``experts.drop_policy``. That is exactly
what ``experts.capacity_factor`` does in a single process on that rank's batch, so
changing ``ep`` or the dispatcher never changes which tokens are dropped.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal, Union

from .section import Section, doc_field

# Where packing the routing weights into the rows' all-to-all pays (``pack_routing_weights: null``): the rows
# a rank sends, in bytes, at most. Packing saves 2 collectives a layer and costs 3 copies of the rows
# (pack, unpack, the gradient's pack). CPU, measured on the 2-core box: gloo's all-to-all costs ~0.55 ms
# before it moves a byte (benchmarks/collective_latency.py) and pack + unpack forward and backward take
# 0.24 ms at 0.25 MiB, 0.74 ms at 2 MiB and 2.1 ms at 4 MiB: even at ~2-3 MiB. CUDA, derived, not measured:
# ~30 us an NCCL all-to-all against ~20 us of launches plus 6 passes over the rows at ~2.6 TB/s.
PACK_WEIGHTS_MAX_BYTES = {"cpu": 2 * 2**20, "cuda": 16 * 2**20}

if TYPE_CHECKING:
    from .experts import ExpertsConfig


@dataclasses.dataclass(frozen=True)
class ParallelConfig(Section):
    name = "parallel"

    ep: int = doc_field(
        1, "Expert-parallel size: ranks sharing one layer's experts (rank r of a group keeps E/ep of them)."
    )
    etp: int = doc_field(
        1,
        "Expert-tensor-parallel size (Megatron-Core's expert_tensor_parallel_size): each expert's FFN width is cut "
        "into etp slices held by etp different ranks, so experts spread over ep x etp ranks (more ranks than "
        "experts, or experts too wide for one). A token routed to an expert goes to every slice and the slices' "
        "outputs add up; this is exact, as the down projection sums over the FFN width.",
    )
    dispatcher: Literal["alltoall", "allgather", "alltoall_dedup"] = doc_field(
        "alltoall",
        "How tokens reach their experts: all-to-all of the routed copies (bytes ~ T*k*H), all-gather "
        "of the tokens and reduce-scatter of the outputs (bytes ~ ep*T*H; no count exchange), or "
        "alltoall_dedup: all-to-all of each token once per rank that holds one of its experts (bytes ~ "
        "T*H times the distinct ranks of its k experts, at most min(k, ep)), the rank's partial sum coming back "
        "(dropless only).",
    )
    dispatch_mode: Literal["dropless", "static"] = doc_field(
        "dropless",
        "dropless: exact per-expert counts, variable-size exchanges (one host sync per layer). static: "
        "fixed capacity, padded fixed-size exchanges, no host sync (CUDA-graph capturable).",
    )
    node_ranks: int = doc_field(
        1,
        "alltoall_dedup at node level (DeepEP's internode dispatch): the ep group's ranks per node. A token then "
        "crosses the slow inter-node links once per node holding one of its experts (to the rank of its own local "
        "index there) and fans out over the node's fast links to the ranks that hold them; partial sums come back "
        "the same two ways. 1: rank level (one exchange). Must divide ep x etp (or be a multiple of it: the ep group "
        "then fits one node, and the exchange is rank level); consecutive ranks share a node, as torchrun numbers "
        "them.",
    )
    capacity_factor: Union[float, None] = doc_field(
        None,
        "Static mode's capacity as a multiple of T_local*k/E (T_local: one rank's tokens); "
        "null takes experts.capacity_factor. Setting both to different values is an error.",
    )
    pack_routing_weights: Union[bool, None] = doc_field(
        None,
        "alltoall, where the experts' glu applies the routing weights (experts.apply_weights: activation): "
        "true sends each row's weight as one more column of the rows' own all-to-all (2 fewer collectives a "
        "layer: the weights' and their gradient's; 3 more copies of the rows); false sends them on their own; "
        "null packs where a rank sends at most 2 MiB of rows on CPU (gloo collectives cost ~0.5 ms) or 16 MiB "
        "on CUDA. Rows and weights of different dtypes never pack (it would widen the rows).",
    )
    overlap_grad_reduce: Union[bool, None] = doc_field(
        None,
        "Launch each gradient bucket's all-reduce (reduce-scatter under shard_optimizer) from backward as soon as "
        "all its gradients are in, in the order backward completes buckets (the same on every rank), so it runs "
        "while backward computes the rest, as DDP and Megatron-Core's overlap_grad_reduce do; with micro-batches, "
        "during the last one's backward. false: every bucket after backward. null: true on NCCL, false on gloo, "
        "whose all-reduce needs the CPU backward runs on: -3.9 to +3.5 % a step over 6 runs on 2 cores, noise. "
        "shard_gradients reduce-scatters from backward either way; on gloo shard_optimizer's reduce-scatter is a "
        "blocking exchange and stays after it.",
    )
    shard_optimizer: bool = doc_field(
        False,
        "ZeRO-1, Megatron-Core's distributed optimizer: each gradient bucket is split into equal ranges over the "
        "ranks that reduce it (dense: every data-parallel rank; experts: the expert-data-parallel ranks), and a "
        "rank keeps optimizer state, and fp32 master weights for a low-precision model, for its range only. "
        "Gradients are reduce-scattered, each rank updates its range, parameters are all-gathered: the bytes of "
        "the all-reduce it replaces. Exact for elementwise optimizers (SGD, Adam, AdamW, ...); others are an error.",
    )
    shard_gradients: bool = doc_field(
        False,
        "ZeRO-2, on top of shard_optimizer: a rank keeps the gradients of its range only. Each bucket is "
        "reduce-scattered as soon as backward has filled it (in bucket order) and its whole buffer freed, so "
        "a rank holds 1/d of the gradients plus the buckets in flight (estimate_memory's in_flight_grads); one "
        "reduce-scatter per micro-batch instead of one per step. Needs shard_optimizer: true.",
    )
    shard_parameters: bool = doc_field(
        False,
        "ZeRO-3 / FSDP, on top of shard_gradients: between uses a rank keeps only its range of each bucket's "
        "parameters. A bucket is all-gathered just before the forward first reads it (the next one prefetched) "
        "and released after its last read; backward gathers it again when it first needs it and releases it once "
        "its gradients are in. Two all-gathers and one reduce-scatter per bucket a micro-batch; the step's "
        "all-gather after the optimizer goes. Needs shard_gradients: true and cuda_graph.mode: none.",
    )
    overlap_param_gather: bool = doc_field(
        False,
        "ZeRO-1/2 (Megatron-Core's overlap_param_gather): the all-gather of the updated parameters after the "
        "optimizer is launched and left running; the next forward waits for each bucket just before the graph "
        "first reads it, so the exchange hides behind the forward of the layers before. Reads outside the graph "
        "wait first (state_dict, step.save / load, step.gathered(), export). Needs shard_optimizer: true, and "
        "cuda_graph.mode: none; shard_parameters gathers where the graph reads already.",
    )
    offload_optimizer: float = doc_field(
        0.0,
        "Share of this rank's optimizer work kept in host memory and run by the CPU (ZeRO-Offload; Megatron-Core's "
        "optimizer_cpu_offload with optimizer_offload_fraction): the fp32 masters, their gradients and the optimizer "
        "state of the first tensors (in parameter order) until that share of the elements is reached. Each step "
        "their reduced gradients go to the host, the device part of the optimizer steps while the host part runs, "
        "and the new values come back. 0: none; 1: all. The same arithmetic as on the device; with "
        "shard_optimizer it is this rank's range that moves. Needs cuda_graph.mode other than full (a host "
        "step is not captured).",
    )
    timeout_s: float = doc_field(
        300.0,
        "Seconds a collective waits for its peers before failing with a DistributedError that names it "
        "(a rank that raised or died must not hang the others).",
    )

    @property
    def expert_ranks(self) -> int:
        """Ranks one layer's experts (their slices, under etp) are spread over: the ep group's size."""
        return self.ep * self.etp

    @property
    def node_level_ranks(self) -> int:
        """``node_ranks`` where it cuts the ep group into nodes; 1 (rank level) where it is 1 or the whole group
        sits in one node. What the world builds, the pass emits and the planner prices."""
        return self.node_ranks if 1 < self.node_ranks < self.expert_ranks else 1

    def validate(self) -> None:
        if self.ep < 1:
            self.fail("ep", "must be >= 1")
        if self.etp < 1:
            self.fail("etp", "must be >= 1")
        P, G = self.expert_ranks, self.node_ranks
        if G < 1 or (P % G and G % P):  # G >= P: the ep group sits in one node, rank level (a plan stays portable)
            self.fail("node_ranks", f"must divide the ep group's {P} ranks (ep x etp), or be a multiple of them (the "
                      "group then sits in one node): a node holds whole consecutive ranks of it")
        if self.node_ranks > 1 and self.dispatcher != "alltoall_dedup":
            self.fail("node_ranks", "de-duplicates per node, which only dispatcher 'alltoall_dedup' does: set "
                      "parallel.dispatcher: alltoall_dedup, or node_ranks: 1")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            self.fail("capacity_factor", "must be > 0, or null to use experts.capacity_factor")
        if self.timeout_s <= 0:
            self.fail("timeout_s", "must be > 0 seconds")
        if not 0.0 <= self.offload_optimizer <= 1.0:
            self.fail("offload_optimizer", "is the share of the optimizer's elements kept on the host: a number "
                      "from 0 (none) to 1 (all)")
        if self.shard_gradients and not self.shard_optimizer:
            self.fail("shard_gradients", "shards the gradients of the ranges shard_optimizer gives each rank: set "
                      "parallel.shard_optimizer: true as well")
        if self.shard_parameters and not self.shard_gradients:
            self.fail("shard_parameters", "shards the parameters of the ranges whose gradients shard_gradients "
                      "keeps: set parallel.shard_optimizer: true and parallel.shard_gradients: true as well")
        if self.overlap_param_gather and not self.shard_optimizer:
            self.fail("overlap_param_gather", "overlaps the all-gather of the parameter ranges shard_optimizer has "
                      "each rank update; without it there is none: set parallel.shard_optimizer: true as well")
        if self.overlap_param_gather and self.shard_parameters:
            self.fail("overlap_param_gather", "shard_parameters has no all-gather after the optimizer: it gathers "
                      "each bucket where the graph reads it, the next one prefetched; set one of the two")

    def packs_routing_weights(self, rows_bytes: float, device_type: str) -> bool:
        """Whether the alltoall dispatch sends the routing weights inside the rows' exchange."""
        if self.pack_routing_weights is not None:
            return self.pack_routing_weights
        return rows_bytes <= PACK_WEIGHTS_MAX_BYTES.get(device_type, PACK_WEIGHTS_MAX_BYTES["cuda"])

    def static_capacity_factor(self, experts: "ExpertsConfig") -> float | None:
        """The capacity factor static mode uses (None in dropless mode)."""
        if self.dispatch_mode != "static":
            return None
        return self.capacity_factor if self.capacity_factor is not None else experts.capacity_factor

    def check_against(self, experts: "ExpertsConfig") -> None:
        """Rules between ``parallel`` and ``experts`` (called by ``Plan.validate``)."""
        if self.dispatcher == "alltoall_dedup" and self.dispatch_mode == "static":
            self.fail("dispatcher", "'alltoall_dedup' sends a variable number of distinct tokens per rank, so it is "
                      "dropless only: use dispatch_mode: dropless, or dispatcher 'alltoall' for static capacity")
        E = experts.num_experts
        if E % self.ep:
            self.fail("ep", f"must divide experts.num_experts={E} (each of the ep={self.ep} ranks keeps E/ep experts)")
        ecf, pcf = experts.capacity_factor, self.capacity_factor
        if self.dispatch_mode == "static":
            if ecf is None and pcf is None:
                self.fail("dispatch_mode", "'static' needs a capacity: set parallel.capacity_factor (e.g. 1.25)")
            if ecf is not None and pcf is not None and ecf != pcf:
                self.fail(
                    "capacity_factor",
                    f"differs from experts.capacity_factor={ecf}; one capacity applies, so set only one of them",
                )
        elif pcf is not None:
            self.fail("capacity_factor", "only applies to dispatch_mode 'static'; set dispatch_mode: static or drop it")
        elif ecf is not None and self.ep > 1:
            self.fail(
                "dispatch_mode",
                f"'dropless' with experts.capacity_factor={ecf} (which drops tokens): set parallel.dispatch_mode: "
                "static for fixed-capacity exchanges, or remove experts.capacity_factor",
            )
