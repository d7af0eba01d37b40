"""Pass ``expert_parallel``: shard each MoE layer's experts over the ep group and move tokens to them.

Before (one layer, as ``upcycle`` built it; E experts, all local)::

    x_NH, row_src_N, sizes_E, load_E = moecompile.permute(x_TH, idx_TK, w_TK, E, C, policy)
    y_NH = experts(x_NH, sizes_E)              # grouped_mm -> act -> grouped_mm over E experts
    y_TH = moecompile.unpermute(y_NH, row_src_N, w_TK, T)

After, ``alltoall`` (rank keeps experts [lo, hi), L = E/ep of them; M rows arrive)::

    counts = wait(all_to_all_single(sizes_E, [L]*ep, [L]*ep))       # dropless only: rows per (source, expert)
    send, recv = host splits                                          # dropless only: the one host sync
    x_MH = wait(all_to_all_single(x_NH, recv, send))                  # dispatch (with each row's routing
                                                                      # weight as column H where the glu
                                                                      # applies it: ep_alltoall.dispatch_rows)
    y_MH = sort_chunks(experts(sort_chunks(x_MH, counts), counts.sum(0)), counts.T)
    y_NH = wait(all_to_all_single(y_MH, send, recv))                  # combine, back on the source rank
    y_TH = moecompile.unpermute(y_NH, row_src_N, w_TK, T)

``parallel.etp``: each expert is first cut along its FFN width into etp slice-experts, a token routed to all
of its expert's slices (ep_slices.py); everything here then runs over the E*etp slice-experts and ep*etp ranks.

``alltoall_dedup`` (ep_dedup.py): each token once to every rank holding one of its experts, that rank's
partial sum back; with ``parallel.node_ranks`` once to every node over the rail group, then inside the node
group (two hops each way, on the World's node and rail groups).

``allgather``: gather x_TH / idx_TK / w_TK of the ep group, permute the gathered tokens to the
local experts, run them, unpermute into a partial [ep*T, H], reduce-scatter the sum back.
``static`` mode: the permute keeps C rows per expert (parallel.capacity_factor, per source rank),
so every buffer and split is fixed and nothing syncs the host. Collective starts are torch's
functional collectives; their waits are ``moecompile.wait_tensor`` (named failures).

Meta: starts have role ``collective_start`` and waits ``collective_wait``, both with ``group`` (the
c10d group name); the wait's label (``"<layer>: dispatch"``, ``": combine"``, ``": dispatch counts"``)
says which exchange the pair is. Local work before the experts is ``dispatch``, after them
``combine_comm``. Expert tensors keep their names with E/ep rows; ``MoEInfo.expert_range`` and the
``expert_shard`` attribute of ``<layer>.experts`` give the global ids (moecompile.distributed).
The verifier below (every collective has exactly one wait, nothing reads it unwaited) runs after
this pass and every later one. Helpers raise ValueError; the pass manager reports a PassError.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.infra.pass_base import PassResult

import moecompile.kernels  # noqa: F401  (registers torch.ops.moecompile.*)
from moecompile import distributed
from moecompile.distributed import ExpertShard, World
from moecompile.errors import DistributedError
from moecompile.expert_slices import whole_experts
from moecompile.graph import inline, trace_block
from moecompile.kernels import row_weights
from moecompile.meta import MoEInfo, Role, moe
from moecompile.outputs import add_side_outputs
from moecompile.pass_manager import PassContext, register_pass, register_verifier

aten, mc = torch.ops.aten, torch.ops.moecompile
EXPERT_TENSORS = ("w_in", "w_out", "b_in", "b_out")  # MoEInfo.params keys sharded along dim 0


@dataclasses.dataclass
class Block:
    """One MoE layer's nodes around its expert section (what both dispatchers rewrite)."""

    layer: str
    info: MoEInfo
    permute: fx.Node
    outs: dict[int, fx.Node]  # permute output index -> its getitem (0 x_NH, 1 row_src_N, 2 sizes_E, 3 load_E)
    experts: list[fx.Node]  # expert section in graph order (grouped_mm, act, grouped_mm, ...)
    unpermute: fx.Node

    @property
    def expert_out(self) -> fx.Node:
        return self.unpermute.args[0]  # type: ignore[return-value]

    @property
    def row_weights(self) -> fx.Node | None:
        """Each permuted row's routing weight, where the experts' glu multiplies it in (else None)."""
        return row_weights_of(self.experts)


def row_weights_of(experts: list[fx.Node]) -> fx.Node | None:
    """The per-row routing weights the expert section's glu reads (apply_weights: activation), or None."""
    for n in experts:
        if n.target is mc.glu.default and len(n.args) > 2 and isinstance(n.args[2], fx.Node):
            return n.args[2]
    return None


class Emit:
    """Builds nodes before ``anchor``, stamped with the layer, a role and the permute's provenance."""

    def __init__(self, gm: fx.GraphModule, block: Block, group: str):
        self.graph, self.block, self.group = gm.graph, block, group

    def at(self, anchor: fx.Node) -> Any:
        return self.graph.inserting_before(anchor)

    def __call__(self, role: Role, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self._stamp(self.graph.call_function(target, args, kwargs), role)

    def _stamp(self, node: fx.Node, role: Role) -> fx.Node:
        for key in ("nn_module_stack", "stack_trace"):
            if key in self.block.permute.meta:
                node.meta[key] = self.block.permute.meta[key]
        node.meta.pop("custom", None)
        node.meta["moe"] = {"layer": self.block.layer, "role": role}
        return node

    def collective(self, start: Any, x: fx.Node, *args: Any, what: str, group: str | None = None) -> fx.Node:
        """A functional-collective start on ``group`` (the ep group by default) and its (named) wait; returns the
        wait."""
        label, group = f"{self.block.layer}: {what}", group or self.group
        s = self(Role.COLLECTIVE_START, start, x, *args, group)
        w = self(Role.COLLECTIVE_WAIT, mc.wait_tensor.default, s, label, group)
        s.meta["moe"]["group"] = w.meta["moe"]["group"] = group
        return w

    def row_weights(self, role: Role, row_src: fx.Node, weights_TK: fx.Node, anchor: fx.Node) -> fx.Node:
        """``kernels.row_weights(row_src, weights_TK)`` traced to ATen and inlined before ``anchor``, stamped."""
        existing = set(self.graph.nodes)
        out = inline(self.graph, _row_weights_block(), [row_src, weights_TK], anchor)
        for n in [n for n in self.graph.nodes if n not in existing]:
            self._stamp(n, role)
        return out

    def host_ints(self, role: Role, t: fx.Node, indices: list[int]) -> list[fx.Node]:
        """Values ``t[i]`` of a 1-d int tensor as SymInt nodes: one device-to-host copy for all of them."""
        host = self(role, aten._to_copy.default, t, device=torch.device("cpu"))
        parts = self(role, aten.unbind.int, host)
        return [self(role, aten._local_scalar_dense.default, self(role, operator.getitem, parts, i)) for i in indices]


def find_blocks(gm: fx.GraphModule) -> list[Block]:
    by_layer: dict[str, dict[str, Any]] = {}
    for n in gm.graph.nodes:
        meta = n.meta.get("moe", {})
        layer = meta.get("layer")
        if layer is None:
            continue
        d = by_layer.setdefault(layer, {"experts": []})
        if "moe" in meta:
            d["info"] = meta["moe"]
        if n.target is mc.permute.default:
            d["permute"] = n
        elif n.target is mc.unpermute.default:
            d["unpermute"] = n
        elif meta.get("role") in (Role.EXPERTS, Role.EXPERT_ACT):
            d["experts"].append(n)
    blocks = []
    for layer, d in by_layer.items():
        if "info" not in d:
            continue
        if not all(k in d for k in ("permute", "unpermute")) or not d["experts"]:
            raise ValueError(f"MoE layer {layer} has no permute -> experts -> unpermute section to distribute")
        outs = {u.args[1]: u for u in d["permute"].users if u.target is operator.getitem}
        blocks.append(Block(layer, d["info"], d["permute"], outs, d["experts"], d["unpermute"]))
    return blocks


def rewire_experts(block: Block, x_in: fx.Node, sizes: fx.Node, w_in: fx.Node | None = None) -> None:
    """Point the expert section at the rows that arrived, the local experts' group sizes and (when the
    glu applies them) the arrived rows' routing weights."""
    section = set(block.experts)
    w_old = block.row_weights
    allowed = {block.outs.get(0), block.outs.get(2), w_old}
    for n in block.experts:
        for arg in n.all_input_nodes:
            if arg not in section and arg not in allowed and arg.op != "get_attr":
                raise ValueError(f"the expert section reads {arg.name} (at {n.format_node()}), which expert "
                                 "parallelism doesn't know how to move to the experts' ranks")
    if (w_old is None) != (w_in is None):
        raise ValueError(f"{block.layer}: " + ("the experts' glu reads routing weights the dispatcher did not move"
                                               if w_in is None else "routing weights were moved but no glu reads them"))
    for old, new in ((block.outs.get(0), x_in), (block.outs.get(2), sizes), (w_old, w_in)):
        for n in block.experts:
            if old is not None and old in n.all_input_nodes:
                n.replace_input_with(old, new)


def _static_capacity(ctx: PassContext, block: Block) -> int | None:
    cf = ctx.plan.parallel.static_capacity_factor(ctx.plan.experts)
    if cf is None:
        return None
    tokens = int(block.permute.args[0].meta["val"].shape[0])  # type: ignore[union-attr]
    return dataclasses.replace(ctx.plan.experts, capacity_factor=cf).capacity(tokens)


def _shard(gm: fx.GraphModule, block: Block, lo: int, hi: int) -> None:
    """Keep rows [lo, hi) of every expert tensor, under the same name; record the global range."""
    E = block.info["num_experts"]
    for key in EXPERT_TENSORS:
        name = block.info["params"].get(key)
        if name is None:
            continue
        if key == "b_out" and block.info.get("slices", 1) > 1:
            _shard_slice_zero_bias(gm, block, lo, hi)
            continue
        owner_path, leaf = name.rpartition(".")[::2]
        owner = gm.get_submodule(owner_path)
        p = owner._parameters[leaf]
        if p.shape[0] != E:
            raise ValueError(f"{name} has {p.shape[0]} rows, expected one per expert ({E})")
        if (lo, hi) != (0, E):
            owner._parameters[leaf] = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
        owner.expert_shard = ExpertShard(lo, hi, E)
    block.info["expert_range"] = (lo, hi)


def _shard_slice_zero_bias(gm: fx.GraphModule, block: Block, lo: int, hi: int) -> None:
    """Under ``parallel.etp`` the output bias is [E, H], whole experts', added by slice 0 and padded with zero rows
    for the later slices (ep_slices.py). Slice-experts [lo, hi) keep its rows [lo, min(hi, E)) and a zero row for
    each of theirs in a later slice; a rank holding only later slices keeps none of it: its GEMM has no bias."""
    info = block.info
    E, name = whole_experts(info), info["params"]["b_out"]
    owner_path, leaf = name.rpartition(".")[::2]
    owner = gm.get_submodule(owner_path)
    p = owner._parameters[leaf]
    attr = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == name)
    pad = next(u for u in attr.users if u.target is aten.constant_pad_nd.default)
    keep = max(0, min(hi, E) - lo)
    if keep == 0:
        for u in list(pad.users):
            u.update_arg(u.args.index(pad), None)
        block.experts.remove(pad)
        gm.graph.erase_node(pad)
        gm.graph.erase_node(attr)
        del owner._parameters[leaf], info["params"]["b_out"]
        return
    if keep != p.shape[0]:
        owner._parameters[leaf] = nn.Parameter(p.detach()[lo:lo + keep].clone(), requires_grad=p.requires_grad)
    if keep == hi - lo:  # only slice-0 experts here: nothing to pad
        pad.replace_all_uses_with(attr)
        block.experts.remove(pad)
        gm.graph.erase_node(pad)
    else:
        pad.update_arg(1, [0, 0, 0, hi - lo - keep])


def replace_load(gm: fx.GraphModule, block: Block, load: fx.Node) -> None:
    """Route the router stats' ``load`` to ``load`` (the local permute that counted it is going away)."""
    old = block.outs.get(3)
    if old is None:
        return
    old.replace_all_uses_with(load, delete_user_cb=lambda u: u is not load)  # ``load`` may read ``old``
    state = gm.meta.get("moe_side_outputs")
    if state and block.layer in state["side"]:
        by_name = {n.name: n for n in gm.graph.nodes}
        side = {k: (load if v == old.name else by_name[v]) for k, v in state["side"][block.layer].items()}
        add_side_outputs(gm, block.layer, side)


@register_pass("expert_parallel", after="upcycle", requires=("moe",), provides=("expert_parallel",))
def expert_parallel(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    cfg = ctx.plan.parallel
    world: World | None = ctx.world
    P = cfg.expert_ranks  # ep x etp: the ranks a layer's experts (or their slices) are spread over
    if P > 1 and (world is None or world.ep != P):
        raise DistributedError(
            f"parallel.ep={cfg.ep}{f' x parallel.etp={cfg.etp}' if cfg.etp > 1 else ''} but the conversion's world "
            f"is {'missing' if world is None else f'built for an ep group of {world.ep}'}: initialise "
            "torch.distributed (torchrun, or moecompile.distributed.init(plan)) before convert"
        )
    layers, changed = [], P > 1  # at ep=1 the graph changes only where a static capacity is set
    for block in find_blocks(gm):
        sliced = ""
        if cfg.etp > 1:
            from .ep_slices import slice_experts

            slice_experts(gm, block, cfg.etp)
            sliced = f" (slices of {block.info['num_experts'] // cfg.etp} experts cut {cfg.etp} ways)"
        E = block.info["num_experts"]
        capacity = _static_capacity(ctx, block)
        if capacity is not None and block.permute.args[4] != capacity:
            block.permute.update_arg(4, capacity)
            changed = True
        lo, hi = world.expert_range(E) if world is not None and P > 1 else (0, E)
        _shard(gm, block, lo, hi)
        mode = "dropless" if capacity is None else f"static, capacity {capacity} per expert per source rank"
        if P == 1:
            ctx.decide(f"{block.layer}: ep=1, all {E} experts local ({mode})")
            layers.append(block.layer)
            continue
        assert world is not None
        from . import ep_allgather, ep_alltoall, ep_dedup  # they build on Emit / Block above

        em, detail = Emit(gm, block, world.ep_group_name), ""
        if cfg.dispatcher == "alltoall":
            pack = ep_alltoall.packs_weights(block, cfg)
            if block.row_weights is not None:
                detail = (", routing weights packed into the rows' all-to-all" if pack else
                          ", routing weights in an all-to-all of their own")
            ep_alltoall.rewrite(gm, em, world, capacity, pack_weights=pack)
        elif cfg.dispatcher == "alltoall_dedup":
            assert capacity is None  # the plan allows it dropless only
            ep_dedup.rewrite(gm, em, world, ctx.plan.experts.top_k * cfg.etp)
            if world.node_ranks > 1:
                G, j = world.node_ranks, world.ep_rank
                detail = f", per node: node {world.ep_ranks[j - j % G:j - j % G + G]}, rail {world.ep_ranks[j % G::G]}"
        else:
            ep_allgather.rewrite(gm, em, world, capacity)
        ctx.decide(
            f"{block.layer}: experts [{lo}, {hi}) of {E}{sliced} on ep rank {world.ep_rank}/{world.ep} "
            f"(group {world.ep_ranks}), {cfg.dispatcher} dispatch, {mode}{detail}"
        )
        layers.append(block.layer)
    ctx.record(ep=cfg.ep, etp=cfg.etp, dispatcher=cfg.dispatcher, dispatch_mode=cfg.dispatch_mode, layers=layers,
               ep_ranks=list(world.ep_ranks) if world is not None else [0])
    gm.graph.lint()
    return PassResult(gm, changed)


# ---------------------------------------------------------------- legal IR after this pass

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


def is_collective_start(n: fx.Node) -> bool:
    t = n.target
    return (n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.namespace in _COLLECTIVE_NAMESPACES
            and t not in distributed.WAITS)


def verify_collectives(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Every collective has exactly one wait, is used only by it, and nothing reads it unwaited."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in distributed.WAITS:
            assert isinstance(n.args[0], fx.Node) and is_collective_start(n.args[0]), (
                f"{n.format_node()} waits on something that is not a collective start")
            assert all(order[u] > order[n] for u in n.users), f"a use of {n.name} precedes it"
        if not is_collective_start(n):
            continue
        waits = [u for u in n.users if u.target in distributed.WAITS]
        assert len(waits) == 1, f"collective {n.format_node()} has {len(waits)} waits, needs exactly one"
        assert len(n.users) == 1, (
            f"collective {n.name} is read before its wait by {[u.name for u in n.users if u not in waits]}")
        assert "group" in moe(n), f"collective {n.name} has no meta['moe']['group']"


register_verifier("expert_parallel", verify_collectives)


@functools.lru_cache(maxsize=None)
def _row_weights_block() -> fx.GraphModule:
    """``kernels.row_weights`` traced once (symbolic shapes): every layer inlines a copy of it."""
    return trace_block(row_weights, {"row_src_N": torch.zeros(6, dtype=torch.int64), "weights_TK": torch.zeros(5, 3)})
