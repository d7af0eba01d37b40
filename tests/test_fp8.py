"""FP8: the training ops (kernels/fp8_linear.py) and the fp8 pass, on CPU.

Legend: M rows, K in features, N out features, E experts.
Oracles: the float64 product of the dequantized operands (what an FP8 GEMM must
compute exactly, up to float32 accumulation) and the float32 model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moecompile as mc
from moecompile.kernels.fp8_linear import fp8_grouped_linear, fp8_linear, fp8_mm
from moecompile.kernels.fp8_quantize import dequantize_fp8, quantize_fp8

from conftest import tiny_hf

ops = torch.ops.moecompile
RECIPES = ["tensorwise", "delayed", "blockwise"]
MOE = {"num_experts": 4, "top_k": 2}


# A CUDA run checks cuBLAS's `_scaled_mm` and the Triton FP8 kernels against the same oracles (gpu_check.sh).
_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _FP8_GPU, reason="needs an sm_89+ GPU")])]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


# ---------------------------------------------------------------- the FP8 GEMM


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,K,N", [(1, 16, 16), (5, 40, 24), (33, 64, 3), (16, 100, 48)])
@pytest.mark.parametrize("mode", ["tensorwise", "tile x block", "tile x tile"])
def test_fp8_mm_is_the_dequantized_product(M, K, N, mode, device):
    torch.manual_seed(0)
    a, b = (torch.randn(M, K) * 3).to(device), torch.randn(N, K).to(device)
    block = 16
    if mode == "tensorwise":
        (aq, sa), (bq, sb) = quantize_fp8(a, "tensorwise", "e4m3", block), quantize_fp8(b, "tensorwise", "e5m2", block)
        a_ref, b_ref = dequantize_fp8(aq, sa, "tensorwise", block), dequantize_fp8(bq, sb, "tensorwise", block)
    else:
        b_recipe = "block" if mode == "tile x block" else "tile"
        (aq, sa), (bq, sb) = quantize_fp8(a, "tile", "e4m3", block), quantize_fp8(b, b_recipe, "e4m3", block)
        a_ref, b_ref = dequantize_fp8(aq, sa, "tile", block), dequantize_fp8(bq, sb, b_recipe, block)
    y = fp8_mm(aq, sa, bq, sb, block, b_blocks=mode == "tile x block")
    assert y.shape == (M, N) and y.dtype == torch.float32 and y.device == a.device
    # FP8 tensor cores add their products in fewer than float32's bits between promotions
    tol = 1e-5 if device == "cpu" else 2e-3
    torch.testing.assert_close(y.double(), a_ref.double() @ b_ref.double().t(), rtol=tol, atol=tol)


# ---------------------------------------------------------------- fp8_linear / fp8_grouped_linear


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("shape", [(2, 5, 40), (1, 16), (33, 64)])
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_linear_tracks_fp32_forward_and_backward(recipe, fmt, shape, device):
    torch.manual_seed(0)
    x = torch.randn(*shape).to(device).requires_grad_()
    w = torch.randn(24, shape[-1]).to(device).requires_grad_()
    b = torch.randn(24).to(device).requires_grad_()
    hist = torch.zeros(3, 4, device=device) if recipe == "delayed" else None
    y, x_q, x_s, amax = ops.fp8_linear(x, w, b, hist, recipe, fmt, 16)
    assert x_q.dtype == torch.float8_e4m3fn and x_q.shape == (x[..., 0].numel(), shape[-1])
    recipe_x = "tile" if recipe == "blockwise" else "tensorwise"
    torch.testing.assert_close(dequantize_fp8(x_q, x_s, recipe_x, 16), x.detach().reshape(x_q.shape), rtol=0.07, atol=1e-2)
    ref = F.linear(x, w, b)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(y, (x, w, b), g)
    ref_grads = torch.autograd.grad(ref, (x, w, b), g)
    assert rel(y, ref) < 0.06
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel(got, want) < (0.15 if fmt == "hybrid" else 0.1)
    torch.testing.assert_close(grads[2], ref_grads[2])  # the bias gradient is a plain sum


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_grouped_linear_tracks_grouped_mm(recipe, device):
    torch.manual_seed(0)
    x = torch.randn(20, 32).to(device).requires_grad_()
    w = torch.randn(4, 48, 32).to(device).requires_grad_()
    bias = torch.randn(4, 48).to(device).requires_grad_()
    sizes = torch.tensor([5, 0, 10, 5], device=device)  # an expert with no rows
    hist = torch.zeros(3, 4, device=device) if recipe == "delayed" else None
    y = fp8_grouped_linear(x, w, sizes, bias, hist, recipe, "hybrid", 16)
    ref = ops.grouped_mm(x, w, sizes, bias)
    g = torch.randn_like(ref)
    got, want = torch.autograd.grad(y, (x, w, bias), g), torch.autograd.grad(ref, (x, w, bias), g)
    assert rel(y, ref) < 0.06
    for a, b in zip(got, want):
        assert rel(a, b) < 0.12
    assert got[1][1].abs().sum() == 0  # the empty expert gets no weight gradient


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_grouped_linear_takes_no_rows(recipe, device):
    """Dropless expert parallelism can send a rank no rows at all: an empty output, zero weight gradients."""
    x = torch.zeros(0, 32, device=device, requires_grad=True)
    w = torch.randn(4, 48, 32, device=device, requires_grad=True)
    bias = torch.randn(4, 48, device=device, requires_grad=True)
    hist = torch.zeros(3, 4, device=device) if recipe == "delayed" else None
    y = fp8_grouped_linear(x, w, torch.zeros(4, dtype=torch.int64, device=device), bias, hist, recipe, "hybrid", 16)
    assert y.shape == (0, 48)
    dx, dw, db = torch.autograd.grad(y, (x, w, bias), torch.zeros_like(y))
    assert dx.shape == (0, 32) and not dw.any() and not db.any()
    if hist is not None:
        assert torch.isfinite(hist).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_takes_no_rows(recipe):
    x = torch.zeros(0, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    hist = torch.zeros(3, 4) if recipe == "delayed" else None
    y = fp8_linear(x, w, None, hist, recipe, "hybrid", 16)
    assert y.shape == (0, 48)
    dx, dw = torch.autograd.grad(y, (x, w), torch.zeros_like(y))
    assert dx.shape == (0, 32) and not dw.any()


@pytest.mark.parametrize("K,N", [(32, 16), (40, 24)])  # 24 and 40: the GEMM pads to 16 and must not leak it
def test_fp8_ops_pass_opcheck(K, N):
    """Fake and real outputs agree in shape, dtype and strides (Inductor asserts the strides at run time)."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, K, requires_grad=True), torch.randn(N, K, requires_grad=True)
    xg, wg, sizes = torch.randn(6, K, requires_grad=True), torch.randn(2, N, K, requires_grad=True), torch.tensor([2, 4])
    checks = ("test_schema", "test_faketensor", "test_autograd_registration")
    for recipe in RECIPES:
        hist = torch.zeros(3, 2) if recipe == "delayed" else None
        torch.library.opcheck(ops.fp8_linear.default, (x, w, None, hist, recipe, "hybrid", 16), test_utils=checks)
        torch.library.opcheck(ops.fp8_grouped_linear.default, (xg, wg, sizes, None, hist, recipe, "e4m3", 16),
                              test_utils=checks)
        _, x_q, x_s, _ = ops.fp8_linear(x.detach(), w.detach(), None, hist, recipe, "hybrid", 16)
        for need in ((True, True, True), (False, True, False)):  # test_schema cannot compare float8 inputs
            torch.library.opcheck(ops.fp8_linear_backward.default,
                                  (torch.randn(2, 3, N), x_q, x_s, w.detach(), hist, recipe, "hybrid", 16, torch.float32,
                                   *need), test_utils=("test_faketensor",))


def test_fp8_saves_one_byte_activations():
    """Autograd keeps the float8 copy of x (1 B/elt), not x itself (2 B/elt in bf16)."""
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(128, 128, dtype=torch.bfloat16))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fp8_linear(x * 2, w, None, None, "tensorwise", "hybrid")
    activations = [t for t in saved if t.numel() > 2 and t is not w]  # (scale and amaxes are tiny)
    assert [t.dtype for t in activations] == [torch.float8_e4m3fn]
    assert activations[0].nbytes == x.nbytes // 2
    y.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


def test_delayed_scaling_keeps_an_amax_history():
    torch.manual_seed(0)
    w = torch.randn(8, 16, requires_grad=True)
    hist = torch.zeros(3, 3)
    x1 = torch.randn(4, 16)
    fp8_linear(x1, w, None, hist, "delayed", "hybrid", 16).sum().backward()
    assert hist[0, 0] == x1.abs().max() and hist[1, 0] == w.detach().abs().max() and hist[2, 0] == 1.0
    assert (hist[:, 1:] == 0).all()
    # step 2: x is 4x larger than anything in the history, so the delayed scale saturates it
    x2 = x1 * 4
    _, x_q, x_s, _ = ops.fp8_linear(x2, w, None, hist, "delayed", "hybrid", 16)
    assert float(x_s) == pytest.approx(float(x1.abs().max()) / 448)
    assert x_q.float().abs().max() == 448
    y, *_ = ops.fp8_linear(x2, w, None, hist, "delayed", "hybrid", 16)
    y.sum().backward()
    assert hist[0, 1] == x1.abs().max() and hist[0, 0] == x2.abs().max()  # rolled, newest first


# ---------------------------------------------------------------- the pass


def _convert(model, ids, **fp8):
    return mc.convert(model, {"experts": MOE, "fp8": fp8}, (ids,))


def _fp8_nodes(result):
    g = result.module.graph
    dense = [n for n in g.nodes if n.target is ops.fp8_linear.default]
    grouped = [n for n in g.nodes if n.target is ops.fp8_grouped_linear.default]
    return dense, grouped


def test_pass_rewrites_attention_and_expert_gemms_keeps_router_and_head(llama, ids):
    result = _convert(llama, ids, recipe="tensorwise")
    dense, grouped = _fp8_nodes(result)
    assert len(dense) == 2 * 4 and len(grouped) == 2 * 2  # q/k/v/o per layer; up and down per MoE layer
    assert {str(n.meta["moe"]["role"]) for n in grouped} == {"experts"}
    linears = [n for n in result.module.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert sorted(str(n.meta["moe"].get("role", "")) for n in linears) == ["", "router", "router"]  # lm_head stays
    assert not result.record("fp8").data["fp8"]["kept"]["layers"]
    ref = mc.convert(llama, {"experts": MOE}, (ids,)).module(ids).logits
    assert rel(result.module(ids).logits, ref) < 0.05


def test_pass_respects_modules_and_keep_high_precision(ids):
    model = tiny_hf("llama", layers=3)
    result = _convert(model, ids, recipe="blockwise", block_size=16, modules=["experts"], keep_high_precision=1)
    dense, grouped = _fp8_nodes(result)
    assert not dense and {n.meta["moe"]["layer"] for n in grouped} == {"model.layers.1.mlp"}
    kept = result.record("fp8").data["fp8"]["kept"]
    assert len(kept["layers"]) == 4 and len(kept["not selected"]) == 12


def test_pass_none_leaves_the_graph_alone(llama, ids):
    result = _convert(llama, ids, recipe="none")
    assert _fp8_nodes(result) == ([], []) and not result.record("fp8").changed


def test_pass_converts_gpt2_addmm(ids):
    model = tiny_hf("gpt2")
    result = _convert(model, ids, recipe="tensorwise", modules=["attention_proj"])
    dense, _ = _fp8_nodes(result)
    assert len(dense) == 4 and not any(n.target is torch.ops.aten.addmm.default and "attn" in str(n.meta.get("nn_module_stack")) for n in result.module.graph.nodes)
    ref = mc.convert(model, {"experts": MOE}, (ids,)).module(ids).logits
    assert rel(result.module(ids).logits, ref) < 0.05


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])  # tensorwise takes the same paths as delayed
def test_an_fp8_graph_compiles_at_unaligned_widths(ids, recipe):
    """torch.compile(fullgraph) of an fp8 model whose GEMM widths are not multiples of 16 (the FP8 GEMM pads
    them): the float8 pads stay inside the ops (Inductor's CPU backend cannot lower float8 masks), and the
    compiled forward and backward agree with eager."""
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=128, num_hidden_layers=1, hidden_size=24, intermediate_size=40,
                           num_attention_heads=4, num_key_value_heads=2)
    result = _convert(T.LlamaForCausalLM(config), ids, recipe=recipe, block_size=16)
    torch._dynamo.reset()
    compiled = torch.compile(result.module, fullgraph=True)
    grads = []
    for forward in (result.module, compiled):
        result.module.zero_grad()
        logits = forward(ids).logits
        logits.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in result.module.named_parameters() if p.grad is not None})
        grads[-1]["logits"] = logits.detach()
    eager, got = grads
    assert set(eager) == set(got)
    for name in eager:  # Inductor's sums may round a value to the neighbouring float8 code; the router's
        # gradient is round-off at init (its experts are copies of one FFN), so it only has to stay that small
        close = rel(got[name], eager[name]) < 0.02 or float((got[name] - eager[name]).abs().max()) < 1e-9
        assert close, (name, rel(got[name], eager[name]))


def test_delayed_history_is_a_checkpointed_buffer(llama, ids):
    result = _convert(llama, ids, recipe="delayed", amax_history_len=5)
    hist = {k: v for k, v in result.module.state_dict().items() if k.endswith("_fp8_amax_history")}
    assert len(hist) == 12 and all(v.shape == (3, 5) for v in hist.values())
    assert "model.layers.0.self_attn.q_proj.weight_fp8_amax_history" in hist
    result.module(ids).logits.sum().backward()
    after = {k: v.clone() for k, v in result.module.state_dict().items() if k in hist}
    assert all((v[:, 0] > 0).all() for v in after.values())
    fresh = _convert(llama, ids, recipe="delayed", amax_history_len=5)
    fresh.module.load_state_dict(result.module.state_dict())
    assert all(torch.equal(fresh.module.state_dict()[k], v) for k, v in after.items())


# ---------------------------------------------------------------- quality


def _train(recipe: str, steps: int, seed: int = 0) -> list[float]:
    """A tiny upcycled Llama learning a fixed bigram language, AdamW; returns the loss per step."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2))
    g = torch.Generator().manual_seed(1)
    table = torch.randint(0, 64, (64, 2), generator=g)

    def batch(step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.zeros(4, 17, dtype=torch.long)
        x[:, 0] = torch.randint(0, 64, (4,), generator=gen)
        for t in range(1, 17):
            x[:, t] = table[x[:, t - 1], torch.randint(0, 2, (4,), generator=gen)]
        return x

    result = mc.convert(model, {"experts": MOE, "fp8": {"recipe": recipe, "block_size": 16}}, (batch(0)[:, :-1],))
    opt = torch.optim.AdamW(result.module.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        b = batch(step)
        loss = F.cross_entropy(result.module(b[:, :-1]).logits.reshape(-1, 64), b[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def smoothed(losses: list[float], window: int = 10) -> list[float]:
    """The loss curve: a trailing mean, so one batch's noise is not read as drift."""
    return [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1]) for i in range(len(losses))]


def _check_tracks(steps: int) -> None:
    base = smoothed(_train("none", steps))
    assert base[-1] < 0.8 * base[0]  # it learns
    for recipe in RECIPES:
        curve = smoothed(_train(recipe, steps))
        worst = max(abs(a - b) / b for a, b in zip(curve, base))
        assert worst < 0.03, f"{recipe}: loss curve deviates {worst:.1%} from fp32"


def test_fp8_training_tracks_fp32_loss():
    _check_tracks(24)


@pytest.mark.slow
def test_fp8_training_tracks_fp32_loss_200_steps():
    _check_tracks(200)


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_conversion_keeps_every_tensor_on_the_models_device(recipe):
    """A model converted on a GPU must stay there: the delayed recipe's amax histories were made on the CPU. The
    meta device stands in for the GPU this machine lacks (convert runs on it: shapes only)."""
    from moecompile.models import build_model

    model, (ids,) = build_model("tiny-llama", seq_len=16)
    plan = {"experts": {"num_experts": 4, "top_k": 2, "granularity": 2, "shared_experts": 1}, "fp8": {"recipe": recipe}}
    result = mc.convert(model.to("meta"), plan, (ids.to("meta"),))
    tensors = [*result.module.named_parameters(), *result.module.named_buffers()]
    assert any(name.endswith("_fp8_amax_history") for name, _ in tensors) == (recipe == "delayed")
    assert [name for name, t in tensors if t.device.type != "meta"] == []
