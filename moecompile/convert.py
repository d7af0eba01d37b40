"""``moecompile.convert``: trace a dense model, run the pass pipeline, return the MoE graph."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
import torch.nn as nn

import moecompile.passes  # noqa: F401  (registers the built-in passes)

from .distributed import resolve_world
from .frontend import example_kwargs_for, flat_inputs, install_call_hooks, trace
from .history import PassRecord
from .pass_manager import Options, PassContext, PassSpec, resolve_order, run_passes
from .plan import Plan
from .stats import RouterStats, attach_stats_hook


@dataclasses.dataclass
class ConversionResult:
    """What ``convert`` made: the MoE module, the plan, and what every pass did."""

    module: fx.GraphModule  # called exactly like the dense model
    plan: Plan
    history: list[PassRecord]
    example_inputs: tuple
    example_kwargs: dict[str, Any]
    context: PassContext = dataclasses.field(repr=False)
    # the dense model's Hugging Face config (None for a plain module): export_hf's default
    source_config: Any = dataclasses.field(default=None, repr=False)

    def report(self, style: str | None = None) -> str:
        """What every pass did (rich on a terminal, else plain; or style="markdown")."""
        from .report import render_report

        return render_report(self, style)  # type: ignore[arg-type]

    def diff(self, pass_name: str, mode: str = "code", **kwargs: Any) -> str:
        """``moecompile.diff(self, pass_name, mode)``: the graph before and after a pass."""
        from .diff import diff

        return diff(self, pass_name, mode, **kwargs)  # type: ignore[arg-type]

    def visualize(self, path: Any, after: str | None = None, layer: Any = None, **kwargs: Any) -> Any:
        """``moecompile.visualize(self, path, after, layer)``: draw the graph after a pass."""
        from .visualize import visualize

        return visualize(self, path, after=after, layer=layer, **kwargs)

    def record(self, pass_name: str) -> PassRecord:
        for r in self.history:
            if r.name == pass_name:
                return r
        raise KeyError(f"no pass named {pass_name!r} ran; ran: {', '.join(r.name for r in self.history)}")

    @property
    def router_stats(self) -> RouterStats:
        return self.module.moe_stats

    def router_loss(self) -> torch.Tensor | float:
        """The plan-weighted router losses of the last forward (add this to the training loss)."""
        return self.module.moe_stats.weighted_loss(self.plan)

    def expert_load(self) -> dict[str, torch.Tensor]:
        """Tokens routed to each expert, per MoE layer, in the last forward."""
        return self.module.moe_stats.load


def convert(
    model: nn.Module,
    plan: Plan | dict | None = None,
    example_inputs: tuple | Any = (),
    example_kwargs: dict[str, Any] | None = None,
    passes: Iterable[str | Callable | PassSpec] | None = None,
    *,
    dynamic: bool = False,
    trace_method: str = "export",
    options: Options | None = None,
    world: Any = None,
) -> ConversionResult:
    """Convert ``model`` into an MoE GraphModule as ``plan`` says; ``model`` is left untouched.

    ``passes`` adds user passes (registered names, functions, or ``PassSpec``s with their own ordering) to
    the built-in pipeline.
    With ``torch.distributed`` initialised and no ``world``, the world is built from ``plan.parallel``.
    """
    plan = plan if isinstance(plan, Plan) else Plan.from_dict(plan)
    world = resolve_world(plan, world)  # before tracing: a plan the world can't run fails first
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    kwargs = example_kwargs_for(model, example_kwargs)
    gm = trace(model, example_inputs, kwargs, method=trace_method, dynamic=dynamic)  # type: ignore[arg-type]
    _own_parameters(gm)
    ctx = PassContext(plan=plan, example_inputs=flat_inputs(example_inputs, kwargs), options=options or Options.from_env(), world=world)
    gm = run_passes(gm, ctx, resolve_order(passes or ()))
    attach_stats_hook(gm)
    install_call_hooks(gm, model, len(example_inputs), kwargs, dynamic)
    config = getattr(model, "config", None)
    # a Hugging Face config (save_pretrained) is kept as a copy: later edits to the model don't leak in
    source_config = copy.deepcopy(config) if hasattr(config, "save_pretrained") else None
    return ConversionResult(gm, plan, ctx.history, example_inputs, kwargs, ctx, source_config)


def _own_parameters(gm: fx.GraphModule) -> None:
    """Give the graph its own copies of the weights, so training it leaves the dense model alone."""
    clones: dict[int, torch.Tensor] = {}
    for module in gm.modules():
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if t is None:
                    continue
                if id(t) not in clones:
                    copy = t.detach().clone()
                    clones[id(t)] = nn.Parameter(copy, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else copy
                store[name] = clones[id(t)]
