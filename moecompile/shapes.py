"""Fake-tensor shape propagation: every node's ``meta["val"]`` without running the model."""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch._subclasses import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp


class ShapePropError(RuntimeError):
    def __init__(self, node: fx.Node, cause: BaseException):
        self.node = node
        super().__init__(f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}")


class _NodeNamingProp(FakeTensorProp):
    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except ShapePropError:
            raise
        except Exception as e:
            raise ShapePropError(n, e) from e


def propagate_fake(gm: fx.GraphModule, inputs: list[Any]) -> None:
    """Fill ``meta["val"]`` on every node from the example inputs (real tensors are faked).

    Input shapes stay static; the ShapeEnv gives data-dependent sizes (a dropless dispatch's
    per-rank token counts) unbacked SymInts. Each run mints its own, so old bindings are dropped.
    """
    for n in gm.graph.nodes:
        n.meta.pop("unbacked_bindings", None)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    _NodeNamingProp(gm, mode).propagate(*inputs)
