"""Plan past one machine: which moecompile plan fits a cluster, and how fast it should run.

    import moecompile as mc
    report = mc.plan_for("deepseek-v3", "h100", gpus=256, global_batch=1024, seq_len=4096)
    print(report.table())            # the fastest plans that fit, the closest that did not
    print(report.explain())          # every term of the best one
    report.save("plan.yaml")         # mc.Plan.from_file("plan.yaml") -> mc.convert(model, plan, ...)

The model is a ConversionResult (its graph as converted) or a Hugging Face config of a large
model (a config object, ``deepseek-v3`` / ``qwen3-235b-a22b`` shipped in ``planner/configs``, a
zoo name or a config.json path), traced through its dense equivalent on the meta device.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import MoecompileError
from .cluster import Cluster, Link, preset, preset_names
from .cost_model import Candidate, Estimate, estimate
from .arch import named_configs
from .profile import ModelProfile, profile_config, profile_result
from .search import PlanReport, SearchSpace, enumerate_candidates, iter_sections, legal_ep_sizes, search

__all__ = [
    "Candidate", "Cluster", "Estimate", "Link", "ModelProfile", "PlanReport", "SearchSpace", "enumerate_candidates",
    "estimate", "legal_ep_sizes", "named_configs", "plan_for", "preset", "preset_names", "profile_config",
    "profile_result", "search",
]


def plan_for(model_or_config: Any, cluster: Cluster | str, *, global_batch: int, seq_len: int | None = None,
             gpus: int | None = None, experts: dict | None = None, space: SearchSpace | None = None,
             progress: Callable[[str], None] | None = None) -> PlanReport:
    """Rank the plans that fit ``cluster`` for ``global_batch`` sequences of ``seq_len`` tokens.

    ``cluster`` is a Cluster or a preset name (``h100``, ``h200``, ``gb200``; ``gpus`` sets its size).
    ``experts`` makes a dense config MoE (and overrides fields of an MoE config's experts plan).
    ``progress`` is told about each graph variant as it is traced (they take seconds each).
    """
    if isinstance(cluster, str):
        cluster = preset(cluster, gpus)
    elif gpus is not None:
        cluster = cluster.with_gpus(gpus)
    if global_batch < 1:
        raise MoecompileError(f"global_batch must be >= 1 sequences, got {global_batch}")
    space = space or SearchSpace.available()
    if hasattr(model_or_config, "history") and hasattr(model_or_config, "module"):
        base = profile_result(model_or_config)
        if seq_len is not None and seq_len != base.seq_len:
            raise MoecompileError(f"the converted graph was traced at seq_len {base.seq_len}, not {seq_len}; convert "
                                  "at the sequence length you will train with (attention cost is not linear in it)")
        plan = model_or_config.plan
        space = _pin(space, plan, base.micro_batch, base.etp)
        start = plan.to_dict()
        profile_for = lambda cand: base  # noqa: E731  (one graph: its own recompute / fp8 as converted)
    else:
        if seq_len is None:
            raise MoecompileError("seq_len is needed to trace a config (e.g. seq_len=4096)")
        say = progress or (lambda msg: None)
        say(f"tracing {model_or_config} at seq {seq_len} on the meta device")
        base = profile_config(model_or_config, seq_len=seq_len, experts=experts)
        start = {}
        seen: set[str] = set()

        def profile_for(cand: Candidate) -> ModelProfile:
            sections = iter_sections(cand)
            if not sections:
                return base
            key = repr(sorted(sections.items()))
            if key not in seen:
                seen.add(key)
                say(f"tracing the variant {sections}")
            return profile_config(model_or_config, seq_len=seq_len, experts=experts, sections=sections)
    return search(profile_for, base.plan.experts.to_dict(), cluster, global_batch, space, start, baseline=base)


def _pin(space: SearchSpace, plan: Any, micro_batch: int, etp: int) -> SearchSpace:
    """A converted graph has its recompute / fp8 / micro-batch / weight placement / expert slices fixed: search
    only around them."""
    import dataclasses

    return dataclasses.replace(space, recompute_sets=(tuple(plan.recompute.modules),),
                               fp8_recipes=(plan.fp8.recipe,), micro_batches=(micro_batch,),
                               weight_placements=(plan.experts.apply_weights,), etps=(etp,))
