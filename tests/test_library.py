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
