"""Bucketed gradient synchronisation for the emitted training step.

Two kinds of parameter, two groups ("parallel folding"):

    dense  (attention, norms, embeddings, routers, shared experts)  replicated on every rank
           -> all-reduce over world.dp_group
    expert (experts.w_*, experts.b_*)  rank r holds experts [r*E/ep, (r+1)*E/ep)
           -> all-reduce over world.edp_group (the ranks holding the same experts)

Both are divided by the data-parallel size, so the result is the gradient of the
mean loss over the global batch: an expert shard's backward already sums the
contributions of its whole expert-parallel group (the transposed all-to-all).

Gradients live in flat buckets (``param.grad`` is a view into one), so a bucket
is one collective and nothing is copied: ``buckets.prepare()`` before backward,
``buckets.sync()`` after it. With ``world=None`` there is nothing to sync.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from .meta import MoEInfo

EXPERT_KEYS = ("w_in", "w_out", "b_in", "b_out")  # MoEInfo.params keys of sharded expert tensors


@dataclasses.dataclass(frozen=True)
class ExpertTensor:
    """Where an expert tensor's rows sit in the global expert numbering."""

    layer: str
    key: str  # MoEInfo.params key: w_in | w_out | b_in | b_out
    num_experts: int  # E, global
    lo: int  # first global expert id held here
    hi: int  # one past the last


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
                out[info["params"][key]] = ExpertTensor(layer, key, info["num_experts"], int(lo), int(hi))
    return out


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclasses.dataclass
class Bucket:
    kind: str  # "dense" | "expert"
    group: Any  # process group, or None (nothing to reduce)
    flat: torch.Tensor
    params: list[nn.Parameter]
    views: list[torch.Tensor]


class GradBuckets:
    """Gradients as views into flat buffers, reduced one bucket per collective."""

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], expert_names: set[str], world: Any = None,
                 bucket_mb: float = 25.0):
        self.world = world
        dp = getattr(world, "dp_group", None) if world is not None else None
        edp = getattr(world, "edp_group", None) if world is not None else None
        self.dp_size = _group_size(dp) if world is not None else 1
        groups = {"dense": dp, "expert": edp}
        # reverse registration order ~ the order backward produces gradients (as DDP does)
        named = [(n, p) for n, p in named_params if p.requires_grad][::-1]
        limit = max(1, int(bucket_mb * 2**20))
        self.buckets: list[Bucket] = []
        for kind in ("dense", "expert"):
            by_key: dict[tuple, list[nn.Parameter]] = {}
            for name, p in named:
                if (name in expert_names) == (kind == "expert"):
                    by_key.setdefault((p.dtype, p.device), []).append(p)
            for (dtype, device), params in by_key.items():
                chunk: list[nn.Parameter] = []
                size = 0
                for p in params:
                    if chunk and size + p.numel() * p.element_size() > limit:
                        self.buckets.append(self._bucket(kind, groups[kind], chunk, dtype, device))
                        chunk, size = [], 0
                    chunk.append(p)
                    size += p.numel() * p.element_size()
                if chunk:
                    self.buckets.append(self._bucket(kind, groups[kind], chunk, dtype, device))

    @staticmethod
    def _bucket(kind: str, group: Any, params: list[nn.Parameter], dtype: torch.dtype, device: torch.device) -> Bucket:
        flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        views, offset = [], 0
        for p in params:
            views.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return Bucket(kind, group, flat, params, views)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for b in self.buckets for p in b.params]

    def collectives_per_step(self) -> int:
        return sum(1 for b in self.buckets if b.group is not None and _group_size(b.group) > 1) if self.world else 0

    def prepare(self) -> None:
        """Zero the buckets and point every ``param.grad`` at its view (backward accumulates in place)."""
        for b in self.buckets:
            b.flat.zero_()
            for p, v in zip(b.params, b.views):
                if p.grad is not v:
                    p.grad = v

    def sync(self) -> None:
        """Sum each bucket over its group (all launched before any is waited on), then divide by dp size."""
        if self.world is None:
            return
        handles = []
        for b in self.buckets:
            if b.group is not None and _group_size(b.group) > 1:
                handles.append(dist.all_reduce(b.flat, group=b.group, async_op=True))
        for h in handles:
            h.wait()
        if self.dp_size > 1:
            for b in self.buckets:
                b.flat.div_(self.dp_size)

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm: dense grads are replicated, expert shards summed over the expert-parallel group."""
        sq = {}
        for kind in ("dense", "expert"):
            flats = [b.flat for b in self.buckets if b.kind == kind]
            sq[kind] = sum((f.float().square().sum() for f in flats), torch.zeros((), device=self._device()))
        ep_group = getattr(self.world, "ep_group", None) if self.world is not None else None
        if ep_group is not None and _group_size(ep_group) > 1:
            dist.all_reduce(sq["expert"], group=ep_group)
        return (sq["dense"] + sq["expert"]).sqrt()

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale all grads so the global norm is at most ``max_norm``; returns the norm before (no host sync)."""
        norm = self.grad_norm()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for b in self.buckets:
            b.flat.mul_(scale.to(b.flat.dtype))
        return norm

    def _device(self) -> torch.device:
        return self.buckets[0].flat.device if self.buckets else torch.device("cpu")
