"""The recompute pass: regions recomputed or offloaded, gradients bit-identical, the budget met.

The model: a tiny Llama whose layer 0 becomes MoE (with a shared expert) and whose
layer 1 stays dense, so every region kind exists in one graph.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import moecompile as mc
from moecompile.passes.regions import OffloadRegion, RecomputeRegion
from moecompile.plan.recompute import REGION_KINDS

from conftest import tiny_hf

EXPERTS = {"num_experts": 4, "top_k": 2, "shared_experts": 1, "layers": "every:2", "z_loss_coeff": 0.1}


@pytest.fixture(scope="module")
def model():
    return tiny_hf("llama")


@pytest.fixture(scope="module")
def batch():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def _convert(model, batch, **recompute):
    return mc.convert(model, {"experts": EXPERTS, "recompute": recompute}, (batch,))


def _step(result, batch):
    """Loss, then every gradient (router losses included, so the router's backward runs too)."""
    result.module.zero_grad(set_to_none=True)
    logits = result.module(batch).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    (loss + 0.1 * result.module.moe_stats.losses.get("model.layers.0.mlp", {}).get("z_loss", 0)).backward()
    return logits.detach(), {k: p.grad.clone() for k, p in result.module.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def baseline(model, batch):
    result = mc.convert(model, {"experts": EXPERTS}, (batch,))
    return result, _step(result, batch), mc.estimate_memory(result, by_pass=False).activations


def _regions(result, cls=RecomputeRegion):
    return {name: m for name, m in result.module.named_children() if isinstance(m, cls)}


@pytest.mark.parametrize("kind", REGION_KINDS)
def test_each_region_kind_recomputes_with_identical_gradients(model, batch, baseline, kind):
    _, (logits0, grads0), act0 = baseline
    result = _convert(model, batch, modules=[kind])
    regions = _regions(result)
    assert regions and all(kind in m.kinds for m in regions.values())
    logits, grads = _step(result, batch)
    assert torch.equal(logits, logits0)
    assert grads.keys() == grads0.keys()
    for k in grads0:
        assert torch.equal(grads[k], grads0[k]), f"{kind}: gradient of {k} differs"
    rec = result.record("recompute").data["recompute"]
    assert rec["activation_bytes"] < act0, f"recomputing {kind} saved nothing"
    assert rec["activation_bytes"] == mc.estimate_memory(result, by_pass=False).activations


def test_moe_act_region_takes_its_consumers_along(model, batch):
    result = _convert(model, batch, modules=["moe_act"])
    (region,) = _regions(result).values()
    recomputed = [n.target for n in region.recompute.graph.nodes if n.op == "call_function"]
    consumers = [n.target for n in region.consumers.graph.nodes if n.op == "call_function"]
    ops = torch.ops
    assert recomputed == [ops.moecompile.glu.default] * 2  # the routed experts' and the shared expert's
    gemms = sorted(str(t) for t in consumers if "reshape" not in str(t))  # (views on the way join them)
    assert gemms == ["aten.linear.default", "moecompile.grouped_mm.default"]  # both down projections
    est = mc.estimate_memory(result, by_pass=False)
    glu_bytes = sum(n.meta["val"].nbytes for n in region.recompute.graph.nodes if n.op == "call_function")
    base = mc.estimate_memory(_convert(model, batch), by_pass=False)
    assert base.activations - est.activations == glu_bytes  # exactly the activation outputs are no longer kept


def test_touching_regions_merge(model, batch):
    result = _convert(model, batch, modules=["layernorm", "attention"])
    merged = [m for m in _regions(result).values() if m.kinds == ["attention", "layernorm"]]
    assert len(merged) == 2  # input_layernorm + self_attn, per layer
    left = [n for n in result.module.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
            and "Attention" in str(n.meta.get("nn_module_stack", ""))]
    assert not left  # every attention node now runs inside a region


def test_budget_chooses_regions_that_fit(model, batch, baseline):
    _, (logits0, grads0), act0 = baseline
    result = _convert(model, batch, budget=0.6)
    rec = result.record("recompute").data["recompute"]
    assert rec["baseline_bytes"] == act0
    assert rec["predicted_bytes"] <= 0.6 * act0 and rec["activation_bytes"] == rec["predicted_bytes"]
    assert rec["recomputed"] and any("budget" in d and "fits" in d for d in result.record("recompute").decisions)
    logits, grads = _step(result, batch)
    assert torch.equal(logits, logits0) and all(torch.equal(grads[k], grads0[k]) for k in grads0)
    looser = _convert(model, batch, budget=0.9).record("recompute").data["recompute"]
    assert looser["predicted_bytes"] <= 0.9 * act0
    assert sum(r["flops"] for r in looser["recomputed"]) <= sum(r["flops"] for r in rec["recomputed"])


def test_budget_in_bytes_restricted_to_modules(model, batch, baseline):
    act0 = baseline[2]
    result = _convert(model, batch, budget=f"{int(act0 * 0.9)}B", modules=["moe_act", "layernorm"])
    kinds = {k for m in _regions(result).values() for k in m.kinds}
    assert kinds <= {"moe_act", "layernorm"}
    assert result.record("recompute").data["recompute"]["activation_bytes"] <= 0.9 * act0


def test_unreachable_budget_says_so(model, batch):
    result = _convert(model, batch, budget=1000, modules=["router"])
    assert any("does not fit" in d for d in result.record("recompute").decisions)


def test_offload_moves_saved_activations_to_host(model, batch, baseline):
    _, (logits0, grads0), act0 = baseline
    result = _convert(model, batch, offload=["moe", "attention"], offload_min_bytes=0)
    assert len(_regions(result, OffloadRegion)) == 3  # the MoE block and both attentions
    logits, grads = _step(result, batch)
    assert torch.equal(logits, logits0) and all(torch.equal(grads[k], grads0[k]) for k in grads0)
    est = mc.estimate_memory(result, by_pass=False)
    assert est.offloaded > 0 and est.activations < act0


def test_recompute_replays_dropout():
    """A region that draws random numbers recomputes with the forward's RNG state."""

    class DropNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(16)

        def forward(self, x):
            return F.dropout(self.ln(x), 0.5, self.training)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return self.down(F.relu(self.up(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.mlp = DropNorm(), MLP()

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    torch.manual_seed(0)
    block, x = Block(), torch.randn(8, 16)
    experts = {"num_experts": 2, "top_k": 1}
    runs = []
    for plan in ({"experts": experts}, {"experts": experts, "recompute": {"modules": ["layernorm"]}}):
        result = mc.convert(block, plan, (x,))
        torch.manual_seed(7)
        xi = x.clone().requires_grad_()
        y = result.module(xi)
        y.square().sum().backward()
        runs.append((y.detach(), xi.grad, result))
    (y0, g0, _), (y1, g1, result) = runs
    assert _regions(result) and torch.equal(y0, y1) and torch.equal(g0, g1)
    assert not torch.equal(y0, block(x))  # dropout really dropped something


def test_nothing_to_do_leaves_the_graph(model, batch):
    result = _convert(model, batch)
    assert not result.record("recompute").changed and not _regions(result)


def _deepseek_v3():
    """A DeepSeek-V3-like model from a small config: layer 0 dense, layers 1-2 HF MoE blocks with a shared expert."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=128)
    return transformers.DeepseekV3ForCausalLM(cfg)


def _deepseek_v3_runs(model, batch, region: str) -> dict:
    """(result, logits, grads) of the DeepSeek-V3-like model with nothing and with ``region`` recomputed."""
    experts = {"num_experts": 4, "top_k": 2, "shared_experts": 1, "score": "sigmoid", "expert_bias": True,
               "adopt": False}  # its MoE blocks (a selection bias, shared experts) stay Hugging Face's
    runs = {}
    for name, rc in (("keep", {}), (region, {"modules": [region]})):
        result = mc.convert(model, {"experts": experts, "recompute": rc}, (batch,))
        result.module.zero_grad(set_to_none=True)
        logits = result.module(batch).logits
        F.cross_entropy(logits[:, :-1].reshape(-1, 128), batch[:, 1:].reshape(-1)).backward()
        runs[name] = result, logits.detach(), {k: p.grad.clone() for k, p in result.module.named_parameters()
                                               if p.grad is not None}
    _, logits0, grads0 = runs["keep"]
    _, logits, grads = runs[region]
    assert torch.equal(logits, logits0)
    assert grads.keys() == grads0.keys() and any(".experts." in k for k in grads)
    for k in grads0:
        assert torch.equal(grads[k], grads0[k]), k
    return runs


def test_moe_act_on_deepseek_v3_like_model_keeps_gradients(batch):
    """An upcycled layer beside HF's own MoE blocks (adopt: false): moe_act recomputes the upcycled experts'
    activation and the gradients stay bit-identical; the blocks' shared experts are theirs, not upcycled."""
    regions = _regions(_deepseek_v3_runs(_deepseek_v3(), batch, "moe_act")["moe_act"][0])
    assert list(regions) == ["recompute_moe_act_model_layers_0_mlp"]  # the dense layer's upcycled FFN
    assert all(any(n.target is torch.ops.moecompile.glu.default for n in m.recompute.graph.nodes)
               for m in regions.values())


def test_attention_that_fills_its_own_buffer_in_place_recomputes(batch):
    """DeepSeek-V3's MLA writes its query / key halves into a new_empty with copy_: the region allocates
    what it writes, so it recomputes (it used to be refused as "an in-place op"), bit-identically."""
    model = _deepseek_v3()
    runs = _deepseek_v3_runs(model, batch, "attention")
    regions = _regions(runs["attention"][0])
    assert len(regions) == model.config.num_hidden_layers  # every layer's attention
    assert all(any(n.target is torch.ops.aten.copy_.default for n in m.recompute.graph.nodes) for m in regions.values())
    assert mc.estimate_memory(runs["attention"][0], by_pass=False).activations < \
        mc.estimate_memory(runs["keep"][0], by_pass=False).activations


def test_an_in_place_write_to_a_tensor_from_outside_the_region_is_refused():
    """Rerunning a region that writes into its input would apply the write twice."""
    import torch.fx as fx

    from moecompile.passes.recompute import Region, _recomputable

    g = fx.Graph()
    x = g.placeholder("x")
    own = g.call_function(torch.ops.aten.new_empty.default, (x, [4]))
    own_half = g.call_function(torch.ops.aten.slice.Tensor, (own, 0, 0, 2))
    g.call_function(torch.ops.aten.copy_.default, (own_half, x))
    input_half = g.call_function(torch.ops.aten.slice.Tensor, (x, 0, 0, 2))
    fill_input = g.call_function(torch.ops.aten.add_.Tensor, (input_half, 1))
    region = {n for n in g.nodes if n.op == "call_function"}
    assert _recomputable(Region("attention", "a", region - {fill_input, input_half}))
    assert not _recomputable(Region("attention", "a", region))


@pytest.mark.parametrize("kinds", [["layernorm", "router"], ["moe_act", "shared_experts"],
                                   ["layernorm", "shared_experts", "router"], list(REGION_KINDS)])
def test_regions_that_meet_recompute_with_identical_gradients(model, batch, baseline, kinds):
    """The post-attention norm's output reaches the router's GEMM through a reshape: that GEMM is the norm's
    consumer and the router's own node, so the two regions must be one unit (once, a KeyError in outline);
    the shared expert's activation is in moe_act and shared_experts, and stays in one of them."""
    _, (logits0, grads0), _ = baseline
    result = _convert(model, batch, modules=kinds)
    if kinds == ["layernorm", "router"]:
        assert [m.kinds for m in _regions(result).values()].count(["layernorm", "router"]) == 1  # the MoE layer's
    logits, grads = _step(result, batch)
    assert torch.equal(logits, logits0)
    assert grads.keys() == grads0.keys() and all(torch.equal(grads[k], grads0[k]) for k in grads0)


@pytest.mark.parametrize("kinds", [["moe_act", "shared_experts"], ["layernorm", "shared_experts", "router"]])
def test_regions_that_would_span_the_exchange_stay_apart_at_ep2(kinds):
    """At ep 2 the MoE block holds the dispatch all-to-all and rows of a run-time size. Merged, these regions
    spanned one or the other (once a verifier error "recomputes collective", or a shape propagation failure):
    now each asked kind is recomputed in a unit that may be, and no node is in two."""
    from _dist import fake_rank

    with fake_rank(0, 2, ep_step=True):
        dense = tiny_hf("llama")
        ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
        result = mc.convert(dense, {"experts": EXPERTS, "parallel": {"ep": 2}, "recompute": {"modules": kinds}}, (ids,))
    regions = _regions(result)
    assert {k for m in regions.values() for k in m.kinds} == set(kinds)
    names = [n.name for m in regions.values() for g in (m.recompute, m.consumers) if g is not None
             for n in g.graph.nodes if n.op == "call_function"]
    assert len(names) == len(set(names))
    assert not any("not recomputed" in d for d in result.record("recompute").decisions)


def test_offloading_every_saved_tensor_keeps_gradients():
    """``offload_min_bytes: 0`` offloads small saved tensors too; one freed inside the region had its storage
    allocated again at the same address for the next, whose saver then got the first one's host copy back:
    7 % wrong gradients below the dense MLP, silently (found by tests/_plan_fuzz.py single)."""
    from moecompile.models import build_model

    dense, (ids,) = build_model("tiny-qwen3", batch_size=2, seq_len=16)
    experts = {"num_experts": 8, "top_k": 4, "granularity": 4, "score": "sigmoid", "aux_loss": "seq_aux",
               "layers": "every:2"}
    grads = []
    for recompute in ({}, {"offload": ["mlp"], "offload_min_bytes": 0}):
        result = mc.convert(dense, {"experts": experts, "recompute": recompute}, (ids,))
        logits = result.module(ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        (loss + result.router_loss()).backward()
        grads.append({k: p.grad for k, p in result.module.named_parameters() if p.grad is not None})
    assert _regions(result, OffloadRegion)
    for k in grads[0]:
        assert torch.allclose(grads[1][k], grads[0][k], rtol=1e-5, atol=1e-7), k
