"""Memory per rank, estimated from fake tensors before anything runs: ``estimate_memory(result)``.

    est = mc.estimate_memory(result)            # the example batch; batch=8 or batch=(ids,) for another
    print(est)                                  # params / grads / optimizer / activations, by layer and category
    est.activations, est.by_category["experts"], est.by_pass[-1]

Activations are moecompile.memory's peak (``profile_activations``, see its doc); parameters,
gradients and optimizer states are what build_train_step keeps on this rank, ZeRO ranges and the
buffers its runtime keeps in flight included (moecompile/memory_shards.py).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .bucket_layout import expert_parameters, param_reads
from .costs import human
from .errors import MoecompileError
from .memory import CATEGORIES, ActivationProfile, profile_activations
from .memory_shards import bucket_layout, optimizer_rank, optimizer_ranks, rank_shards, sharded_state
from .optimizer_offload import offloaded_count, transfer_bytes

_OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "none": 0}


# ---------------------------------------------------------------- the estimate


@dataclasses.dataclass
class PassMemory:
    """Memory after one pass (``result.history``): how the pass changed it."""

    name: str
    params: int | None
    activations: int | None
    offloaded: int | None
    note: str = ""


@dataclasses.dataclass
class MemoryEstimate:
    """Bytes per rank for one training step at ``batch``; ``activations`` is moecompile.memory's peak."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int
    offloaded: int  # host bytes of offloaded activations
    by_category: dict[str, int]
    by_layer: dict[str, dict[str, int]]
    by_pass: list[PassMemory]
    tokens: int
    profile: ActivationProfile = dataclasses.field(repr=False)
    masters: int = 0  # fp32 master copies of low-precision parameters (build_train_step keeps them)
    expert_params: int = 0  # the part of ``params`` that is this rank's routed experts (E/ep of them)
    master_grads: int = 0  # the part of ``grads`` that is the masters' fp32 .grad
    shard_optimizer: bool = False  # optimizer, masters and master grads are this rank's range (ZeRO-1)
    dp: int = 1  # ranks the dense ranges are split over (the data-parallel world) when sharded
    edp: int = 1  # ranks the expert ranges are split over (dp / ep) when sharded
    shard_gradients: bool = False  # model-dtype grads are this rank's range too, + buckets in flight (ZeRO-2)
    in_flight_grads: int = 0  # the part of ``grads`` that is ZeRO-2's whole bucket buffers in flight
    shard_parameters: bool = False  # parameters are this rank's range too, + buckets gathered (ZeRO-3)
    in_flight_params: int = 0  # the part of ``params`` that is ZeRO-3's whole parameter buckets gathered
    offload_optimizer: float = 0.0  # the share of the optimizer's elements whose state, masters and grads are on host
    host_optimizer: int = 0  # their host bytes (not in ``total``: the device's); see parallel.offload_optimizer

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.masters + self.buffers + self.activations

    def __str__(self) -> str:
        return self.table()

    def table(self) -> str:
        b = lambda n: "-" if n is None else human(n, "B", 1024)  # noqa: E731
        lines = [f"memory per rank ({self.tokens} tokens)",
                 f"  params {b(self.params)}  grads {b(self.grads)}  optimizer {b(self.optimizer)}  masters {b(self.masters)}  "
                 f"buffers {b(self.buffers)}  activations {b(self.activations)}  (offloaded to host {b(self.offloaded)})"]
        cats = [c for c in CATEGORIES if any(c in d for d in self.by_layer.values())]
        rows = [("layer", *cats, "total")]
        for layer, d in self.by_layer.items():
            rows.append((layer, *(b(d.get(c, 0)) for c in cats), b(sum(d.values()))))
        rows.append(("total", *(b(self.by_category.get(c, 0)) for c in cats), b(self.activations)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        if self.by_pass:
            lines.append("  after pass: " + ", ".join(f"{p.name} {b(p.activations)}" for p in self.by_pass))
        if self.shard_optimizer:
            what = ("params, optimizer, masters and all grads (parallel.shard_parameters)" if self.shard_parameters
                    else "optimizer, masters and all grads (parallel.shard_gradients)" if self.shard_gradients else
                    "optimizer, masters and their grads (parallel.shard_optimizer)")
            lines.append(f"  {what}: this rank's range, dense / dp={self.dp}, experts / edp={self.edp}")
        if self.in_flight_grads:
            lines.append(f"  grads include {b(self.in_flight_grads)} of whole gradient buckets in flight (ZeRO-2)")
        if self.in_flight_params:
            lines.append(f"  params include {b(self.in_flight_params)} of whole parameter buckets gathered (ZeRO-3)")
        if self.offload_optimizer:
            lines.append(f"  optimizer state, fp32 masters and their grads of {self.offload_optimizer:.0%} of the elements "
                         f"in host memory: {b(self.host_optimizer)} (parallel.offload_optimizer; not in the device's)")
        return "\n".join(lines)


def _resize(t: Any, b0: int, b: int) -> Any:
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != b0:
        return t
    reps = -(-b // b0)
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:b]


def example_inputs(result: Any, batch: Any = None) -> list[Any]:
    """The graph's flat inputs: the example batch, resized to ``batch`` sequences, or ``batch`` itself."""
    args, kwargs = tuple(result.example_inputs), dict(result.example_kwargs)
    if isinstance(batch, int) and not isinstance(batch, bool):
        b0 = next((t.shape[0] for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor) and t.dim()), None)
        if b0 is not None and batch != b0:
            args, kwargs = pytree.tree_map(lambda t: _resize(t, b0, batch), (args, kwargs))
    elif batch is not None:
        args = batch if isinstance(batch, tuple) else (batch,)
    return pytree.tree_leaves((args, kwargs))


def estimate_memory(result: Any, batch: Any = None, *, optimizer: str = "adamw", state_dtype: torch.dtype | None = None,
                    master_weights: bool | None = None, by_pass: bool = True, shard_optimizer: bool | None = None,
                    dp: int | None = None, shard_gradients: bool | None = None, bucket_mb: float = 25.0,
                    shard_parameters: bool | None = None, backend: str | None = None,
                    offload_optimizer: float | None = None, rank: int | None = None) -> MemoryEstimate:
    """Per-rank memory of ``result`` (a ConversionResult) for a training step; nothing real runs.

    On an expert-parallel graph (``parallel.ep`` > 1, converted on this rank) every figure is this
    rank's: parameters, gradients and optimizer states of its E/ep local experts plus the dense
    part, activations with the dispatch/combine exchange buffers (dropless splits taken as
    balanced routing). ``batch``: None (the example inputs), an int (that many sequences of the
    example's length), or the inputs themselves. ``optimizer``: adam | adamw (2 states per parameter) | sgd |
    sgd_momentum | none. ``master_weights``: fp32 master copies of the trainable parameters (and
    their fp32 gradients, counted in ``grads``); None does what ``build_train_step`` does: masters
    when any trainable parameter is not fp32. ``state_dtype``: the optimizer states' dtype; None
    is the dtype the optimizer sees (fp32 with masters, else each parameter's own, as torch.optim
    keeps them). ``by_pass``: also estimate activations after every pass in ``result.history``.

    ``shard_optimizer`` (None: ``plan.parallel.shard_optimizer``): ZeRO-1, the optimizer states,
    masters and the masters' grads are this rank's range only: dense parameters' over ``dp`` ranks,
    experts' over ``edp = dp / ep``, the parts of the parameters build_train_step's ranges give the rank
    ``rank`` (below; they are cut at aligned offsets, so ranks' differ); parameters and model-dtype grads stay
    whole. ``dp``: the data-parallel world
    size of the run to estimate; None takes the result's world (1 for a single-process conversion,
    where sharding changes nothing). A single-process ``ep=1`` conversion holds what every rank of an
    ``ep=1`` run holds, so ``dp=4`` estimates one rank of 4; for ``ep > 1`` convert under the world
    (or a fake process group) so the graph holds E/ep experts.

    ``shard_gradients`` (None: ``plan.parallel.shard_gradients``, or False when ``shard_optimizer=False``
    is passed): ZeRO-2, the model-dtype grads are this rank's range too, plus the whole bucket
    buffers in flight (``in_flight_grads``): the most at once of those backward fills side by side and
    those whose reduce-scatter is running, from build_train_step's own code run over the buckets of
    ``bucket_mb`` (build_train_step's) in the graph's backward order
    (memory_shards.in_flight_peak). ``backend``: the collectives' ("nccl" keeps 2 reduce-scatters in
    flight, "gloo" exchanges one bucket at a time); None: the run's process group's, or without one
    nccl for CUDA parameters and gloo for CPU ones. A bucket over a group of one rank (experts at
    edp = 1) stays whole.

    ``shard_parameters`` (None: ``plan.parallel.shard_parameters`` where shard_gradients is on): ZeRO-3, the
    parameters are this rank's range too, plus the whole buckets gathered (``in_flight_params``): the most
    at once as the runtime gathers them, simulated over the graph's reads (a bucket whole from its first read to
    its last, the next one prefetched; memory_shards.gathered_peak).

    ``offload_optimizer`` (None: ``plan.parallel.offload_optimizer``): the share of the optimizer's elements
    build_train_step keeps in host memory (whole tensors in parameter order, so at least that share:
    ``offload_optimizer`` reports the share reached). Their state, fp32 masters (made for fp32 parameters
    too) and the masters' grads leave the device figures for ``host_optimizer``, with the pinned buffers
    their gradients and values cross in on CUDA. Under shard_optimizer the host part is the leading tensors of
    this rank's ranges (padding excluded), as the runtime picks them, so ``host_optimizer``, the device's optimizer
    and masters, and ``offload_optimizer`` are that rank's exactly; ``rank`` (None: the result's own, or 0 for a
    single-process conversion) names the data-parallel rank of the ``dp`` estimated, as ranks' ranges differ.
    """
    if optimizer not in _OPTIMIZER_STATES:
        raise MoecompileError(f"estimate_memory: optimizer {optimizer!r} unknown; use one of {', '.join(_OPTIMIZER_STATES)}")
    if state_dtype is not None and not isinstance(state_dtype, torch.dtype):
        raise MoecompileError(f"estimate_memory: state_dtype must be a torch.dtype (e.g. torch.float32), got {state_dtype!r}")
    gm = result.module
    inputs = example_inputs(result, batch)
    ep = result.plan.parallel.expert_ranks  # the graph holds this rank's E/ep experts and its dispatch/combine buffers
    try:
        profile = profile_activations(gm.graph, gm, inputs, ep=ep)
    except Exception as e:
        if batch is None:
            raise
        raise MoecompileError(
            f"estimate_memory: the graph does not run on the inputs for batch={batch!r} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); a graph traced with static shapes only takes its example "
            "batch size: convert with dynamic=True to estimate other batches"
        ) from e
    named = dict(gm.named_parameters())  # shared parameters once
    trainable = {n: p for n, p in named.items() if p.requires_grad}
    experts = set(expert_parameters(gm))
    if master_weights is None:  # build_train_step: bf16 parameters train through fp32 masters
        master_weights = any(p.dtype != torch.float32 for p in trainable.values())
    shard, dp, edp = optimizer_ranks(result, shard_optimizer, dp, ep)
    rank = optimizer_rank(result, rank, dp)
    if shard_gradients is None:
        shard_gradients = result.plan.parallel.shard_gradients and shard_optimizer is not False
    if shard_gradients and not shard:
        raise MoecompileError("estimate_memory: shard_gradients=True needs shard_optimizer (ZeRO-2 keeps the "
                              "gradients of the ranges ZeRO-1 gives each rank): pass shard_optimizer=True too, or "
                              "shard_gradients=False")
    if shard_parameters is None:
        shard_parameters = result.plan.parallel.shard_parameters and bool(shard_gradients)
    if shard_parameters and not shard_gradients:
        raise MoecompileError("estimate_memory: shard_parameters=True needs shard_gradients (ZeRO-3 keeps the "
                              "parameters of the ranges whose gradients ZeRO-2 keeps): pass shard_gradients=True "
                              "and shard_optimizer=True too, or shard_parameters=False")
    # this rank's ranges, the whole gradient buckets backward fills and sends, the parameter buckets gathered
    reads = param_reads(gm)
    mine, g_bytes, in_flight, gathered = sharded_state(trainable, experts, dp, edp, bucket_mb,
                                                       grads=bool(shard_gradients), params=bool(shard_parameters),
                                                       reads=reads, exchange=_backend(backend, trainable) == "gloo")
    p_bytes = mine + gathered + sum(p.numel() * p.element_size() for p in named.values() if not p.requires_grad)
    offload = result.plan.parallel.offload_optimizer if offload_optimizer is None else offload_optimizer
    if not 0.0 <= offload <= 1.0:
        raise MoecompileError(f"estimate_memory: offload_optimizer={offload!r} is a share of the optimizer's "
                              "elements, from 0 to 1")
    size = torch.empty((), dtype=state_dtype).element_size() if state_dtype is not None else None
    state = lambda p: size or (4 if master_weights else p.element_size())  # noqa: E731  bytes per state per element
    states = _OPTIMIZER_STATES[optimizer]
    state_bytes, m_bytes, host, share = _optimizer_parts(
        trainable, experts, (dp, edp, ep, rank) if shard and dp > 1 else None, bucket_mb, reads, offload,
        states, state, master_weights)
    buf_bytes = sum(b.numel() * b.element_size() for b in gm.buffers())
    x_bytes = sum(named[n].numel() * named[n].element_size() for n in expert_parameters(gm) if n in named)
    by_layer: dict[str, dict[str, int]] = {}
    for k, t in profile.tensors.items():
        if t.on_device or k in profile.outputs:
            d = by_layer.setdefault(t.layer, {})
            d[t.category] = d.get(t.category, 0) + t.nbytes
    history = []
    if by_pass:
        for rec in result.history:
            history.append(_pass_memory(rec, gm, inputs, ep))
    tokens = next((t.numel() for t in inputs if isinstance(t, torch.Tensor) and not t.is_floating_point()), 0)
    return MemoryEstimate(
        params=p_bytes, grads=g_bytes + in_flight + m_bytes, optimizer=state_bytes,
        buffers=buf_bytes,
        activations=profile.device_bytes, offloaded=profile.host_bytes, by_category=profile.split("category"),
        by_layer=dict(sorted(by_layer.items(), key=lambda kv: _layer_order(kv[0]))), by_pass=history,
        tokens=tokens, profile=profile, masters=m_bytes, expert_params=x_bytes, master_grads=m_bytes,
        shard_optimizer=shard, dp=dp, edp=edp, shard_gradients=bool(shard_gradients), in_flight_grads=in_flight,
        shard_parameters=bool(shard_parameters), in_flight_params=gathered, offload_optimizer=share,
        host_optimizer=host,
    )


def _optimizer_parts(trainable: dict[str, torch.nn.Parameter], experts: set[str],
                     ranks: tuple[int, int, int, int] | None, bucket_mb: float, reads: dict[str, tuple[int, int]],
                     offload: float, states: int, state: Callable[[torch.nn.Parameter], int],
                     masters: bool) -> tuple[int, int, int, float]:
    """(device optimizer state, device masters, host bytes, share offloaded) over the tensors the optimizer updates,
    in parameter order: whole parameters, or under ``ranks`` (dp, edp, ep, rank) that rank's parts of them
    (memory_shards.rank_shards). The leading ones are in host memory, as the runtime picks them (offloaded_count)."""
    parts = [(p, p.numel()) for p in trainable.values()]
    if ranks is not None:
        dp, edp, ep, rank = ranks
        layout = bucket_layout(trainable, experts, dp, edp, bucket_mb, {n: f for n, (f, _) in reads.items()})
        parts = [(trainable[s.name], s.hi - s.lo) for s in rank_shards(trainable, layout, rank, ep)]
    n = offloaded_count([k for _, k in parts], offload)
    host_parts, kept = parts[:n], parts[n:]
    total = sum(k for _, k in parts)
    share = sum(k for _, k in host_parts) / total if total else 0.0
    m_bytes = sum(4 * k for _, k in kept) if masters else 0  # the masters and, as much, their fp32 .grad
    # host: the state, the fp32 master and its grad, and on CUDA the pinned buffers the gradient and value cross in
    host = sum(k * (states * state(p) + 8 + (transfer_bytes(p.element_size()) if p.is_cuda else 0))
               for p, k in host_parts)
    return states * sum(k * state(p) for p, k in kept), m_bytes, host, share


def _backend(backend: str | None, trainable: dict[str, torch.nn.Parameter]) -> str:
    """The collectives' backend of the run estimated (see estimate_memory's ``backend``)."""
    if backend is not None:
        if backend not in ("nccl", "gloo"):
            raise MoecompileError(f"estimate_memory: backend={backend!r} unknown; use 'nccl', 'gloo' or None "
                                  "(the run's process group's)")
        return backend
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return str(torch.distributed.get_backend())
    return "nccl" if any(p.is_cuda for p in trainable.values()) else "gloo"


def _layer_order(layer: str) -> tuple:
    m = re.search(r"\.(\d+)$", layer)
    return (0 if "embed" in layer else 1 if m else 2, int(m.group(1)) if m else 0, layer)


def _pass_memory(rec: Any, gm: fx.GraphModule, inputs: list[Any], ep: int = 1) -> PassMemory:
    if rec.graph is None:
        return PassMemory(rec.name, None, None, None, "no graph snapshot")
    try:
        prof = profile_activations(rec.graph, gm, inputs, ep=ep)
    except Exception as e:  # an old snapshot the inputs don't fit (static shapes)
        return PassMemory(rec.name, None, None, None, f"{type(e).__name__}")
    seen, params = set(), 0
    for n in rec.graph.nodes:
        v = n.meta.get("val")
        if n.op == "get_attr" and isinstance(v, torch.Tensor) and n.target not in seen:
            seen.add(n.target)
            params += v.numel() * v.element_size()
    return PassMemory(rec.name, params, prof.device_bytes, prof.host_bytes)
