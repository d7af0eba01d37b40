"""import_moe: a Hugging Face MoE model (Mixtral, Qwen2/3-MoE, OLMoE, ERNIE 4.5, Granite-MoE, DeepSeek-V3 and its kin,
Nemotron-H, Llama 4, gpt-oss) converted as it is.

Oracles: the Hugging Face model itself (same logits and the same gradients, by parameter, at
conversion), a single process (ep=2 matches it step for step), and the exported checkpoint
(from_pretrained gives the trained model's logits).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import moecompile as mc
from _dist import spawn
from moecompile.errors import PassError
from moecompile.export_hf import ExportError
from moecompile.models import build_model, own_experts

VOCAB = 128


def hf_moe(name: str, **config):
    model, (ids,) = build_model(name, **config)
    randomise_selection_bias(model)
    return model, ids


def randomise_selection_bias(model) -> None:
    """A trained-looking selection bias (it starts at zero), so that it changes the routing: DeepSeek-V3's and
    LFM2-MoE's buffers, ERNIE 4.5's and AFMoE's frozen parameters."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, b in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("e_score_correction_bias", ".expert_bias")):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def converted(name: str, config: dict | None = None, **experts):
    model, ids = hf_moe(name, **(config or {}))
    plan = {"experts": {**own_experts(model.config), **experts}}
    return model, ids, mc.convert(model, plan, (ids,))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# HF name of each adopted tensor -> moecompile's, and the rows of it that the HF tensor is
RENAMES = {"gate.weight": ("router.weight", 0), "experts.gate_up_proj": ("experts.w_gate_up", 0),
           "experts.down_proj": ("experts.w_down", 0), "shared_expert_gate.weight": ("shared_experts.gate.weight", 0),
           "shared_expert.gate_proj.weight": ("shared_experts.w_gate_up", 1),  # rows [0, Fs) of expert 0
           "shared_expert.up_proj.weight": ("shared_experts.w_gate_up", 2),  # rows [Fs, 2Fs)
           "shared_expert.down_proj.weight": ("shared_experts.w_down", 3),  # expert 0
           "shared_experts.gate_proj.weight": ("shared_experts.w_gate_up", 1),  # DeepSeek-V3's, ungated
           "shared_experts.up_proj.weight": ("shared_experts.w_gate_up", 2),
           "shared_experts.down_proj.weight": ("shared_experts.w_down", 3)}


def adopted_grad(names: dict, hf_name: str) -> torch.Tensor:
    """The gradient moecompile holds for the HF parameter ``hf_name``."""
    for old, (new, part) in RENAMES.items():
        if hf_name.endswith("mlp." + old):
            g = names[hf_name[: -len(old)] + new].grad
            if part == 0:
                return g
            half = g.shape[1] // 2
            return {1: g[0, :half], 2: g[0, half:], 3: g[0]}[part]
    return names[hf_name].grad


def assert_hf_logits_and_gradients(model, result, ids, grad_of) -> None:
    """The HF model's logits, and each of its parameters' gradients, which ``grad_of(names, hf_name)`` reads from
    moecompile's; nothing left behind, nothing doubled (a shared GLU's gate_proj and up_proj are one tensor)."""
    names = dict(result.module.named_parameters())
    got, want = result.module(ids).logits, model(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    lm_loss(got, ids).backward()
    lm_loss(want, ids).backward()
    for hf_name, p in model.named_parameters():
        torch.testing.assert_close(grad_of(names, hf_name), p.grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=hf_name: f"{n}: {m}")
    fused = sum(".shared_experts.w_gate_up" in n for n in names)
    assert len(names) == len(dict(model.named_parameters())) - fused


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-deepseek-v3"])
def test_adopted_model_gives_the_hf_logits_and_gradients(name):
    model, ids, result = converted(name)
    adopted = result.record("import_moe").data["layers"]
    first_dense = name in ("tiny-qwen3-moe", "tiny-deepseek-v3")
    assert adopted == (["model.layers.1.mlp"] if first_dense else ["model.layers.0.mlp", "model.layers.1.mlp"])
    assert not result.record("upcycle").data["layers"]  # a dense layer 0 stays dense
    names = dict(result.module.named_parameters())
    assert "model.layers.1.mlp.experts.w_gate_up" in names and "model.layers.1.mlp.experts.gate_up_proj" not in names
    assert_hf_logits_and_gradients(model, result, ids, adopted_grad)
    if name == "tiny-deepseek-v3":  # the selection bias came along, as a buffer the train step updates
        bias = dict(result.module.named_buffers())["model.layers.1.mlp.router.expert_bias"]
        assert torch.equal(bias, model.model.layers[1].mlp.gate.e_score_correction_bias)


def test_deepseek_v3_routes_within_its_groups(monkeypatch):
    """Read as ungrouped, the block would pick other experts and fail the numeric check: the groups are real."""
    model, ids, result = converted("tiny-deepseek-v3")
    assert "top-2 within 2 of 4 groups sigmoid (biased selection) renormalised x2.5 silu GLUs + a shared expert" in \
        result.record("import_moe").decisions[0]
    from moecompile.passes import import_moe

    read = import_moe.read_router
    monkeypatch.setattr(import_moe, "read_router", lambda *a: dataclasses.replace(read(*a), route_groups=1, route_group_top_k=1))
    with pytest.raises(PassError, match="read as 8 experts top-2 sigmoid .biased selection. renormalised x2.5.*differs"):
        mc.convert(model, {"experts": {**own_experts(model.config), "route_groups": 1, "route_group_top_k": 1}}, (ids,))


def test_a_bf16_deepseek_v3_routes_in_fp32_as_hugging_face_does():
    """Its router GEMM casts to fp32; so does the adopted block (router_dtype: float32), so both pick alike."""
    model, ids = hf_moe("tiny-deepseek-v3", dtype="bfloat16")
    result = mc.convert(model, {"experts": own_experts(model.config)}, (ids,))
    router = [n for n in result.module.graph.nodes if n.target is torch.ops.aten.linear.default
              and n.meta.get("moe", {}).get("role") == "router"]
    assert router and all(n.meta["val"].dtype == torch.float32 for n in router)
    with torch.no_grad():
        got, want = result.module(ids).logits.float(), model(ids, use_cache=False).logits.float()
    assert float((got - want).abs().max() / want.abs().max()) < 2e-2


def test_glm4_moe_is_adopted_too():
    """GLM-4.5's MoE layer is DeepSeek-V3's router and shared experts under another name."""
    import transformers as T

    torch.manual_seed(0)
    model = T.Glm4MoeForCausalLM(T.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5))
    randomise_selection_bias(model)
    ids = torch.randint(0, VOCAB, (2, 8))
    result = mc.convert(model, {"experts": own_experts(model.config)}, (ids,))
    assert result.record("import_moe").data["layers"] == ["model.layers.1.mlp"]
    torch.testing.assert_close(result.module(ids).logits, model(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["solar_open", "exaone_moe", "mimo_v2_flash"])
def test_deepseek_v3_routers_of_other_model_types_are_read_from_their_config_fields(model_type):
    """own_experts reads DeepSeek-V3's router from the config's fields, not from a list of model types: Solar Open,
    EXAONE MoE and MiMo-V2-Flash carry it too (it used to say softmax for them, and convert refused the plan)."""
    import transformers as T

    try:
        config = T.AutoConfig.for_model(model_type)
    except ValueError:
        pytest.skip(f"this transformers has no {model_type}")
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=8, num_experts=8,
                 num_local_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                 first_k_dense_replace=0, max_position_embeddings=64)
    for field, value in small.items():
        if hasattr(config, field):
            setattr(config, field, value)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    randomise_selection_bias(model)
    plan = own_experts(model.config)
    assert plan["score"] == "sigmoid" and plan["route_groups"] == 4 and plan["route_scale"] == 2.5
    ids = torch.randint(0, VOCAB, (2, 8))
    result = mc.convert(model, {"experts": plan}, (ids,))
    assert result.record("import_moe").data["layers"]
    torch.testing.assert_close(result.module(ids).logits, model(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_ernie_4_5_moe_is_adopted_with_its_squeezed_selection_bias():
    """ERNIE 4.5: softmax scores shifted by a [1, E] bias it squeezes, fp32 routing, an ungated shared GLU."""
    import transformers as T

    try:
        config = T.AutoConfig.for_model(
            "ernie4_5_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_num_experts=8, moe_k=2,
            moe_num_shared_experts=1, moe_layer_start_index=1, max_position_embeddings=64)
    except ValueError:
        pytest.skip("this transformers has no ernie4_5_moe")
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    randomise_selection_bias(model)
    ids = torch.randint(0, VOCAB, (2, 8))
    result = mc.convert(model, {"experts": own_experts(model.config)}, (ids,))
    assert result.record("import_moe").data["layers"] == ["model.layers.1.mlp"]
    assert "(biased selection)" in result.record("import_moe").decisions[0]
    torch.testing.assert_close(result.module(ids).logits, model(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type, extra", [("granitemoe", {}), ("granitemoeshared", {"shared_intermediate_size": 32})])
def test_granite_moe_is_adopted_with_its_softmax_over_the_top_logits(model_type, extra):
    """Granite-MoE's router (``router.weight``) takes the top-k of the logits, then a softmax over those k: the top-k
    of the softmax, renormalised. Granite-MoE-Shared's shared MLP sits beside the block and stays dense."""
    import transformers as T

    try:
        config = T.AutoConfig.for_model(
            model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, **extra)
    except ValueError:
        pytest.skip(f"this transformers has no {model_type}")
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, VOCAB, (2, 8))
    result = mc.convert(model, {"experts": own_experts(model.config)}, (ids,))
    assert len(result.record("import_moe").data["layers"]) == 2
    assert "top-2 softmax renormalised" in result.record("import_moe").decisions[0]
    torch.testing.assert_close(result.module(ids).logits, model(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


# HF name -> (moecompile's, how its gradient reads the HF tensor's) for blocks stored otherwise than RENAMES says:
# Nemotron-H's plain MLP experts and shared MLP; Llama 4's transposed experts and ungated shared GLU
OTHER_LAYOUTS = {"mlp.experts.gate_up_proj": ("mlp.experts.w_gate_up", "transposed, interleaved"),  # gpt-oss's
                 "mlp.experts.gate_up_proj_bias": ("mlp.experts.b_gate_up", "interleaved"),
                 "mlp.experts.down_proj": ("mlp.experts.w_down", "transposed"),
                 "mlp.experts.down_proj_bias": ("mlp.experts.b_down", "same"),
                 "gate.weight": ("router.weight", "same"), "experts.up_proj": ("experts.w_up", "same"),
                 "mixer.experts.down_proj": ("mixer.experts.w_down", "same"),
                 "shared_experts.up_proj.weight": ("shared_experts.w_up", "expert 0"),
                 "shared_experts.down_proj.weight": ("shared_experts.w_down", "expert 0"),
                 "experts.gate_up_proj": ("experts.w_gate_up", "transposed"),
                 "feed_forward.experts.down_proj": ("feed_forward.experts.w_down", "transposed"),
                 "shared_expert.gate_proj.weight": ("shared_experts.w_gate_up", "gate half"),
                 "shared_expert.up_proj.weight": ("shared_experts.w_gate_up", "up half"),
                 "shared_expert.down_proj.weight": ("shared_experts.w_down", "expert 0")}


def grad_in_hf_layout(names: dict, hf_name: str) -> torch.Tensor:
    old, (new, how) = next(((o, r) for o, r in OTHER_LAYOUTS.items() if hf_name.endswith(o)), (hf_name, (hf_name, "same")))
    g = names[hf_name[: -len(old)] + new].grad

    def interleaved(t: torch.Tensor) -> torch.Tensor:  # [gate | up] along the last dim -> gate, up alternating
        return torch.stack(t.chunk(2, -1), -1).flatten(-2)
    return {"same": lambda: g, "transposed": lambda: g.transpose(1, 2), "expert 0": lambda: g[0],
            "gate half": lambda: g[0].chunk(2)[0], "up half": lambda: g[0].chunk(2)[1],
            "interleaved": lambda: interleaved(g), "transposed, interleaved": lambda: interleaved(g.transpose(1, 2))}[how]()


@pytest.mark.parametrize("name, layers, what", [
    ("tiny-nemotron-h", ["model.layers.1.mixer", "model.layers.3.mixer"],
     "sigmoid (biased selection) renormalised x2.5 relu2 MLPs + a shared expert (dropless, routing weights at the "
     "combine)"),
    ("tiny-llama4", ["model.layers.1.feed_forward"],
     "top-1 sigmoid unnormalised silu GLUs weighted at their input + a shared expert (dropless, routing weights at "
     "the input)"),
    ("tiny-gpt-oss", ["model.layers.0.mlp", "model.layers.1.mlp"],
     "top-2 softmax (a router bias) renormalised clamped_swiglu GLUs with biases (dropless, routing weights at the "
     "combine)"),
])
def test_blocks_of_other_layouts_are_adopted_and_give_the_hf_logits_and_gradients(name, layers, what):
    """Nemotron-H (Mamba-2, attention and MoE layers): ReLU² MLP experts, not GLUs, beside a ReLU² shared MLP, routed
    like DeepSeek-V3 (sigmoid, selection bias, scaled); before, its blocks went unseen and upcycle made an MoE of the
    shared expert inside each. Llama 4: a sigmoid of the top logits weighs each expert's *input*, experts stored
    transposed ([E, H, 2F], read by bmm), an ungated shared GLU, the block's output flattened to [T, H]. gpt-oss: a
    router bias, expert biases, gate and up columns alternating in transposed experts, its clamped SwiGLU."""
    model, ids, result = converted(name)
    assert result.record("import_moe").data["layers"] == layers
    assert what in result.record("import_moe").decisions[0]
    assert not any("in model" in d for d in result.record("find_ffn").decisions)
    assert_hf_logits_and_gradients(model, result, ids, grad_in_hf_layout)


@pytest.mark.parametrize("name, place, match", [
    ("tiny-llama4", "combine", "weights its experts' input rows.*set experts.apply_weights: auto"),
    ("tiny-gpt-oss", "activation", "its down projection has a bias.*use 'auto'"),
])
def test_routing_weights_go_only_where_the_adopted_block_computes_them(name, place, match):
    model, ids = hf_moe(name)
    with pytest.raises(PassError, match=match):
        mc.convert(model, {"experts": {**own_experts(model.config), "apply_weights": place}}, (ids,))


def test_adopt_false_leaves_a_shared_expert_inside_the_models_block_alone():
    """A shared expert is part of the model's MoE block, not a dense FFN to upcycle."""
    model, ids, result = converted("tiny-qwen2-moe", adopt=False)
    assert not result.record("find_ffn").data["ffns"] and not result.record("upcycle").data["layers"]
    assert "model.layers.0.mlp.shared_expert (in model.layers.0.mlp)" in result.record("find_ffn").decisions[0]
    torch.testing.assert_close(result.module(ids).logits, model(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)


@pytest.mark.parametrize("model_type, extra, what", [
    ("hunyuan_v1_moe", {"moe_topk": 2}, "8 experts top-2 softmax renormalised silu GLUs + a shared expert"),
    ("afmoe", {"num_dense_layers": 1, "route_scale": 2.5, "num_shared_experts": 1},
     "8 experts top-2 sigmoid (biased selection) renormalised x2.5 silu GLUs + a shared expert"),
    ("lfm2_moe", {"num_dense_layers": 1, "routed_scaling_factor": 2.5, "layer_types": ["conv", "full_attention"]},
     "8 experts top-2 sigmoid (biased selection) renormalised x2.5 silu GLUs (dropless"),
    ("deepseek_v2", {"n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
                     "routed_scaling_factor": 2.5, **MLA},
     "8 experts top-2 softmax unnormalised x2.5 silu GLUs + a shared expert"),
    ("dots1", {"n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
     "8 experts top-2 sigmoid (biased selection) unnormalised silu GLUs + a shared expert"),
    ("qwen3_next", {"shared_expert_intermediate_size": 16, "layer_types": ["linear_attention", "full_attention"],
                    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 8,
                    "linear_value_head_dim": 8},
     "8 experts top-2 softmax renormalised silu GLUs + a gated shared expert"),
    ("minimax", {}, "8 experts top-2 softmax renormalised silu GLUs (dropless"),
    ("flex_olmo", {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0},
     "8 experts top-2 softmax unnormalised silu GLUs (dropless"),
])
def test_more_families_adopt_with_the_routers_their_configs_describe(model_type, extra, what):
    """Blocks moecompile adopts under other names or beside other layers: HunYuan-MoE (``gate.wg``, ``shared_mlp``,
    ``moe_topk``), AFMoE (``router.gate``, its ``expert_bias``, ``route_scale``), LFM2-MoE (short-conv layers, a
    selection bias, weights renormalised after a cast), DeepSeek-V2 (``topk_method: greedy``: softmax, fp32, scaled),
    dots.llm1 (DeepSeek-V3's router), Qwen3-Next (Gated DeltaNet layers, Qwen2-MoE's block), MiniMax (lightning
    attention layers) and FlexOlmo: the oracle is each model's own logits."""
    import transformers as T

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                 max_position_embeddings=64)
    try:
        config = T.AutoConfig.for_model(model_type, **{**small, **extra})
    except ValueError:
        pytest.skip(f"this transformers has no {model_type}")
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    randomise_selection_bias(model)
    ids = torch.randint(0, VOCAB, (2, 8))
    result = mc.convert(model, {"experts": own_experts(model.config)}, (ids,))
    assert what in result.record("import_moe").decisions[-1]
    torch.testing.assert_close(result.module(ids).logits, model(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_deepseek_v2_group_limited_greedy_routing_is_a_named_error():
    """DeepSeek-V2 scores a group by its best expert, DeepSeek-V3 by its top two: only V3's is moecompile's."""
    import transformers as T

    config = T.AutoConfig.for_model(
        "deepseek_v2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2, **MLA)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, VOCAB, (2, 8))
    with pytest.raises(PassError, match="masks the scores otherwise than by groups scored by their top-2"):
        mc.convert(model, {"experts": own_experts(model.config)}, (ids,))


def test_olmoe_is_adopted_too():
    import transformers as T

    torch.manual_seed(0)
    model = T.OlmoeForCausalLM(T.OlmoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                             num_experts_per_tok=2, pad_token_id=0, eos_token_id=1, bos_token_id=1))
    ids = torch.randint(0, VOCAB, (2, 8))
    result = mc.convert(model, {"experts": own_experts(model.config)}, (ids,))
    assert result.record("import_moe").data["layers"] == ["model.layers.0.mlp"]
    torch.testing.assert_close(result.module(ids).logits, model(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_listed_dense_layers_are_upcycled_beside_the_adopted_ones():
    # upcycling is exact with renormalised weights only, so this Qwen3-MoE renormalises
    model, ids, result = converted("tiny-qwen3-moe", {"norm_topk_prob": True}, layers=["model.layers.0.mlp"])
    assert result.record("upcycle").data["layers"] == ["model.layers.0.mlp"]
    assert set(mc.bucket_layout.moe_blocks(result.module)) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    torch.testing.assert_close(result.module(ids).logits, model(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_the_plan_must_say_there_is_a_shared_expert():
    model, ids = hf_moe("tiny-qwen2-moe")
    with pytest.raises(PassError, match="Qwen2MoeSparseMoeBlock with shared_experts = 1.*set experts.shared_experts: 1"):
        mc.convert(model, {"experts": {**own_experts(model.config), "shared_experts": 0}}, (ids,))


@pytest.mark.parametrize("field, value, want", [("num_experts", 8, "set experts.num_experts: 4"),
                                                ("top_k", 1, "set experts.top_k: 2"),
                                                ("normalize", False, "set experts.normalize: true"),
                                                ("granularity", 2, "set experts.granularity: 1"),
                                                ("shared_experts", 1, "set experts.shared_experts: 0")])
def test_a_plan_that_does_not_describe_the_model_names_the_field(field, value, want):
    model, ids = hf_moe("tiny-mixtral")
    experts = {**own_experts(model.config), field: value}
    if field == "granularity":
        experts |= {"top_k": 2}
    with pytest.raises(PassError, match=f"experts.{field}.*MixtralSparseMoeBlock.*{want}"):
        mc.convert(model, {"experts": experts}, (ids,))


@pytest.mark.parametrize("field, value, want", [("route_groups", 1, "set experts.route_groups: 4"),
                                                ("route_group_top_k", 1, "set experts.route_group_top_k: 2"),
                                                ("route_scale", 1.0, "set experts.route_scale: 2.5"),
                                                ("score", "softmax", "set experts.score: sigmoid"),
                                                ("shared_experts", 0, "set experts.shared_experts: 1"),
                                                ("expert_bias", False, "gate.e_score_correction_bias.*set "
                                                 "experts.expert_bias: true"),
                                                ("router_dtype", "model", "set experts.router_dtype: float32")])
def test_a_plan_that_does_not_describe_deepseek_v3_names_the_field(field, value, want):
    model, ids = hf_moe("tiny-deepseek-v3")
    experts = {**own_experts(model.config), field: value}
    if field == "route_groups":
        experts |= {"route_group_top_k": 1}
    with pytest.raises(PassError, match=f"experts.{field}.*DeepseekV3MoE.*{want}"):
        mc.convert(model, {"experts": experts}, (ids,))


@pytest.mark.parametrize("config, match", [({"router_jitter_noise": 0.1}, r"jitter noise\); set config.router_jitter_noise = 0"),
                                           ({"output_router_logits": True}, "set config.output_router_logits = False")])
def test_what_the_block_cannot_express_is_a_named_error(config, match):
    model, ids = hf_moe("tiny-mixtral", **config)
    with pytest.raises(PassError, match=f"import_moe.*UnsupportedMoE.*{match}"):
        mc.convert(model, {"experts": own_experts(model.config)}, (ids,))


def test_a_selection_bias_is_a_named_error():
    model, ids = hf_moe("tiny-mixtral")
    model.model.layers[0].mlp.gate.register_buffer("e_score_correction_bias", torch.zeros(4))
    forward = type(model.model.layers[0].mlp.gate).forward

    def biased(self, h):  # DeepSeek-V3's router: a bias that shifts the selection
        logits, weights, idx = forward(self, h)
        return logits, weights + self.e_score_correction_bias[idx], idx

    model.model.layers[0].mlp.gate.forward = biased.__get__(model.model.layers[0].mlp.gate)
    with pytest.raises(PassError, match=r"layers\.0\.mlp.*reads model\.layers\.0\.mlp\.gate\.e_score_correction_bias"):
        mc.convert(model, {"experts": own_experts(model.config)}, (ids,))


def test_a_block_that_computes_something_else_fails_the_check(monkeypatch):
    """The block's reading is checked, not trusted: misread its activation and the conversion refuses."""
    from moecompile.passes import import_moe

    monkeypatch.setitem(import_moe._ACTS, torch.ops.aten.silu.default, "gelu")
    model, ids = hf_moe("tiny-mixtral")
    with pytest.raises(PassError, match="read as 4 experts top-2 softmax renormalised gelu GLUs, differs"):
        mc.convert(model, {"experts": own_experts(model.config)}, (ids,))


@pytest.mark.parametrize("name, arch", [("tiny-mixtral", "mixtral"), ("tiny-qwen3-moe", "qwen3_moe"),
                                        ("tiny-qwen2-moe", "qwen2_moe"), ("tiny-deepseek-v3", "deepseek_v3")])
def test_trained_adopted_model_exports_back_to_its_architecture(tmp_path, name, arch):
    from transformers import AutoModelForCausalLM

    model, ids, result = converted(name, aux_loss="aux", expert_bias_rate=1e-2)
    step = mc.build_train_step(result, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        x = torch.randint(0, VOCAB, ids.shape, generator=g)
        step(x, (x * 3 + 1) % VOCAB)
    trained = dict(result.module.named_parameters())["model.layers.1.mlp.experts.w_down"]
    assert (trained - model.model.layers[1].mlp.experts.down_proj).abs().max() > 1e-3
    mc.export_hf(result, tmp_path, arch=arch)
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert hf.config.to_dict()["num_experts_per_tok"] == 2
    if arch == "qwen3_moe":  # the adopted expert width and the dense layer survive the round trip
        assert hf.config.moe_intermediate_size == 32 and hf.config.mlp_only_layers == [0]
        assert hf.config.norm_topk_prob is False
    if arch == "qwen2_moe":  # the trained shared expert and its gate went back under their own names
        shared = dict(result.module.named_parameters())["model.layers.1.mlp.shared_experts.w_gate_up"]
        torch.testing.assert_close(hf.model.layers[1].mlp.shared_expert.up_proj.weight, shared[0, 64:].detach())
        assert hf.config.shared_expert_intermediate_size == 64
    if arch == "deepseek_v3":  # the selection bias moved with the load and went back as the router's
        bias = dict(result.module.named_buffers())["model.layers.1.mlp.router.expert_bias"]
        assert not torch.equal(bias, model.model.layers[1].mlp.gate.e_score_correction_bias)
        torch.testing.assert_close(hf.model.layers[1].mlp.gate.e_score_correction_bias, bias)
        assert (hf.config.n_group, hf.config.topk_group, hf.config.routed_scaling_factor) == (4, 2, 2.5)
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, result.module(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_deepseek_v3_with_an_upcycled_dense_layer_does_not_export_as_one(tmp_path):
    model, ids, result = converted("tiny-deepseek-v3", layers=["model.layers.0.mlp"])
    assert set(mc.bucket_layout.moe_blocks(result.module)) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    with pytest.raises(ExportError, match=r"MoE layers are \[0, 1\].*first_k_dense_replace \(1\)"):
        mc.export_hf(result, tmp_path, arch="deepseek_v3")


def ep2_adopted(rank: int, world_size: int) -> dict[str, list[dict]]:
    return {name: ep2_steps(rank, world_size, name)
            for name in ("tiny-mixtral", "tiny-qwen2-moe", "tiny-deepseek-v3", "tiny-nemotron-h", "tiny-llama4",
                         "tiny-gpt-oss")}


def ep2_steps(rank: int, world_size: int, name: str) -> list[dict]:
    """ep=2 on an adopted model: each step's loss and gradients equal one process on both shards."""
    import torch.distributed as dist

    from test_expert_parallel import gathered_grads, rel, sgd

    model, _ = hf_moe(name)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, VOCAB, (2 * world_size, 9), generator=g) for _ in range(3)]
    experts = {**own_experts(model.config), "aux_loss": "aux", "z_loss_coeff": 1e-3}
    ep = mc.convert(model, {"experts": experts, "parallel": {"ep": 2, "timeout_s": 120.0}}, (batches[0][:2],))
    ref = mc.convert(model, {"experts": experts}, (batches[0][:2],))
    out = []
    for ids in batches:
        shards = ids.chunk(world_size)

        def loss_of(result, x):
            return lm_loss(result.module(x).logits, x) + result.router_loss()

        loss = loss_of(ep, shards[rank])
        loss.backward()
        mc.distributed.reduce_gradients(ep.module, ep.context.world)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        ref_loss = sum(loss_of(ref, s) for s in shards) / world_size
        ref_loss.backward()
        grads, ref_grads = gathered_grads(ep.module, ep.context.world), dict(ref.module.named_parameters())
        out.append({"loss": abs(float(mean) / world_size - float(ref_loss.detach())),
                    "grad": max(rel(grads[n], ref_grads[n].grad) for n in grads)})
        sgd(ep.module)
        sgd(ref.module)
    return out


@pytest.mark.distributed
def test_adopted_moes_of_every_layout_train_with_ep2_like_one_process():
    for by_model in spawn(ep2_adopted, 2, timeout=300):
        for name, steps in by_model.items():
            for s in steps:
                assert s["loss"] < 1e-5 and s["grad"] < 1e-4, (name, steps)


def test_a_meta_device_model_is_adopted_unchecked():
    """The planner traces configs on the meta device: nothing to run, so the check says it was skipped."""
    from transformers import AutoModelForCausalLM

    from moecompile.models import load_config

    config = load_config("tiny-mixtral")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    result = mc.convert(model, {"experts": own_experts(config)}, (torch.zeros(2, 8, dtype=torch.long, device="meta"),))
    decisions = result.record("import_moe").decisions
    assert len(decisions) == 2 and all("not checked (meta tensors)" in d for d in decisions), decisions


def test_adopt_false_leaves_the_models_blocks_and_upcycles_its_dense_ffns():
    model, ids, result = converted("tiny-qwen3-moe", {"norm_topk_prob": True}, adopt=False)
    assert result.record("import_moe").decisions == ["left 1 MoE block(s) of the model as they are (experts.adopt: false)"]
    assert set(mc.bucket_layout.moe_blocks(result.module)) == {"model.layers.0.mlp"}  # upcycled; layer 1 is HF's
    assert "model.layers.1.mlp.experts.gate_up_proj" in dict(result.module.named_parameters())
    torch.testing.assert_close(result.module(ids).logits, model(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_experts_run_eagerly_by_the_model_are_traced_fused_and_the_setting_restored():
    """experts_implementation='eager' loops over experts data-dependently; the trace takes grouped_mm."""
    model, ids = hf_moe("tiny-mixtral")
    model.set_experts_implementation("eager")
    result = mc.convert(model, {"experts": own_experts(model.config)}, (ids,))
    assert model.config._experts_implementation == "eager"
    assert len(result.record("import_moe").data["layers"]) == 2
    torch.testing.assert_close(result.module(ids).logits, model(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_a_dynamic_trace_adopts_and_runs_at_other_shapes():
    """Sizes the block computes are reused by later layers in a dynamic trace; they stay, the block goes."""
    model, ids = hf_moe("tiny-mixtral")
    result = mc.convert(model, {"experts": own_experts(model.config)}, (ids,), dynamic=True)
    assert len(result.record("import_moe").data["layers"]) == 2
    for shape in ((2, 8), (3, 5), (1, 12)):
        x = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(sum(shape)))
        torch.testing.assert_close(result.module(x).logits, model(x, use_cache=False).logits, rtol=1e-5, atol=1e-5)
