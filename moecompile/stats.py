"""Router statistics of the last forward: losses to add to the training loss, expert load.

The converted graph returns ``(model_output, side)``; a forward hook splits them so
``result.module`` is called exactly like the dense model, and keeps ``side`` as
``module.moe_stats`` (a :class:`RouterStats`) until the next forward::

    out = result.module(ids)                 # same structure as the dense model
    loss = lm_loss(out) + result.router_loss()   # plan-weighted aux / z losses
    result.expert_load()                     # {layer: tokens per expert}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from .outputs import split_outputs
from .plan import Plan

LOSS_COEFFS = {"aux_loss": "aux_loss_coeff", "z_loss": "z_loss_coeff"}


@dataclasses.dataclass
class RouterStats:
    """Per MoE layer: raw router losses (tensors with grad), tokens per expert, other side outputs."""

    losses: dict[str, dict[str, torch.Tensor]]
    load: dict[str, torch.Tensor]
    metrics: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)

    def weighted_loss(self, plan: Plan) -> torch.Tensor | float:
        """Sum over layers of coefficient * loss, as the plan asks."""
        total: Any = 0.0
        for per_layer in self.losses.values():
            for name, value in per_layer.items():
                total = total + getattr(plan.experts, LOSS_COEFFS[name]) * value
        return total

    def per_loss(self) -> dict[str, float]:
        """Each loss averaged over layers (for metrics)."""
        out: dict[str, list[float]] = {}
        for per_layer in self.losses.values():
            for name, value in per_layer.items():
                out.setdefault(name, []).append(float(value.detach()))
        return {k: sum(v) / len(v) for k, v in out.items()}


def _split_hook(module: fx.GraphModule, args: Any, kwargs: Any, output: Any) -> Any:
    model_output, side = split_outputs(module, output)
    module.moe_stats = RouterStats(
        losses={layer: {k: v for k, v in d.items() if k in LOSS_COEFFS} for layer, d in side.items()},
        load={layer: d["load"].detach() for layer, d in side.items() if "load" in d},
        metrics={layer: {k: v for k, v in d.items() if k not in LOSS_COEFFS and k != "load"} for layer, d in side.items()},
    )
    return model_output


def attach_stats_hook(gm: fx.GraphModule) -> None:
    """Make ``gm`` return only the model output and keep router stats on ``gm.moe_stats``."""
    gm.moe_stats = RouterStats({}, {})
    gm.register_forward_hook(_split_hook, with_kwargs=True)
