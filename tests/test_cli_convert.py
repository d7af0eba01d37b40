"""``moecompile convert`` and pretrained loading: a dense checkpoint's weights in, a checked HF MoE checkpoint out."""

from __future__ import annotations

import pytest
import torch

from moecompile.cli import main
from moecompile.errors import MoecompileError
from moecompile.models import build_model, has_weights


def saved(tmp_path, name: str = "tiny-llama", dtype=None, **config):
    """A dense model with weights unlike any zoo seed, written with save_pretrained."""
    model, _ = build_model(name, seed=7, **config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # weights that were not produced by from_config at any seed
    path = tmp_path / "dense"
    (model.to(dtype) if dtype else model).save_pretrained(path)
    return model, path


def load_back(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def test_build_model_loads_the_checkpoint_weights_in_float32(tmp_path):
    dense, path = saved(tmp_path, dtype=torch.bfloat16)
    assert has_weights(path) and not has_weights(tmp_path) and not has_weights("tiny-llama")
    model, (ids,) = build_model(path, batch_size=3, seq_len=5)
    assert model.training and ids.shape == (3, 5)
    got = dict(model.named_parameters())
    for name, p in dense.named_parameters():
        assert got[name].dtype == torch.float32  # master weights, whatever the file stored
        torch.testing.assert_close(got[name], p.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_a_checkpoint_that_does_not_fit_its_config_is_named(tmp_path):
    _, path = saved(tmp_path)
    with pytest.raises(MoecompileError, match=r"mismatched keys \(.*mlp.down_proj.weight: checkpoint \[32, 64\], "
                                              r"model \[32, 128\]"):
        build_model(path, intermediate_size=128)
    with pytest.raises(MoecompileError, match=r"missing keys \(model.layers.2"):
        build_model(path, num_hidden_layers=3)  # the third layer would start random


def test_convert_upcycles_a_llama_checkpoint_into_mixtral(tmp_path, capsys):
    dense, path = saved(tmp_path)
    out = tmp_path / "moe"
    assert main(["convert", "--model", str(path), "--out", str(out), "--set", "experts.num_experts=4"]) == 0
    text = capsys.readouterr().out
    assert "weights loaded" in text and "as mixtral" in text and "(function preserved)" in text, text
    moe = load_back(out)
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.config.num_local_experts == 4
    ids = torch.randint(0, dense.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense.eval()(ids).logits, rtol=1e-5, atol=1e-5)  # the dense function
    gate_up = moe.model.layers[1].mlp.experts.gate_up_proj  # [E, 2F, H]: every expert a copy of the dense FFN
    mlp = dense.model.layers[1].mlp
    for e in range(4):
        torch.testing.assert_close(gate_up[e], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), rtol=0, atol=0)
    assert (out / "moecompile_plan.yaml").exists() and "upcycle" in (out / "moecompile_report.md").read_text()


def test_convert_qwen3_fine_grained_into_qwen3_moe(tmp_path, capsys):
    dense, path = saved(tmp_path, "tiny-qwen3")
    out = tmp_path / "moe"
    argv = ["convert", "--model", str(path), "--out", str(out), "--set", "experts.num_experts=8",
            "--set", "experts.top_k=4", "--set", "experts.granularity=2"]
    assert main(argv) == 0
    assert "(function preserved)" in capsys.readouterr().out
    moe = load_back(out)
    assert type(moe).__name__ == "Qwen3MoeForCausalLM" and moe.config.moe_intermediate_size == 32
    ids = torch.randint(0, dense.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense.eval()(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--set", "parallel.ep=2"], "applies only the experts section"),
    (["--model", "tiny-gpt2"], "no Hugging Face MoE architecture takes a 'gpt2' model"),
    (["--set", "experts.granularity=2", "--set", "experts.top_k=4"], "export fine-grained experts as qwen3_moe"),
    (["--model", "tiny-mixtral"], "an MoE already (4 experts top-2): there is no dense FFN to upcycle; train it"),
])
def test_convert_errors_name_the_fix(tmp_path, capsys, argv, message):
    base = ["convert", "--model", "tiny-llama", "--out", str(tmp_path / "moe")]
    assert main([*base, *argv]) == 2
    assert message in capsys.readouterr().err


def test_convert_never_writes_over_its_source(tmp_path, capsys):
    _, path = saved(tmp_path)
    before = (path / "model.safetensors").read_bytes()
    assert main(["convert", "--model", str(path), "--out", str(path)]) == 2
    assert "is the source checkpoint" in capsys.readouterr().err
    assert (path / "model.safetensors").read_bytes() == before


def test_an_export_that_fails_midway_leaves_the_last_one_whole(tmp_path, monkeypatch):
    import safetensors.torch

    out = tmp_path / "moe"
    assert main(["convert", "--model", "tiny-llama", "--out", str(out), "--set", "experts.num_experts=4"]) == 0
    before = {f: (out / f).read_bytes() for f in ("config.json", "model.safetensors")}

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        main(["convert", "--model", "tiny-llama", "--out", str(out), "--set", "experts.num_experts=2",
              "--set", "experts.top_k=1"])
    assert {f: (out / f).read_bytes() for f in before} == before
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "moecompile_plan.yaml",
                                                     "moecompile_report.md"]  # no temporary left behind


def test_train_refuses_a_checkpoint_too_small_for_bytes(tmp_path, capsys):
    _, path = saved(tmp_path)  # vocabulary 128
    assert main(["train", "--model", str(path), "--nproc", "1", "--steps", "1", "--out", str(tmp_path / "t")]) == 2
    assert "vocabulary of 128 tokens" in capsys.readouterr().err
