"""Options added to the op vocabulary (permute's align, glu's routing weight), the backward ops, and
backend selection; CPU reference path. Oracles are naive and share no code with the kernels.

Legend: T tokens, K top-k, E experts, H hidden, N permuted rows, F FFN width.
"""
import pytest
import torch

import moecompile.kernels as mk
from moecompile.errors import KernelError
from moecompile.kernels import backend

ops = torch.ops.moecompile
F64 = torch.float64


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def naive_padded_rows(idx_TK, E, align):
    """Dropless rows, each expert's block padded with -1 to a multiple of align, slack to the last."""
    flat = idx_TK.flatten().tolist()
    T, K = idx_TK.shape
    blocks = [[a for a in range(len(flat)) if flat[a] == e] for e in range(E)]
    blocks = [b + [-1] * (-len(b) % align) for b in blocks]
    N = -(-(T * K + E * (align - 1)) // align) * align
    blocks[-1] += [-1] * (N - sum(map(len, blocks)))
    return [a for b in blocks for a in b], [len(b) for b in blocks]


@pytest.mark.parametrize("T,E,K,align", [(7, 4, 2, 4), (5, 3, 3, 16), (1, 5, 1, 2), (9, 2, 1, 3)])
def test_permute_align_dropless(T, E, K, align):
    x, w = torch.randn(T, 6), torch.rand(T, K)
    idx = torch.rand(T, E).topk(K, -1).indices
    idx[:, 0] = idx[:, 0].clamp(max=E - 2) if E > K else idx[:, 0]  # leave some experts light
    x_NH, row_src, sizes, load = mk.permute(x, idx, w, E, 0, "position", align)
    want_rows, want_sizes = naive_padded_rows(idx, E, align)
    assert row_src.tolist() == want_rows and sizes.tolist() == want_sizes
    assert all(s % align == 0 for s in want_sizes) and sum(want_sizes) == x_NH.shape[0]
    assert load.tolist() == torch.bincount(idx.flatten(), minlength=E).tolist()
    for r, a in enumerate(want_rows):
        assert torch.equal(x_NH[r], x[a // K] if a >= 0 else torch.zeros(6))
    # the padded layout combines back to the same tokens
    torch.testing.assert_close(mk.unpermute(x_NH, row_src, w, T), (x.unsqueeze(1) * w.unsqueeze(2)).sum(1))


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_permute_align_with_capacity_rounds_capacity_up(policy):
    x, w = torch.randn(9, 4), torch.rand(9, 2)
    idx = torch.rand(9, 3).topk(2, -1).indices
    got = mk.permute(x, idx, w, 3, 3, policy, 4)
    want = mk.permute(x, idx, w, 3, 4, policy)
    for g, r in zip(got, want):
        assert torch.equal(g, r)


def test_permute_align_grad_skips_padding():
    x = torch.randn(5, 3, dtype=F64, requires_grad=True)
    idx, w = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0], [1, 2]]), torch.rand(5, 2, dtype=F64)
    assert torch.autograd.gradcheck(lambda x: mk.permute(x, idx, w, 4, 0, "position", 8)[0], (x,))


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_glu_weight_multiplies_rows(act):
    h, wt = torch.randn(6, 10), torch.rand(6)
    torch.testing.assert_close(mk.glu(h, act, wt), mk.glu(h, act) * wt[:, None])
    h3, w3 = torch.randn(2, 3, 8), torch.rand(2, 3)
    torch.testing.assert_close(mk.glu(h3, act, w3), mk.glu(h3, act) * w3[..., None])


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_gradcheck_glu_weight(act):
    h = torch.randn(5, 8, dtype=F64)
    h = (h + 0.1 * h.sign()).requires_grad_()
    wt = torch.rand(5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h, wt: mk.glu(h, act, wt), (h, wt))


def test_weighted_glu_block_equals_weighted_combine():
    """Routing weight folded into the GLU, unweighted combine: same output and grads."""
    T, E, K, H, Fh = 6, 4, 2, 5, 3
    x = torch.randn(T, H, dtype=F64)
    w1, w2 = torch.randn(E, 2 * Fh, H, dtype=F64), torch.randn(E, H, Fh, dtype=F64)
    logits = torch.randn(T, E, dtype=F64, requires_grad=True)

    def block(fused):
        wts, idx = mk.route(logits, None, K, "softmax", True)
        x_NH, row_src, sizes, _ = mk.permute(x, idx, wts, E, 0, "position", 4)
        h = mk.grouped_mm(x_NH, w1, sizes)
        if fused:
            w_N = torch.where(row_src >= 0, wts.reshape(-1)[row_src.clamp(min=0)], 0)
            y = mk.grouped_mm(mk.glu(h, "silu", w_N), w2, sizes)
            return mk.unpermute(y, row_src, torch.ones_like(wts), T)
        return mk.unpermute(mk.grouped_mm(mk.glu(h, "silu"), w2, sizes), row_src, wts, T)

    out_f = block(True)
    (g_f,) = torch.autograd.grad(out_f.sum(), logits)
    out_u = block(False)
    (g_u,) = torch.autograd.grad(out_u.sum(), logits)
    torch.testing.assert_close(out_f, out_u)
    torch.testing.assert_close(g_f, g_u)


def _opcheck_cases():
    torch.manual_seed(0)
    rg = dict(requires_grad=True)
    x, w = torch.randn(5, 6, **rg), torch.rand(5, 2)
    idx = torch.tensor([[0, 1], [2, 1], [0, 3], [1, 2], [3, 0]])
    _, row_src, _, _ = mk.permute(x.detach(), idx, w, 4, 0, "position", 4)
    yield "permute", (x, idx, w, 4, 0, "position", 4)
    yield "permute", (x, idx, w, 4, 3, "probs", 2)
    yield "glu", (torch.randn(6, 10, **rg), "silu", torch.rand(6, **rg))
    yield "glu", (torch.randn(2, 3, 4, **rg), "gelu", torch.rand(2, 3, **rg))
    logits = torch.randn(5, 4)
    wts, ix = mk.route(logits, None, 2, "sigmoid", True)
    yield "route_backward", (torch.randn(5, 2), logits, wts, ix, "sigmoid", True)
    yield "permute_backward", (torch.randn(row_src.shape[0], 6), row_src, 5, 2)
    yield "unpermute_backward", (torch.randn(5, 6), torch.randn(row_src.shape[0], 6), row_src, w)
    yield "glu_backward", (torch.randn(6, 5), torch.randn(6, 10), "gelu_tanh", torch.rand(6))
    yield "glu_backward", (torch.randn(6, 5), torch.randn(6, 10), "relu", None)


@pytest.mark.parametrize("name,args", list(_opcheck_cases()), ids=lambda v: v if isinstance(v, str) else "-")
def test_opcheck(name, args):
    torch.library.opcheck(getattr(ops, name).default, args)


def test_backend_choice_scopes_and_validates():
    assert backend.choice() in backend.CHOICES
    with backend.use("reference"):
        assert backend.choice() == "reference"
        assert backend.implementation("permute", torch.device("cpu")) is mk.permute_ref
        with backend.use("auto"):
            assert backend.choice() == "auto"
        assert backend.choice() == "reference"
    with pytest.raises(KernelError, match="'fast'"):
        with backend.use("fast"):
            pass
    with pytest.raises(KernelError, match="no kernel registered"):
        backend.implementation("softmax", torch.device("cpu"))
    assert set(backend.registered()) >= {"route", "permute", "grouped_mm", "grouped_mm_wgrad", "glu", "unpermute",
                                         "quantize_fp8", "grouped_mm_fp8", "adamw_update"}
    assert all(backend.registered().values())  # every op has a Triton body


def test_auto_runs_reference_on_cpu():
    with backend.use("auto"):
        assert backend.implementation("glu", torch.device("cpu")) is mk.glu_ref


def test_auto_runs_an_ops_host_body_on_cpu_and_reference_forces_the_formula():
    from moecompile.kernels.adamw import adamw_update_host

    cpu = torch.device("cpu")
    with backend.use("auto"):
        assert backend.implementation("adamw_update", cpu) is adamw_update_host
    with backend.use("reference"):
        assert backend.implementation("adamw_update", cpu) is mk.adamw_update_ref


def test_forcing_triton_on_cpu_without_interpreter_says_how(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(backend, "_INTERPRETED", {})
    with backend.use("triton"), pytest.raises(KernelError, match="TRITON_INTERPRET=1"):
        mk.glu(torch.randn(2, 4))


def test_gpu_benchmark_says_so_without_cuda(capsys):
    import importlib.util
    import pathlib

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark would run for real")
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "kernels_gpu.py"
    spec = importlib.util.spec_from_file_location("kernels_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_env_var_is_read_once_and_validated(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "Reference")
    backend._env_choice.cache_clear()
    try:
        assert backend.choice() == "reference"
        monkeypatch.setenv(backend.ENV_VAR, "triton")
        assert backend.choice() == "reference"  # read once: later changes don't leak in mid-run
        monkeypatch.setenv(backend.ENV_VAR, "cuda")
        backend._env_choice.cache_clear()
        with pytest.raises(KernelError, match="MOECOMPILE_KERNELS = 'cuda'"):
            backend.choice()
    finally:
        monkeypatch.undo()
        backend._env_choice.cache_clear()
