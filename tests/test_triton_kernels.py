"""Every Triton body against its torch reference, forward and backward, under TRITON_INTERPRET=1 on CPU.

Legend: T tokens, E experts, K top-k, H hidden, N permuted rows, I in, O out, F FFN width, R x C matrices.

Each property draws a shape (hypothesis; derandomized so CI is reproducible),
builds tensors from a drawn seed, runs the public op once with
`backend.use("triton")` and once with `backend.use("reference")`, and compares:
exactly for indices, layouts and fp8 bytes, within a per-dtype tolerance for
floats. `@example`s pin the awkward shapes (an expert with no tokens, one
token, k = E, hidden sizes that are not a power of two, E = 64). The
`*_many` twins run the same properties with many more examples (slow).

The interpreter must be on before `triton` itself is imported (its own jit
helpers, tl.max and friends, are decorated then). In a session where
something imported triton first (torch._dynamo does), these tests skip and
`test_suite_in_a_fresh_interpreter_process` reruns this file in a child.
"""
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton and the Triton bodies are imported

import pytest  # noqa: E402

pytest.importorskip("triton")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import torch  # noqa: E402

import moecompile.kernels as mk  # noqa: E402
from moecompile.kernels import backend  # noqa: E402
from moecompile.kernels.grouped_mm_fp8 import GEMM_RECIPES  # noqa: E402
from moecompile.kernels.unpermute import unpermute_backward  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=2e-2),
       torch.float64: dict(atol=1e-10, rtol=1e-10)}


def _interpreter_usable() -> bool:
    """Was triton imported with the interpreter on (so its own jit helpers are interpreted)?"""
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(std.max, InterpretedFunction)


IN_PROCESS = _interpreter_usable()


@pytest.fixture(autouse=True)
def _interpreted(request):
    if request.node.name == "test_suite_in_a_fresh_interpreter_process":
        return
    if not IN_PROCESS:
        pytest.skip("triton was imported before TRITON_INTERPRET=1; the fresh-process test runs these")
    with backend.use("triton"):
        mk.glu(torch.randn(1, 2))  # imports the first Triton module
    if not backend.interpreting():
        pytest.skip("the Triton bodies were imported compiled (TRITON_INTERPRET unset at first use)")


def test_suite_in_a_fresh_interpreter_process(request):
    if IN_PROCESS:
        pytest.skip("the interpreter works in this process: the tests above ran here")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
           "-m", request.config.getoption("markexpr") or "not slow"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"interpreter suite timed out after {e.timeout} s: {cmd}")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert " passed" in out and "1 skipped" in out, out[-2000:]  # it ran here, and skipped only itself


def both(fn):
    """(triton result, reference result) of fn() under each forced backend."""
    got = {}
    for name in ("triton", "reference"):
        with backend.use(name):
            got[name] = fn()
    return got["triton"], got["reference"]


def close(got, want, dtype, what=""):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (what, i, g.dtype, w.dtype, g.shape, w.shape)
        torch.testing.assert_close(g.double(), w.double(), **TOL[dtype], msg=lambda m: f"{what}[{i}]: {m}")


def grad_of(out, seed):
    """The output gradient ``grads`` backpropagates for ``seed``."""
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out.dtype)


def grads(out, inputs, seed):
    return torch.autograd.grad(out, inputs, grad_of(out, seed))


def dot_close(got, want, magnitude, what):
    """A bf16 routing-weight gradient is a dot over a row: the references round each factor and product to bf16
    before their fp32 sum (kernels/row_ops.py), the kernels multiply in fp32, so the two may differ by a few 2^-9
    of each term (up to three roundings, two act formulas); the flat bf16 tolerance failed rows of 23-68 terms.
    Bounded by 2^-6 of the dot of the terms' magnitudes."""
    err, bound = (got.double() - want.double()).abs(), 2**-6 * magnitude + 1e-6
    worst = (err / bound).argmax()
    assert (err <= bound).all(), f"{what}: error {err[worst].item():.3g} over the bound {bound[worst].item():.3g}"


def prop(strategy, examples=(), fast=10, slow=150):
    """(fast test, slow twin) of `check` over `strategy`, with pinned examples."""
    def deco(check):
        def make(n, **kw):
            fn = given(strategy)(check)
            for ex in examples:
                fn = example(ex)(fn)
            return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), **kw)(fn)
        return make(fast, derandomize=True), pytest.mark.slow(make(slow))
    return deco


def _routing(gen, T, E, K, empty_expert):
    """idx_TK with distinct experts per token; the last expert gets nobody if asked (and K < E)."""
    pool = E - 1 if (empty_expert and K < E) else E
    return torch.stack([torch.randperm(pool, generator=gen)[:K] for _ in range(T)]) if T else \
        torch.zeros(0, K, dtype=torch.int64)


# -------------------------------------------------------------------------- route


@st.composite
def route_cases(draw):
    E = draw(st.integers(1, 64))
    groups = draw(st.sampled_from([g for g in (1, 1, 2, 3, 4, 8) if E % g == 0]))
    group_k = draw(st.integers(1, groups))
    return dict(T=draw(st.integers(1, 40)), E=E, K=draw(st.integers(1, min(8, group_k * (E // groups)))),
                score=draw(st.sampled_from(["softmax", "sigmoid"])), normalize=draw(st.booleans()),
                bias=draw(st.booleans()), dtype=draw(st.sampled_from(DTYPES)), seed=draw(st.integers(0, 2**16)),
                groups=groups, group_k=group_k)


def check_route(case):
    T, E, K, dtype = case["T"], case["E"], case["K"], case["dtype"]
    gen = torch.Generator().manual_seed(case["seed"])
    # distinct logits (multiples of 1/16, exact in bf16): top-k has no ties to break differently
    logits = torch.stack([torch.randperm(E, generator=gen) for _ in range(T)]).float() / 16 - 2
    logits = logits.to(dtype).requires_grad_()
    groups, group_k = case.get("groups", 1), case.get("group_k", 1)
    # groups sum two scores, which can tie across groups (sigmoid(a) + sigmoid(-a) = 1): a bias breaks ties
    bias = torch.randn(E, generator=gen) * 0.01 if case["bias"] or groups > 1 else None

    def run():
        w, idx = mk.route(logits, bias, K, case["score"], case["normalize"], groups, group_k)
        return (w, idx, *grads(w, (logits,), case["seed"]))
    (w, idx, dl), (w_r, idx_r, dl_r) = both(run)
    assert torch.equal(idx, idx_r)
    close((w, dl), (w_r, dl_r), torch.float32 if dtype == torch.float32 else dtype, "route")


test_route, test_route_many = prop(route_cases(), examples=[
    dict(T=1, E=1, K=1, score="softmax", normalize=True, bias=False, dtype=torch.float32, seed=0),
    dict(T=33, E=64, K=8, score="sigmoid", normalize=True, bias=True, dtype=torch.bfloat16, seed=1),
    dict(T=5, E=3, K=3, score="softmax", normalize=False, bias=True, dtype=torch.float32, seed=2),
    dict(T=20, E=64, K=8, score="sigmoid", normalize=True, bias=True, dtype=torch.float32, seed=3, groups=8,
         group_k=4),  # DeepSeek-V3's shape, scaled down: 8 groups, 4 kept
    dict(T=7, E=6, K=2, score="softmax", normalize=False, bias=False, dtype=torch.bfloat16, seed=4, groups=3,
         group_k=2),
])(check_route)


# --------------------------------------------------------------- permute / unpermute


@st.composite
def dispatch_cases(draw):
    E = draw(st.integers(1, 64))
    return dict(T=draw(st.integers(1, 40)), E=E, K=draw(st.integers(1, min(8, E))), H=draw(st.integers(1, 70)),
                capacity=draw(st.sampled_from([0, 0, 1, 3, 8])), policy=draw(st.sampled_from(["position", "probs"])),
                align=draw(st.sampled_from([1, 1, 4, 16])), empty=draw(st.booleans()),
                weighted=draw(st.booleans()), dtype=draw(st.sampled_from(DTYPES)), seed=draw(st.integers(0, 2**16)))


def check_dispatch(case):
    T, E, K, H, dtype = case["T"], case["E"], case["K"], case["H"], case["dtype"]
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(T, H, generator=gen).to(dtype).requires_grad_()
    idx = _routing(gen, T, E, K, case["empty"])
    w = torch.rand(T, K, generator=gen).requires_grad_()

    def run():
        x_NH, row_src, sizes, load = mk.permute(x, idx, w.detach(), E, case["capacity"], case["policy"],
                                                case["align"])
        y_NH = (x_NH.float() * 1.5 + 0.25).to(dtype)  # rows differ from x so the combine is tested
        if not case.get("weighted", True):  # the rows carry their weights (as glu's weight_N leaves them)
            y_NH = y_NH * mk.row_weights(row_src, w).to(dtype)[:, None]
        out = mk.unpermute(y_NH, row_src, w, T, case.get("weighted", True))
        gx, gw = grads(out, (x, w), case["seed"])
        return (x_NH, row_src, sizes, load, y_NH.detach()), (out, gx, gw)
    (layout, floats), (layout_r, floats_r) = both(run)
    for name, g, r in zip(["x_NH", "row_src_N", "group_sizes_E", "load_E"], layout, layout_r):
        assert torch.equal(g, r), (name, g, r)
    if dtype == torch.bfloat16 and case.get("weighted", True):  # the weights' gradient is a dot over H
        out, row_src, y_NH = floats_r[0], layout_r[1], layout_r[4]
        magnitude = unpermute_backward(grad_of(out, case["seed"]).abs().double(), y_NH.abs().double(), row_src,
                                       w.detach().double())[1]
        dot_close(floats[2], floats_r[2], magnitude, "unpermute grad_w")
        floats, floats_r = floats[:2], floats_r[:2]
    close(floats, floats_r, dtype, "unpermute")


test_permute_unpermute, test_permute_unpermute_many = prop(dispatch_cases(), examples=[
    dict(T=1, E=4, K=2, H=7, capacity=0, policy="position", align=1, empty=True, dtype=torch.float32, seed=0),
    dict(T=40, E=64, K=8, H=33, capacity=0, policy="position", align=16, empty=True, dtype=torch.bfloat16,
         seed=1),
    dict(T=20, E=3, K=3, H=5, capacity=3, policy="probs", align=4, empty=False, dtype=torch.float32, seed=2),
    dict(T=23, E=2, K=1, H=64, capacity=8, policy="position", align=1, empty=True, dtype=torch.float32, seed=3),
    dict(T=17, E=5, K=2, H=9, capacity=3, policy="probs", align=4, empty=True, weighted=False, dtype=torch.float32,
         seed=4),
    dict(T=9, E=4, K=2, H=16, capacity=0, policy="position", align=1, empty=False, weighted=False,
         dtype=torch.bfloat16, seed=5),
])(check_dispatch)


# ----------------------------------------------------------------------- grouped_mm


@st.composite
def gemm_cases(draw):
    E = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.sampled_from([0, 1, 5, 16, 17, 33]), min_size=E, max_size=E))
    return dict(sizes=sizes, I=draw(st.integers(1, 70)), O=draw(st.integers(1, 70)), bias=draw(st.booleans()),
                dtype=draw(st.sampled_from(DTYPES)), seed=draw(st.integers(0, 2**16)))


def check_grouped_mm(case):
    sizes, I, O, dtype = torch.tensor(case["sizes"]), case["I"], case["O"], case["dtype"]
    E, N = sizes.shape[0], int(sizes.sum())
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(N, I, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(E, O, I, generator=gen) / I**0.5).to(dtype).requires_grad_()
    b = torch.randn(E, O, generator=gen).to(dtype).requires_grad_() if case["bias"] else None
    inputs = (x, w) if b is None else (x, w, b)

    def run():
        y = mk.grouped_mm(x, w, sizes, b)
        return (y, *grads(y, inputs, case["seed"]))
    got, want = both(run)
    close(got, want, dtype, "grouped_mm")


test_grouped_mm, test_grouped_mm_many = prop(gemm_cases(), examples=[
    dict(sizes=[0, 3, 0, 2], I=13, O=7, bias=True, dtype=torch.float32, seed=0),
    dict(sizes=[17, 0, 33], I=64, O=40, bias=False, dtype=torch.bfloat16, seed=1),
    dict(sizes=[1] * 8 + [0] * 56, I=9, O=5, bias=True, dtype=torch.float32, seed=2),  # E = 64
])(check_grouped_mm)


# ---------------------------------------------------------------------------- glu


@st.composite
def glu_cases(draw):
    return dict(lead=draw(st.sampled_from([(1,), (37,), (70,), (2, 3)])), F=draw(st.integers(1, 70)),
                act=draw(st.sampled_from(["silu", "gelu", "gelu_tanh", "relu", "clamped_swiglu"])),
                weight=draw(st.booleans()),
                dtype=draw(st.sampled_from(DTYPES)), seed=draw(st.integers(0, 2**16)))


def check_glu(case):
    lead, F, dtype = case["lead"], case["F"], case["dtype"]
    gen = torch.Generator().manual_seed(case["seed"])
    h = (torch.randn(*lead, 2 * F, generator=gen) * 2).to(dtype).requires_grad_()
    w = torch.rand(*lead, generator=gen).requires_grad_() if case["weight"] else None
    inputs = (h,) if w is None else (h, w)

    def run():
        out = mk.glu(h, case["act"], w)
        return (out, *grads(out, inputs, case["seed"]))
    got, want = both(run)
    if dtype == torch.bfloat16 and w is not None:  # the weight's gradient is a dot over F
        terms = grad_of(want[0], case["seed"]).double() * mk.glu_ref(h.detach().double(), case["act"])
        magnitude = terms.abs().sum(-1)
        dot_close(got[2], want[2], magnitude, "glu grad_w")
        got, want = got[:2], want[:2]
    close(got, want, dtype, "glu")


test_glu, test_glu_many = prop(glu_cases(), examples=[
    dict(lead=(70,), F=45, act="gelu", weight=True, dtype=torch.bfloat16, seed=0),
    dict(lead=(2, 3), F=1, act="relu", weight=False, dtype=torch.float32, seed=1),
])(check_glu)


@pytest.mark.parametrize("weighted", [False, True])
def test_the_clamped_swiglu_kernels_match_the_reference_on_both_sides_of_the_clamps(weighted):
    gen = torch.Generator().manual_seed(6)
    h = (torch.randn(37, 2 * 45, generator=gen) * 6).requires_grad_()  # about a quarter of the values past +-7
    w = torch.rand(37, generator=gen).requires_grad_() if weighted else None
    inputs = (h,) if w is None else (h, w)

    def run():
        out = mk.glu(h, "clamped_swiglu", w)
        return (out, *grads(out, inputs, 6))
    got, want = both(run)
    close(got, want, torch.float32, "clamped_swiglu")


def test_an_input_weighted_glu_runs_the_triton_kernels_on_the_weighted_rows():
    gen = torch.Generator().manual_seed(5)
    h = (torch.randn(37, 2 * 45, generator=gen) * 2).requires_grad_()
    w = torch.rand(37, generator=gen).requires_grad_()

    def run():
        out = mk.glu(h, "silu", w, True)
        return (out, *grads(out, (h, w), 5))
    got, want = both(run)
    close(got, want, torch.float32, "glu weight_input")


# ------------------------------------------------------------------------------ fp8


@st.composite
def quant_cases(draw):
    return dict(lead=draw(st.sampled_from([(), (3,)])), R=draw(st.integers(1, 70)), C=draw(st.integers(1, 150)),
                recipe=draw(st.sampled_from(["tensorwise", "rowwise", "tile", "block"])),
                fmt=draw(st.sampled_from(["e4m3", "e5m2"])), block=draw(st.sampled_from([16, 32])),
                dtype=draw(st.sampled_from(DTYPES)), seed=draw(st.integers(0, 2**16)))


def check_quantize(case):
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (*case["lead"], case["R"], case["C"])
    x = (torch.randn(shape, generator=gen) * torch.logspace(-4, 2, case["C"])).to(case["dtype"])
    (q, s), (q_r, s_r) = both(lambda: mk.quantize_fp8(x, case["recipe"], case["fmt"], case["block"]))
    assert torch.equal(q.view(torch.uint8), q_r.view(torch.uint8))  # bit for bit
    assert s.shape == s_r.shape and s.stride() == s_r.stride() and torch.equal(s, s_r)


test_quantize_fp8, test_quantize_fp8_many = prop(quant_cases(), examples=[
    dict(lead=(3,), R=33, C=130, recipe="block", fmt="e4m3", block=32, dtype=torch.bfloat16, seed=0),
    dict(lead=(), R=1, C=1, recipe="tensorwise", fmt="e5m2", block=16, dtype=torch.float32, seed=1),
])(check_quantize)


@st.composite
def fp8_gemm_cases(draw):
    E = draw(st.integers(1, 6))
    return dict(sizes=draw(st.lists(st.sampled_from([0, 1, 7, 16, 20]), min_size=E, max_size=E)),
                I=draw(st.integers(1, 100)), O=draw(st.integers(1, 70)),
                recipe=draw(st.sampled_from(["tensorwise", "rowwise", "blockwise"])),
                block=draw(st.sampled_from([16, 32])), bias=draw(st.booleans()),
                out=draw(st.sampled_from([torch.float32, torch.bfloat16])), seed=draw(st.integers(0, 2**16)))


def check_grouped_mm_fp8(case):
    sizes, I, O, B = torch.tensor(case["sizes"]), case["I"], case["O"], case["block"]
    E, N = sizes.shape[0], int(sizes.sum())
    x_recipe, w_recipe = GEMM_RECIPES[case["recipe"]]
    gen = torch.Generator().manual_seed(case["seed"])
    x, w = torch.randn(N, I, generator=gen), torch.randn(E, O, I, generator=gen) / I**0.5
    b = torch.randn(E, O, generator=gen) if case["bias"] else None
    with backend.use("reference"):
        x_q, x_s = mk.quantize_fp8(x, x_recipe, "e4m3", B)
        w_q, w_s = mk.quantize_fp8(w, w_recipe, "e4m3", B)
    got, want = both(lambda: (mk.grouped_mm_fp8(x_q, x_s, w_q, w_s, sizes, case["recipe"], B, b, case["out"]),))
    close(got, want, case["out"], "grouped_mm_fp8")


test_grouped_mm_fp8, test_grouped_mm_fp8_many = prop(fp8_gemm_cases(), examples=[
    dict(sizes=[0, 7, 0, 20], I=100, O=40, recipe="blockwise", block=16, bias=True, out=torch.bfloat16, seed=0),
    dict(sizes=[16], I=1, O=1, recipe="tensorwise", block=16, bias=False, out=torch.float32, seed=1),
])(check_grouped_mm_fp8)


def test_fp8_dgrad_through_transposed_views():
    """grouped_mm_fp8 on w_q.transpose(1, 2) and w_scale.transpose(-1, -2): the strided path."""
    sizes = torch.tensor([5, 0, 11])
    g, w = torch.randn(16, 48), torch.randn(3, 48, 40)
    with backend.use("reference"):
        g_q, g_s = mk.quantize_fp8(g, "tile", "e5m2", 16)
        w_q, w_s = mk.quantize_fp8(w, "block", "e4m3", 16)
    got, want = both(lambda: (mk.grouped_mm_fp8(g_q, g_s, w_q.transpose(1, 2), w_s.transpose(-1, -2), sizes,
                                                "blockwise", 16, None, torch.float32),))
    close(got, want, torch.float32, "dgrad")


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_fp8_grouped_linear_takes_no_rows(recipe):
    """A rank that dropless expert parallelism sends no rows: the quantize kernels' empty path."""
    from moecompile.kernels.fp8_linear import fp8_grouped_linear

    w = torch.randn(3, 24, 16, requires_grad=True)

    def run():
        x = torch.zeros(0, 16, requires_grad=True)
        hist = torch.zeros(3, 4) if recipe == "delayed" else None
        y = fp8_grouped_linear(x, w, torch.zeros(3, dtype=torch.int64), None, hist, recipe, "hybrid", 16)
        return (y, *torch.autograd.grad(y, (x, w), torch.zeros_like(y)))

    got, want = both(run)
    close(got, want, torch.float32, recipe)
    assert got[0].shape == (0, 24) and not got[2].any()


def test_moe_block_runs_on_triton_end_to_end():
    """route -> permute(align) -> grouped_mm -> weighted glu -> grouped_mm -> unpermute, all Triton."""
    T, E, K, H, Fh = 19, 6, 2, 24, 20
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen, requires_grad=True)
    router = torch.randn(E, H, generator=gen, requires_grad=True)
    w1 = (torch.randn(E, 2 * Fh, H, generator=gen) / H**0.5).requires_grad_()
    w2 = (torch.randn(E, H, Fh, generator=gen) / Fh**0.5).requires_grad_()

    def run():
        weights, idx = mk.route(x @ router.T, None, K, "softmax", True)
        x_NH, row_src, sizes, _ = mk.permute(x, idx, weights, E, 0, "position", 16)
        h = mk.glu(mk.grouped_mm(x_NH, w1, sizes), "silu", mk.row_weights(row_src, weights))
        out = mk.unpermute(mk.grouped_mm(h, w2, sizes), row_src, weights, T, False)
        return (out, *grads(out, (x, router, w1, w2), 0))
    got, want = both(run)
    close(got, want, torch.float32, "block")


# --------------------------------------------------------------- adamw_update (moecompile.AdamW's step)


@st.composite
def adamw_cases(draw):
    return dict(n=draw(st.integers(1, 3000)), param=draw(st.sampled_from(DTYPES)),
                moments=draw(st.sampled_from(DTYPES)), steps=draw(st.integers(1, 3)),
                beta1=draw(st.sampled_from([0.9, 0.0, 0.6])), weight_decay=draw(st.sampled_from([0.0, 0.1])),
                seed=draw(st.integers(0, 2**16)))


def check_adamw(case):
    """Steps of one tensor, its gradient in the parameter's dtype; moments and values compared after each."""
    gen = torch.Generator().manual_seed(case["seed"])
    n, beta2, lr, eps = case["n"], 0.999, 1e-2, 1e-8
    start = torch.randn(n, generator=gen).to(case["param"])
    grads_ = [torch.randn(n, generator=gen).to(case["param"]) for _ in range(case["steps"])]

    def run():
        p = start.clone()
        m, v = torch.zeros(n, dtype=case["moments"]), torch.zeros(n, dtype=case["moments"])
        for t, g in enumerate(grads_, 1):
            step = torch.tensor(float(t), dtype=torch.float64)
            mk.adamw_update(p, g, m, v, step, lr=lr, weight_decay=case["weight_decay"], beta1=case["beta1"],
                            beta2=beta2, eps=eps)
        return p, m, v
    (p, m, v), (p_r, m_r, v_r) = both(run)
    close((m, v), (m_r, v_r), case["moments"], "moments")
    if case["param"] == case["moments"] == torch.float32:  # one pass in fp32, IEEE division and square root
        torch.testing.assert_close(p, p_r, rtol=2e-6, atol=1e-7)
    elif case["param"] == torch.float32:  # a moment one bf16 ulp apart moves a later step's update by ~1 %
        torch.testing.assert_close(p, p_r, rtol=0, atol=case["steps"] * lr * 2e-2)
    else:
        close((p,), (p_r,), case["param"], "value")


test_adamw_update, test_adamw_update_many = prop(adamw_cases(), examples=[
    dict(n=1, param=torch.float32, moments=torch.float32, steps=1, beta1=0.9, weight_decay=0.0, seed=0),
    dict(n=1025, param=torch.bfloat16, moments=torch.bfloat16, steps=3, beta1=0.9, weight_decay=0.1, seed=1),
    dict(n=2000, param=torch.float32, moments=torch.bfloat16, steps=2, beta1=0.6, weight_decay=0.1, seed=2),
])(check_adamw)


def test_adamw_update_takes_the_reference_for_strided_tensors():
    g = torch.randn(8, 6)
    one = torch.tensor(1.0, dtype=torch.float64)

    def run():
        p, m, v = torch.randn(8, 6, generator=torch.Generator().manual_seed(0)), torch.zeros(6, 8).t(), \
            torch.zeros(6, 8).t()  # moments not contiguous
        mk.adamw_update(p, g, m, v, one, lr=1e-2, weight_decay=0.0, beta1=0.9, beta2=0.999, eps=1e-8)
        return p, m, v
    got, want = both(run)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the reference itself
