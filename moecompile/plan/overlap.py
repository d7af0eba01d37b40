"""Plan section ``overlap``: hide the expert-parallel exchanges behind compute (the ``overlap`` pass).

Each MoE layer's tokens are split into ``chunks`` pieces that are pipelined: while chunk i's
experts compute, chunk i+1's dispatch and chunk i-1's combine are in flight. Collective starts
are hoisted and waits sunk as far as the graph's dependencies allow, with the shared experts
(and any other independent compute) placed between a start and its wait.

Rules (the cross-section ones are checked in ``Plan.validate``):

- with ``parallel.ep == 1`` there is nothing to overlap: the pass records that and leaves the
  graph alone (a plan stays portable between a one-process debug run and an ep > 1 run);
- dropless chunks are token ranges (each chunk routes its own tokens: same drops, none);
  static chunks are capacity-slot ranges of one permute, so capacity still applies to the
  whole batch and exactly the same tokens are dropped. Every exchange stays fixed-size, so a
  static graph stays free of host syncs (CUDA-graph capturable);
- ``parallel.dispatcher: allgather`` in static mode buckets by (source rank, expert) over the
  gathered batch; chunking it would change which tokens are dropped, so ``chunks`` must be 1
  (or ``auto``, which then picks 1) there.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .section import Section, doc_field

if TYPE_CHECKING:
    from .parallel import ParallelConfig

MAX_CHUNKS = 64


@dataclasses.dataclass(frozen=True)
class OverlapConfig(Section):
    name = "overlap"

    enabled: bool = doc_field(False, "Schedule each MoE layer's dispatch/combine exchanges to overlap with compute.")
    chunks: Any = doc_field(
        "auto",
        "Token chunks N per MoE layer (>= 1; 1 only reorders starts and waits), or 'auto': pick N from a "
        "cost model of measured expert compute time per row against the measured exchange latency and "
        "bandwidth (the choice and why are in the pass record).",
    )
    shared_expert: bool = doc_field(
        True, "Run the shared experts (and other compute independent of the exchange) while the dispatch is in flight."
    )
    backward: bool = doc_field(
        True,
        "Overlap the backward too: all-to-alls become moecompile.a2a_start/a2a_wait, whose backward starts "
        "the transposed exchange where the forward waited and waits for it where the forward started.",
    )

    def validate(self) -> None:
        ok = self.chunks == "auto" or (type(self.chunks) is int and 1 <= self.chunks <= MAX_CHUNKS)
        if not ok:
            self.fail("chunks", f"must be an integer between 1 and {MAX_CHUNKS}, or 'auto'")

    def check_against(self, parallel: "ParallelConfig") -> None:
        """Rules between ``overlap`` and ``parallel`` (called by ``Plan.validate``)."""
        if not self.enabled:
            return
        if parallel.dispatcher == "allgather" and parallel.dispatch_mode == "static" and self.chunks not in (1, "auto"):
            self.fail(
                "chunks",
                "with parallel.dispatcher 'allgather' and dispatch_mode 'static', capacity is applied per "
                "(source rank, expert) over the gathered batch, so chunking would change which tokens are "
                "dropped: set overlap.chunks: 1 (starts/waits still overlap), or use dispatcher 'alltoall' "
                "(chunked by capacity slots, same drops), or dispatch_mode 'dropless'",
            )
