"""Side outputs: values a pass adds to what the graph returns (router losses, expert load).

The graph then returns ``(model_output, side)`` with ``side = {layer: {name: tensor}}``;
the driver splits the two again so the converted module is called exactly like the
dense model (see ``moecompile.stats``). Kept in ``gm.meta["moe_side_outputs"]``.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree

_KEY = "moe_side_outputs"


def side_output_names(gm: fx.GraphModule) -> dict[str, list[str]]:
    state = gm.meta.get(_KEY)
    return {layer: list(d) for layer, d in state["side"].items()} if state else {}


def add_side_outputs(gm: fx.GraphModule, layer: str, values: dict[str, fx.Node]) -> None:
    """Make the graph also return ``values`` under ``side[layer]`` (same names are replaced)."""
    graph = gm.graph
    out = graph.output_node()
    codegen = graph._codegen
    pytree_info = getattr(codegen, "pytree_info", None)
    state = gm.meta.get(_KEY)
    if state is None:
        flat = list(out.args[0]) if pytree_info is not None else [out.args[0]]
        state = {"n_orig": len(flat), "out_spec": pytree_info.out_spec if pytree_info else None, "side": {}}
        gm.meta[_KEY] = state
        orig = flat
    else:
        orig = list(out.args[0])[: state["n_orig"]] if pytree_info is not None else [out.args[0][0]]
    state["side"].setdefault(layer, {}).update({name: node.name for name, node in values.items()})
    by_name = {n.name: n for n in graph.nodes}
    side = {lay: {k: by_name[v] for k, v in d.items()} for lay, d in state["side"].items()}
    if pytree_info is None:
        out.args = ((orig[0], side),)
        return
    side_leaves, side_spec = pytree.tree_flatten(side)
    orig_example = pytree.tree_unflatten([0] * state["n_orig"], state["out_spec"])
    new_spec = pytree.tree_structure((orig_example, pytree.tree_unflatten([0] * len(side_leaves), side_spec)))
    out.args = (tuple(orig) + tuple(side_leaves),)
    codegen.pytree_info = pytree_info._replace(out_spec=new_spec)
    if hasattr(gm, "_out_spec"):
        gm._out_spec = new_spec


def split_outputs(gm: fx.GraphModule, output: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
    """``(model_output, side)`` from what the graph returned; side is empty for a dense graph."""
    if gm.meta.get(_KEY) is None:
        return output, {}
    return output[0], output[1]
