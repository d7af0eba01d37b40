"""Where parameters sit in gradient buckets, and where the forward graph reads them (core: no runtime here).

The emitted step's bucketed collectives (moecompile/grad_sync.py, grad_shards.py, param_shards.py)
and the memory estimator (moecompile/memory_shards.py) lay buckets out with the same functions, so
the estimate is the runtime's layout: parameters in the order backward completes their gradients
(``backward_order``), cut per kind, dtype and device up to ``bucket_mb`` (``cut_buckets``), each
start aligned when a bucket is split over ranks (``bucket_offsets``). The graph side says which
parameters are experts (``expert_parameters``) and each parameter's first and last read
(``param_reads``), through views and through any node a runtime registers as reading its
parameters through (``read_through``: ZeRO-3's gather).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import torch.fx as fx
import torch.nn as nn

from .meta import MoEInfo

EXPERT_KEYS = ("w_in", "w_out", "b_in", "b_out")  # MoEInfo.params keys of sharded expert tensors
ALIGN_BYTES = 256  # a parameter's offset in a sharded bucket (CUDA's allocator aligns to 512)
_READ_THROUGH: set[Callable] = set()  # graph targets whose i-th output is argument 2 + i, read (ZeRO-3's gather)
_RUNTIME_ONLY: set[Callable] = set()  # graph targets the step's runtime inserts that compute nothing (release, wait)


@dataclasses.dataclass(frozen=True)
class ExpertTensor:
    """Where an expert tensor's rows sit in the global expert numbering."""

    layer: str
    key: str  # MoEInfo.params key: w_in | w_out | b_in | b_out
    num_experts: int  # E, global
    lo: int  # first global expert id held here
    hi: int  # one past the last
    slices: int = 1  # parallel.etp: ids are slice-experts, id = q * (num_experts // slices) + e (expert_slices)
    glu: bool = False  # w_in / b_in hold gate rows then up rows


def moe_blocks(gm: fx.GraphModule) -> dict[str, MoEInfo]:
    """Every MoE block of the graph, by layer, as upcycle (and expert_parallel) recorded it."""
    out: dict[str, MoEInfo] = {}
    for n in gm.graph.nodes:
        meta = n.meta.get("moe", {})
        if "moe" in meta:
            out[meta["layer"]] = meta["moe"]
    return out


def expert_parameters(gm: fx.GraphModule) -> dict[str, ExpertTensor]:
    """Parameter name -> its expert shard, for every sharded expert tensor of the graph."""
    out = {}
    for layer, info in moe_blocks(gm).items():
        lo, hi = info.get("expert_range", (0, info["num_experts"]))
        for key in EXPERT_KEYS:
            if key in info["params"]:
                out[info["params"][key]] = ExpertTensor(layer, key, info["num_experts"], int(lo), int(hi),
                                                        info.get("slices", 1), bool(info.get("glu", False)))
    return out


def readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node``'s tensor: its users, and through the views of it they make (t, view, expand,
    alias, ... and the elements of a split) the users of those. A parameter is needed until the last of them."""
    out, stack = [], list(node.users)
    while stack:
        user = stack.pop()
        out.append(user)
        if _makes_view(user):
            stack.extend(user.users)
    return out


def _makes_view(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:  # reached from a view op only: an element of its outputs
        return True
    returns = getattr(getattr(node.target, "_schema", None), "returns", None)
    alias = returns[0].alias_info if returns else None
    return alias is not None and not alias.is_write


def read_through(target: Callable) -> None:
    """Register a graph target that passes parameters on: ``target(a, b, *params)``'s i-th output is params[i],
    so ``param_reads`` follows it to the nodes reading that output (ZeRO-3's ``gather_bucket``)."""
    _READ_THROUGH.add(target)


def runtime_only(target: Callable) -> None:
    """Register a graph target the step's runtime inserts that computes nothing (ZeRO-3's release, a wait for an
    in-flight all-gather): an analysis of the graph skips it."""
    _RUNTIME_ONLY.add(target)


def analysed_value(target: Any, args: tuple) -> tuple[bool, Any]:
    """(True, the value) for a node the step's runtime inserted, as an analysis of the graph (moecompile.memory's
    fake run) takes it: a read-through passes its parameters on, a runtime-only node is None; else (False, None).
    Running them would gather, release or wait for real buffers in the middle of an estimate."""
    if target in _READ_THROUGH:
        return True, tuple(args[2:])
    if target in _RUNTIME_ONLY:
        return True, None
    return False, None


def param_reads(gm: nn.Module) -> dict[str, tuple[int, int]]:
    """Each parameter's first and last read in the forward graph, by the positions of the nodes that use it
    (through ZeRO-3's gather node, if a step has placed one: ``read_through``)."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return {}
    order = {n: i for i, n in enumerate(graph.nodes)}
    out: dict[str, tuple[int, int]] = {}
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        first, last = [], []
        for u in node.users:
            if u.op == "call_function" and u.target in _READ_THROUGH:  # read through the gather's element for it
                items = [item for item in u.users if item.args[1] == u.args.index(node, 2) - 2]
                first += [w for item in items for w in item.users]
                last += [w for item in items for w in readers(item)]
            else:
                first.append(u)
                last += [u, *(readers(u) if _makes_view(u) else [])]
        lo = min((order[u] for u in first), default=order[node])
        hi = max((order[u] for u in last), default=order[node])
        was = out.get(node.target, (lo, hi))
        out[node.target] = (min(was[0], lo), max(was[1], hi))
    return out


def first_reads(gm: nn.Module) -> dict[str, int]:
    """Each parameter's first read in the forward graph, by the position of the first node that uses it."""
    return {name: first for name, (first, _) in param_reads(gm).items()}


def backward_order(named: list[tuple[str, nn.Parameter]], first_use: dict[str, int]) -> list[tuple[str, nn.Parameter]]:
    """Parameters in the order backward completes their gradients: the last read first (ties, and parameters
    the graph does not read, in reverse registration order, as DDP assumes). Buckets are cut from this order,
    so a bucket holds parameters that forward reads together: what ZeRO-3 gathers at once."""
    return sorted(named[::-1], key=lambda item: -first_use.get(item[0], -1))


def completion_order(buckets: list[Any], first_use: dict[str, int]) -> list[Any]:
    """Buckets (anything with ``names``) in the order backward completes them, which every rank sends them in: a
    bucket is complete when its parameter that the forward read first has its gradient, and backward runs the
    forward in reverse."""
    return sorted(buckets, key=lambda b: -min(first_use.get(n, -1) for n in b.names))


def cut_buckets(named: list[tuple[str, nn.Parameter]], expert_names: set[str],
                bucket_mb: float) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """(kind, its parameters) of each bucket: dense ones then expert ones, per dtype and device, in ``named``'s
    order, each up to ``bucket_mb`` (or one larger parameter)."""
    limit = max(1, int(bucket_mb * 2**20))
    out = []
    for kind in ("dense", "expert"):
        by_key: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
        for name, p in named:
            if (name in expert_names) == (kind == "expert"):
                by_key.setdefault((p.dtype, p.device), []).append((name, p))
        for params in by_key.values():
            chunk: list[tuple[str, nn.Parameter]] = []
            size = 0
            for name, p in params:
                if chunk and size + p.numel() * p.element_size() > limit:
                    out.append((kind, chunk))
                    chunk, size = [], 0
                chunk.append((name, p))
                size += p.numel() * p.element_size()
            if chunk:
                out.append((kind, chunk))
    return out


def bucket_offsets(params: list[nn.Parameter], d: int) -> tuple[list[int], int]:
    """Where each parameter starts in a bucket split over ``d`` ranks (ALIGN_BYTES-aligned when split), and the
    bucket's elements, padded to ``d`` whole ranges."""
    align = max(1, ALIGN_BYTES // params[0].element_size()) if d > 1 else 1
    offsets, end = [], 0
    for p in params:
        offsets.append(end)
        end = -(-(end + p.numel()) // align) * align
    return offsets, (-(-end // (d * align)) * d * align if d > 1 else end)
