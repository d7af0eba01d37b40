"""Tests for the MoE op vocabulary (moecompile.kernels), CPU reference path.

Legend: T tokens, K top-k, E experts, H hidden, N permuted rows, F FFN width.
Oracles here are deliberately naive (Python loops per token / expert) and share
no code with the kernels.
"""
import math

import pytest
import torch
from torch._subclasses import FakeTensorMode

import moecompile.kernels as mk

ops = torch.ops.moecompile
F64 = torch.float64
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------- naive oracles


def naive_route(logits_TE, bias_E, k, score, normalize):
    T, E = logits_TE.shape
    scores = logits_TE.double().softmax(-1) if score == "softmax" else logits_TE.double().sigmoid()
    weights, idx = [], []
    for t in range(T):
        choice = [float(scores[t, e]) + (0.0 if bias_E is None else float(bias_E[e])) for e in range(E)]
        top = sorted(range(E), key=lambda e: -choice[e])[:k]
        w = [float(scores[t, e]) for e in top]
        if normalize:
            w = [v / sum(w) for v in w]
        weights.append(w)
        idx.append(top)
    return torch.tensor(weights, dtype=F64), torch.tensor(idx)


def naive_kept(idx_TK, weights_TK, E, C, policy):
    """Per expert: the assignments it keeps, ascending."""
    flat, w = idx_TK.flatten().tolist(), weights_TK.flatten().tolist()
    kept = []
    for e in range(E):
        mine = [a for a in range(len(flat)) if flat[a] == e]
        if C and policy == "position":
            mine = mine[:C]
        elif C:
            mine = sorted(sorted(mine, key=lambda a: (-w[a], a))[:C])
        kept.append(mine)
    return kept


def naive_permute(x_TH, idx_TK, weights_TK, E, C, policy):
    K = idx_TK.shape[1]
    kept = naive_kept(idx_TK, weights_TK, E, C, policy)
    rows, x_rows = [], []
    for e in range(E):
        block = kept[e] + ([-1] * (C - len(kept[e])) if C else [])
        rows += block
        x_rows += [x_TH[a // K] if a >= 0 else torch.zeros_like(x_TH[0]) for a in block]
    loads = [int((idx_TK == e).sum()) for e in range(E)]
    sizes = [C] * E if C else loads
    x_NH = torch.stack(x_rows) if x_rows else x_TH.new_zeros((0, x_TH.shape[1]))
    return x_NH, torch.tensor(rows, dtype=torch.int64), torch.tensor(sizes), torch.tensor(loads)


def naive_grouped_mm(x_NI, w_EOI, sizes_E, bias_EO):
    out, start = [], 0
    for e, n in enumerate(sizes_E.tolist()):
        for r in range(start, start + n):
            y = w_EOI[e].float() @ x_NI[r].float()
            out.append(y if bias_EO is None else y + bias_EO[e].float())
        start += n
    return torch.stack(out)


def naive_act(x, act):
    if act == "silu":
        return x / (1 + torch.exp(-x))
    if act == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    if act == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def naive_unpermute(y_NH, row_src_N, weights_TK, T):
    K = weights_TK.shape[1]
    out = [torch.zeros(y_NH.shape[1]) for _ in range(T)]
    for r, a in enumerate(row_src_N.tolist()):
        if a >= 0:
            out[a // K] = out[a // K] + weights_TK.flatten()[a].float() * y_NH[r].float()
    return torch.stack(out)


# --------------------------------------------------------------- awkward cases


def make_idx(case, T, E, k):
    """Expert choices forcing the named corner case (distinct experts per token)."""
    if case == "all_to_one":  # every token's first choice is expert 0, the rest fixed
        return torch.arange(k).expand(T, k).clone()
    scores = torch.rand(T, E)
    if case == "empty_expert":
        scores[:, E - 1] = -1.0  # never chosen
    return scores.topk(k, -1).indices


CASES = [  # (name, T, E, k, H)
    ("empty_expert", 7, 4, 2, 8),
    ("all_to_one", 6, 4, 1, 8),
    ("all_to_one", 5, 4, 2, 4),
    ("k_eq_E", 5, 3, 3, 8),
    ("k1", 9, 4, 1, 16),
    ("one_token", 1, 4, 2, 8),
    ("odd_hidden", 6, 3, 2, 7),
    ("odd_hidden", 5, 5, 2, 13),
]
CASE_IDS = [f"{c[0]}-T{c[1]}E{c[2]}k{c[3]}H{c[4]}" for c in CASES]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("score,normalize,biased", [("softmax", True, False), ("softmax", False, True),
                                                    ("sigmoid", True, True), ("sigmoid", False, False)])
@pytest.mark.parametrize("case,T,E,k,H", CASES, ids=CASE_IDS)
def test_route_matches_naive(case, T, E, k, H, score, normalize, biased, dtype):
    logits = torch.randn(T, E).to(dtype)
    if case == "all_to_one":
        logits[:, 0] = 10.0
    bias = torch.randn(E) if biased else None
    w, idx = mk.route(logits, bias, k, score, normalize)
    w_ref, idx_ref = naive_route(logits, bias, k, score, normalize)
    assert w.dtype == torch.float32 and idx.dtype == torch.int64
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(w.double(), w_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("E,k,groups,group_k,normalize", [(8, 2, 4, 2, True), (16, 4, 8, 3, False),
                                                        (12, 3, 6, 3, True), (12, 2, 3, 1, True)])
def test_grouped_route_matches_deepseek_v3_router(E, k, groups, group_k, normalize):
    """Group-limited routing is Hugging Face's DeepSeek-V3 router (its weights before the scaling factor)."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(E + groups)
    cfg = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=E, num_experts_per_tok=k, n_group=groups,
                                        topk_group=group_k, norm_topk_prob=normalize, routed_scaling_factor=1.0)
    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(40, 16)
    with torch.no_grad():
        _, w_hf, idx_hf = router(x)
        w, idx = mk.route(x @ router.weight.T, router.e_score_correction_bias, k, "sigmoid", normalize, groups,
                          group_k)
    order_hf, order = idx_hf.argsort(-1), idx.argsort(-1)  # HF's top-k is unsorted
    assert torch.equal(idx_hf.gather(-1, order_hf), idx.gather(-1, order))
    torch.testing.assert_close(w_hf.gather(-1, order_hf), w.gather(-1, order))
    if group_k < groups:  # the limit binds: some token's plain top-k would have left its groups
        assert not torch.equal(mk.route(x @ router.weight.T, router.e_score_correction_bias, k, "sigmoid",
                                        normalize)[1].sort(-1).values, idx.sort(-1).values)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("capacity", [0, 1, 2])
@pytest.mark.parametrize("case,T,E,k,H", CASES, ids=CASE_IDS)
def test_permute_unpermute_match_naive(case, T, E, k, H, capacity, dtype):
    x = torch.randn(T, H).to(dtype)
    idx, w = make_idx(case, T, E, k), torch.rand(T, k)
    for policy in ("position", "probs"):
        got = mk.permute(x, idx, w, E, capacity, policy)
        want = naive_permute(x, idx, w, E, capacity, policy)
        for g, r in zip(got, want):
            assert torch.equal(g, r.to(g.dtype)), (policy, g, r)
        y = torch.randn(got[0].shape).to(dtype)
        out = mk.unpermute(y, got[1], w, T)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), naive_unpermute(y, got[1], w, T), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case,T,E,k,H", CASES, ids=CASE_IDS)
def test_grouped_mm_matches_naive(case, T, E, k, H, with_bias, dtype):
    sizes = torch.bincount(make_idx(case, T, E, k).flatten(), minlength=E)
    O = H + 3  # out features unaligned even where H is aligned
    x, w = torch.randn(int(sizes.sum()), H).to(dtype), torch.randn(E, O, H).to(dtype)
    b = torch.randn(E, O).to(dtype) if with_bias else None
    y = mk.grouped_mm(x, w, sizes, b)
    assert y.dtype == dtype and y.shape == (x.shape[0], O) and y.is_contiguous()
    torch.testing.assert_close(y.float(), naive_grouped_mm(x, w, sizes, b), **TOL[dtype])


@pytest.mark.parametrize("native", [True, False])
def test_bf16_grouped_mm_without_native_bf16_runs_in_fp32(monkeypatch, native):
    """Where the CPU has no bf16 matmul the expert GEMMs (fwd, dgrad, wgrad) run in fp32 on upcast
    copies, as one torch._grouped_mm each: bf16 out, and exactly the fp32 product of the bf16 inputs
    rounded once. With native bf16 they stay bf16, one mm per non-empty expert."""
    import importlib

    gm_mod = importlib.import_module("moecompile.kernels.grouped_mm")  # the module, not the function
    monkeypatch.setattr(gm_mod, "_cpu_has_native", lambda dtype: native)
    calls: list[tuple[str, torch.dtype]] = []
    for name in ("mm", "_grouped_mm"):
        def spy(a, *args, _real=getattr(torch, name), _name=name, **kw):
            calls.append((_name, a.dtype))
            return _real(a, *args, **kw)

        monkeypatch.setattr(torch, name, spy)
    sizes = torch.tensor([3, 0, 5])
    x = torch.randn(8, 16).bfloat16().requires_grad_()
    w = torch.randn(3, 12, 16).bfloat16().requires_grad_()
    y = mk.grouped_mm(x, w, sizes)
    y.backward(torch.randn_like(y))
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    if native:
        assert calls == [("mm", torch.bfloat16)] * 6  # 2 non-empty experts x (fwd, dgrad, wgrad)
    else:
        assert calls == [("_grouped_mm", torch.float32)] * 3  # fwd, dgrad, wgrad
    want = torch.cat([x[:3].float() @ w[0].float().T, x[3:].float() @ w[2].float().T]).bfloat16()
    if native:  # oneDNN/ATen bf16: the same fp32 accumulation, its own blocking
        torch.testing.assert_close(y, want, **TOL[torch.bfloat16])
    else:
        assert torch.equal(y, want)
    assert torch.equal(w.grad[1], torch.zeros(12, 16, dtype=torch.bfloat16))


def test_grouped_mm_dgrad_reads_the_weights_in_place(monkeypatch):
    """dx = dy @ w[e] passes w's own storage to torch._grouped_mm (a transposed view), no copy of it."""
    seen: list[int] = []
    real = torch._grouped_mm

    def spy(a, b, *args, **kw):
        seen.append(b.untyped_storage().data_ptr())
        return real(a, b, *args, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(3, 4, 8, requires_grad=True)
    mk.grouped_mm(x, w, torch.tensor([2, 0, 4])).backward(torch.randn(6, 4))
    assert seen[:2] == [w.untyped_storage().data_ptr()] * 2  # forward, then dgrad


@pytest.mark.parametrize("I,O", [(8, 4), (5, 7), (1, 1)], ids=["aligned", "unaligned", "one-wide"])
def test_grouped_mm_fp32_grads_match_float64(I, O):
    """The one-call fp32 path (padded to torch._grouped_mm's alignment) against the float64
    per-expert loop: output, dx, dw and db, with an empty expert in the middle."""
    sizes = torch.tensor([3, 0, 4, 1])
    x64 = torch.randn(8, I, dtype=F64, requires_grad=True)
    w64 = torch.randn(4, O, I, dtype=F64, requires_grad=True)
    b64 = torch.randn(4, O, dtype=F64, requires_grad=True)
    x, w, b = (t.detach().float().requires_grad_() for t in (x64, w64, b64))
    dy = torch.randn(8, O, dtype=F64)
    for args, grad in (((x64, w64, b64), dy), ((x, w, b), dy.float())):
        y = mk.grouped_mm(args[0], args[1], sizes, args[2])
        y.backward(grad)
    torch.testing.assert_close(mk.grouped_mm(x, w, sizes, b).double(), mk.grouped_mm(x64, w64, sizes, b64),
                               rtol=1e-5, atol=1e-5)
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_grouped_mm_empty_groups_get_zero_grads():
    sizes = torch.tensor([0, 3, 0, 2])
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(4, 4, 8, requires_grad=True)
    b = torch.randn(4, 4, requires_grad=True)
    mk.grouped_mm(x, w, sizes, b).sum().backward()  # y.sum(): stride-0 incoming grad
    for e in (0, 2):
        assert torch.equal(w.grad[e], torch.zeros(4, 8)) and torch.equal(b.grad[e], torch.zeros(4))
    torch.testing.assert_close(w.grad[1], torch.ones(4, 3) @ x[:3].detach())
    torch.testing.assert_close(b.grad[3], torch.full((4,), 2.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("shape", [(5, 14), (2, 3, 6), (1, 2)])
def test_glu_matches_naive(shape, act, dtype):
    h = torch.randn(shape).to(dtype)
    F = shape[-1] // 2
    want = naive_act(h[..., :F].float(), act) * h[..., F:].float()
    got = mk.glu(h, act)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


# ------------------------------------------------------------------- capacity


# idx below: expert 0 gets a = 0, 2, 4, 7 (weights .1 .5 .6 .7), expert 1 a = 1, 3, 6
# (weights .9 .5 .3), expert 2 a = 5; so load = [4, 3, 1].
@pytest.mark.parametrize("policy,C,row_src,dropped", [
    ("position", 3, [0, 2, 4, 1, 3, 6, 5, -1, -1], [1, 0, 0]),
    ("probs", 3, [2, 4, 7, 1, 3, 6, 5, -1, -1], [1, 0, 0]),
    ("position", 2, [0, 2, 1, 3, 5, -1], [2, 1, 0]),
    ("probs", 2, [4, 7, 1, 3, 5, -1], [2, 1, 0]),
])
def test_capacity_keeps_exactly(policy, C, row_src, dropped):
    idx = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    w = torch.tensor([[0.1, 0.9], [0.5, 0.5], [0.6, 0.4], [0.3, 0.7]])
    x = torch.arange(4.0).unsqueeze(1).repeat(1, 3)  # row value = token id
    x_NH, got_rows, sizes, load = mk.permute(x, idx, w, 3, C, policy)
    assert got_rows.tolist() == row_src
    assert sizes.tolist() == [C] * 3 and load.tolist() == [4, 3, 1]
    assert (load - load.clamp(max=C)).tolist() == dropped
    tokens = torch.tensor([a // 2 if a >= 0 else 0 for a in row_src], dtype=torch.float32)
    assert torch.equal(x_NH, tokens.unsqueeze(1).repeat(1, 3))
    out = mk.unpermute(x_NH, got_rows, w, 4)  # dropped assignments contribute nothing
    kept = torch.tensor([a for a in row_src if a >= 0])
    kept_w = torch.zeros(8)
    kept_w[kept] = w.flatten()[kept]
    torch.testing.assert_close(out[:, 0], kept_w.view(4, 2).sum(1) * torch.arange(4.0))


def test_probs_ties_keep_lower_assignment():
    idx, w = torch.zeros(4, 1, dtype=torch.int64), torch.tensor([[0.5], [0.9], [0.5], [0.5]])
    _, row_src, _, load = mk.permute(torch.randn(4, 4), idx, w, 2, 2, "probs")
    assert row_src.tolist() == [0, 1, -1, -1] and load.tolist() == [4, 0]


@pytest.mark.parametrize("capacity", [0, 4])
def test_permute_unpermute_roundtrip(capacity):
    x = torch.randn(4, 5)
    idx = torch.tensor([[2], [0], [2], [1]])
    x_NH, row_src, _, _ = mk.permute(x, idx, torch.ones(4, 1), 4, capacity, "position")  # expert 3 empty
    assert torch.equal(mk.unpermute(x_NH, row_src, torch.ones(4, 1), 4), x)


# ------------------------------------------------- opcheck / gradcheck / fake


def _routed(T=5, E=4, k=2, H=6, dtype=torch.float32):
    x = torch.randn(T, H, dtype=dtype, requires_grad=True)
    w, idx = mk.route(torch.randn(T, E, dtype=dtype), None, k, "softmax", True)
    return x, idx, w.detach().to(dtype)


def _opcheck_cases():
    torch.manual_seed(0)  # runs at collection, before the seeding fixture
    x, idx, w = _routed()
    E = 4
    x_NH, row_src, sizes, _ = mk.permute(x.detach(), idx, w, E, 0, "position")
    _, row_src_c, _, _ = mk.permute(x.detach(), idx, w, E, 2, "probs")
    rg = dict(requires_grad=True)
    yield "route", (torch.randn(5, E, **rg), None, 2, "softmax", True)
    yield "route", (torch.randn(5, E, **rg), torch.randn(E), 3, "sigmoid", True)
    yield "route", (torch.randn(5, E, **rg), None, 1, "sigmoid", False)
    yield "permute", (x, idx, w, E, 0, "position")
    yield "permute", (x, idx, w, E, 2, "position")
    yield "permute", (x, idx, w, E, 2, "probs")
    yield "grouped_mm", (x_NH.clone().requires_grad_(), torch.randn(E, 8, 6, **rg), sizes, None)
    b = torch.randn(E, 5, **rg)
    yield "grouped_mm", (x_NH.clone().requires_grad_(), torch.randn(E, 5, 6, **rg), sizes, b)
    yield "grouped_mm_wgrad", (torch.randn(10, 5), x_NH.clone(), sizes)
    yield "glu", (torch.randn(6, 10, **rg), "silu")
    yield "glu", (torch.randn(2, 3, 4, **rg), "gelu_tanh")
    yield "glu", (torch.randn(6, 10, **rg), "silu", torch.rand(6, **rg), True)
    yield "unpermute", (torch.randn(10, 6, **rg), row_src, w.clone().requires_grad_(), 5)
    yield "unpermute", (torch.randn(8, 6, **rg), row_src_c, w.clone().requires_grad_(), 5)
    yield "unpermute", (torch.randn(8, 6, **rg), row_src_c, w.clone(), 5, False)


@pytest.mark.parametrize("name,args", list(_opcheck_cases()),
                         ids=lambda v: v if isinstance(v, str) else "-")
def test_opcheck(name, args):
    torch.library.opcheck(getattr(ops, name).default, args)


def test_gradcheck_route():
    logits = torch.randn(6, 5, dtype=F64, requires_grad=True)
    bias = torch.randn(5, dtype=F64)
    for score, normalize, b, k in [("softmax", True, None, 2), ("softmax", False, bias, 3),
                                   ("sigmoid", True, bias, 2), ("sigmoid", False, None, 1),
                                   ("softmax", True, None, 5)]:
        assert mk.route(logits, b, k, score, normalize)[0].dtype == F64
        assert torch.autograd.gradcheck(lambda l: mk.route(l, b, k, score, normalize)[0], (logits,))
    wide = torch.randn(6, 8, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda l: mk.route(l, None, 3, "sigmoid", True, 4, 2)[0], (wide,))


@pytest.mark.parametrize("capacity,policy", [(0, "position"), (2, "position"), (2, "probs")])
def test_gradcheck_permute(capacity, policy):
    x, idx, w = _routed(dtype=F64)
    assert torch.autograd.gradcheck(lambda x: mk.permute(x, idx, w, 4, capacity, policy)[0], (x,))


def test_gradcheck_grouped_mm():
    sizes = torch.tensor([3, 0, 4, 1])
    x = torch.randn(8, 5, dtype=F64, requires_grad=True)
    w = torch.randn(4, 3, 5, dtype=F64, requires_grad=True)
    b = torch.randn(4, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: mk.grouped_mm(x, w, sizes, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: mk.grouped_mm(x, w, sizes), (x, w))


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_gradcheck_glu(act):
    h = torch.randn(3, 2, 8, dtype=F64)
    h = (h + 0.1 * h.sign()).requires_grad_()  # keep relu away from its kink
    assert torch.autograd.gradcheck(lambda h: mk.glu(h, act), (h,))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_an_input_weighted_glu_is_the_glu_of_the_weighted_rows_and_its_gradients_are_exact(act):
    """weight_input: act(w gate) * (w up), what an expert whose input rows were weighted computes (Llama 4)."""
    h = torch.randn(5, 8, dtype=F64, requires_grad=True)
    w = torch.rand(5, dtype=F64, requires_grad=True)
    want = mk.glu(h * w[:, None], act)
    torch.testing.assert_close(mk.glu(h, act, w, True), want)
    assert not torch.allclose(mk.glu(h, act, w), want)  # the weight applied after the activation differs
    assert torch.autograd.gradcheck(lambda h, w: mk.glu(h, act, w, True), (h, w))
    with pytest.raises(ValueError, match="weight_input=True scales the rows by weight_N"):
        mk.glu(h, act, None, True)


@pytest.mark.parametrize("weighted", [False, True])
def test_the_clamped_swiglu_is_gpt_oss_formula_with_exact_gradients_on_both_sides_of_its_clamps(weighted):
    """gpt-oss: min(gate, 7) * sigmoid(1.702 min(gate, 7)) * (clamp(up, -7, 7) + 1), written out as its model does."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 10, generator=g, dtype=F64) * 6
    h = (h + 0.2 * (h.abs() - 7).abs().lt(0.2) * h.sign()).requires_grad_()  # no value at a clamp's kink
    assert (h.abs() > 7).any() and (h.abs() < 7).any()
    w = torch.rand(6, generator=g, dtype=F64, requires_grad=True) if weighted else None
    gate, up = h[:, :5].clamp(max=7.0), h[:, 5:].clamp(-7.0, 7.0)
    want = gate * torch.sigmoid(1.702 * gate) * (up + 1)
    want = want if w is None else want * w[:, None]
    torch.testing.assert_close(mk.glu(h, "clamped_swiglu", w), want)
    inputs = (h,) if w is None else (h, w)
    assert torch.autograd.gradcheck(lambda *a: mk.glu(a[0], "clamped_swiglu", *a[1:]), inputs)


def _expert_rows(capacity: int):
    """(row_src, expert outputs y [N, 6], routing weights w [5, K]) of a routed toy batch, float64."""
    x, idx, w = _routed(dtype=F64)
    _, row_src, _, _ = mk.permute(x.detach(), idx, w, 4, capacity, "probs")
    y = torch.randn(row_src.shape[0], 6, dtype=F64, requires_grad=True)
    return row_src, y, w.clone().requires_grad_()


@pytest.mark.parametrize("capacity", [0, 2])
def test_gradcheck_unpermute(capacity):
    row_src, y, w = _expert_rows(capacity)
    assert torch.autograd.gradcheck(lambda y, w: mk.unpermute(y, row_src, w, 5), (y, w))
    assert torch.autograd.gradcheck(lambda y: mk.unpermute(y, row_src, w, 5, False), (y,))


@pytest.mark.parametrize("capacity", [0, 2])
def test_weights_in_the_rows_combine_like_weights_in_the_combine(capacity):
    """unpermute(y * row_weights, weighted=False) == unpermute(y): values and both grads; y is not saved."""
    row_src, y, w = _expert_rows(capacity)
    g = torch.randn(5, 6, dtype=F64)
    want = torch.autograd.grad(mk.unpermute(y, row_src, w, 5), (y, w), g)
    y_weighted = y * mk.row_weights(row_src, w)[:, None]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = mk.unpermute(y_weighted, row_src, w, 5, False)
    got = torch.autograd.grad(out, (y, w), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert saved and max(t.numel() for t in saved) < y.numel(), [tuple(t.shape) for t in saved]


def test_fake_impls_give_static_shapes():
    with FakeTensorMode():
        logits, x = torch.empty(7, 4, dtype=torch.bfloat16), torch.empty(7, 6, dtype=torch.bfloat16)
        w, idx = ops.route(logits, torch.empty(4), 2, "sigmoid", True)
        assert (w.shape, w.dtype, idx.shape, idx.dtype) == ((7, 2), torch.float32, (7, 2), torch.int64)
        assert ops.route(logits.double(), None, 2, "softmax", True)[0].dtype == F64
        for capacity, N in [(0, 14), (3, 12)]:
            x_NH, row_src, sizes, load = ops.permute(x, idx, w, 4, capacity, "probs")
            assert (x_NH.shape, x_NH.dtype, row_src.shape, sizes.shape, load.shape) == (
                (N, 6), torch.bfloat16, (N,), (4,), (4,))
            assert row_src.dtype == sizes.dtype == load.dtype == torch.int64
        y = ops.grouped_mm(x_NH, torch.empty(4, 10, 6, dtype=torch.bfloat16), sizes, None)
        assert (y.shape, y.dtype) == ((12, 10), torch.bfloat16)
        h = ops.glu(y, "gelu")
        assert (h.shape, h.dtype) == ((12, 5), torch.bfloat16)
        assert ops.glu(torch.empty(2, 3, 8), "relu").shape == (2, 3, 4)
        out = ops.unpermute(torch.empty(12, 6, dtype=torch.bfloat16), row_src, w, 7)
        assert (out.shape, out.dtype) == ((7, 6), torch.bfloat16)


# ------------------------------------------------------------- composition


@pytest.mark.parametrize("capacity", [0, 7, 3])  # dropless, capacity without drops, with drops
@pytest.mark.parametrize("H,Fh", [(8, 4), (6, 5)])
def test_moe_block_matches_dense_loop(capacity, H, Fh):
    T, E, k, act = 7, 4, 2, "silu"
    rg = dict(requires_grad=True)
    x = torch.randn(T, H, **rg)
    w_r = torch.randn(E, H, **rg)
    w1, b1 = (0.3 * torch.randn(E, 2 * Fh, H)).requires_grad_(), torch.randn(E, 2 * Fh, **rg)
    w2 = (0.3 * torch.randn(E, H, Fh)).requires_grad_()
    params = (x, w_r, w1, b1, w2)

    logits = x @ w_r.T
    logits.retain_grad()
    weights, idx = mk.route(logits, None, k, "softmax", True)
    x_NH, row_src, sizes, _ = mk.permute(x, idx, weights, E, capacity, "probs")
    h = mk.glu(mk.grouped_mm(x_NH, w1, sizes, b1), act)
    out = mk.unpermute(mk.grouped_mm(h, w2, sizes), row_src, weights, T)
    g_out = torch.randn(T, H)
    (out * g_out).sum().backward()
    got = [out.detach(), logits.grad] + [p.grad for p in params]

    for p in params:
        p.grad = None
    kept = {a for block in naive_kept(idx, weights.detach(), E, capacity, "probs") for a in block}
    logits = x @ w_r.T
    logits.retain_grad()
    scores = logits.softmax(-1)
    rows = []
    for t in range(T):
        top = sorted(range(E), key=lambda e: -float(scores[t, e].detach()))[:k]
        gate = scores[t, top] / scores[t, top].sum()
        acc = torch.zeros(H)
        for j, e in enumerate(top):
            if t * k + j in kept:
                u = w1[e] @ x[t] + b1[e]
                acc = acc + gate[j] * (w2[e] @ (naive_act(u[:Fh], act) * u[Fh:]))
        rows.append(acc)
    want_out = torch.stack(rows)
    (want_out * g_out).sum().backward()
    want = [want_out.detach(), logits.grad] + [p.grad for p in params]
    for name, g, r in zip(["out", "logits", "x", "w_r", "w1", "b1", "w2"], got, want):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


class _MoeBlock(torch.nn.Module):
    def __init__(self, H=6, E=4, Fh=5, k=2, capacity=0):
        super().__init__()
        self.router = torch.nn.Parameter(torch.randn(E, H))
        self.w1 = torch.nn.Parameter(torch.randn(E, 2 * Fh, H))
        self.b1 = torch.nn.Parameter(torch.randn(E, 2 * Fh))
        self.w2 = torch.nn.Parameter(torch.randn(E, H, Fh))
        self.E, self.k, self.capacity = E, k, capacity

    def forward(self, x_TH):
        weights, idx = mk.route(x_TH @ self.router.T, None, self.k, "softmax", True)
        x_NH, row_src, sizes, _ = mk.permute(x_TH, idx, weights, self.E, self.capacity, "probs")
        h = mk.glu(mk.grouped_mm(x_NH, self.w1, sizes, self.b1), "silu")
        return mk.unpermute(mk.grouped_mm(h, self.w2, sizes), row_src, weights, x_TH.shape[0])


@pytest.mark.parametrize("capacity", [0, 3])
def test_moe_block_exports_and_compiles(capacity):
    block, x = _MoeBlock(capacity=capacity), torch.randn(7, 6)
    gm = torch.export.export(block, (x,), strict=False).graph_module
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    ops_used = {t.split(".")[1] for t in targets if t.startswith("moecompile.")}
    assert ops_used == {"route", "permute", "grouped_mm", "glu", "unpermute"}
    block(x).square().sum().backward()
    eager = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    # traces the float32 backward (ATen's torch._grouped_mm meta kernel is bf16-only)
    torch.compile(block, backend="aot_eager", fullgraph=True)(x).square().sum().backward()
    for g, r in zip([p.grad for p in block.parameters()], eager):
        torch.testing.assert_close(g, r)


# ------------------------------------------------------------ user mistakes


@pytest.mark.parametrize("call,match", [
    (lambda: mk.route(torch.randn(3, 4), None, 5, "softmax", True), "k=5"),
    (lambda: mk.route(torch.randn(3, 4), None, 0, "softmax", True), "k=0"),
    (lambda: mk.route(torch.randn(3, 4), None, 2, "sparsemax", True), "sparsemax"),
    (lambda: mk.route(torch.randn(3, 4), torch.zeros(3), 2, "softmax", True), r"\(3,\)"),
    (lambda: mk.route(torch.randn(3, 6), None, 2, "sigmoid", True, 4, 1), "groups=4 must be >= 1 and divide"),
    (lambda: mk.route(torch.randn(3, 8), None, 2, "sigmoid", True, 4, 5), "group_k=5"),
    (lambda: mk.route(torch.randn(3, 8), None, 3, "sigmoid", True, 4, 1), "k=3 exceeds the 2 experts"),
    (lambda: mk.permute(torch.randn(3, 4), torch.tensor([[0], [1], [4]]), torch.ones(3, 1), 4, 0,
                        "position"),
     "max 4"),
    (lambda: mk.permute(torch.randn(3, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), 4, 0,
                        "position"), r"\(3, 4\)"),
    (lambda: mk.permute(torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1), 4, 2,
                        "random"), "random"),
    (lambda: mk.grouped_mm(torch.randn(5, 4), torch.randn(2, 3, 6), torch.tensor([2, 3])),
     r"\(2, 3, 6\)"),
    (lambda: mk.grouped_mm(torch.randn(5, 4), torch.randn(2, 3, 4), torch.tensor([2, 2])), r"\[2, 2\]"),
    (lambda: mk.glu(torch.randn(3, 4), "swish"), "swish"),
    (lambda: mk.glu(torch.randn(3, 5), "silu"), r"\(3, 5\)"),
    (lambda: mk.unpermute(torch.randn(4, 2), torch.tensor([0, 1, 2, 9]), torch.ones(2, 2), 2), "max 9"),
    (lambda: mk.unpermute(torch.randn(4, 2), torch.arange(4), torch.ones(2, 2), 3), "num_tokens=3"),
])
def test_user_mistakes_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
