"""Plan section ``recompute``: what to recompute in backward, what to offload, and a budget.

    recompute:
      modules: [moe_act, layernorm]   # each becomes a checkpointed region: only its inputs are saved
      budget: 0.5                     # or bytes (2147483648, "2GiB"): the pass picks regions to fit
      offload: [attention]            # saved activations of these regions go to host memory

With a budget, ``modules`` are the candidates (all kinds when empty) and the pass
chooses the cheapest set (fewest recompute FLOPs) that brings the estimated
activation memory per rank under the budget.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Union

from .section import Section, doc_field

REGION_KINDS = ("router", "moe_act", "layernorm", "shared_experts", "moe", "attention", "mlp")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


@dataclasses.dataclass(frozen=True)
class RecomputeConfig(Section):
    name = "recompute"

    modules: list = doc_field(
        [],
        "Regions to recompute: 'router', 'moe_act' (the activation of routed and shared experts), 'layernorm', 'shared_experts', "
        "'moe' (whole MoE block), 'attention', 'mlp' (FFNs left dense). With a budget: the candidates.",
    )
    budget: Union[None, int, float, str] = doc_field(
        None,
        "Activation-memory budget per rank: a fraction (0, 1] of the baseline estimate, bytes, or a "
        "string such as '2GiB' or '50%'; null recomputes exactly `modules`.",
    )
    offload: list = doc_field(
        [], "Regions whose saved activations move to host memory in forward and back in backward (same names)."
    )
    offload_min_bytes: int = doc_field(65536, "Saved tensors smaller than this stay on the device when offloading.")

    def validate(self) -> None:
        for field in ("modules", "offload"):
            for m in getattr(self, field):
                if m not in REGION_KINDS:
                    self.fail(field, f"unknown region {m!r}; valid regions are {', '.join(REGION_KINDS)}")
        both = sorted(set(self.offload) & set(self.modules))
        if both and self.budget is None:
            self.fail("offload", f"{both} are also recomputed; a recomputed region saves only its inputs, so "
                                 "offload it or recompute it, not both")
        if self.budget is not None:
            self._parse_budget()
        if self.offload_min_bytes < 0:
            self.fail("offload_min_bytes", "must be >= 0")

    def _parse_budget(self) -> tuple[str, float]:
        """('fraction', f) or ('bytes', n)."""
        b = self.budget
        if isinstance(b, str):
            m = re.fullmatch(r"\s*([0-9.]+)\s*(%|[kKmMgG]?i?[bB]?)\s*", b)
            if not m:
                self.fail("budget", "must look like '2GiB', '512MB', '1000000' or '50%'")
            value, unit = float(m.group(1)), m.group(2).lower()
            b = value / 100 if unit == "%" else int(value * _UNITS.get(unit, 0) or -1)
        if isinstance(b, float) and not isinstance(b, bool):
            if not 0 < b <= 1:
                self.fail("budget", "a fraction of the baseline activation memory must be in (0, 1]")
            return "fraction", b
        if b < 1:
            self.fail("budget", "bytes must be >= 1 (units: B, KB, MB, GB, KiB, MiB, GiB)")
        return "bytes", b

    def budget_bytes(self, baseline: int) -> int | None:
        """The budget in bytes, given the estimated baseline activation memory."""
        if self.budget is None:
            return None
        kind, value = self._parse_budget()
        return int(value * baseline) if kind == "fraction" else int(value)

    @property
    def candidates(self) -> list[str]:
        """Region kinds the budget may choose from."""
        return list(self.modules) or [k for k in REGION_KINDS if k not in self.offload]
