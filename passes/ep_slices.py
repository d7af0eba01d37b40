"""Expert tensor parallelism (``parallel.etp = Q``) for ``expert_parallel``: each expert cut into Q slices.

An expert's FFN is elementwise over its width F and its down projection sums over F, so the expert is
the sum of Q narrower experts (slices) that each keep F/Q of its columns::

    expert_e(x) = sum_q  down[:, q] @ act(gate[q] x) * (up[q] x)        (q: columns [q*F/Q, (q+1)*F/Q))

So the layer becomes one of E*Q slice-experts, and a token routed to expert e is routed to all of its Q
slices with e's weight; the combine's weighted sum over the k*Q copies adds the slices back up::

    idx_T(QK) = cat([idx_TK + q*E for q in range(Q)], 1)       slice-major: slice-expert q*E + e
    w_T(QK)   = w_TK.repeat(1, Q)                               (the permute, glu weights and combine read it)
    load_E    = load_(QE)[:E]                                   (slice 0's counts: every slice gets e's tokens)

Then the expert-parallel rewrite runs unchanged over ep*Q ranks: rank r holds slice-experts
[r*E/ep, (r+1)*E/ep), i.e. slice r // ep of the experts of ep rank r % ep — Megatron-Core's ETP layout.
It moves the same bytes as Megatron's all-to-all + all-gather (and reduce-scatter + all-to-all) inside
the ETP group: each routed copy goes to Q ranks and Q partial outputs come back. Capacity (static mode)
is per slice-expert and every slice of e sees exactly e's tokens, so the same tokens drop in each slice.
Expert tensors keep their names; ``MoEInfo`` says ``num_experts = E*Q`` and ``slices = Q``
(``moecompile.expert_slices.join_slices`` rebuilds whole experts for export). An output bias (GPT-2's
``c_proj``) is the expert's, not a sum over the width: slice 0 adds it and the other slices add zeros,
padded in the graph, so it stays one [E, H] parameter held by the ranks of slice 0.

``slices_pass(Q)`` runs the same cut as a pass of its own on one process, every slice local: the graph
one etp group computes, which the planner profiles to price ``parallel.etp = Q`` (planner/profile.py).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.infra.pass_base import PassResult

from moecompile.expert_slices import WIDTH_DIM, cut_slices
from moecompile.meta import Role
from moecompile.pass_manager import PassContext, PassSpec

from .expert_parallel import Block, find_blocks, replace_load

aten = torch.ops.aten


def slice_experts(gm: fx.GraphModule, block: Block, Q: int) -> None:
    """Rewrite ``block`` into E*Q slice-experts (see the module doc); raises ValueError where it cannot."""
    info, E = block.info, block.info["num_experts"]
    params = info["params"]
    for key in ("w_in", "w_out", "b_in"):
        name = params.get(key)
        if name is None:
            continue
        owner_path, leaf = name.rpartition(".")[::2]
        owner = gm.get_submodule(owner_path)
        p = owner._parameters[leaf]
        width = p.shape[WIDTH_DIM[key]] // (2 if info["glu"] and key in ("w_in", "b_in") else 1)
        if width % Q:
            fits = [d for d in range(1, width + 1) if width % d == 0][:8]
            raise ValueError(f"{block.layer}: parallel.etp={Q} must divide each expert's FFN width {width} ({name} "
                             f"is {list(p.shape)}); choose etp among {fits}")
        sliced = cut_slices(p.detach(), key, Q, info["glu"])
        owner._parameters[leaf] = nn.Parameter(sliced, requires_grad=p.requires_grad)
    if "b_out" in params:
        _output_bias_on_slice_zero(gm, block, E, Q)

    permute, graph = block.permute, gm.graph
    idx_TK, w_TK = permute.args[1:3]
    stamp = {k: permute.meta[k] for k in ("nn_module_stack", "stack_trace") if k in permute.meta}

    def emit(target, *args) -> fx.Node:
        n = graph.call_function(target, args)
        n.meta.update(stamp)
        n.meta["moe"] = {"layer": block.layer, "role": Role.PERMUTE}
        return n

    readers = [u for u in w_TK.users if u.meta.get("moe", {}).get("role") in (Role.PERMUTE, Role.COMBINE)]
    with graph.inserting_before(permute):
        idx_Q = emit(aten.cat.default, [idx_TK, *(emit(aten.add.Tensor, idx_TK, q * E) for q in range(1, Q))], 1)
        w_Q = emit(aten.repeat.default, w_TK, [1, Q])
    for n in readers:  # the permute, the glu's per-row weights, the combine
        n.replace_input_with(w_TK, w_Q)
    permute.update_arg(1, idx_Q)
    permute.update_arg(3, E * Q)
    load = block.outs.get(3)
    if load is not None and load.users:  # router losses, bias updates and stats count whole experts: slice 0's
        order = {n: i for i, n in enumerate(graph.nodes)}
        with graph.inserting_before(min(load.users, key=order.__getitem__)):  # where the load was first read
            load_E = emit(aten.narrow.default, load, 0, 0, E)  # (overlap's chunks re-sum it before that)
        replace_load(gm, block, load_E)
    info["num_experts"], info["slices"] = E * Q, Q


def _output_bias_on_slice_zero(gm: fx.GraphModule, block: Block, E: int, Q: int) -> None:
    """The down projection's bias is the expert's, not a sum over its width: slice 0 adds it, the others add
    nothing. It stays one [E, H] parameter of whole experts' biases, padded in the graph with (Q-1)*E zero rows
    for the later slices' rows (so the zeros are no parameter, get no gradient and cannot drift);
    ``expert_parallel._shard`` keeps the rows of a rank's slice-0 experts and drops it on the other ranks."""
    name = block.info["params"]["b_out"]
    attr = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == name)
    users = [u for u in block.experts if attr in u.all_input_nodes]
    with gm.graph.inserting_before(users[0]):
        pad = gm.graph.call_function(aten.constant_pad_nd.default, (attr, [0, 0, 0, (Q - 1) * E]))
    pad.meta.update({k: users[0].meta[k] for k in ("nn_module_stack", "stack_trace") if k in users[0].meta})
    pad.meta["moe"] = {"layer": block.layer, "role": Role.EXPERTS}
    for u in users:
        u.replace_input_with(attr, pad)
    block.experts.insert(block.experts.index(users[0]), pad)  # a node of the section: it moves with the experts


def slices_pass(Q: int) -> PassSpec:
    """Every MoE layer cut into ``Q`` slices per expert, all on this process, as a pass before ``expert_parallel``.

    Not a plan setting (``parallel.etp`` slices inside ``expert_parallel``, over ep x etp ranks): the
    one-process graph the planner measures an etp plan's FLOPs, bytes and activations on. It computes
    what the unsliced graph does, which is how the slicing is tested without a process group.
    """

    def expert_slices(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if Q < 1:
            raise ValueError(f"slices_pass({Q}): the slices per expert must be >= 1")
        if ctx.plan.parallel.etp > 1:
            raise ValueError(f"the plan has parallel.etp={ctx.plan.parallel.etp}, which expert_parallel slices; "
                             f"slices_pass({Q}) is for a plan with parallel.etp: 1")
        blocks = find_blocks(gm) if Q > 1 else []
        for block in blocks:
            E = block.info["num_experts"]
            slice_experts(gm, block, Q)
            ctx.decide(f"{block.layer}: {E} experts cut into {Q} slices each, {E * Q} slice-experts, all local")
        ctx.record(slices=Q, layers=[b.layer for b in blocks])
        return PassResult(gm, bool(blocks))

    return PassSpec("expert_slices", expert_slices, after=("upcycle", "import_moe"), before=("expert_parallel",),
                    requires=("moe",))
