"""kernels/library.py's `op`: an ordinary operator to every tracer, a cheap one to eager autograd."""
import importlib

import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

library = importlib.import_module("moecompile.kernels.library")
CALLS: list[str] = []


@library.op("moecompile_test::scale_top")
def scale_top(x: Tensor, k: int = 1, factor: float = 2.0) -> tuple[Tensor, Tensor]:
    """(x * factor, indices of the k largest): a float output with a grad and an integer one without."""
    CALLS.append("forward")
    return x * factor, x.topk(k).indices


@scale_top.register_fake
def _scale_top_fake(x, k=1, factor=2.0):
    return torch.empty_like(x), x.new_empty((k,), dtype=torch.int64)


def _setup(ctx, inputs, output):
    ctx.factor = inputs[2]  # the default, restored though the dispatcher leaves it out


def _backward(ctx, grad_y, grad_idx):
    CALLS.append("backward")
    return grad_y * ctx.factor, None, None


scale_top.register_autograd(_backward, setup_context=_setup)


def test_forward_backward_with_defaults_and_integer_output():
    x = torch.randn(5, requires_grad=True)
    CALLS.clear()
    y, idx = scale_top(x)
    assert y.requires_grad and not idx.requires_grad and idx.dtype == torch.int64
    y.sum().backward()
    assert CALLS == ["forward", "backward"]
    torch.testing.assert_close(x.grad, torch.full((5,), 2.0))
    x.grad = None
    torch.ops.moecompile_test.scale_top.default(x, 2, 3.0)[0].sum().backward()
    torch.testing.assert_close(x.grad, torch.full((5,), 3.0))


def test_no_grad_needed_builds_no_graph():
    with torch.no_grad():
        assert scale_top(torch.randn(3, requires_grad=True))[0].grad_fn is None
    assert scale_top(torch.randn(3))[0].grad_fn is None  # grad on, but no input needs it


def test_opcheck_and_traces_as_one_node():
    torch.library.opcheck(torch.ops.moecompile_test.scale_top.default, (torch.randn(4, requires_grad=True), 2, 0.5))
    gm = make_fx(lambda x: scale_top(x, 2)[0], tracing_mode="fake")(torch.randn(4))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.moecompile_test.scale_top.default) == 1


@library.op("moecompile_test::matmul_fp32")
def matmul_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b in float32, whatever autocast says outside: an op's body sets its own precision."""
    return a @ b


@matmul_fp32.register_fake
def _matmul_fp32_fake(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


def test_the_body_runs_without_autocast_as_under_a_dispatch_mode_or_on_a_triton_kernel():
    """Autocast casts an op's inputs at its boundary (where registered); inside, the body's aten ops were cast
    again (an FP8 GEMM's float32 accumulation came out in bf16), and not under a TorchDispatchMode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    a, b = torch.randn(8, 64), torch.randn(64, 8)
    want = a @ b
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = matmul_fp32(a, b)
        with Passthrough():
            moded = matmul_fp32(a, b)
        assert (a @ b).dtype == torch.bfloat16  # autocast is on, outside the op
    assert got.dtype == torch.float32 and torch.equal(got, want) and torch.equal(moded, want)


def test_compile_caches_are_keyed_on_the_kernels_source():
    """torch.compile's on-disk caches do not hash the ops' autograd formulas; the package's tag does."""
    import hashlib
    import pathlib
    import re

    import torch.compiler.config as compile_config

    folder = pathlib.Path(library.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py"), key=lambda p: p.name):
        digest.update(path.name.encode() + path.read_bytes())
    assert re.fullmatch(r"moecompile-kernels-[0-9a-f]{16}", library.CACHE_TAG)
    assert library.CACHE_TAG == f"moecompile-kernels-{digest.hexdigest()[:16]}"
    assert library.CACHE_TAG in compile_config.cache_key_tag.split("+")
    assert library._tag_compile_caches() == library.CACHE_TAG  # idempotent: tagged once
    assert compile_config.cache_key_tag.split("+").count(library.CACHE_TAG) == 1
