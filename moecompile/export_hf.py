"""``moecompile.export_hf``: a converted (and trained) model as a Hugging Face MoE checkpoint.

    mc.export_hf(result, "out/", arch="mixtral", config=dense.config)     # Llama / Mistral source
    mc.export_hf(result, "out/", arch="qwen3_moe", config=dense.config)   # Qwen3 source
    mc.export_hf(result, "out/", arch="mixtral")    # an adopted Mixtral (import_moe) goes back as it came
    mc.export_hf(result, "out/", arch="deepseek_v3")   # so does an adopted DeepSeek-V3 (or qwen2_moe, glm4_moe)
    AutoModelForCausalLM.from_pretrained("out/")    # same logits as result.module

Writes ``config.json`` and ``model.safetensors`` in transformers 5's layout, where a
layer's experts are fused 3-D parameters, exactly moecompile's own::

    <layer>.router.weight        [E, H]        -> <layer>.gate.weight
    <layer>.experts.w_gate_up    [E, 2F, H]    -> <layer>.experts.gate_up_proj   (gate rows first)
    <layer>.experts.w_down       [E, H, F]     -> <layer>.experts.down_proj

An adopted model's shared expert and selection bias go back to its own names
(``shared_expert(s).*``, ``gate.e_score_correction_bias``, trained by ``expert_bias_rate``).
Everything else keeps its name. With ep > 1 every rank calls it; the experts are gathered
over the expert-parallel group and rank 0 writes. What the target cannot express (shared
experts, sigmoid scores, a selection bias, grouped routing into Mixtral or Qwen3-MoE, FFN
biases, fine-grained experts into Mixtral, dense layers into Mixtral...) is an
:class:`ExportError` that says what to change.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import param_gathers, param_shards
from .errors import MoecompileError
from .bucket_layout import moe_blocks
from .expert_slices import join_slices, whole_experts
from .models import GROUPED_SIGMOID_ROUTERS

log = logging.getLogger(__name__)
ARCHS = {"mixtral": ("MixtralConfig", "MixtralForCausalLM", ("llama", "mistral", "mixtral")),
         "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", ("qwen3", "qwen3_moe")),
         # adopted models only, exported with their own config: Qwen2-MoE's shared expert is gated, and
         # an upcycled one is not; DeepSeek-V3's and GLM-4.5's attention and router are their own
         "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", ("qwen2_moe",)),
         "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", ("deepseek_v3",)),
         "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", ("glm4_moe",))}
ADOPTED_ONLY = ("qwen2_moe", "deepseek_v3", "glm4_moe")
_HF_ACT = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.mlp")


class ExportError(MoecompileError):
    """The converted model cannot be expressed in the requested Hugging Face architecture."""


def _fail(arch: str, what: str, fix: str) -> None:
    raise ExportError(f"cannot export as {arch}: {what}; {fix}")


def arch_for(model_type: str | None) -> str:
    """The Hugging Face MoE architecture a dense ``model_type`` exports as (qwen3 -> qwen3_moe, llama -> mixtral)."""
    for name, (_cfg, _cls, sources) in ARCHS.items():
        if model_type in sources:
            return name
    supported = "; ".join(f"{', '.join(v[2])} -> {k}" for k, v in ARCHS.items())
    raise ExportError(f"no Hugging Face MoE architecture takes a {model_type!r} model ({supported}); "
                      "use moecompile.convert and build_train_step to train it without exporting")


def check_exportable(arch: str, plan: Any, config: Any) -> None:
    """What the source model and the plan alone decide about exporting as ``arch``: checked before a run
    trains (``moecompile train --export-hf``), so a plan the target cannot express fails at once, not at the end."""
    experts = plan.experts
    src = getattr(config, "model_type", None)
    if src not in ARCHS[arch][2]:
        other = [a for a, v in ARCHS.items() if src in v[2]]
        _fail(arch, f"the source model is {src!r}, whose attention {arch} does not have",
              f"export it as {other[0]}" if other else f"{arch} takes models upcycled from {', '.join(ARCHS[arch][2])}")
    if experts.shared_experts and arch not in ADOPTED_ONLY:
        _fail(arch, f"the plan has {experts.shared_experts} shared expert(s), which {arch} has no place for",
              "convert with experts.shared_experts: 0")
    score = "sigmoid" if arch in GROUPED_SIGMOID_ROUTERS else "softmax"
    if experts.score != score:
        _fail(arch, f"experts.score={experts.score!r}; its router is {score}", f"convert with experts.score: {score}")
    if arch not in GROUPED_SIGMOID_ROUTERS and (experts.route_groups > 1 or experts.route_scale != 1):
        _fail(arch, "the plan routes within groups or scales the routing weights, which its router does not",
              "convert with experts.route_groups: 1 and route_scale: 1")
    if arch == "mixtral" and not experts.normalize:
        _fail(arch, "experts.normalize=false; Mixtral always renormalises the top-k weights",
              "convert with experts.normalize: true, or export as qwen3_moe (norm_topk_prob)")
    if arch == "mixtral" and experts.granularity > 1:
        _fail(arch, f"experts.granularity={experts.granularity}: Mixtral's experts are whole FFN copies",
              "export fine-grained experts as qwen3_moe (moe_intermediate_size = F/G), or convert with granularity 1")
    if arch == "mixtral" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
        _fail(arch, "the source model has attention / MLP biases", "Mixtral's projections have none")
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) and arch == "qwen3_moe":
        _fail(arch, "the source uses sliding-window layers per layer_types", "export a model with full attention")


def _check(result: Any, arch: str, config: Any, blocks: dict[str, Any]) -> None:
    check_exportable(arch, result.plan, config)
    plan = result.plan.experts
    if arch in ADOPTED_ONLY:
        gated = arch == "qwen2_moe"
        wants_shared = gated or bool(getattr(config, "n_shared_experts", 0))
        for layer, info in blocks.items():
            p = info["params"]
            if ("shared_w_in" in p) != wants_shared or ("shared_gate" in p) != gated:
                _fail(arch, f"{layer} is not the MoE layer of a {config.__class__.__name__} (its shared expert "
                      "differs); only models adopted from it export as it", "export an upcycled model as mixtral "
                      "or qwen3_moe")
    if arch in GROUPED_SIGMOID_ROUTERS:
        first_dense = getattr(config, "first_k_dense_replace", 0)
        moe = sorted(int(_LAYER.fullmatch(layer).group(1)) for layer in blocks if _LAYER.fullmatch(layer))
        if moe != list(range(first_dense, config.num_hidden_layers)):
            _fail(arch, f"its MoE layers are {moe}; {arch}'s are those from first_k_dense_replace "
                  f"({first_dense}) on", "leave experts.layers out when converting an adopted model")
    n_layers = config.num_hidden_layers
    if arch == "mixtral" and len(blocks) != n_layers:
        _fail(arch, f"only {len(blocks)} of {n_layers} FFNs are MoE layers; every Mixtral layer is sparse",
              "convert with experts.layers: all, or export as qwen3_moe (mlp_only_layers)")
    for layer, info in blocks.items():
        if not _LAYER.fullmatch(layer):
            _fail(arch, f"MoE layer {layer!r} is not a decoder layer's mlp", "convert a Hugging Face causal LM")
        if not info["glu"]:
            _fail(arch, f"{layer} is a plain MLP; {arch} experts are gated (act(x Wg) * x Wu)", "upcycle a GLU model")
        if any(k in info["params"] for k in ("b_in", "b_out")):
            _fail(arch, f"{layer}'s experts have biases", f"{arch} experts have none")
    if plan.expert_bias and arch not in GROUPED_SIGMOID_ROUTERS:
        bufs = dict(result.module.named_buffers())
        for layer, info in blocks.items():
            b = bufs.get(info["params"].get("bias", ""))
            if b is not None and bool(b.ne(0).any()):
                _fail(arch, f"{layer} has a non-zero expert-selection bias (aux-loss-free balancing), which "
                      f"{arch}'s router does not apply", "train with experts.expert_bias: false to export")
    if plan.capacity_factor is not None:
        log.warning("the plan drops tokens over capacity (capacity_factor=%s); the exported %s routes dropless, "
                    "so its outputs differ wherever tokens were dropped", plan.capacity_factor, arch)


def hf_config(result: Any, arch: str, config: Any) -> Any:
    """The target architecture's config, built from the dense source config and the plan."""
    import transformers

    blocks = moe_blocks(result.module)
    plan = result.plan.experts
    info = next(iter(blocks.values()))
    F_dense = config.intermediate_size  # the dense layers' (and Mixtral's experts') width
    F_expert = (dict(result.module.named_parameters())[info["params"]["w_out"]].shape[-1]  # F/G, or an adopted block's
                * info.get("slices", 1))  # parallel.etp: each rank holds 1/etp of the width
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        hidden_act=_HF_ACT[info["act"]], max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, rope_parameters=dict(config.rope_parameters),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        initializer_range=config.initializer_range, attention_dropout=config.attention_dropout,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        num_experts_per_tok=plan.top_k, router_aux_loss_coef=plan.aux_loss_coeff,
    )
    moe_layers = {int(_LAYER.fullmatch(layer).group(1)) for layer in blocks}
    dense_layers = [i for i in range(config.num_hidden_layers) if i not in moe_layers]
    if arch in ADOPTED_ONLY:  # its own config, the experts' fields from the plan
        cfg = config.__class__.from_dict(config.to_dict())
        cfg.num_experts_per_tok, cfg.norm_topk_prob = plan.top_k, plan.normalize
        if arch == "qwen2_moe":
            cfg.num_experts, cfg.mlp_only_layers, cfg.decoder_sparse_step = plan.num_experts, dense_layers, 1
        else:
            cfg.n_routed_experts, cfg.n_group, cfg.topk_group = plan.num_experts, plan.route_groups, plan.route_group_top_k
            cfg.routed_scaling_factor = plan.route_scale
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(
            **common, intermediate_size=F_dense, head_dim=_head_dim(config), num_local_experts=plan.num_experts,
            sliding_window=getattr(config, "sliding_window", None),
        )
    else:
        cfg = transformers.Qwen3MoeConfig(
            **common, intermediate_size=F_dense, moe_intermediate_size=F_expert,
            num_experts=plan.num_experts, norm_topk_prob=plan.normalize, decoder_sparse_step=1,
            mlp_only_layers=dense_layers,
            attention_bias=bool(getattr(config, "attention_bias", False)), head_dim=_head_dim(config),
            use_sliding_window=False,
        )
    cfg.architectures = [ARCHS[arch][1]]
    return cfg


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _gather_experts(t: torch.Tensor, world: Any) -> torch.Tensor:
    """The whole [E, ...] tensor from the expert-parallel group's shards (in ep-rank order)."""
    if world is None or world.ep == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world.ep)]
    dist.all_gather(parts, t.contiguous(), group=world.ep_group)
    return torch.cat(parts)


def hf_state_dict(result: Any, world: Any = None, selection_bias: bool = False) -> dict[str, torch.Tensor]:
    """Tensors under Hugging Face names, experts whole (gathered over ep when sharded).

    ``selection_bias``: write each router's expert bias as ``gate.e_score_correction_bias``
    (zero where the plan has none), as DeepSeek-V3's router applies it.
    """
    module = result.module
    param_shards.require_whole(module, "export_hf")
    param_gathers.settle(module)  # the last step's all-gather may still be writing them (overlap_param_gather)
    blocks = moe_blocks(module)
    rename: dict[str, str] = {}
    for layer, info in blocks.items():
        p = info["params"]
        rename[p["router"]] = f"{layer}.gate.weight"
        rename[p["w_in"]] = f"{layer}.experts.gate_up_proj"
        rename[p["w_out"]] = f"{layer}.experts.down_proj"
    shared = {}  # an adopted shared expert: parameter -> (HF name or names, how to cut it)
    for layer, info in blocks.items():
        p = info["params"]
        if "shared_w_in" not in p:
            continue
        mlp = f"{layer}.shared_expert" if "shared_gate" in p else f"{layer}.shared_experts"  # Qwen2-MoE / DeepSeek-V3
        if "shared_gate" in p:
            rename[p["shared_gate"]] = f"{layer}.shared_expert_gate.weight"
        shared[p["shared_w_in"]] = (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight")
        shared[p["shared_w_out"]] = (f"{mlp}.down_proj.weight",)
    expert_names = {blocks[layer]["params"][k]: (blocks[layer], k) for layer in blocks for k in ("w_in", "w_out")}
    out = {}
    for name, t in module.named_parameters():
        value = t.detach()
        if name in shared:  # [1, 2Fs, H] -> gate_proj, up_proj [Fs, H]; [1, H, Fs] -> down_proj
            out.update(zip(shared[name], (v.contiguous().clone() for v in value[0].chunk(len(shared[name])))))
            continue
        if name in expert_names:
            info, key = expert_names[name]
            value = _gather_experts(value, world)
            if value.shape[0] != info["num_experts"]:
                raise ExportError(f"{name} holds {value.shape[0]} experts after gathering, the plan has "
                                  f"{info['num_experts']}")
            if info.get("slices", 1) > 1:  # parallel.etp: the slices of each expert joined back
                value = join_slices(value, key, info["slices"], info["glu"])
        out[rename.get(name, name)] = value.contiguous().clone()
    if selection_bias:
        buffers = dict(module.named_buffers())
        for layer, info in blocks.items():
            bias = buffers.get(info["params"].get("bias", ""))
            out[f"{layer}.gate.e_score_correction_bias"] = (
                bias.detach().float().clone() if bias is not None else torch.zeros(whole_experts(info)))
    return out


def export_hf(result: Any, path: str | Path, arch: str = "mixtral", config: Any = None, world: Any = None) -> Path:
    """Write ``result`` as a Hugging Face ``arch`` model directory loadable by ``from_pretrained``.

    ``config``: the dense source model's Hugging Face config; it carries what the graph does not
    (RoPE, norm epsilon, token ids). Default: ``result.source_config``, the copy ``convert`` kept.
    ``world`` defaults to the convert world.
    """
    if arch not in ARCHS:
        raise ExportError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    config = config if config is not None else getattr(result, "source_config", None)
    if config is None:
        raise ExportError("export_hf needs the dense model's Hugging Face config: pass config=model.config")
    world = world if world is not None else getattr(result.context, "world", None)
    blocks = moe_blocks(result.module)
    if not blocks:
        raise ExportError("the converted model has no MoE layer to export")
    _check(result, arch, config, blocks)
    cfg = hf_config(result, arch, config)
    tensors = hf_state_dict(result, world, selection_bias=arch in GROUPED_SIGMOID_ROUTERS)  # every rank takes part in the gathers
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    path = Path(path)
    if world is None or world.rank == 0:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        dtype = next(iter(tensors.values())).dtype
        cfg.dtype = str(dtype).replace("torch.", "")
        with tempfile.TemporaryDirectory(dir=path, prefix=".export-") as tmp:  # a crash leaves the old files whole
            cfg.save_pretrained(tmp)
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            for name in ("model.safetensors", "config.json"):
                os.replace(os.path.join(tmp, name), path / name)
        log.info("exported %d tensors as %s to %s", len(tensors), arch, path)
    if world is not None and world.world_size > 1:
        dist.barrier(group=world.dp_group)
    return path
