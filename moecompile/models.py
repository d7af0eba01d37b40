"""A small zoo of dense models built from configs (no downloads), for inspect, train and bench.

    model, (ids,) = build_model("tiny-llama")                       # 2 layers, hidden 32
    model, (ids,) = build_model("tiny-llama", num_hidden_layers=4, seq_len=32)
    model, (ids,) = build_model("path/to/config.json")              # any Hugging Face causal LM config
    model, (ids,) = build_model("path/to/checkpoint")               # save_pretrained output: its weights

A zoo name or a bare config gets random (seeded) weights; a directory that also holds weights
(``model.safetensors``, ``pytorch_model.bin`` or their sharded indexes) is loaded with them, in
float32 unless ``dtype`` says otherwise, since upcycling a trained dense model is the point.
Example inputs are token ids ``[batch_size, seq_len]``. Keyword overrides set fields of the
Hugging Face config; ``batch_size``, ``seq_len``, ``seed`` and ``dtype`` shape the example
batch and the weights instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from .errors import MoecompileError

# Every tiny config: hidden 32, 2 layers, 4 heads (2 KV heads), FFN 64, vocab 128, no dropout.
_TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    description: str
    config: Callable[[], Any]  # () -> transformers.PretrainedConfig


def _hf(cls_name: str, **fields: Any) -> Callable[[], Any]:
    def make() -> Any:
        import transformers

        return getattr(transformers, cls_name)(**fields)

    return make


MODELS: dict[str, ZooEntry] = {
    "tiny-llama": ZooEntry("Llama (SwiGLU, RMSNorm, RoPE, GQA)", _hf("LlamaConfig", **_TINY)),
    "tiny-qwen3": ZooEntry("Qwen3 (SwiGLU, QK-norm)", _hf("Qwen3Config", **_TINY, head_dim=8)),
    "tiny-qwen2": ZooEntry("Qwen2 (SwiGLU, QKV bias)", _hf("Qwen2Config", **_TINY)),
    "tiny-mistral": ZooEntry("Mistral (SwiGLU, no sliding window)", _hf("MistralConfig", **_TINY, sliding_window=None)),
    "tiny-gemma": ZooEntry("Gemma (GeGLU with tanh GELU)", _hf("GemmaConfig", **_TINY, head_dim=8)),
    "tiny-phi3": ZooEntry("Phi-3 (fused gate_up projection)", _hf("Phi3Config", **_TINY)),
    "tiny-olmo2": ZooEntry("OLMo-2 (SwiGLU, post-norm)", _hf("Olmo2Config", **_TINY)),
    "tiny-gpt2": ZooEntry(
        "GPT-2 (GELU MLP as Conv1D, biases)",
        _hf("GPT2Config", vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2),
    ),
    "tiny-mixtral": ZooEntry("Mixtral (an MoE already: 4 experts top-2, adopted as is)",
                             _hf("MixtralConfig", **_TINY, num_local_experts=4, num_experts_per_tok=2)),
    "tiny-qwen3-moe": ZooEntry(
        "Qwen3-MoE (8 experts top-2 of width 32, unnormalised weights; layer 0 dense)",
        _hf("Qwen3MoeConfig", **_TINY, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=False, mlp_only_layers=[0]),
    ),
    "tiny-qwen2-moe": ZooEntry(
        "Qwen2-MoE (4 experts top-2 of width 32 and a gated shared expert of width 64)",
        _hf("Qwen2MoeConfig", **_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64),
    ),
    "tiny-deepseek-v3": ZooEntry(
        "DeepSeek-V3 (MLA; 8 experts top-2 of width 16 routed within 2 of 4 groups, sigmoid scores with a "
        "selection bias, scaled by 2.5, an ungated shared expert; layer 0 dense)",
        _hf("DeepseekV3Config", **{**_TINY, "num_key_value_heads": 4}, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8),
    ),
    "tiny-ernie4.5-moe": ZooEntry(
        "ERNIE 4.5 MoE (8 experts top-2 of width 16, softmax scores with a selection bias, fp32 routing, an ungated "
        "shared expert; layer 0 dense)",
        _hf("Ernie4_5_MoeConfig", **_TINY, head_dim=8, moe_num_experts=8, moe_k=2, moe_intermediate_size=16,
            moe_num_shared_experts=1, moe_layer_start_index=1),
    ),
    "tiny-granite-moe": ZooEntry(
        "Granite-MoE (8 experts top-2 of width 16, a softmax over the top-2 router logits, Granite's multipliers)",
        _hf("GraniteMoeConfig", **{**_TINY, "intermediate_size": 16}, num_local_experts=8, num_experts_per_tok=2),
    ),
    "tiny-nemotron-h": ZooEntry(
        "Nemotron-H (hybrid: Mamba-2, MoE, attention, MoE; 8 ReLU² MLP experts top-2 of width 16, sigmoid scores with "
        "a selection bias, scaled by 2.5, a ReLU² shared expert)",
        _hf("NemotronHConfig", **{k: v for k, v in _TINY.items() if k != "num_hidden_layers"}, head_dim=8,
            layers_block_type=["linear_attention", "moe", "full_attention", "moe"], mamba_num_heads=4,
            mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=16, use_mamba_kernels=False,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=32, routed_scaling_factor=2.5),
    ),
    "tiny-llama4": ZooEntry(
        "Llama 4 (4 experts top-1 of width 16: a sigmoid of the top logit weighs the expert's input, a shared "
        "expert; layer 0 dense)",
        _hf("Llama4TextConfig", **{**_TINY, "intermediate_size": 16}, head_dim=8, intermediate_size_mlp=64,
            num_local_experts=4, num_experts_per_tok=1, moe_layers=[1]),
    ),
    "tiny-gpt-oss": ZooEntry(
        "gpt-oss (4 experts top-2 of width 16 with biases, a router bias, a softmax over the top-2 logits, "
        "gpt-oss's clamped SwiGLU; attention sinks, sliding and full attention layers)",
        _hf("GptOssConfig", **{**_TINY, "intermediate_size": 16}, head_dim=8, num_local_experts=4,
            num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], sliding_window=16),
    ),
    "small-llama": ZooEntry(
        "Llama, 4 layers, hidden 256, FFN 688, vocab 1024 (for benchmarks)",
        _hf("LlamaConfig", **{**_TINY, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 688,
                              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                              "max_position_embeddings": 2048}),
    ),
}


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def has_weights(name_or_path: str | Path) -> bool:
    """Whether ``name_or_path`` is a checkpoint directory with weights (not just a config)."""
    path = Path(str(name_or_path))
    return str(name_or_path) not in MODELS and path.is_dir() and any((path / f).is_file() for f in WEIGHT_FILES)


# the architectures export_hf writes with DeepSeek-V3's router: sigmoid scores, a selection bias, group-limited, scaled
GROUPED_SIGMOID_ROUTERS = ("deepseek_v3", "glm4_moe")
# what a model type's router has that its config has no field for
ROUTERS = {
    "ernie4_5_moe": {"expert_bias": True, "router_dtype": "float32"},  # softmax, its moe_statics bias, in fp32
    "llama4_text": {"score": "sigmoid", "normalize": False, "shared_experts": 1},  # and its shared expert, always
    "hunyuan_v1_moe": {"shared_experts": 1},  # its shared_mlp, always
    "afmoe": {"score": "sigmoid", "expert_bias": True},  # AFMoE: sigmoid scores shifted by its expert_bias
    "lfm2_moe": {"score": "sigmoid"},
    "deepseek_v2": {"router_dtype": "float32"},  # softmax scores (topk_method greedy) of an fp32 router GEMM
}


def own_experts(config: Any) -> dict[str, Any]:
    """The ``experts`` plan fields a model with MoE layers of its own fixes (empty for a dense model).

    Those layers are adopted as they are (pass ``import_moe``), so the plan must say what they are. Read from the
    config's fields, by what they are rather than by model type: a config with DeepSeek-V3's router fields
    (``n_group``, ``topk_group``, ``routed_scaling_factor``) has its router, sigmoid scores with a selection bias
    (DeepSeek-V3, GLM-4.5, Solar Open, EXAONE MoE, MiMo-V2-Flash...) unless ``topk_method`` says greedy (DeepSeek-V2's
    softmax); ``moe_topk``, ``routed_scaling_factor`` / ``route_scale`` and ``use_expert_bias`` mean what they say
    wherever they appear; ``ROUTERS`` adds what no field says (ERNIE 4.5's selection bias, Llama 4's sigmoid).
    ``import_moe`` reads the blocks from the traced graph and names any field these get wrong.
    """
    num = (getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
           or getattr(config, "n_routed_experts", None))
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None)  # HunYuan: moe_topk
    if not num or not top_k:
        return {}
    if not isinstance(num, int) or not isinstance(top_k, int):
        raise MoecompileError(f"{type(config).__name__} gives each layer its own experts ({num}) or top-k ({top_k}); "
                              "moecompile's plan has one of each: give every layer the same")
    fields = {"num_experts": num, "top_k": top_k, "normalize": bool(getattr(config, "norm_topk_prob", True))}
    scale = next((getattr(config, f) for f in ("routed_scaling_factor", "route_scale")  # AFMoE: route_scale
                  if getattr(config, f, None) is not None), None)
    if scale is not None:
        fields["route_scale"] = float(scale)
    if getattr(config, "use_expert_bias", False):  # LFM2-MoE's selection bias
        fields["expert_bias"] = True
    if getattr(config, "shared_expert_intermediate_size", 0):  # Qwen2-MoE's gated shared expert
        fields["shared_experts"] = 1
    greedy = getattr(config, "topk_method", None) in ("greedy", "group_limited_greedy")  # DeepSeek-V2: softmax
    if not greedy and all(getattr(config, f, None) is not None for f in ("n_group", "topk_group", "routed_scaling_factor")):
        fields |= {"score": "sigmoid", "expert_bias": True, "router_dtype": "float32", "route_groups": int(config.n_group),
                   "route_group_top_k": int(config.topk_group)}
    # however many, one GLU of n_shared * moe_intermediate_size
    if any(getattr(config, f, None) for f in ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")):
        fields["shared_experts"] = 1
    return fields | ROUTERS.get(getattr(config, "model_type", None), {})


def list_models() -> list[tuple[str, str]]:
    """(name, description) of every zoo model."""
    return [(name, entry.description) for name, entry in MODELS.items()]


def load_config(name_or_config_path: str | Path, **overrides: Any) -> Any:
    """The Hugging Face config of a zoo name, a config.json, or a directory holding one; ``overrides`` set fields."""
    config = _read_config(name_or_config_path)
    _apply_overrides(config, overrides)
    return config


def _read_config(name_or_config_path: str | Path) -> Any:
    key = str(name_or_config_path)
    if key in MODELS:
        return MODELS[key].config()
    path = Path(key)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise MoecompileError(
            f"model {key!r} is neither a zoo model ({', '.join(MODELS)}) nor a path to a Hugging Face config.json"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MoecompileError(f"{path} is not valid JSON ({e}); give a Hugging Face config.json") from e
    if "model_type" not in data:
        raise MoecompileError(f"{path} has no 'model_type'; a Hugging Face config.json names its architecture there")
    from transformers import AutoConfig

    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except (KeyError, ValueError) as e:
        raise MoecompileError(f"{path}: transformers does not know model_type {model_type!r} ({e})") from e


def _apply_overrides(config: Any, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise MoecompileError(
                f"{type(config).__name__} has no field {key!r}; override config fields such as "
                "hidden_size, intermediate_size, num_hidden_layers, vocab_size (or batch_size, seq_len, seed, dtype)"
            )
        setattr(config, key, value)


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise MoecompileError(f"dtype {dtype!r} is not a torch dtype; use e.g. 'float32' or 'bfloat16'")
    return value


def build_model(
    name_or_config_path: str | Path,
    *,
    batch_size: int = 2,
    seq_len: int = 8,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    **config_overrides: Any,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A randomly initialised causal LM in train mode, and example token ids ``[batch_size, seq_len]``."""
    from transformers import AutoModelForCausalLM

    config = load_config(name_or_config_path, **config_overrides)
    if batch_size < 1 or seq_len < 1:
        raise MoecompileError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and seq_len > max_pos:
        raise MoecompileError(f"seq_len {seq_len} exceeds the model's max_position_embeddings {max_pos}; lower seq_len")
    dt = _dtype(dtype)
    if has_weights(name_or_config_path):
        model = _from_pretrained(Path(str(name_or_config_path)), config, dt or torch.float32)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        if dt is not None:
            model = model.to(dt)
    model.train()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=g)
    return model, (ids,)


def _from_pretrained(path: Path, config: Any, dtype: torch.dtype) -> nn.Module:
    """Load a local checkpoint; a weight that is missing or has another shape is an error, not random init."""
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        try:
            model, info = AutoModelForCausalLM.from_pretrained(  # mismatches are reported below, by name
                path, config=config, dtype=dtype, local_files_only=True, output_loading_info=True,
                ignore_mismatched_sizes=True)
        except (OSError, RuntimeError, ValueError) as e:
            raise MoecompileError(f"cannot load the checkpoint in {path}: {str(e).splitlines()[0]}") from e
    for kind in ("missing_keys", "mismatched_keys"):
        if info.get(kind):
            names = sorted(_describe_key(k) for k in info[kind])
            raise MoecompileError(
                f"the checkpoint in {path} does not fit its config: {len(names)} {kind.replace('_', ' ')} "
                f"({'; '.join(names[:3])}{'; ...' if len(names) > 3 else ''}); they would start random. If a "
                "--config override changed a layer count or a shape (hidden_size, intermediate_size, vocab_size), "
                "drop it: the checkpoint fixes those")
    if info.get("unexpected_keys"):
        import logging

        logging.getLogger(__name__).warning(
            "%s: %d checkpoint tensors are not used by the model (e.g. %s); fewer layers were asked for?",
            path, len(info["unexpected_keys"]), sorted(info["unexpected_keys"])[0])
    return model


def _describe_key(key: Any) -> str:
    if isinstance(key, tuple) and len(key) == 3:  # (name, checkpoint shape, model shape)
        name, have, want = key
        return f"{name}: checkpoint {list(have)}, model {list(want)}"
    return str(key)


@contextlib.contextmanager
def quiet_transformers():
    """transformers prints a progress bar and a load report per checkpoint; our errors say what matters."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
