"""FP8 ops (quantize_fp8, grouped_mm_fp8): the CPU reference against naive loops and torch._scaled_mm.

Legend: R rows, C columns, B block, E experts, N rows, I in, O out.
"""
import math

import pytest
import torch
from torch._subclasses import FakeTensorMode

import moecompile.kernels as mk
from moecompile.kernels.fp8_quantize import FORMATS, fp8_max

ops = torch.ops.moecompile


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _tile(recipe, R, C, block):
    return {"tensorwise": (R, C), "rowwise": (1, C), "tile": (1, block), "block": (block, block)}[recipe]


def naive_amax(x, recipe, block):
    """One amax per tile, by explicit loops over tile corners."""
    R, C = x.shape
    tr, tc = _tile(recipe, R, C, block)
    out = torch.empty(math.ceil(R / tr), math.ceil(C / tc))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = x[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc].abs().max().float()
    return out


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_gemms_accumulate_in_float32_under_bf16_autocast(recipe):
    """On CPU ``_scaled_mm`` is a bf16 ``mm`` under autocast: the bf16 training step's FP8 GEMMs came out rounded
    to bf16 (and, under a CUDA-graph capture's dispatch mode, did not), until op bodies ran with autocast off."""
    import moecompile.kernels.fp8_linear  # noqa: F401  (defines the fp8 linear ops)

    x, w = torch.randn(32, 64), torch.randn(48, 64)
    want = ops.fp8_linear(x, w, None, None, recipe, "hybrid", 16)[0]
    sizes = torch.tensor([20, 12])
    want_grouped = ops.fp8_grouped_linear(x, w.view(2, 24, 64), sizes, None, None, recipe, "hybrid", 16)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ops.fp8_linear(x, w, None, None, recipe, "hybrid", 16)[0]
        grouped = ops.fp8_grouped_linear(x, w.view(2, 24, 64), sizes, None, None, recipe, "hybrid", 16)[0]
    assert torch.equal(got, want) and torch.equal(grouped, want_grouped)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "tile", "block"])
@pytest.mark.parametrize("R,C", [(5, 40), (33, 16), (1, 7)])
def test_quantize_scales_and_error_bound(R, C, recipe, fmt):
    x = (torch.randn(R, C) * torch.logspace(-3, 3, C)).to(torch.bfloat16)
    q, scale = mk.quantize_fp8(x, recipe, fmt, 16)
    assert q.dtype == FORMATS[fmt] and q.shape == x.shape and scale.dtype == torch.float32
    fmax, (tr, tc) = fp8_max(fmt), _tile(recipe, R, C, 16)
    want = naive_amax(x, recipe, 16).clamp(min=1e-12) / fmax
    torch.testing.assert_close(scale.reshape(want.shape), want, rtol=1e-6, atol=0)
    # every element within half an fp8 ulp (relative), or half the smallest subnormal step
    mantissa = 3 if fmt == "e4m3" else 2
    min_exp = -6 if fmt == "e4m3" else -14
    s = torch.tensor([[float(want[i // tr, j // tc]) for j in range(C)] for i in range(R)])
    bound = x.float().abs() * 2.0 ** -(mantissa + 1) + s * 2.0 ** (min_exp - mantissa - 1)
    deq = mk.dequantize_fp8(q, scale, recipe, 16)
    assert bool(((deq - x.float()).abs() <= bound).all())
    # the element at a tile's amax lands exactly on +-fp8_max
    assert float(q.float().abs().max()) == fmax


def test_scale_layouts_are_what_scaled_mm_takes():
    x, w = torch.randn(48, 64), torch.randn(3, 32, 64)
    _, s_tile = mk.quantize_fp8(x, "tile", "e4m3", 16)
    assert s_tile.shape == (48, 4) and s_tile.stride() == (1, 48)  # BlockWise1x128: outer-dim-major
    _, s_block = mk.quantize_fp8(w, "block", "e4m3", 16)
    assert s_block.shape == (3, 2, 4) and s_block.is_contiguous()  # BlockWise128x128: row-major
    _, s_row = mk.quantize_fp8(w, "rowwise", "e4m3", 16)
    assert s_row.shape == (3, 32, 1)
    _, s_t = mk.quantize_fp8(w, "tensorwise", "e4m3", 0)
    assert s_t.shape == (3,)
    _, s_0 = mk.quantize_fp8(x, "tensorwise", "e4m3", 0)
    assert s_0.shape == ()


def test_all_zero_tile_quantizes_to_zero():
    x = torch.zeros(4, 32)
    x[0, 20] = 3.0
    q, scale = mk.quantize_fp8(x, "tile", "e4m3", 16)
    assert torch.equal(q.float()[1:], torch.zeros(3, 32)) and bool((scale > 0).all())
    assert float(q.float()[0, 20]) == 448.0


def _cpu_scaled_mm_takes_row_scales() -> bool:
    """torch 2.11 on the CPU takes only tensorwise scales (an internal assert otherwise)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_grouped_mm_fp8_matches_scaled_mm_per_group(recipe):
    if recipe == "rowwise" and not _cpu_scaled_mm_takes_row_scales():
        pytest.skip(f"the oracle, torch._scaled_mm with row scales, is not on the CPU in torch {torch.__version__}")
    sizes = torch.tensor([3, 0, 5, 2])
    x, w = torch.randn(10, 32), torch.randn(4, 24, 32)
    x_q, x_s = mk.quantize_fp8(x, recipe, "e4m3", 0)
    w_q, w_s = mk.quantize_fp8(w, recipe, "e4m3", 0)
    y = mk.grouped_mm_fp8(x_q, x_s, w_q, w_s, sizes, recipe, 0, None, torch.float32)
    start = 0
    for e, n in enumerate(sizes.tolist()):
        rows = slice(start, start + n)
        sx = x_s if recipe == "tensorwise" else x_s[rows].contiguous()
        sw = w_s[e] if recipe == "tensorwise" else w_s[e].t().contiguous()
        want = torch._scaled_mm(x_q[rows], w_q[e].t(), sx, sw, out_dtype=torch.float32)
        torch.testing.assert_close(y[rows], want, rtol=1e-5, atol=1e-4)
        start += n


@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_mm_fp8_blockwise_matches_naive(with_bias):
    B, sizes = 16, torch.tensor([0, 7, 1, 12])
    x, w = torch.randn(20, 40), torch.randn(4, 24, 40)
    b = torch.randn(4, 24) if with_bias else None
    x_q, x_s = mk.quantize_fp8(x, "tile", "e4m3", B)
    w_q, w_s = mk.quantize_fp8(w, "block", "e4m3", B)
    y = mk.grouped_mm_fp8(x_q, x_s, w_q, w_s, sizes, "blockwise", B, b, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (20, 24)
    want, start = [], 0
    for e, n in enumerate(sizes.tolist()):
        for r in range(start, start + n):
            xr = torch.stack([x_q[r, i].float() * x_s[r, i // B] for i in range(40)])
            we = torch.stack([torch.stack([w_q[e, o, i].float() * w_s[e, o // B, i // B] for i in range(40)])
                              for o in range(24)])
            want.append(we @ xr + (0 if b is None else b[e]))
        start += n
    torch.testing.assert_close(y.float(), torch.stack(want), rtol=1e-2, atol=1e-2)
    # fp8 rounding only: close to the unquantized product
    dense = torch.cat([x[s:s + n] @ w[e].T for e, (s, n) in
                       enumerate(zip((torch.cumsum(sizes, 0) - sizes).tolist(), sizes.tolist()))])
    if b is not None:
        dense = dense + b[torch.repeat_interleave(torch.arange(4), sizes)]
    assert float((y.float() - dense).norm() / dense.norm()) < 0.08


def test_grouped_mm_fp8_transposed_weight_gives_input_grad():
    """dgrad: grad_y @ w[e] through the same op on transposed views."""
    B, sizes = 16, torch.tensor([5, 0, 3])
    g, w = torch.randn(8, 32), torch.randn(3, 32, 48)  # w [E, O=32, I=48]; g [N, O]
    g_q, g_s = mk.quantize_fp8(g, "tile", "e5m2", B)
    w_q, w_s = mk.quantize_fp8(w, "block", "e4m3", B)
    dx = mk.grouped_mm_fp8(g_q, g_s, w_q.transpose(1, 2), w_s.transpose(-1, -2), sizes, "blockwise", B,
                           None, torch.float32)
    w_deq = mk.dequantize_fp8(w_q, w_s, "block", B)
    g_deq = mk.dequantize_fp8(g_q, g_s, "tile", B)
    want = torch.cat([g_deq[:5] @ w_deq[0], g_deq[5:8] @ w_deq[2]])
    torch.testing.assert_close(dx, want, rtol=1e-5, atol=1e-4)


def _opcheck_cases():
    torch.manual_seed(0)
    sizes = torch.tensor([2, 0, 4])
    x, w = torch.randn(6, 32), torch.randn(3, 16, 32)
    for recipe, xr, wr in [("tensorwise", "tensorwise", "tensorwise"), ("rowwise", "rowwise", "rowwise"),
                           ("blockwise", "tile", "block")]:
        yield "quantize_fp8", (x, xr, "e4m3", 16)
        yield "quantize_fp8", (w, wr, "e5m2", 16)
        xq, xs = mk.quantize_fp8(x, xr, "e4m3", 16)
        wq, ws = mk.quantize_fp8(w, wr, "e4m3", 16)
        yield "grouped_mm_fp8", (xq, xs, wq, ws, sizes, recipe, 16, torch.randn(3, 16), torch.bfloat16)


@pytest.mark.parametrize("name,args", list(_opcheck_cases()), ids=lambda v: v if isinstance(v, str) else "-")
def test_opcheck(name, args):
    # test_schema compares float8 inputs before/after with ops float8 lacks on CPU
    utils = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(getattr(ops, name).default, args,
                          test_utils=utils if name == "grouped_mm_fp8" else utils + ("test_schema",))


def test_fake_shapes():
    with FakeTensorMode():
        q, s = ops.quantize_fp8(torch.empty(7, 300, dtype=torch.bfloat16), "tile", "e4m3", 128)
        assert (q.shape, q.dtype, s.shape, s.stride()) == ((7, 300), torch.float8_e4m3fn, (7, 3), (1, 7))
        wq, ws = ops.quantize_fp8(torch.empty(4, 256, 300), "block", "e4m3", 128)
        assert ws.shape == (4, 2, 3)
        y = ops.grouped_mm_fp8(q, s, wq, ws, torch.empty(4, dtype=torch.int64), "blockwise", 128, None,
                               torch.bfloat16)
        assert (y.shape, y.dtype) == ((7, 256), torch.bfloat16)


@pytest.mark.parametrize("call,match", [
    (lambda: mk.quantize_fp8(torch.randn(4, 4), "channelwise"), "channelwise"),
    (lambda: mk.quantize_fp8(torch.randn(4, 4), "tile", "e4m3", 100), "power of two"),
    (lambda: mk.quantize_fp8(torch.randn(4, 4), "tensorwise", "e3m4"), "e3m4"),
    (lambda: mk.quantize_fp8(torch.randn(4), "tensorwise"), r"\(4,\)"),
    (lambda: mk.quantize_fp8(torch.randn(4, 4).to(torch.float8_e4m3fn), "tensorwise"), "float8"),
    (lambda: mk.grouped_mm_fp8(*mk.quantize_fp8(torch.randn(4, 32), "tensorwise"),
                               *mk.quantize_fp8(torch.randn(2, 8, 32), "rowwise"), torch.tensor([2, 2]),
                               "tensorwise"), r"w_scale float32 of shape \(2,\)"),
    (lambda: mk.grouped_mm_fp8(torch.randn(4, 32), torch.tensor(1.0), torch.randn(2, 8, 32), torch.ones(2),
                               torch.tensor([2, 2])), "float8"),
])
def test_user_mistakes_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
