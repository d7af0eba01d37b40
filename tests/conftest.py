"""Shared fixtures: tiny models built from configs (no downloads), small and fast."""

from __future__ import annotations

import logging
import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 128


def tiny_hf(family: str, layers: int = 2) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2)
    if family == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common))
    if family == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**common))
    if family == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**common))
    if family == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(head_dim=8, **common))
    if family == "gemma":
        return T.GemmaForCausalLM(T.GemmaConfig(head_dim=8, **common))
    if family == "phi3":
        return T.Phi3ForCausalLM(T.Phi3Config(pad_token_id=0, **common))
    if family in ("arcee", "nemotron"):  # plain MLPs with ReLU squared
        kind = T.ArceeForCausalLM if family == "arcee" else T.NemotronForCausalLM
        return kind(kind.config_class(head_dim=8, bos_token_id=0, eos_token_id=0, **common))
    if family == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_head=4, n_layer=layers, vocab_size=VOCAB, n_positions=32,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                              bos_token_id=0, eos_token_id=0))
    raise ValueError(family)


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def llama() -> torch.nn.Module:
    return tiny_hf("llama")
