"""Plan section ``fp8``: which GEMMs run in FP8 and how they are scaled.

    fp8:
      recipe: blockwise          # none | tensorwise | delayed | blockwise
      format: hybrid             # e4m3 forward and backward, or e4m3 forward + e5m2 gradients
      modules: [experts, shared_experts]
      keep_high_precision: 1     # first and last transformer layer stay high precision

The router GEMM always stays in high precision: top-k selection is sensitive to
small logit errors, and it is a tiny share of the FLOPs.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Union

from .section import Section, doc_field

FP8_MODULES = ("experts", "shared_experts", "dense", "attention_proj")


@dataclasses.dataclass(frozen=True)
class FP8Config(Section):
    name = "fp8"

    recipe: Literal["none", "tensorwise", "delayed", "blockwise"] = doc_field(
        "none",
        "Scaling: 'tensorwise' (current amax per tensor), 'delayed' (scale from an amax history of "
        "earlier steps), 'blockwise' (1 x block activation tiles, block x block weight tiles, as "
        "DeepSeek-V3); 'none' leaves every GEMM as it is.",
    )
    format: Literal["e4m3", "hybrid"] = doc_field(
        "hybrid", "'e4m3' everywhere, or 'hybrid': e4m3 activations and weights, e5m2 gradients (more range)."
    )
    modules: list = doc_field(
        list(FP8_MODULES),
        "Which GEMMs: 'experts' (grouped expert GEMMs), 'shared_experts', 'dense' (linears of FFNs left "
        "dense), 'attention_proj' (q/k/v/o projections). Router, embedding and output head stay high precision.",
    )
    keep_high_precision: Union[int, list] = doc_field(
        0, "Transformer layers kept out of FP8: N keeps the first and last N, [first, last] sets each end."
    )
    amax_history_len: int = doc_field(16, "Steps of amax history the 'delayed' recipe takes its scale from.")
    block_size: int = doc_field(128, "Tile edge of the 'blockwise' recipe (128 as DeepSeek-V3; a multiple of 16).")

    def validate(self) -> None:
        for m in self.modules:
            if m not in FP8_MODULES:
                self.fail("modules", f"unknown entry {m!r}; valid entries are {', '.join(FP8_MODULES)}")
        keep = self.keep_high_precision
        ends = [keep, keep] if isinstance(keep, int) else list(keep)
        if len(ends) != 2 or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in ends):
            self.fail("keep_high_precision", "must be an int N >= 0 or a pair [first, last] of ints >= 0")
        if self.amax_history_len < 1:
            self.fail("amax_history_len", "must be >= 1")
        if self.block_size < 16 or self.block_size % 16:
            self.fail("block_size", "must be a positive multiple of 16 (FP8 GEMM alignment)")

    @property
    def enabled(self) -> bool:
        return self.recipe != "none" and bool(self.modules)

    def kept_layers(self, num_layers: int) -> set[int]:
        """Indices of the transformer layers that stay in high precision."""
        keep = self.keep_high_precision
        first, last = (keep, keep) if isinstance(keep, int) else keep
        return set(range(min(first, num_layers))) | set(range(max(0, num_layers - last), num_layers))
