"""Plan section ``cuda_graph``: whether the emitted training step is captured into CUDA graphs.

- ``none``: every step runs eagerly.
- ``partial``: the static regions of the forward and backward (attention, router, dense
  layers) are captured per region with ``make_graphed_callables``; the expert path
  (permute, dispatch, expert GEMMs, combine) runs eagerly, as Megatron-Core does for
  dropless MoE. Works with either dispatch mode.
- ``full``: forward, backward, gradient sync and optimizer step are captured once and
  replayed. Legal only when nothing in the step syncs with the host and every shape is
  static, which needs ``parallel.dispatch_mode: static`` (checked in ``Plan.validate``).

On CPU there is nothing to capture: the step runs eagerly and says so once.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from .section import Section, doc_field


@dataclasses.dataclass(frozen=True)
class CudaGraphConfig(Section):
    name = "cuda_graph"

    mode: Literal["none", "partial", "full"] = doc_field(
        "none",
        "none: eager steps. partial: capture attention / router / dense regions, experts eager. "
        "full: capture the whole step (needs parallel.dispatch_mode: static).",
    )
    warmup_steps: int = doc_field(
        3, "Eager steps (on a side stream) before capture, so lazy allocations and autotuning happen outside it."
    )

    def validate(self) -> None:
        if self.warmup_steps < 1:
            self.fail("warmup_steps", "must be >= 1: capture needs at least one eager step to allocate state first")

    def check_against(self, parallel: object) -> None:
        """Rules between ``cuda_graph`` and ``parallel`` (called by ``Plan.validate``)."""
        if self.mode != "none" and getattr(parallel, "shard_parameters", False):
            self.fail(
                "mode",
                f"{self.mode!r} replays recorded kernels, but parallel.shard_parameters gathers and releases "
                "parameters from Python hooks that a replay does not run. Set cuda_graph.mode: none, or "
                "parallel.shard_parameters: false (ZeRO-2 captures)",
            )
        if self.mode != "none" and getattr(parallel, "overlap_param_gather", False):
            self.fail(
                "mode",
                f"{self.mode!r} replays recorded kernels, but parallel.overlap_param_gather leaves the parameters' "
                "all-gather running past the end of the step and waits for it in the next one, from Python a replay "
                "does not run. Set cuda_graph.mode: none, or parallel.overlap_param_gather: false",
            )
        if self.mode == "full" and getattr(parallel, "offload_optimizer", 0.0) > 0:
            self.fail(
                "mode",
                "'full' captures the optimizer step too, but parallel.offload_optimizer runs part of it on the CPU, "
                "which a CUDA graph cannot record. Set cuda_graph.mode: partial (the optimizer runs eagerly), or "
                "parallel.offload_optimizer: 0",
            )
        if self.mode == "full" and getattr(parallel, "dispatch_mode", None) != "static":
            self.fail(
                "mode",
                f"'full' captures the whole step, but parallel.dispatch_mode="
                f"{getattr(parallel, 'dispatch_mode', None)!r} sizes the token exchange from per-expert counts "
                "read on the host (a sync, and shapes that change every step). Set parallel.dispatch_mode: static "
                "with a capacity_factor (e.g. 1.25), or use cuda_graph.mode: partial to keep the experts eager",
            )
