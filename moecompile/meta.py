"""The ``node.meta["moe"]`` contract: everything moecompile stores on a graph node.

Passes talk to each other only through this dict (next to torch's own
``nn_module_stack``, ``val`` and ``stack_trace``). A pass that replaces a node
copies its origin's entry with :func:`copy_moe`. Keys, all optional:

- ``layer``: the module path of the FFN / MoE block the node belongs to
  (``"model.layers.3.mlp"``).
- ``role``: what the node does; one of :class:`Role`.
- ``ffn``: on an FFN's output node, the :class:`FFNInfo` found by ``find_ffn``
  (and ``ffn_index``, its position among the FFNs).
- ``moe``: on an MoE block's output node, the :class:`MoEInfo` written by ``upcycle``.
- ``chunk``: the token chunk a node works on (overlap pass).
- ``group``: the process-group name a collective runs on (expert_parallel pass).
- ``routed_rows``: on a dispatcher's rows when no permute states them (alltoall_dedup), the routed
  (token, expert) pairs they stand for; costs and the planner's profile size the layer by it.
- ``balanced``: on a host-read split of a dropless dispatch, its value under uniform routing (the
  memory estimator's stand-in for a data-dependent size).

``routed_rows`` and ``balanced`` count the tokens the node works on (TOKEN_COUNTS): a pass that
splits the tokens (the overlap pass's chunks) scales them to its pieces.
"""

from __future__ import annotations

import enum
from typing import Any, NotRequired, TypedDict

import torch.fx as fx

TOKEN_COUNTS = ("routed_rows", "balanced")  # moe entries that count the tokens a node works on


class Role(str, enum.Enum):
    FFN = "ffn"  # a node of a dense FFN found by find_ffn
    ROUTER = "router"  # router logits GEMM
    ROUTE = "route"  # scores -> top-k
    ROUTER_LOSS = "router_loss"  # aux / seq_aux / z-loss terms
    PERMUTE = "permute"  # sort token copies by expert
    DISPATCH = "dispatch"  # tokens travel to the experts' ranks
    EXPERTS = "experts"  # grouped expert GEMMs
    EXPERT_ACT = "expert_act"  # the expert activation (GLU / GELU)
    COMBINE_COMM = "combine_comm"  # expert outputs travel back
    COMBINE = "combine"  # unpermute + weighted sum over k
    SHARED_EXPERTS = "shared_experts"  # always-on experts
    COLLECTIVE_START = "collective_start"
    COLLECTIVE_WAIT = "collective_wait"
    FP8_CAST = "fp8_cast"
    RECOMPUTE = "recompute"

    def __str__(self) -> str:
        return self.value


class FFNInfo(TypedDict):
    """A dense FFN as find_ffn saw it. Weights are get_attr targets in the GraphModule."""

    kind: str  # "glu" (act(x Wg) * (x Wu) -> Wd) or "mlp" (x W1 -> act -> W2)
    act: str  # "silu" | "gelu" | "gelu_tanh" | "relu"; an "mlp" also "relu2" (ReLU squared)
    input: str  # node name of x
    output: str  # node name of the FFN's result
    nodes: list[str]  # every node of the match (all replaced together)
    weights: dict[str, str]  # "gate" / "up" / "down" (or fused "gate_up") -> parameter name
    biases: dict[str, str]  # same keys, only those present
    transposed: bool  # weights stored [in, out] (GPT-2 Conv1D / addmm) instead of [out, in]
    hidden: int
    intermediate: int


class MoEInfo(TypedDict):
    """An MoE block as upcycle built it; later passes read it instead of re-deriving it."""

    num_experts: int
    top_k: int
    granularity: int
    shared_experts: int
    act: str
    glu: bool
    params: dict[str, str]  # "router", "w_in", "w_out", optional "b_in", "b_out", "bias", "shared_w_in", ...
    nodes: dict[str, str]  # role -> node name of the block's key nodes (route, permute, experts_in, ...)
    expert_range: tuple[int, int]  # global expert ids held by this rank [lo, hi)
    # "activation" (glu multiplies each row's routing weight in), "combine" (unpermute does) or "input" (glu scales
    # the rows by it before the activation: the experts' input was weighted)
    weights_at: str
    slices: NotRequired[int]  # parallel.etp: each expert cut into this many slice-experts (num_experts counts them)


class MoEMeta(TypedDict, total=False):
    layer: str
    role: Role
    ffn: FFNInfo
    ffn_index: int  # position of the FFN among all FFNs, in graph order
    moe: MoEInfo
    chunk: int
    group: str


def moe(node: fx.Node) -> MoEMeta:
    """The node's moecompile metadata (created empty on first access)."""
    return node.meta.setdefault("moe", {})  # type: ignore[return-value]


def set_moe(node: fx.Node, **fields: Any) -> fx.Node:
    moe(node).update(fields)  # type: ignore[typeddict-item]
    return node


def copy_moe(src: fx.Node, dst: fx.Node) -> fx.Node:
    """Give a replacement node its origin's moecompile and torch provenance metadata."""
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in src.meta and key not in dst.meta:
            dst.meta[key] = src.meta[key]
    if "moe" in src.meta:
        dst.meta["moe"] = {**src.meta["moe"], **dst.meta.get("moe", {})}
    return dst


def nodes_with_role(graph: fx.Graph, role: Role, layer: str | None = None) -> list[fx.Node]:
    return [
        n
        for n in graph.nodes
        if n.meta.get("moe", {}).get("role") == role and (layer is None or n.meta["moe"].get("layer") == layer)
    ]
