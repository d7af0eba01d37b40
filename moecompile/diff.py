"""``moecompile.diff(result, "upcycle")``: what a pass changed, as a diff of the graph.

Two views of the same change::

    print(mc.diff(result, "upcycle"))                 # unified diff of the generated Python
    print(mc.diff(result, "upcycle", mode="nodes"))   # node by node, with shapes and roles

    ~ 2 changed, +62 added, -16 removed (223 -> 269 nodes)
    - linear_4 = aten.linear.default(mul_9, model_layers_0_mlp_gate_proj_weight)  [2, 8, 64] float32
    + route = moecompile.route.default(linear_16, None, 2, 'softmax', True)  (tuple)  role=route layer=model.layers.0.mlp

The "before" graph is the record of the pass that ran just before (or ``before=``).
"""

from __future__ import annotations

import difflib
import enum
from typing import Any, Literal

import torch
import torch.fx as fx

from .errors import MoecompileError
from .history import PassRecord


def _records(result_or_history: Any) -> list[PassRecord]:
    return list(getattr(result_or_history, "history", result_or_history))


def _pair(history: list[PassRecord], pass_name: str, before: str | None) -> tuple[PassRecord, PassRecord]:
    names = [r.name for r in history]
    if pass_name not in names:
        raise MoecompileError(f"no pass named {pass_name!r} ran; ran: {', '.join(names)}")
    i = names.index(pass_name)
    if before is None:
        if i == 0:
            raise MoecompileError(f"{pass_name!r} is the first record; nothing ran before it to diff against")
        return history[i - 1], history[i]
    if before not in names:
        raise MoecompileError(f"before={before!r} is not in the history; ran: {', '.join(names)}")
    return history[names.index(before)], history[i]


def _short(value: Any) -> str:
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_short(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def describe_value(val: Any) -> str:
    """``[2, 8, 32] float32`` for a tensor, ``(tuple of 4)`` for several outputs."""
    if isinstance(val, torch.Tensor):
        return f"{list(val.shape)} {str(val.dtype).replace('torch.', '')}"
    if isinstance(val, (tuple, list)):
        return f"(tuple of {len(val)})"
    if val is None:
        return ""
    return type(val).__name__


def describe_node(node: fx.Node) -> str:
    """One line: ``name = target(args)  shape dtype  role=... layer=...``."""
    args = ", ".join([_short(a) for a in node.args] + [f"{k}={_short(v)}" for k, v in node.kwargs.items()])
    if node.op == "call_function":
        call = f"{node.target}({args})" if hasattr(node.target, "_schema") else f"{getattr(node.target, '__name__', node.target)}({args})"
    elif node.op == "get_attr":
        call = f"get_attr {node.target}"
    elif node.op == "output":
        call = f"output({args})"
    else:
        call = f"{node.op} {node.target}" + (f"({args})" if args else "")
    line = f"{node.name} = {call}"
    shape = describe_value(node.meta.get("val"))
    if shape:
        line += f"  {shape}"
    moe = node.meta.get("moe") or {}
    tags = [f"{k}={moe[k]}" for k in ("role", "layer", "chunk", "group") if k in moe]
    return line + ("  " + " ".join(tags) if tags else "")


def _changes(a: fx.Node, b: fx.Node) -> list[str]:
    what = []
    if str(a.target) != str(b.target):
        what.append(f"target {a.target} -> {b.target}")
    if _short(tuple(a.args)) != _short(tuple(b.args)) or _short(a.kwargs) != _short(b.kwargs):
        what.append("inputs " + _short(tuple(a.args)) + " -> " + _short(tuple(b.args)))
    if describe_value(a.meta.get("val")) != describe_value(b.meta.get("val")):
        what.append(f"value {describe_value(a.meta.get('val'))} -> {describe_value(b.meta.get('val'))}")
    ma, mb = a.meta.get("moe") or {}, b.meta.get("moe") or {}
    for key in sorted(set(ma) | set(mb)):
        if str(ma.get(key)) != str(mb.get(key)):
            what.append(f"moe.{key} {_short(ma.get(key))} -> {_short(mb.get(key))}")
    return what


def node_diff(before: fx.Graph, after: fx.Graph, context: int = 0) -> str:
    """Node-by-node diff: ``-`` removed, ``+`` added, ``~`` same name but changed (and what changed)."""
    a_nodes, b_nodes = list(before.nodes), list(after.nodes)
    keys = lambda nodes: [(n.name, str(n.target)) if n.op != "output" else ("output", "") for n in nodes]  # noqa: E731
    matcher = difflib.SequenceMatcher(a=keys(a_nodes), b=keys(b_nodes), autojunk=False)
    lines: list[str] = []
    added = removed = changed = 0
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            unchanged = 0
            for a, b in zip(a_nodes[i1:i2], b_nodes[j1:j2]):
                what = _changes(a, b)
                if what:
                    if unchanged:
                        lines.append(f"  ... {unchanged} unchanged")
                        unchanged = 0
                    changed += 1
                    lines.append(f"~ {b.name}: " + "; ".join(what))
                elif context:
                    lines.append(f"  {describe_node(b)}")
                else:
                    unchanged += 1
            if unchanged:
                lines.append(f"  ... {unchanged} unchanged")
            continue
        for a in a_nodes[i1:i2]:
            lines.append(f"- {describe_node(a)}")
            removed += 1
        for b in b_nodes[j1:j2]:
            lines.append(f"+ {describe_node(b)}")
            added += 1
    head = f"~ {changed} changed, +{added} added, -{removed} removed ({len(a_nodes)} -> {len(b_nodes)} nodes)"
    return "\n".join([head, *lines])


def diff(
    result: Any,
    pass_name: str,
    mode: Literal["code", "nodes"] = "code",
    *,
    before: str | None = None,
    context: int | None = None,
) -> str:
    """The graph before and after ``pass_name``: a unified diff of the code, or node by node.

    ``result`` is a ConversionResult (or its history); ``before`` picks another record to
    compare against; ``context``: the unified diff's context lines (default 3); in nodes
    mode, nonzero lists unchanged nodes too (default: they are counted, not listed).
    """
    a, b = _pair(_records(result), pass_name, before)
    if mode == "code":
        lines = difflib.unified_diff(
            a.code.strip("\n").splitlines(), b.code.strip("\n").splitlines(),
            fromfile=f"after {a.name}", tofile=f"after {b.name}", n=3 if context is None else context, lineterm="",
        )
        text = "\n".join(lines)
        return text or f"# {b.name} left the generated code exactly as {a.name} did"
    if mode == "nodes":
        if a.graph is None or b.graph is None:
            raise MoecompileError(f"records {a.name!r}/{b.name!r} hold no graph copy; node diff needs PassRecord.graph")
        return node_diff(a.graph, b.graph, context=context or 0)
    raise MoecompileError(f"unknown diff mode {mode!r}; use 'code' or 'nodes'")
