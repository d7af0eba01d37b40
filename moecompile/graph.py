"""IR helpers the passes share: module provenance, parameters, and counting.

Small and boring on purpose: anything more specific belongs in the pass that uses it.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn


def module_path(node: fx.Node) -> str:
    """The innermost module a node was traced from ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _type = list(stack.values())[-1]
    return clean_path(path)


def module_chain(node: fx.Node) -> list[str]:
    """Every module path enclosing the node, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [clean_path(p) for p, _t in stack.values() if clean_path(p)]


def common_module(nodes: list[fx.Node]) -> str:
    """The deepest module containing all the nodes (e.g. an FFN's ``...mlp``)."""
    chains = [module_chain(n) for n in nodes]
    common: list[str] = []
    for level in zip(*chains):
        if all(p == level[0] for p in level):
            common.append(level[0])
        else:
            break
    return common[-1] if common else ""


def clean_path(path: str) -> str:
    # export's nn_module_stack spells paths like "L['self'].model.layers[0]" in strict mode and
    # "model.layers.0" in non-strict; normalise both to dotted parameter-style names.
    path = path.replace("L['self'].", "").replace("L['self']", "")
    return path.replace("[", ".").replace("]", "").replace("'", "").strip(".")


def ancestors_within(nodes: Iterable[fx.Node], pool: set[fx.Node]) -> set[fx.Node]:
    """Every node of ``pool`` that ``nodes`` read, directly or through other nodes of ``pool``."""
    seen: set[fx.Node] = set()
    stack = [a for n in nodes for a in n.all_input_nodes if a in pool]
    while stack:
        a = stack.pop()
        if a not in seen:
            seen.add(a)
            stack.extend(x for x in a.all_input_nodes if x in pool)
    return seen


def get_attr_value(gm: fx.GraphModule, target: str) -> torch.Tensor:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    assert isinstance(obj, torch.Tensor), f"{target} is not a tensor"
    return obj


def add_parameter(gm: fx.GraphModule, name: str, value: torch.Tensor, requires_grad: bool = True) -> str:
    """Register ``value`` at dotted ``name`` (creating empty parent modules) and return the name."""
    *parents, leaf = name.split(".")
    owner: nn.Module = gm
    for part in parents:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    if value.is_floating_point() and requires_grad:
        owner.register_parameter(leaf, nn.Parameter(value.detach().clone(), requires_grad=True))
    else:
        owner.register_buffer(leaf, value.detach().clone())
    return name


def delete_unused_attrs(gm: fx.GraphModule, candidates: list[str]) -> list[str]:
    """Drop those of ``candidates`` (parameter/buffer names) no get_attr node reads any more."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    removed = []
    for name in candidates:
        if name in used:
            continue
        *parents, leaf = name.split(".")
        owner: nn.Module = gm
        for part in parents:
            owner = getattr(owner, part)
        owner._parameters.pop(leaf, None)
        owner._buffers.pop(leaf, None)
        removed.append(name)
    gm.delete_all_unused_submodules()
    return removed


def count_parameters(gm: nn.Module) -> int:
    return sum(p.numel() for p in gm.parameters())


def call(graph: fx.Graph, op: object, *args: object, **kwargs: object) -> fx.Node:
    return graph.call_function(op, args, kwargs)  # type: ignore[arg-type]


def trace_block(fn: Any, examples: dict[str, torch.Tensor]) -> fx.GraphModule:
    """Trace ``fn(**examples)`` to an ATen training-IR graph with symbolic shapes.

    Code inside ``torch.fx.traceback.annotate({...})`` leaves those keys in each
    node's ``meta["custom"]``; passes use it to stamp roles on the nodes they build.
    """
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    names = list(examples)

    def flat(*args: torch.Tensor) -> Any:
        return fn(**dict(zip(names, args)))

    # Without duck shaping every input dim gets its own symbol: a weight dim that happens to equal an
    # activation dim (E = 8 experts and a sequence of 8) must not stand in for it in the block's views.
    from torch.fx.experimental import _config as shape_config

    with fx_traceback.preserve_node_meta(), shape_config.patch(use_duck_shape=False):
        return make_fx(flat, tracing_mode="symbolic", pre_dispatch=True)(*[t.detach() for t in examples.values()])


def inline(graph: fx.Graph, block: fx.GraphModule, inputs: list[fx.Node], anchor: fx.Node) -> Any:
    """Copy ``block``'s nodes in before ``anchor``, its placeholders bound to ``inputs``.

    Returns the block's output with every value mapped to the new nodes.
    """
    placeholders = [n for n in block.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(inputs), (len(placeholders), len(inputs))
    with graph.inserting_before(anchor):
        return graph.graph_copy(block.graph, dict(zip(placeholders, inputs)))
