"""``moecompile.distributed``: the ranks, the process groups a plan needs, and the collectives the graph calls.

**World.** A small frozen dataclass, built once per process from the plan::

    world = mc.distributed.init(plan)          # torchrun env (RANK, WORLD_SIZE, MASTER_*) or explicit args
    world = mc.distributed.world_from_plan(plan)   # torch.distributed already initialised by the user
    result = mc.convert(model, plan, (ids,))   # picks the world up by itself when torch.distributed is up

Fields: ``rank, world_size, ep, ep_rank, ep_group, edp_group, dp_group`` (+ ``edp``, ``edp_rank``,
``ep_ranks``, ``edp_ranks``, ``timeout_s``, ``etp``, ``node_ranks``, ``node_group``, ``rail_group``). The
layout is "parallel folding": dense layers see one data-parallel world, experts see it folded into ``ep`` x
``edp``. Under ``parallel.etp`` the ep group
spans ``parallel.ep * parallel.etp`` ranks (``World.ep``) holding E*etp expert slices
(passes/ep_slices.py); everything below is unchanged::

    ep groups   [0, ep), [ep, 2ep), ...     share one layer's experts; tokens travel inside them
    edp groups  {j, j+ep, j+2ep, ...}        hold the same experts on different data
    dp group    all world_size ranks         every dense parameter is replicated here
    e.g. world 4, ep 2:  ep {0,1} {2,3}   edp {0,2} {1,3}   dp {0,1,2,3}

With ``parallel.node_ranks`` = G (node-level alltoall_dedup) each ep group is also cut two ways: ``node_group``,
its G consecutive ranks on this rank's node, and ``rail_group``, the ranks at this rank's local index on every
node of the ep group (``World.nodes`` of them), e.g. ep 4, G 2: nodes {0,1} {2,3}, rails {0,2} {1,3}.

**Gradients** (each rank's loss is the mean over its own batch; the step's loss is their mean):
dense grads ``all_reduce(SUM, dp_group) / world_size``; expert grads ``all_reduce(SUM, edp_group) /
world_size`` (a rank's expert grads already hold every token its ep group routed to it).
:func:`reduce_gradients` does exactly that, one collective per tensor; a training step may bucket it.

**Expert shards.** Rank ``ep_rank`` keeps global experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``. Tensor
names do not change (``<layer>.experts.w_gate_up`` is ``[E/ep, 2F, H]`` instead of ``[E, 2F, H]``);
:func:`expert_shards` maps each such name to an :class:`ExpertShard` (kept as ``expert_shard`` on the
``<layer>.experts`` module), so local row ``i`` is global expert ``shard.lo + i``. A checkpoint writes
the rows with their global range; a loader at another ``ep`` slices ``[lo, hi)`` of the global tensor.

**Collectives** are graph nodes: torch's functional collectives (``torch.ops._c10d_functional.*``,
whose registered autograd runs the transposed collective in the backward), each followed by a
``torch.ops.moecompile.wait_tensor(t, what, group_name)`` node: torch's ``wait_tensor`` plus a
label, so a scheduling pass can move start and wait apart and a backend failure or timeout in
the forward becomes a :class:`~moecompile.errors.DistributedError` naming the collective, the
layer and the group. (A failure inside the backward's own exchanges is torch's RuntimeError, bounded
by the same group timeout.)
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  (registers the collectives' autograd)
import torch.nn as nn

from .errors import DistributedError, PlanError

log = logging.getLogger(__name__)
_fc = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class World:
    """This rank's place in the world and the three process groups built for the plan."""

    rank: int
    world_size: int
    ep: int
    ep_rank: int
    ep_group: Any  # dist.ProcessGroup of this rank's ep group
    edp_group: Any  # ranks holding the same experts (expert grads are reduced here)
    dp_group: Any  # every rank (dense grads are reduced here)
    edp: int = 1
    edp_rank: int = 0
    ep_ranks: tuple[int, ...] = ()
    edp_ranks: tuple[int, ...] = ()
    timeout_s: float = 300.0
    etp: int = 1  # of ``ep``, the slices each expert is cut into (plan.parallel.etp); ep / etp whole experts
    node_ranks: int = 1  # of ``ep``, the ranks per node (plan.parallel.node_ranks): node-level dedup's two groups
    node_group: Any = None  # this rank's node inside its ep group (consecutive node_ranks ranks)
    rail_group: Any = None  # the ep group's ranks with this rank's local index, one per node

    @property
    def nodes(self) -> int:
        """Nodes the ep group spans (1 unless ``node_ranks`` splits it)."""
        return self.ep // self.node_ranks

    @property
    def ep_group_name(self) -> str:
        """The name torch's functional collectives take for the ep group."""
        return self.ep_group.group_name

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """Global experts ``[lo, hi)`` this rank keeps of ``num_experts``."""
        per = num_experts // self.ep
        return self.ep_rank * per, (self.ep_rank + 1) * per


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """Rows ``[lo, hi)`` of a global ``[num_experts, ...]`` expert tensor live on this rank."""

    lo: int
    hi: int
    num_experts: int


# ---------------------------------------------------------------- building the world

_GROUPS: dict[str, tuple[str, tuple[int, ...], float]] = {}  # c10d name -> (description, ranks, timeout)
_WORLDS: dict[tuple[int, float], World] = {}
_WORLDS_OWNER: list[Any] = [None]  # the default process group the cached worlds were built on


def init(
    plan: Any = None,
    *,
    backend: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout_s: float | None = None,
) -> World:
    """Initialise ``torch.distributed`` (unless it already is) and build the world the plan needs.

    Without arguments it reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``); ``rank``/``world_size``/``init_method`` set it up explicitly. The backend is
    NCCL when CUDA is available, else gloo.
    """
    timeout_s = timeout_s if timeout_s is not None else (plan.parallel.timeout_s if plan is not None else 300.0)
    if not dist.is_initialized():
        rank = int(os.environ["RANK"]) if rank is None and "RANK" in os.environ else rank
        world_size = int(os.environ["WORLD_SIZE"]) if world_size is None and "WORLD_SIZE" in os.environ else world_size
        if rank is None or world_size is None:
            raise DistributedError(
                "moecompile.distributed.init: no rank / world size: launch with torchrun (which sets RANK and "
                "WORLD_SIZE) or pass rank=, world_size= and init_method= (e.g. 'tcp://127.0.0.1:29500')"
            )
        if init_method is None and "MASTER_ADDR" not in os.environ:
            init_method = "tcp://127.0.0.1:29500"
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if plan is None:
        return build_world(1, timeout_s)
    return build_world(plan.parallel.ep, timeout_s, etp=plan.parallel.etp, node_ranks=plan.parallel.node_level_ranks)


def shutdown() -> None:
    """Destroy the process groups, after freeing what still refers to them.

    A training step sits in reference cycles (its runner holds it; compiled graphs hold themselves), so
    without a collection first it is freed at interpreter exit, after its groups are destroyed, and gloo then
    aborts the process ("terminate called without an active exception") though the work finished.
    """
    import gc

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def world_from_plan(plan: Any) -> World:
    """The world for ``plan.parallel`` on the already-initialised ``torch.distributed``."""
    return build_world(plan.parallel.ep, plan.parallel.timeout_s, etp=plan.parallel.etp,
                       node_ranks=plan.parallel.node_level_ranks)


def check_ep(ep: int, world_size: int, etp: int = 1) -> None:
    """A ``PlanError`` naming the numbers unless ``ep`` (times ``etp``) divides the world (before any rank or
    group exists)."""
    W, group = world_size, ep * etp
    if ep < 1 or W % group:
        sizes = [d for d in range(1, W + 1) if W % d == 0]
        if etp == 1:
            raise PlanError("parallel.ep", ep, f"must divide the world size {W} (world_size % ep = "
                            f"{W % ep if ep >= 1 else W}); launch a multiple of {ep} ranks or choose ep among {sizes}")
        raise PlanError("parallel.ep", ep, f"times parallel.etp={etp} ({group} ranks hold one layer's expert slices) "
                        f"must divide the world size {W}; launch a multiple of {group} ranks or choose ep x etp "
                        f"among {sizes}")


def free_port() -> int:
    """A free TCP port on the loopback, for a local rendezvous of ranks this process spawns."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_world(ep: int = 1, timeout_s: float = 300.0, etp: int = 1, node_ranks: int = 1) -> World:
    """Create (once per process) the ep / edp / dp groups for expert-parallel size ``ep`` and expert-tensor-
    parallel size ``etp``: the ep group spans ``ep * etp`` ranks (``World.ep``), which hold the experts' slices.
    With ``node_ranks`` > 1 (and the ep group wider than it) each ep group is also cut into nodes of that many
    consecutive ranks and rails (one rank of each node, the same local index): node-level dedup's two groups.

    Every rank must call it with the same arguments, as with ``dist.new_group``. Raises a
    ``PlanError`` naming the numbers, before any group exists, when ``ep * etp`` doesn't divide the world.
    """
    if not dist.is_initialized():
        raise DistributedError(
            "torch.distributed is not initialised: run under torchrun, call moecompile.distributed.init(plan), "
            "or torch.distributed.init_process_group(...) first"
        )
    W, rank = dist.get_world_size(), dist.get_rank()
    check_ep(ep, W, etp)
    ep = ep * etp  # the ep group: ranks a layer's experts (their slices) are spread over
    if _WORLDS_OWNER[0] is not dist.group.WORLD:
        _WORLDS.clear()
        _WORLDS_OWNER[0] = dist.group.WORLD
    key = (ep, etp, float(timeout_s), node_ranks)
    if key in _WORLDS:
        return _WORLDS[key]
    edp = W // ep
    timeout = datetime.timedelta(seconds=timeout_s)
    ep_sets = [tuple(range(g * ep, (g + 1) * ep)) for g in range(edp)]
    edp_sets = [tuple(range(j, W, ep)) for j in range(ep)]
    kinds = [("ep", ep_sets), ("edp", edp_sets), ("dp", [tuple(range(W))])]
    if 1 < node_ranks < ep:
        G = node_ranks
        kinds += [("node", [s[i:i + G] for s in ep_sets for i in range(0, ep, G)]),
                  ("rail", [s[g::G] for s in ep_sets for g in range(G)])]
    mine: dict[str, Any] = {}
    for kind, sets in kinds:
        for i, ranks in enumerate(sets):  # every rank creates every group, in the same order
            desc = f"{kind}{i}" if len(sets) > 1 else kind
            pg = dist.new_group(list(ranks), timeout=timeout, group_desc=desc)
            if rank in ranks:
                mine[kind] = pg
                _GROUPS[pg.group_name] = (desc, ranks, float(timeout_s))
    world = World(
        rank=rank, world_size=W, ep=ep, ep_rank=rank % ep, ep_group=mine["ep"], edp_group=mine["edp"],
        dp_group=mine["dp"], edp=edp, edp_rank=rank // ep, ep_ranks=ep_sets[rank // ep],
        edp_ranks=edp_sets[rank % ep], timeout_s=float(timeout_s), etp=etp,
        node_ranks=node_ranks if "node" in mine else 1, node_group=mine.get("node"), rail_group=mine.get("rail"),
    )
    _WORLDS[key] = world
    log.info("rank %d: ep group %s, edp group %s, dp world %d", rank, world.ep_ranks, world.edp_ranks, W)
    return world


def resolve_world(plan: Any, world: World | None) -> World | None:
    """The world ``convert`` hands the passes: the given one, or one built from the plan when
    ``torch.distributed`` is initialised; ``None`` for a single process (``parallel.ep`` must be 1)."""
    ep, etp = plan.parallel.ep, plan.parallel.etp
    if world is None and dist.is_available() and dist.is_initialized():
        world = world_from_plan(plan)
    if world is None:
        if ep * etp > 1:
            what = f"parallel.ep={ep}" if etp == 1 else f"parallel.ep={ep} x parallel.etp={etp}"
            raise DistributedError(
                f"{what} needs {ep * etp} or a multiple of {ep * etp} processes with torch.distributed initialised: "
                "launch with torchrun --nproc-per-node N, call moecompile.distributed.init(plan) first, "
                "or pass world= to convert"
            )
        return None
    if (world.ep, world.etp) != (ep * etp, etp):
        raise PlanError("parallel.ep", ep, f"the world passed to convert was built for ep={world.ep // world.etp}, "
                        f"etp={world.etp}; build it from this plan")
    if world.node_ranks != plan.parallel.node_level_ranks:
        raise PlanError("parallel.node_ranks", plan.parallel.node_ranks, f"the world passed to convert was built "
                        f"with {world.node_ranks} ranks per node; build it from this plan")
    return world


# ---------------------------------------------------------------- collectives (graph node targets)


def _describe(group_name: str) -> str:
    desc, ranks, timeout = _GROUPS.get(group_name, (group_name, (), 0.0))
    where = f"process group '{desc}' (c10d name {group_name!r}, ranks {list(ranks)}"
    return where + (f", timeout {timeout:g} s)" if timeout else ")")


def _named(e: BaseException, kind: str, what: str, group_name: str) -> DistributedError:
    cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
    rank = dist.get_rank() if dist.is_initialized() else "?"
    err = DistributedError(
        f"{kind} '{what}' on {_describe(group_name)} failed on rank {rank}: {cause}. A peer rank raised, died "
        "or never reached this collective (its own log says why); if the ranks are only slow, raise "
        "parallel.timeout_s."
    )
    err.collective, err.group = f"{kind} '{what}'", group_name  # type: ignore[attr-defined]
    return err


def wait_work(handle: Any, kind: str, what: str, group: Any) -> None:
    """``handle.wait()`` of a collective the training step launched (a gradient bucket's sum, a parameter
    all-gather), whose failure is a DistributedError naming it, its group and this rank."""
    try:
        handle.wait()
    except RuntimeError as e:
        raise _named(e, kind, what, getattr(group, "group_name", str(group))) from e


_lib = torch.library.Library("moecompile", "FRAGMENT")
_lib.define("wait_tensor(Tensor(a) self, str what, str group_name) -> Tensor(a)")


def _wait_impl(t: torch.Tensor, what: str, group_name: str) -> torch.Tensor:
    try:
        return _fc.wait_tensor(t)
    except RuntimeError as e:
        raise _named(e, "collective", what, group_name) from e


# CompositeImplicitAutograd: torch's wait_tensor underneath supplies autograd (identity) and the
# fake impl, and a trace (export, make_fx) sees through to it.
_lib.impl("wait_tensor", _wait_impl, "CompositeImplicitAutograd")


def wait_tensor(t: torch.Tensor, what: str, group_name: str) -> torch.Tensor:
    """``torch.ops.moecompile.wait_tensor``: torch's ``wait_tensor`` whose failure names the collective."""
    return torch.ops.moecompile.wait_tensor(t, what, group_name)


# The collective starts the pass emits: torch's functional collectives, whose registered autograd runs
# the transposed collective in the backward (waited there, so those failures stay the backend's own
# RuntimeError, still bounded by the group's timeout).
ALL_TO_ALL = _fc.all_to_all_single.default  # (x, output_split_sizes, input_split_sizes, group_name)
ALL_GATHER = _fc.all_gather_into_tensor.default  # (x, group_size, group_name), along dim 0
REDUCE_SCATTER = _fc.reduce_scatter_tensor.default  # (x, "sum", group_size, group_name), along dim 0
ALL_REDUCE = _fc.all_reduce.default  # (x, "sum", group_name)
COLLECTIVE_STARTS = (ALL_TO_ALL, ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)
WAITS = (torch.ops.moecompile.wait_tensor.default, _fc.wait_tensor.default)


# ---------------------------------------------------------------- expert shards and gradients


def expert_shards(module: nn.Module) -> dict[str, ExpertShard]:
    """Parameter name -> the global expert rows it holds, for every expert tensor of ``module``."""
    out = {}
    for path, sub in module.named_modules():
        shard = getattr(sub, "expert_shard", None)
        if isinstance(shard, ExpertShard):
            for name, _p in sub.named_parameters(recurse=False):
                out[f"{path}.{name}" if path else name] = shard
    return out


def reduce_gradients(module: nn.Module, world: World | None) -> None:
    """Average gradients the way the world's layout needs: dense over dp, experts over edp.

    Both are divided by ``world_size`` (see the module docstring). One collective per tensor.
    """
    if world is None or world.world_size == 1:
        return
    experts = expert_shards(module)
    for name, p in module.named_parameters():
        if p.grad is None:
            continue
        expert = name in experts
        group, size = (world.edp_group, world.edp) if expert else (world.dp_group, world.world_size)
        if size > 1:
            try:
                dist.all_reduce(p.grad, group=group)
            except RuntimeError as e:
                raise _named(e, "all_reduce", f"grad of {name}", group.group_name) from e
        p.grad.div_(world.world_size)
