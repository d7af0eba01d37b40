"""export_hf: trained MoE -> Hugging Face Mixtral / Qwen3-MoE that from_pretrained loads with the same logits."""

from __future__ import annotations

import json

import pytest
import torch

import moecompile as mc
from conftest import VOCAB, tiny_hf
from moecompile.export_hf import ExportError, export_hf


def trained(family: str, steps: int = 6, **experts) -> tuple[torch.nn.Module, mc.ConversionResult, torch.Tensor]:
    """Upcycle, then train until the experts of a layer differ (not only at init)."""
    dense = tiny_hf(family)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    plan = {"experts": {"num_experts": 4, "top_k": 2, "router_noise": 0.05, "aux_loss": "aux", **experts}}
    result = mc.convert(dense, plan, (ids,))
    step = mc.build_train_step(result, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (2, 8), generator=g)
        step(x, (x * 3 + 1) % VOCAB)
    return dense, result, ids


def roundtrip(tmp_path, result, dense, arch: str, ids: torch.Tensor) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    export_hf(result, tmp_path, arch=arch)  # the dense config comes from result.source_config
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf.eval()
    with torch.no_grad():
        want = result.module(ids).logits
        got = hf(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return hf


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_llama_and_mistral_export_as_mixtral(tmp_path, family):
    dense, result, ids = trained(family)
    w = dict(result.module.named_parameters())["model.layers.0.mlp.experts.w_gate_up"]
    assert (w[0] - w[1]).abs().max() > 1e-3  # training made the experts differ
    hf = roundtrip(tmp_path, result, dense, "mixtral", ids)
    assert type(hf).__name__ == "MixtralForCausalLM"
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_local_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    assert cfg["rope_parameters"]["rope_theta"] == dense.config.rope_parameters["rope_theta"]  # not Mixtral's 1e6


def test_qwen3_exports_as_qwen3_moe_with_fine_grained_and_dense_layers(tmp_path):
    dense, result, ids = trained("qwen3", num_experts=8, top_k=4, granularity=2, layers="every:2")
    hf = roundtrip(tmp_path, result, dense, "qwen3_moe", ids)
    cfg = hf.config
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert cfg.mlp_only_layers == [1] and cfg.moe_intermediate_size == dense.config.intermediate_size // 2
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 4 and cfg.norm_topk_prob


@pytest.mark.parametrize(
    "family, experts, arch, match",
    [
        ("llama", {"granularity": 2, "top_k": 2}, "mixtral", "granularity=2.*qwen3_moe"),
        ("llama", {"shared_experts": 1}, "mixtral", "shared expert"),
        ("qwen3", {"score": "sigmoid"}, "qwen3_moe", "score='sigmoid'"),
        ("llama", {"layers": "every:2"}, "mixtral", "only 1 of 2 FFNs"),
        ("llama", {}, "qwen3_moe", "source model is 'llama'.*export it as mixtral"),
        ("llama", {"route_groups": 2}, "mixtral", "routes within groups.*route_groups: 1"),
        ("qwen3", {"route_scale": 2.0}, "qwen3_moe", "scales the routing weights.*route_scale: 1"),
        ("llama", {"score": "sigmoid", "expert_bias": True}, "deepseek_v3", "source model is 'llama'"),
    ],
)
def test_unsupported_combinations_are_clear_errors(tmp_path, family, experts, arch, match):
    dense = tiny_hf(family)
    ids = torch.randint(0, VOCAB, (2, 8))
    plan = {"experts": {"num_experts": 4, "top_k": 2, **experts}}
    result = mc.convert(dense, plan, (ids,))
    with pytest.raises(ExportError, match=match):
        export_hf(result, tmp_path, arch=arch, config=dense.config)
    assert not (tmp_path / "config.json").exists()


def test_needs_the_source_config_and_a_known_arch(tmp_path, llama, ids):
    result = mc.convert(llama, {"experts": {"num_experts": 4, "top_k": 2}}, (ids,))
    assert result.source_config.to_dict() == llama.config.to_dict()  # convert kept it: no config= needed
    result.source_config = None  # as for a plain nn.Module source
    with pytest.raises(ExportError, match="config=model.config"):
        export_hf(result, tmp_path)
    with pytest.raises(ExportError, match="unknown arch 'deepseek'"):
        export_hf(result, tmp_path, arch="deepseek", config=llama.config)


@pytest.mark.distributed
def test_an_ep2_model_exports_with_every_expert_gathered():
    from transformers import AutoModelForCausalLM

    from _ep_scenario import ep1_reference, ep2_results

    out, _ = ep2_results()
    _, result, _ = ep1_reference()  # the same run in one process
    hf = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert hf.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4  # both ranks' experts
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, result.module(ids).logits, rtol=1e-4, atol=1e-4)
