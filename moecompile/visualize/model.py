"""The graph as the pictures see it: nodes, module groups, edges and role colours.

Both renderers (interactive HTML, graphviz SVG/PNG/DOT) draw the same :class:`GraphView`,
so a node has the same group, colour and label in either picture. Groups come from
``nn_module_stack`` (layers, attention, MoE blocks); a parameter (``get_attr``) joins
its module's group, or its first user's. Colours come from ``meta["moe"]["role"]``;
a functional collective without a role is coloured as a collective start / wait.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from typing import Any, Iterable

import torch
import torch.fx as fx

from ..costs import collective_kind, is_recomputed
from ..errors import MoecompileError
from ..graph import clean_path
from ..meta import Role

# One colour per Role (fill), and for nodes without one, by op kind.
ROLE_COLORS: dict[str, str] = {
    Role.FFN.value: "#fde68a",
    Role.ROUTER.value: "#fca5a5",
    Role.ROUTE.value: "#f9a8d4",
    Role.ROUTER_LOSS.value: "#fbcfe8",
    Role.PERMUTE.value: "#c4b5fd",
    Role.DISPATCH.value: "#93c5fd",
    Role.EXPERTS.value: "#86efac",
    Role.EXPERT_ACT.value: "#bbf7d0",
    Role.COMBINE_COMM.value: "#7dd3fc",
    Role.COMBINE.value: "#a5b4fc",
    Role.SHARED_EXPERTS.value: "#5eead4",
    Role.COLLECTIVE_START.value: "#3b82f6",
    Role.COLLECTIVE_WAIT.value: "#fb923c",
    Role.FP8_CAST.value: "#e879f9",
    Role.RECOMPUTE.value: "#fef08a",
}
OP_COLORS: dict[str, str] = {
    "placeholder": "#bae6fd",
    "get_attr": "#e5e7eb",
    "output": "#9ca3af",
    "call_function": "#ffffff",
    "call_module": "#f5f5f4",
    "call_method": "#ffffff",
}
ROLE_DESCRIPTIONS: dict[str, str] = {
    Role.FFN.value: "dense FFN (found)",
    Role.ROUTER.value: "router logits",
    Role.ROUTE.value: "top-k routing",
    Role.ROUTER_LOSS.value: "router losses",
    Role.PERMUTE.value: "permute by expert",
    Role.DISPATCH.value: "dispatch (tokens out)",
    Role.EXPERTS.value: "expert GEMMs",
    Role.EXPERT_ACT.value: "expert activation",
    Role.COMBINE_COMM.value: "combine (tokens back)",
    Role.COMBINE.value: "combine / unpermute",
    Role.SHARED_EXPERTS.value: "shared experts",
    Role.COLLECTIVE_START.value: "collective start",
    Role.COLLECTIVE_WAIT.value: "collective wait",
    Role.FP8_CAST.value: "FP8 cast",
    Role.RECOMPUTE.value: "recompute region",
}


def color_of(role: str | None, op: str) -> str:
    return ROLE_COLORS.get(role or "", OP_COLORS.get(op, "#ffffff"))


def ink_of(fill: str) -> str:
    """Text colour that reads on ``fill``: white on dark fills, near-black otherwise."""
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#ffffff" if 0.299 * r + 0.587 * g + 0.114 * b < 140 else "#111827"


@dataclasses.dataclass
class ViewNode:
    id: int
    name: str
    op: str
    target: str
    label: str  # what the box says: op or parameter name
    detail: str  # second line: shape and dtype
    group: int  # index into GraphView.groups (0 = root)
    role: str | None
    color: str
    inputs: list[int]
    ink: str = "#111827"  # text colour on ``color``
    users: list[int] = dataclasses.field(default_factory=list)
    values: list[str] = dataclasses.field(default_factory=list)  # "[2, 8, 32] float32" per output
    module: str = ""
    moe: dict[str, Any] = dataclasses.field(default_factory=dict)  # json-safe meta["moe"]
    stack: str = ""  # last frame of the stack trace
    new: bool = False  # added by the pass this picture is "after"
    notes: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # e.g. "overlaps" -> node ids
    recompute: bool = False
    external: bool = False  # outside the selected layer, shown as its boundary


@dataclasses.dataclass
class ViewGroup:
    id: int
    path: str  # module path, "" for the root
    label: str
    parent: int  # -1 for the root
    depth: int
    collapsed: bool = False
    layer: bool = False  # a repeating block (model.layers.3, transformer.h.0): offered in the layer selector


@dataclasses.dataclass
class GraphView:
    title: str
    nodes: list[ViewNode]
    groups: list[ViewGroup]

    @property
    def edges(self) -> list[tuple[int, int]]:
        return [(i, n.id) for n in self.nodes for i in n.inputs]

    def to_json(self) -> str:
        roles = {r: {"color": c, "description": ROLE_DESCRIPTIONS[r]} for r, c in ROLE_COLORS.items()}
        data = {
            "title": self.title,
            "nodes": [dataclasses.asdict(n) for n in self.nodes],
            "groups": [dataclasses.asdict(g) for g in self.groups],
            "roles": roles,
            "opColors": OP_COLORS,
        }
        # "</" would end the inline <script> early; JSON allows the escaped form.
        return json.dumps(data, separators=(",", ":")).replace("</", "<\\/")


def json_safe(value: Any, depth: int = 0) -> Any:
    """meta["moe"] as plain JSON: enums by value, tensors by shape, anything else by repr."""
    if depth > 6:
        return repr(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [json_safe(v, depth + 1) for v in value]
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, fx.Node):
        return value.name
    return repr(value)


def _value_text(val: Any) -> list[str]:
    if isinstance(val, torch.Tensor):
        return [f"{list(val.shape)} {str(val.dtype).replace('torch.', '')}"]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in _value_text(v)]
    if val is None:
        return []
    return [f"{type(val).__name__} {val}" if isinstance(val, (int, float, bool)) else type(val).__name__]


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _user_frame(trace: str) -> str:
    """The innermost frame of the stack trace outside torch itself: where the model made this node."""
    lines = trace.strip().splitlines()
    frames = []
    for i, line in enumerate(lines):
        m = _FRAME_RE.search(line)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME_RE.search(lines[i + 1]) else ""
            frames.append((m.group(1), m.group(2), m.group(3), code))
    if not frames:
        return ""
    outside = [f for f in frames if "/torch/" not in f[0].replace("\\", "/")]
    path, line, fn, code = (outside or frames)[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line} in {fn}" + (f"\n  {code}" if code else "")


def _short_dtype(dtype: torch.dtype) -> str:
    names = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int64: "i64",
             torch.int32: "i32", torch.bool: "bool", torch.float64: "f64"}
    return names.get(dtype, str(dtype).replace("torch.", ""))


def _detail(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        dims = "x".join(str(d) if isinstance(d, int) else f"({str(d).replace(' ', '')})" for d in val.shape) or "scalar"
        return f"{dims} {_short_dtype(val.dtype)}"
    if isinstance(val, (tuple, list)):
        parts = [_detail(v) for v in val if isinstance(v, torch.Tensor)]
        return f"{len(val)} outputs" if len(parts) > 2 else ", ".join(parts)
    return ""


def _label(node: fx.Node) -> str:
    if node.op == "get_attr":
        return ".".join(str(node.target).split(".")[-2:])
    if node.op in ("placeholder", "output"):
        return node.name
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def display_role(node: fx.Node) -> str | None:
    """The node's role for colouring: meta["moe"]["role"], else inferred for raw collectives."""
    role = (node.meta.get("moe") or {}).get("role")
    if role is not None:
        return str(role.value if isinstance(role, enum.Enum) else role)
    kind = collective_kind(node)
    if kind is None:
        return None
    return Role.COLLECTIVE_WAIT.value if kind == "wait_tensor" else Role.COLLECTIVE_START.value


def _chain(node: fx.Node) -> list[tuple[str, str]]:
    """(path, module type) of every module enclosing the node, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for path, typ in stack.values():
        p = clean_path(path)
        if p and (not out or out[-1][0] != p):
            out.append((p, str(getattr(typ, "__name__", typ)).split(".")[-1]))
    return out


def _fallback_chains(chains: dict[fx.Node, list[tuple[str, str]]]) -> None:
    """A pass's node without ``nn_module_stack`` joins its MoE layer's module (and its known parents)."""
    known = {p: t for chain in chains.values() for p, t in chain}
    for node, chain in chains.items():
        layer = (node.meta.get("moe") or {}).get("layer")
        if chain or not layer:
            continue
        parts = str(layer).split(".")
        prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
        chains[node] = [(p, known.get(p, "")) for p in prefixes if p in known or p == layer]


_LAYER_RE = re.compile(r".*\.\d+$")


def overlap_notes(data: Any) -> dict[str, dict[str, list[str]]]:
    """Node name -> {"overlaps": [...]} / {"overlapped by": [...]} from a pass record's data.

    Any dict in it with ``start``, ``wait`` (node names) and ``nodes`` (the names that run while
    that collective is in flight), as the overlap pass records them, links those nodes."""
    notes: dict[str, dict[str, list[str]]] = {}

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            if isinstance(v.get("start"), str) and isinstance(v.get("wait"), str) and isinstance(v.get("nodes"), list):
                for end in (v["start"], v["wait"]):
                    notes.setdefault(end, {}).setdefault("overlaps", []).extend(str(m) for m in v["nodes"])
                for m in v["nodes"]:
                    notes.setdefault(str(m), {}).setdefault("overlapped by", []).append(v["start"])
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(data)
    return notes


def build_view(graph: fx.Graph, title: str = "graph", new_names: Iterable[str] | None = None,
               layer: str | int | None = None, collapse: Iterable[str] = (),
               notes: dict[str, dict[str, list[str]]] | None = None) -> GraphView:
    """The renderable view of ``graph``; ``layer`` keeps one module subtree (plus its boundary)."""
    nodes = list(graph.nodes)
    new = set(new_names or ())
    groups: list[ViewGroup] = [ViewGroup(0, "", title, -1, 0)]
    by_path: dict[str, int] = {"": 0}
    types: dict[str, str] = {}
    chains: dict[fx.Node, list[tuple[str, str]]] = {n: _chain(n) for n in nodes}
    _fallback_chains(chains)
    for chain in chains.values():
        for path, typ in chain:
            if typ and path not in types:
                types[path] = typ
    moe_blocks = {str((n.meta.get("moe") or {}).get("layer")): n.meta["moe"]["moe"] for n in nodes
                  if "moe" in (n.meta.get("moe") or {})}

    parents: dict[str, str] = {}  # a module's enclosing *called* module (a ModuleList is never called)
    for chain in chains.values():
        for (outer, _), (inner, _) in zip([("", "")] + chain[:-1], chain):
            parents.setdefault(inner, outer)

    def group_of(path: str) -> int:
        if path in by_path:
            return by_path[path]
        parent_path = parents.get(path, "")
        parent = group_of(parent_path)
        name = path[len(parent_path) + 1:] if parent_path and path.startswith(parent_path + ".") else path
        label = f"{name} · {types[path]}" if types.get(path) else name
        if path in moe_blocks:
            info = moe_blocks[path]
            cut = info.get("slices", 1)
            experts = f"{info.get('num_experts', 0) // cut} experts" + (f" in {cut} slices" if cut > 1 else "")
            label = f"{name} · MoE ({experts}, top-{info.get('top_k')})"
        gid = len(groups)
        groups.append(ViewGroup(gid, path, label, parent, groups[parent].depth + 1, layer=bool(_LAYER_RE.match(path))))
        by_path[path] = gid
        return gid

    for n in nodes:
        if chains[n]:
            group_of(chains[n][-1][0])
    index = {n: i for i, n in enumerate(nodes)}
    view_nodes: list[ViewNode] = []
    for n in nodes:
        if chains[n]:
            gid = by_path[chains[n][-1][0]]
        elif n.op == "get_attr":
            owner = str(n.target).rsplit(".", 1)[0] if "." in str(n.target) else ""
            users = [u for u in n.users if chains[u]]
            gid = by_path.get(owner) or (by_path[chains[users[0]][-1][0]] if users else 0)
        else:
            gid = 0
        role = display_role(n)
        val = n.meta.get("val")
        view_nodes.append(ViewNode(
            id=index[n], name=n.name, op=n.op, target=str(n.target), label=_label(n), detail=_detail(val),
            group=gid, role=role, color=color_of(role, n.op), ink=ink_of(color_of(role, n.op)),
            inputs=[index[i] for i in n.all_input_nodes],
            values=_value_text(val), module=groups[gid].path, moe=json_safe(n.meta.get("moe") or {}),
            stack=_user_frame(n.meta.get("stack_trace") or ""),
            new=n.name in new, recompute=is_recomputed(n),
        ))
    for vn in view_nodes:
        for i in vn.inputs:
            view_nodes[i].users.append(vn.id)
    ids = {vn.name: vn.id for vn in view_nodes}
    for name, per_key in (notes or {}).items():
        if name in ids:
            view_nodes[ids[name]].notes = {k: [ids[m] for m in dict.fromkeys(v) if m in ids] for k, v in per_key.items()}
    view = GraphView(title, view_nodes, groups)
    collapse = set(collapse)
    for g in groups:
        g.collapsed = g.path in collapse
    unknown = collapse - set(by_path)
    if unknown:
        raise MoecompileError(f"collapse={sorted(unknown)} names no module group; groups: {_some(by_path)}")
    return select_layer(view, layer) if layer is not None else view


def _some(paths: Iterable[str], n: int = 12) -> str:
    paths = [p for p in paths if p]
    return ", ".join(paths[:n]) + (f", ... ({len(paths)} in all)" if len(paths) > n else "")


def layer_groups(view: GraphView) -> list[ViewGroup]:
    """The repeating blocks, outermost first (``model.layers.0``, ...)."""
    found = [g for g in view.groups if g.layer]
    if not found:
        return []
    depth = min(g.depth for g in found)
    return [g for g in found if g.depth == depth]


def select_layer(view: GraphView, layer: str | int) -> GraphView:
    """Keep one module subtree: its nodes, plus the nodes just outside it that feed or use them."""
    if isinstance(layer, int):
        blocks = layer_groups(view)
        if not 0 <= layer < len(blocks):
            raise MoecompileError(f"layer={layer} is out of range: the graph has {len(blocks)} repeating layers "
                                  f"({_some(g.path for g in blocks)}); pass an index below that or a module path")
        layer = blocks[layer].path
    match = [g for g in view.groups if g.path == layer]
    if not match:
        raise MoecompileError(f"layer={layer!r} names no module in this graph; modules: {_some(g.path for g in view.groups)}")
    root = match[0].id
    inside_groups = {root}
    for g in view.groups:  # parents come before children
        if g.parent in inside_groups:
            inside_groups.add(g.id)
    inside = {n.id for n in view.nodes if n.group in inside_groups}
    boundary = {j for i in inside for j in (*view.nodes[i].inputs, *view.nodes[i].users)} - inside
    keep = sorted(inside | boundary)
    remap = {old: new for new, old in enumerate(keep)}
    nodes = []
    for old in keep:
        n = dataclasses.replace(view.nodes[old])
        n.id = remap[old]
        n.inputs = [remap[i] for i in n.inputs if i in remap]
        n.users = [remap[i] for i in n.users if i in remap]
        n.notes = {k: [remap[i] for i in v if i in remap] for k, v in n.notes.items()}
        n.external = old in boundary
        if n.external:
            n.group = 0
        nodes.append(n)
    used = {n.group for n in nodes}
    keep_groups = {g.id for g in view.groups if g.id in inside_groups} | {0}
    for gid in list(used):  # ancestors of any used group stay
        while gid > 0:
            keep_groups.add(gid)
            gid = view.groups[gid].parent
    gmap = {old: new for new, old in enumerate(sorted(keep_groups))}
    groups = []
    for old in sorted(keep_groups):
        g = dataclasses.replace(view.groups[old])
        g.id, g.parent = gmap[old], gmap.get(g.parent, -1)
        groups.append(g)
    for n in nodes:
        n.group = gmap[n.group]
    return GraphView(f"{view.title} · {layer}", nodes, groups)
