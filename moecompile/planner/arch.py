"""Which Hugging Face configs the planner can rebuild, and how: a dense equivalent plus an experts plan.

    arch = moe_arch(load_model_config("deepseek-v3"))
    arch.config(layers=1, intermediate=arch.moe_intermediate)   # traced and upcycled by the profiler
    arch.experts                                                # {'num_experts': 256, 'top_k': 8, ...}

DeepSeek-V3's MoE layer is exactly what ``upcycle`` makes of a DeepSeek-V3 layer whose MLP is
one expert wide (2048): 256 experts, top-8 within 4 of 8 groups, one shared expert of the
same width, fp32 sigmoid scores with a selection bias, weights scaled by 2.5. Qwen3-MoE and
Mixtral map the same way onto Qwen3 and Mistral dense layers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable

from ..errors import MoecompileError
from ..models import own_experts

CONFIGS = Path(__file__).parent / "configs"


def named_configs() -> dict[str, Path]:
    """The large-model configs shipped with the planner (name -> JSON path)."""
    return {p.stem: p for p in sorted(CONFIGS.glob("*.json"))}


def load_model_config(spec: Any) -> Any:
    """A Hugging Face config from a config object, a shipped name (``deepseek-v3``), a zoo name or a path."""
    from ..models import load_config

    if hasattr(spec, "to_dict") and hasattr(spec, "model_type"):
        return spec
    key = str(spec).lower()
    named = named_configs()
    return load_config(named[key]) if key in named else load_config(spec)


@dataclasses.dataclass(frozen=True)
class MoEArch:
    """How to rebuild a model's MoE layers with moecompile: a dense equivalent and an experts plan."""

    model_type: str  # of the dense-equivalent config
    base: dict  # its config fields (layers and FFN width are set per trace)
    experts: dict  # the experts plan section
    moe_intermediate: int
    dense_intermediate: int
    n_dense: int
    n_moe: int
    ffn_field: str = "intermediate_size"  # the config field of the FFN width (GPT-2's: n_inner)

    def config(self, layers: int, intermediate: int) -> Any:
        from transformers import AutoConfig

        fields = {**self.base, "num_hidden_layers": layers, self.ffn_field: intermediate}
        if isinstance(fields.get("layer_types"), list):  # per-layer attention kinds (Qwen2/3...): the first layers'
            fields["layer_types"] = fields["layer_types"][:layers]
        if self.model_type == "deepseek_v3":
            fields["first_k_dense_replace"] = layers  # every layer a dense MLP; upcycle makes the MoE
        return AutoConfig.for_model(self.model_type, **fields)


def _fields(config: Any, drop: Iterable[str] = ()) -> dict:
    d = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures", "transformers_version",
                                                               "auto_map", "_name_or_path", "dtype", "torch_dtype")}
    for k in drop:
        d.pop(k, None)
    return d


def moe_arch(config: Any, experts: dict | None = None) -> MoEArch:
    """The dense equivalent and experts plan of a Hugging Face config (MoE types, or dense + ``experts``)."""
    mt = config.model_type
    L = config.num_hidden_layers
    if mt == "deepseek_v3":
        n_dense = int(getattr(config, "first_k_dense_replace", 0))
        # its router as it is (sigmoid, selection bias, groups, scale); n_shared upcycled experts of its width
        plan = {**own_experts(config), "shared_experts": int(config.n_shared_experts or 0)}
        return MoEArch("deepseek_v3", _fields(config), {**plan, **(experts or {})}, config.moe_intermediate_size,
                       config.intermediate_size, n_dense, L - n_dense)
    if mt == "qwen3_moe":
        step = max(1, int(getattr(config, "decoder_sparse_step", 1)))
        only = set(getattr(config, "mlp_only_layers", []) or [])
        n_moe = sum(1 for i in range(L) if i not in only and (i + 1) % step == 0)
        plan = dict(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                    normalize=bool(getattr(config, "norm_topk_prob", True)))
        drop = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
                "norm_topk_prob", "output_router_logits", "router_aux_loss_coef")
        return MoEArch("qwen3", _fields(config, drop), {**plan, **(experts or {})}, config.moe_intermediate_size,
                       config.intermediate_size, L - n_moe, n_moe)
    if mt == "mixtral":
        plan = dict(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok)
        drop = ("num_local_experts", "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef",
                "router_jitter_noise")
        return MoEArch("mistral", _fields(config, drop), {**plan, **(experts or {})}, config.intermediate_size,
                       config.intermediate_size, 0, L)
    if getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or \
            getattr(config, "num_local_experts", None):
        raise MoecompileError(
            f"model_type {mt!r} is an MoE architecture the planner cannot rebuild yet (supported: deepseek_v3, "
            "qwen3_moe, mixtral); give its dense equivalent config and an experts plan instead")
    if not experts:
        raise MoecompileError(
            f"{mt!r} is a dense model: say how to make it MoE with experts={{'num_experts': 8, 'top_k': 2}} "
            "(moecompile plan --experts '{...}')")
    field, width = _ffn_width(config)
    return MoEArch(mt, _fields(config), dict(experts), width, width, 0, L, field)


def _ffn_width(config: Any) -> tuple[str, int]:
    """The config field holding a dense model's FFN width, and the width (GPT-2's n_inner: None is 4 x hidden)."""
    if getattr(config, "intermediate_size", None) is not None:
        return "intermediate_size", int(config.intermediate_size)
    if hasattr(config, "n_inner"):
        return "n_inner", int(config.n_inner or 4 * config.hidden_size)
    raise MoecompileError(f"{config.model_type!r} config has no intermediate_size (nor GPT-2's n_inner): the planner "
                          "cannot tell its FFN width; give a config that names it")


