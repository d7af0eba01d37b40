"""Function preservation at init: the upcycled model reproduces the dense one."""

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import moecompile as mc
from moecompile import Role
from moecompile.frontend import inline_grad_regions
from moecompile.meta import nodes_with_role

from conftest import tiny_hf

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "arcee", "nemotron"]


def plan(E=8, k=2, G=1, S=0, **extra):
    return {"experts": {"num_experts": E, "top_k": k, "granularity": G, "shared_experts": S, **extra}}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("G,S", [(1, 0), (2, 0), (1, 1), (2, 2)])
def test_hf_logits_identical_at_init(family, G, S, ids):
    model = tiny_hf(family)
    result = mc.convert(model, plan(k=2 * G, G=G, S=S), (ids,))
    got, want = result.module(ids).logits, model(ids).logits
    assert type(result.module(ids)).__name__ == type(model(ids)).__name__
    assert (got - want).abs().max().item() <= 1e-5
    routes = [n for n in nodes_with_role(result.module.graph, Role.ROUTE) if n.target == torch.ops.moecompile.route.default]
    assert len(routes) == 2


def test_dense_model_is_not_modified(llama, ids):
    before = {k: v.clone() for k, v in llama.state_dict().items()}
    result = mc.convert(llama, plan(), (ids,))
    for p in result.module.parameters():
        p.data.add_(1.0)
    after = llama.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_layers_alike_share_one_traced_block(ids, monkeypatch):
    """Tracing the MoE block is most of upcycle's time: the same shapes and options trace once per convert."""
    import moecompile.passes.upcycle as upcycle

    shapes = []
    real = upcycle.trace_block
    monkeypatch.setattr(upcycle, "trace_block", lambda fn, ex: (shapes.append(ex["x"].shape), real(fn, ex))[1])
    model = tiny_hf("llama", layers=3)
    result = mc.convert(model, plan(), (ids,))
    assert shapes == [torch.Size([2, 8, 32])]
    assert (result.module(ids).logits - model(ids).logits).abs().max().item() <= 1e-5
    names = dict(result.module.named_parameters())  # each layer still has its own experts
    assert names["model.layers.0.mlp.experts.w_gate_up"] is not names["model.layers.2.mlp.experts.w_gate_up"]
    mc.convert(model, plan(), (torch.zeros(1, 4, dtype=torch.long),))  # another convert traces its own
    assert shapes[1:] == [torch.Size([1, 4, 32])]


def test_parameter_names_follow_the_dense_module_path(llama, ids):
    result = mc.convert(llama, plan(S=1, expert_bias=True), (ids,))
    names = dict(result.module.named_parameters())
    assert names["model.layers.0.mlp.experts.w_gate_up"].shape == (8, 128, 32)  # [E, 2F, H]
    assert names["model.layers.0.mlp.experts.w_down"].shape == (8, 32, 64)  # [E, H, F]
    assert names["model.layers.0.mlp.router.weight"].shape == (8, 32)
    assert names["model.layers.1.mlp.shared_experts.w_gate_up"].shape == (1, 128, 32)
    assert "model.layers.0.mlp.gate_proj.weight" not in names
    assert "model.layers.0.mlp.router.expert_bias" in dict(result.module.named_buffers())


def test_granular_experts_are_slices_and_router_rows_share_virtual_groups(llama, ids):
    result = mc.convert(llama, plan(E=8, k=4, G=4), (ids,))
    p = dict(result.module.named_parameters())
    w_gate_up, router = p["model.layers.0.mlp.experts.w_gate_up"], p["model.layers.0.mlp.router.weight"]
    assert w_gate_up.shape == (8, 32, 32)  # F/G = 16 gate rows + 16 up rows
    gate = llama.model.layers[0].mlp.gate_proj.weight
    assert torch.equal(w_gate_up[1, :16], gate[16:32])  # expert 1 = slice 1 of copy 0
    assert torch.equal(w_gate_up[5, :16], gate[16:32])  # expert 5 = slice 1 of copy 1
    assert torch.equal(router[0], router[3]) and not torch.equal(router[3], router[4])


def test_router_noise_breaks_exactness_on_purpose(llama, ids):
    result = mc.convert(llama, plan(E=4, k=2, G=2, router_noise=0.5), (ids,))
    r = dict(result.module.named_parameters())["model.layers.0.mlp.router.weight"]
    assert not torch.equal(r[0], r[1])


def test_layer_selection_every_and_list(llama, ids):
    every = mc.convert(tiny_hf("llama", layers=3), plan(layers="every:2"), (ids,))
    assert every.record("upcycle").data["layers"] == ["model.layers.0.mlp", "model.layers.2.mlp"]
    listed = mc.convert(llama, plan(layers=[r"model\.layers\.1\.mlp"]), (ids,))
    assert listed.record("upcycle").data["layers"] == ["model.layers.1.mlp"]
    assert (listed.module(ids).logits - llama(ids).logits).abs().max() <= 1e-5


class PlainMLP(nn.Module):
    def __init__(self, act: nn.Module, bias: bool, H=24, F=40):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1, self.act, self.fc2 = nn.Linear(H, F, bias=bias), act, nn.Linear(F, H, bias=bias)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class ReLUSquared(nn.Module):
    def forward(self, x):
        return torch.relu(x).square()


class PlainGLU(nn.Module):
    def __init__(self, H=24, F=40):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(H, F), nn.Linear(H, F), nn.Linear(F, H)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.gate(x), approximate="tanh") * self.up(x))


@pytest.mark.parametrize("module", [
    PlainMLP(nn.GELU(), True), PlainMLP(nn.ReLU(), False), PlainMLP(nn.SiLU(), True),
    PlainMLP(nn.GELU(approximate="tanh"), True), PlainMLP(ReLUSquared(), True), PlainGLU(),
], ids=["gelu-bias", "relu", "silu-bias", "gelu_tanh", "relu2-bias", "geglu-bias"])
@pytest.mark.parametrize("G,S", [(1, 0), (2, 1)])
def test_plain_modules_identical_at_init(module, G, S):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 24)
    result = mc.convert(module, plan(E=4, k=2, G=G, S=S), (x,))
    assert (result.module(x) - module(x)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("groups, group_k", [(1, 1), (4, 1), (2, 2)])
def test_group_limited_routing_stays_exact_and_route_scale_scales(groups, group_k):
    """Every expert is a copy of the FFN, so whichever groups a token may pick from, its renormalised
    output is the FFN's; route_scale (DeepSeek-V3's routed_scaling_factor) multiplies it."""
    torch.manual_seed(0)
    module, x = PlainGLU(), torch.randn(3, 5, 24)
    for scale in (1.0, 2.5):
        extra = {"route_groups": groups, "route_group_top_k": group_k, "route_scale": scale}
        result = mc.convert(module, plan(E=8, k=2, **extra), (x,))
        torch.testing.assert_close(result.module(x), scale * module(x), rtol=1e-5, atol=1e-5)
    route = next(n for n in result.module.graph.nodes if n.target is torch.ops.moecompile.route.default)
    assert route.args[5:6] == ((groups,) if groups > 1 else ())  # a default group_k (1) is not recorded


@pytest.mark.parametrize("router_dtype, want", [("model", torch.bfloat16), ("float32", torch.float32)])
def test_router_dtype_float32_routes_a_bf16_model_in_fp32(llama, ids, router_dtype, want):
    result = mc.convert(llama.to(torch.bfloat16), plan(router_dtype=router_dtype), (ids,))
    routers = nodes_with_role(result.module.graph, Role.ROUTER)
    logits = [n for n in routers if n.target is torch.ops.aten.linear.default]
    assert len(logits) == 2 and all(n.meta["val"].dtype == want for n in logits)
    params = dict(result.module.named_parameters())
    with torch.no_grad():  # experts that differ, as after training (copies at init: the router's gradient is 0)
        w = params["model.layers.0.mlp.experts.w_down"]
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)).to(w.dtype), alpha=0.02)
    result.module(ids).logits.float().square().mean().backward()
    router = params["model.layers.0.mlp.router.weight"]
    assert router.dtype == torch.bfloat16 and router.grad.abs().sum() > 0


def test_some_experts_get_no_tokens_and_gradients_flow(llama):
    one = torch.zeros(1, 3, dtype=torch.long)  # 3 identical tokens -> at most 2 of 16 experts used
    result = mc.convert(llama, plan(E=16, k=2), (one,))
    out = result.module(one).logits
    load = result.expert_load()["model.layers.0.mlp"]
    assert (load == 0).sum() >= 14 and load.sum() == 6
    (out.float().square().mean()).backward()
    g = dict(result.module.named_parameters())["model.layers.0.mlp.experts.w_down"].grad
    used = load > 0
    assert g[used].abs().sum() > 0 and torch.all(g[~used] == 0)


def test_router_losses_are_in_the_graph_and_differentiable(llama, ids):
    result = mc.convert(llama, plan(aux_loss="aux", z_loss_coeff=1e-2), (ids,))
    result.module(ids)
    losses = result.router_stats.losses["model.layers.0.mlp"]
    assert set(losses) == {"aux_loss", "z_loss"}
    assert losses["aux_loss"].item() >= 1.0 - 1e-5  # the Switch loss is 1 at perfect balance, above otherwise
    total = result.router_loss()
    total.backward()
    assert dict(result.module.named_parameters())["model.layers.0.mlp.router.weight"].grad.abs().sum() > 0


def test_seq_aux_loss_matches_a_direct_computation(llama, ids):
    result = mc.convert(llama, plan(E=4, k=2, aux_loss="seq_aux"), (ids,))
    result.module(ids)
    assert result.router_stats.losses["model.layers.1.mlp"]["aux_loss"].item() >= 1.0 - 1e-5


def test_capacity_drops_tokens_and_counts_load(llama, ids):
    result = mc.convert(llama, plan(E=4, k=2, capacity_factor=0.5), (ids,))
    out = result.module(ids).logits
    assert torch.isfinite(out).all()
    assert result.expert_load()["model.layers.0.mlp"].sum() == ids.numel() * 2  # load counts before dropping
    assert "capacity 4" in " ".join(result.record("upcycle").decisions)


@pytest.mark.parametrize("E", [4, 8, 2])  # 8 experts = the traced sequence, 2 = the traced batch
def test_dynamic_shapes_accept_other_batch_and_sequence_lengths(llama, ids, E):
    result = mc.convert(llama, plan(E=E, k=2), (ids,), dynamic=True)
    for shape in [(3, 5), (1, 12)]:
        x = torch.randint(0, 128, shape)
        assert (result.module(x).logits - llama(x).logits).abs().max() <= 1e-5


def test_granularity_must_divide_intermediate(ids):
    with pytest.raises(mc.PassError, match="F=40") as err:
        mc.convert(PlainMLP(nn.GELU(), True), plan(E=6, k=3, G=3), (torch.randn(2, 3, 24),))
    assert "upcycle" in str(err.value)


def test_model_without_ffn_is_a_clear_error():
    with pytest.raises(mc.PassError, match="no FFN in the model matches") as err:
        mc.convert(nn.Sequential(nn.Linear(4, 4)), plan(), (torch.randn(2, 4),))
    assert "SwiGLU" in str(err.value) and err.value.pass_name == "find_ffn"


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # Python control flow on a tensor value: not traceable
            return self.fc(x)
        return x


def test_a_model_taking_use_cache_through_kwargs_is_traced_without_a_cache():
    """Granite-MoE's forward names no use_cache, takes it through **kwargs, and caches unless told not to."""
    from moecompile.frontend import example_kwargs_for

    class Cached(torch.nn.Module):
        config = type("Config", (), {"use_cache": True})()

        def forward(self, ids, **kwargs):
            return ids

    class Plain(torch.nn.Module):
        def forward(self, ids, **kwargs):
            return ids

    assert example_kwargs_for(Cached(), None) == {"use_cache": False}
    assert example_kwargs_for(Cached(), {"use_cache": True}) == {"use_cache": True}  # the caller's choice stays
    assert example_kwargs_for(Plain(), None) == {}  # nothing says it caches: nothing added


def test_untraceable_model_is_a_trace_error():
    with pytest.raises(mc.TraceError, match="DataDependent") as err:
        mc.convert(DataDependent(), plan(), (torch.randn(2, 4),))
    assert "Hint" in str(err.value)
    with pytest.raises(mc.TraceError, match="expected an nn.Module"):
        mc.trace(lambda x: x, (torch.randn(2),))


def _graph_with_a_no_grad_block() -> fx.GraphModule:
    """What torch 2.11's export makes of ``y = 2 x; with no_grad: b = 3 sin(y); return b + y``."""
    body = fx.Graph()
    y_in = body.placeholder("y")
    sin = body.call_function(torch.ops.aten.sin.default, (y_in,))
    body.output((body.call_function(torch.ops.aten.mul.Tensor, (sin, 3.0)),))
    root = nn.Module()
    root.submod_1 = fx.GraphModule(nn.Module(), body)
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    block = graph.call_function(torch.ops.higher_order.wrap_with_set_grad_enabled,
                                (False, graph.get_attr("submod_1"), y))
    b = graph.call_function(operator.getitem, (block, 0))
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (b, y)))
    return fx.GraphModule(root, graph)


def test_a_no_grad_block_export_kept_as_a_submodule_is_inlined_and_passes_no_gradient():
    gm = _graph_with_a_no_grad_block()
    x = torch.randn(5, requires_grad=True)
    want = gm(x)
    want_grad, = torch.autograd.grad(want.sum(), x)  # 2: the block's branch carries none
    inline_grad_regions(gm)
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" or "wrap" in str(n.target)]
    assert not hasattr(gm, "submod_1")
    got = gm(x)
    got_grad, = torch.autograd.grad(got.sum(), x)
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    assert torch.equal(got_grad, torch.full_like(x, 2.0))


def test_the_converted_model_takes_its_inputs_by_name_like_the_model(llama, ids):
    result = mc.convert(llama, plan(), (ids,))
    assert torch.equal(result.module(input_ids=ids).logits, result.module(ids).logits)
    torch.testing.assert_close(result.module(input_ids=ids).logits, llama(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_a_call_at_another_shape_names_the_input_and_the_traced_shape(llama, ids):
    result = mc.convert(llama, plan(), (ids,))
    for bad in (ids[:, :4], torch.cat([ids, ids])):
        with pytest.raises(mc.MoecompileError, match=rf"input 'input_ids' has shape \({bad.shape[0]}, {bad.shape[1]}\) "
                                                     r"but the graph was traced at \(2, 8\)"):
            result.module(bad)  # (dynamic=True graphs take other shapes: test_dynamic_shapes_accept_...)


@pytest.mark.parametrize("module", [PlainMLP(nn.GELU(), True), PlainMLP(nn.SiLU(), False), PlainMLP(ReLUSquared(), True),
                                    PlainGLU()], ids=["gelu-bias", "silu", "relu2-bias", "geglu-bias"])
def test_symbolic_trace_frontend_speaks_the_same_ops(module):
    x = torch.randn(3, 5, 24)
    result = mc.convert(module, plan(E=4, k=2, G=2), (x,), trace_method="symbolic_trace")
    assert (result.module(x) - module(x)).abs().max().item() <= 1e-5
    assert result.record("find_ffn").decisions


def test_new_parameters_live_on_the_dense_models_device():
    # The meta device stands in for a GPU: router, expert bias and experts all follow the FFN weights.
    module = PlainGLU().to("meta")  # with biases: the zero-bias fallbacks must follow too
    x = torch.randn(2, 5, module.up.in_features, device="meta")
    result = mc.convert(module, plan(E=4, expert_bias=True), (x,))
    devices = {name: t.device.type for name, t in [*result.module.named_parameters(), *result.module.named_buffers()]}
    assert any("router" in name for name in devices) and any("expert_bias" in name for name in devices)
    assert set(devices.values()) == {"meta"}, devices


def _weights_at(result) -> set[str]:
    return {n.meta["moe"]["moe"]["weights_at"] for n in result.module.graph.nodes if "moe" in n.meta.get("moe", {})}


@pytest.mark.parametrize("family, want", [("llama", "activation"), ("gpt2", "combine")])
def test_auto_puts_the_routing_weights_in_the_glu_where_they_commute(family, want, ids):
    result = mc.convert(tiny_hf(family), plan(), (ids,))
    assert _weights_at(result) == {want}
    glus = [n for n in result.module.graph.nodes if n.target is torch.ops.moecompile.glu.default]
    assert all((len(n.args) > 2 and n.args[2] is not None) == (want == "activation") for n in glus)
    assert f"routing weights at the {want}" in result.report()


def test_activation_weights_match_combine_weights_after_training_moved_the_experts(llama, ids):
    """Same function, same gradients (to round-off); the combine keeps no [N, H] rows for its backward."""
    runs = {}
    for where in ("activation", "combine"):
        result = mc.convert(llama, plan(E=8, k=2, apply_weights=where, router_noise=0.1), (ids,))
        torch.manual_seed(1)
        with torch.no_grad():  # experts that differ, so a wrong weight placement shows
            for name, p in result.module.named_parameters():
                if "experts" in name:
                    p.add_(torch.randn_like(p) * 0.05)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = result.module(ids).logits
        out.square().mean().backward()
        grads = {k: p.grad for k, p in result.module.named_parameters()}
        runs[where] = out, grads, sum(saved)
        assert _weights_at(result) == {where}
    (out_a, g_a, saved_a), (out_c, g_c, saved_c) = runs["activation"], runs["combine"]
    torch.testing.assert_close(out_a, out_c, rtol=1e-5, atol=1e-6)
    assert g_a.keys() == g_c.keys() and any("router" in k for k in g_a)
    for k in g_a:
        torch.testing.assert_close(g_a[k], g_c[k], rtol=1e-4, atol=1e-6, msg=k)
    N, H = ids.numel() * 2, llama.config.hidden_size  # T*k routed rows of width H, per MoE layer
    # 2 layers: the combine's [N, H] rows gone; the glu's weights, the gather's index and mask ([N] each) added
    assert saved_c - saved_a == 2 * N * H - 2 * 3 * N, (saved_c, saved_a)


def test_activation_weights_on_experts_they_do_not_commute_with_is_a_plan_error(ids):
    # a PassError of upcycle (like any pass failure) carrying the PlanError's field, value and rule
    with pytest.raises(mc.PassError, match=r"upcycle.*PlanError.*apply_weights.*not GLUs.*'auto'.*'combine'"):
        mc.convert(tiny_hf("gpt2"), plan(apply_weights="activation"), (ids,))
    with pytest.raises(mc.PassError, match="down projection has a bias"):
        mc.convert(PlainGLU(), plan(E=4, apply_weights="activation"), (torch.randn(2, 3, 24),))
