"""``moecompile.build_train_step``: the compiler's output, one call per training step.

    step = mc.build_train_step(result, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    for x, y in data:
        m = step(x, y)          # StepMetrics: loss, router losses, tokens/s, expert load
    step.save("ckpt")           # torch.distributed.checkpoint; each rank writes its experts
    step.load("ckpt")

One call runs::

    forward (bf16 autocast optional)  ->  loss_fn(output, y) + result.router_loss()
    -> backward into flat gradient buckets  ->  bucketed all-reduce (dense: dp, experts: edp; each
       bucket's launched from backward once complete: parallel.overlap_grad_reduce, moecompile.grad_overlap)
    -> optional clipping by the global norm  ->  optimizer step  (fp32 master weights if the
    model is bf16)  ->  expert-bias update from the global per-expert load  ->  metrics

With ``parallel.shard_optimizer`` (ZeRO-1) the all-reduce becomes a reduce-scatter, the optimizer
updates this rank's range of each bucket (its state and masters exist for that range only), and
an all-gather of the parameters follows it (moecompile.grad_sync, moecompile.optimizer), or, with
``parallel.overlap_param_gather``, runs behind the next forward (moecompile.param_gathers).
``parallel.shard_gradients`` (ZeRO-2) reduce-scatters each bucket as backward completes it
(moecompile.grad_shards); ``parallel.shard_parameters`` (ZeRO-3) keeps this rank's range of the
parameters too, and the graph gathers each bucket where it is read (moecompile.param_shards):
read them outside a step inside ``step.gathered()``.

A batch of M times the batch the graph was traced at runs as M micro-batches (gradient
accumulation: each backward adds 1/M of its loss into the buckets, synced once; router losses
are per micro-batch). Metrics are reduced over the data-parallel group in one small
collective, launched after the last forward and waited on after the optimizer.
``compile=True`` runs the forward under ``torch.compile`` (``TrainStep._compile``).
``cuda_graph.mode`` picks how the step runs (moecompile.cuda_graphs); on CPU it runs eagerly
and says so once, and (``keep_host_memory``) keeps freed host memory for reuse, since a fresh
large CPU tensor costs page faults every step (moecompile.host_memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from . import grad_hooks, host_memory, optimizer_offload, param_gathers, param_shards
from .distributed import wait_work
from .errors import MoecompileError
from .bucket_layout import expert_parameters, first_reads, moe_blocks
from .grad_sync import GradBuckets
from .optimizer import OptimizerFactory, build_optimizer

log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]
PRECISIONS = ("fp32", "bf16")


def causal_lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``targets`` are already shifted (position i predicts targets[i])."""
    logits = getattr(output, "logits", None)
    if logits is None:
        logits = output[0] if isinstance(output, (tuple, list)) else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)


@dataclasses.dataclass
class StepMetrics:
    """What one step measured; losses are means over the global batch (every rank agrees)."""

    step: int
    loss: float  # lm loss + plan-weighted router losses
    lm_loss: float
    router_losses: dict[str, float]  # each router loss (unweighted), averaged over layers
    tokens: int  # tokens in the global batch
    time_s: float
    expert_load: dict[str, list[int]]  # layer -> tokens routed to each expert, whole global batch
    grad_norm: float | None = None
    micro_batches: int = 1  # forwards + backwards this rank ran for the step (gradient accumulation)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else float("inf")

    def load_balance(self) -> dict[str, float]:
        """Per layer: max expert load / mean expert load (1.0 is perfectly balanced)."""
        out = {}
        for layer, load in self.expert_load.items():
            mean = sum(load) / len(load)
            out[layer] = max(load) / mean if mean else float("nan")
        return out


class TrainStep:
    """A compiled training step over ``result.module``; see the module docstring."""

    def __init__(
        self,
        result: Any,
        optimizer: OptimizerFactory | None = None,
        loss_fn: LossFn | None = None,
        *,
        world: Any = None,
        clip_grad_norm: float | None = None,
        precision: str | None = None,
        bucket_mb: float = 25.0,
        expert_bias_rate: float | None = None,
        cuda_graph: str | None = None,
        keep_host_memory: bool | None = None,
        compile: bool | dict[str, Any] = False,
    ):
        self.result = result
        self.module: nn.Module = result.module
        self.plan = result.plan
        self.world = world if world is not None else getattr(result.context, "world", None)
        self.loss_fn = loss_fn or causal_lm_loss
        self.clip_grad_norm = clip_grad_norm
        params = dict(self.module.named_parameters())
        if not params:
            raise MoecompileError("the converted module has no parameters to train")
        self.device = next(iter(params.values())).device
        elsewhere = [n for n, t in [*params.items(), *self.module.named_buffers()] if t.device != self.device]
        if elsewhere:
            raise MoecompileError(
                f"the converted module's tensors are on more than one device: {elsewhere[:3]} are not on "
                f"{self.device}; move the module (result.module.to(device)) or convert the model on one device"
            )
        # on CPU, and wherever the optimizer steps on the host in part (its temporaries), freed host memory is reused
        on_host = self.device.type == "cpu" or self.plan.parallel.offload_optimizer > 0
        if keep_host_memory if keep_host_memory is not None else on_host:
            if host_memory.keep_freed_memory():
                log.info("host memory: glibc keeps freed blocks for reuse (no mmap, no trim; keep_host_memory=False "
                         "leaves malloc as it is)")
        self.precision = precision or ("bf16" if self.device.type == "cuda" else "fp32")
        if self.precision not in PRECISIONS:
            raise MoecompileError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        self.expert_names = set(expert_parameters(self.module))
        self.sharded = bool(self.plan.parallel.shard_optimizer and self.world is not None
                            and getattr(self.world, "world_size", 1) > 1)
        param_shards.take_over(self.module)  # a step built before on this module gives its parameters back whole
        param_gathers.take_over(self.module)  # ... with no all-gather still running into them
        grad_hooks.release(params.values())  # and its gradient hooks go: this step places its own
        self.buckets = GradBuckets(params.items(), self.expert_names, self.world, bucket_mb, shard=self.sharded,
                                   shard_grads=self.sharded and self.plan.parallel.shard_gradients,
                                   first_use=first_reads(self.module),
                                   shard_params=self.sharded and self.plan.parallel.shard_parameters,
                                   overlap_gather=self.sharded and self.plan.parallel.overlap_param_gather,
                                   overlap_reduce=self._overlap_grad_reduce())
        for instrumented in (self.buckets.param_shards, self.buckets.param_gathers):
            if instrumented is not None:
                instrumented.instrument(self.module)
        self.trainable = {n: p for n, p in params.items() if p.requires_grad}
        # bf16 parameters train through fp32 master copies; fp32 ones are their own masters
        masters = any(p.dtype != torch.float32 for p in self.trainable.values())
        order = {name: i for i, name in enumerate(self.trainable)}
        # parallel.offload_optimizer: the leading share of them in host memory, stepped by the CPU
        self.updates = optimizer_offload.updates_for(sorted(self.buckets.shards(), key=lambda s: order[s.name]),
                                                     masters, self.plan.parallel.offload_optimizer, self.device)
        self.masters: dict[str, nn.Parameter] = {u.shard.name: u.tensor for u in self.updates} if masters else {}
        self.optimizer = build_optimizer(optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
                                         list(self.trainable.values()), self.updates, self.sharded)
        optimizer_offload.check(self.optimizer, self.updates)
        self.bias_rate = expert_bias_rate if expert_bias_rate is not None else self.plan.experts.expert_bias_rate
        self.biases = self._expert_biases()
        self.step_count = 0
        self.traced_batch = traced_batch(self.module)
        self.parts = 1
        self.forward_module: nn.Module = self.module  # a runner may swap in a split copy (same parameters)
        self.tracing: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # compile sets it
        self.autocast_cache = True
        from .cuda_graphs import make_runner

        mode = cuda_graph if cuda_graph is not None else self.plan.cuda_graph.mode
        if mode != self.plan.cuda_graph.mode and self.device.type == "cuda":  # the plan's rules, for the mode given
            dataclasses.replace(self.plan.cuda_graph, mode=mode).check_against(self.plan.parallel)
        self.runner = make_runner(self, mode)
        if compile:
            self._compile({} if compile is True else dict(compile), mode)

    def _compile(self, options: dict[str, Any], mode: str) -> None:
        """The forward under ``torch.compile``: TorchInductor fuses the dense parts (norms, rotary, residuals)
        and AOTAutograd builds their backward; the MoE ops stay opaque custom ops (fake impls). A dropless
        dispatch's host reads of its splits are traced as unbacked sizes (dynamo's ``capture_scalar_outputs``,
        set around the compiled forward only), so the forward stays one graph instead of breaking at every
        layer's exchange. Compiled on the first step."""
        from .cuda_graphs import EagerRunner

        if not isinstance(self.runner, EagerRunner):
            raise MoecompileError(
                f"compile and cuda_graph.mode={mode!r} both take over the forward: choose one (on CUDA, "
                "compile={'mode': 'reduce-overhead'} captures CUDA graphs of the compiled regions itself)")
        import torch._dynamo as dynamo

        self.forward_module = torch.compile(self.module, **options)
        self.tracing = functools.partial(dynamo.config.patch, capture_scalar_outputs=True)

    def _overlap_grad_reduce(self) -> bool:
        """The plan's ``parallel.overlap_grad_reduce``; null: on unless the data-parallel group is gloo's."""
        on = self.plan.parallel.overlap_grad_reduce
        if on is None:
            dp = getattr(self.world, "dp_group", None)
            on = dp is not None and dist.get_backend(dp) != "gloo"
        return on

    # ------------------------------------------------------------------ one step

    def __call__(self, inputs: Any, targets: Any = None) -> StepMetrics:
        """Run one step on this rank's batch: ``step(x, y)`` or ``step((x, y))``."""
        if targets is None:
            if not (isinstance(inputs, (tuple, list)) and len(inputs) == 2):
                raise MoecompileError("call the step as step(inputs, targets) or step((inputs, targets))")
            inputs, targets = inputs
        start = time.perf_counter()
        inputs, targets = to_device((inputs, targets), self.device)  # a host batch goes to the step's device
        out = self.runner(inputs, targets)
        stats = out["stats"].tolist()  # waits for the device, so the step's time includes its kernels
        norm = None if out.get("grad_norm") is None else float(out["grad_norm"])
        return self._metrics(stats, norm, time.perf_counter() - start)

    def compute(self, inputs: Any, targets: Any) -> dict[str, Any]:
        """The whole step as tensor work (no host sync): what a CUDA graph captures.

        A batch of M times the traced batch runs as M micro-batches, each backward adding
        1/M of its loss's gradient into the buckets, which are synced once.
        """
        self.buckets.prepare()
        parts = self.micro_batches(inputs, targets)
        self.parts = len(parts)  # a captured step replays the count it was captured with
        local, handle = None, None
        for i, (x, y) in enumerate(parts):
            with self._autocast():
                output = self._forward(x)
                lm = self.loss_fn(output, y)
            loss = lm + self.result.router_loss()
            stats = self._local_stats(lm, loss, self.module.moe_stats, y, len(parts))
            local = stats if local is None else local + stats
            if i == len(parts) - 1:  # launched before the last backward, waited on after the optimizer
                reduced, handle = self._reduce_stats(local)
                self.buckets.last_backward()
            (loss / len(parts)).backward()
            self.buckets.after_backward()
        self.buckets.sync()
        norm = self.buckets.clip_(self.clip_grad_norm) if self.clip_grad_norm is not None else None
        optimizer_offload.step(self.optimizer, self.updates, self.device)
        self.write_back()
        if handle is not None:
            wait_work(handle, "collective", "the step's metrics all-reduce", self.world.dp_group)
        self._update_biases(reduced)
        return {"stats": reduced, "grad_norm": norm}

    @torch.no_grad()
    def evaluate(self, inputs: Any, targets: Any = None) -> float:
        """``loss_fn`` on a batch without training on it (held-out loss): no gradients, the step's precision and
        micro-batches (the mean of their losses), on its device. Router losses are not added, and nothing is
        reduced over ranks; with ep > 1 the forward exchanges tokens, so every rank of the ep group calls it."""
        if targets is None:
            inputs, targets = inputs
        parts = self.micro_batches(*to_device((inputs, targets), self.device))
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for x, y in parts:
            with self._autocast():
                total += self.loss_fn(_apply(self.module, x), y).double()
        return float(total) / len(parts)

    def write_back(self) -> None:
        """The optimizer's new values into every rank's parameters: masters copied, shards all-gathered."""
        for u in self.updates:
            u.write_back()
        self.buckets.gather_params()

    def _forward(self, inputs: Any) -> Any:
        shards = self.buckets.param_shards
        with shards.saving() if shards is not None else contextlib.nullcontext(), self.tracing():
            return _apply(self.forward_module, inputs)

    def gathered(self) -> contextlib.AbstractContextManager:
        """The parameters whole in the module, for reads outside a step (export, evaluation); every rank enters
        it. Needed under ``parallel.shard_parameters``, where a rank otherwise keeps its range of them, and
        ``overlap_param_gather``, where the last step's all-gather may still be writing them."""
        param_gathers.settle(self.module)
        shards = self.buckets.param_shards
        return shards.gathered() if shards is not None else contextlib.nullcontext()

    def param_bytes(self) -> int:
        """Bytes of trainable parameters this rank keeps between steps (ZeRO-3: its ranges of the sharded ones)."""
        return self.buckets.param_bytes()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16" and not self.masters:
            _register_moe_autocast(self.device.type)
            return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=self.autocast_cache)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ metrics and expert bias

    def _stat_layout(self) -> tuple[list[str], list[tuple[str, int]]]:
        names = sorted({k for d in self.module.moe_stats.losses.values() for k in d})
        loads = [(layer, int(v.numel())) for layer, v in sorted(self.module.moe_stats.load.items())]
        return names, loads

    def micro_batches(self, inputs: Any, targets: Any) -> list[tuple[Any, Any]]:
        """The rank's batch as micro-batches of the batch the graph was traced at."""
        return split_micro_batches(inputs, targets, self.traced_batch)

    def _local_stats(self, lm: torch.Tensor, loss: torch.Tensor, stats: Any, targets: Any, parts: int) -> torch.Tensor:
        """This micro-batch's [loss, lm, tokens, router losses (layer means), loads...] in float64; the
        losses divided by the micro-batch count, so the sum over micro-batches is their mean."""
        names, loads = self._stat_layout()
        out = [loss.detach().double().reshape(1) / parts, lm.detach().double().reshape(1) / parts,
               torch.full((1,), float(_numel(targets)), dtype=torch.float64, device=self.device)]
        for name in names:
            values = [d[name].detach().double() for d in stats.losses.values() if name in d]
            out.append((sum(values) / len(values)).reshape(1).to(self.device) / parts)
        out += [stats.load[layer].double().reshape(-1).to(self.device) for layer, _ in loads]
        return torch.cat(out)

    def _reduce_stats(self, flat: torch.Tensor):
        """The step's stats summed over dp (one small collective, asynchronous)."""
        dp = getattr(self.world, "dp_group", None) if self.world is not None else None
        if dp is None or dist.get_world_size(dp) == 1:
            return flat, None
        return flat, dist.all_reduce(flat, group=dp, async_op=True)

    def _expert_biases(self) -> dict[str, torch.Tensor]:
        if not self.plan.experts.expert_bias:
            return {}
        buffers = dict(self.module.named_buffers())
        out = {}
        for layer, info in moe_blocks(self.module).items():
            name = info["params"].get("bias")
            if name in buffers:
                out[layer] = buffers[name]
        return out

    def _update_biases(self, reduced: torch.Tensor) -> None:
        """DeepSeek-V3 aux-loss-free balancing: b_e += rate * sign(mean load - load_e), global load."""
        if not self.biases:
            return
        names, loads = self._stat_layout()
        offset = 3 + len(names)
        with torch.no_grad():
            for layer, n in loads:
                load = reduced[offset : offset + n]
                offset += n
                if layer in self.biases:
                    b = self.biases[layer]
                    b.add_((load.mean() - load).sign().to(b.dtype) * self.bias_rate)

    def _metrics(self, flat: list[float], norm: float | None, seconds: float) -> StepMetrics:
        self.step_count += 1
        names, loads = self._stat_layout()
        dp_size = self.buckets.dp_size
        offset = 3 + len(names)
        load = {}
        for layer, n in loads:
            load[layer] = [int(round(v)) for v in flat[offset : offset + n]]
            offset += n
        return StepMetrics(
            step=self.step_count, loss=flat[0] / dp_size, lm_loss=flat[1] / dp_size,
            router_losses={name: flat[3 + i] / dp_size for i, name in enumerate(names)},
            tokens=int(flat[2]), time_s=seconds, expert_load=load,
            grad_norm=norm, micro_batches=self.parts,
        )

    def optimizer_bytes(self) -> int:
        """Bytes this rank keeps for the optimizer on its device: the state tensors (built by the first step) and
        fp32 masters of the updates not offloaded (``host_optimizer_bytes`` has the others)."""
        kept = [u for u in self.updates if not isinstance(u, optimizer_offload.HostUpdate)]
        masters = sum(u.tensor.numel() * u.tensor.element_size() for u in kept if u.is_copy)
        return self._state_bytes(kept) + masters

    def host_optimizer_bytes(self) -> int:
        """Host bytes of the offloaded updates (``parallel.offload_optimizer``): their fp32 masters, the masters'
        gradients, the pinned transfer buffers and the optimizer state (built by the first step)."""
        host = [u for u in self.updates if isinstance(u, optimizer_offload.HostUpdate)]
        return self._state_bytes(host) + sum(u.nbytes() for u in host)

    def _state_bytes(self, updates: list[Any]) -> int:
        state = {id(t): t.numel() * t.element_size()
                 for u in updates for t in self.optimizer.state.get(u.tensor, {}).values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0}
        return sum(state.values())

    # ------------------------------------------------------------------ state

    def save(self, path: str) -> None:
        """Write model, optimizer, RNG and step count (see moecompile.checkpoint)."""
        from .checkpoint import save

        param_gathers.settle(self.module)
        save(self, path)

    def load(self, path: str) -> None:
        """Restore what ``save`` wrote, at this step's expert-parallel layout (any ep)."""
        from .checkpoint import load

        param_gathers.settle(self.module)
        if self.buckets.param_shards is not None:  # a bucket a forward kept whole would go stale
            self.buckets.param_shards.release_all()
        load(self, path)
        param_gathers.settle(self.module)  # not hot: the loaded parameters are whole on return


def traced_batch(gm: nn.Module) -> int | None:
    """The batch size the graph's first tensor input was traced at; None if it may vary (``dynamic=True``)."""
    graph = getattr(gm, "graph", None)
    if graph is None or getattr(gm, "meta", {}).get("dynamic"):
        return None
    for node in graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and val.dim() >= 1:
            return val.shape[0] if isinstance(val.shape[0], int) else None
    return None


def split_micro_batches(inputs: Any, targets: Any, traced: int | None) -> list[tuple[Any, Any]]:
    """``(inputs, targets)`` of B sequences as B / ``traced`` micro-batches (gradient accumulation).

    A graph traced at a fixed batch takes exactly that many sequences a forward; a batch of M
    times as many runs as M micro-batches. Input tensors with another leading size (a broadcast
    [1, S] position tensor) go to every micro-batch whole; every target must have the batch's.
    """
    batched = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() >= 1]
    if traced is None or not batched or batched[0].shape[0] == traced:
        return [(inputs, targets)]
    B = batched[0].shape[0]
    if B % traced:
        raise MoecompileError(
            f"the batch has {B} sequences but the graph was traced at {traced}: give a multiple of {traced} (the "
            f"step runs it as micro-batches of {traced}, accumulating gradients) or convert with example inputs "
            f"of the batch you train with")
    odd = [tuple(t.shape) for t in pytree.tree_leaves(targets)
           if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] != B)]
    if odd:
        raise MoecompileError(f"the inputs hold {B} sequences but targets of shape {odd[0]} do not: the step splits "
                              "the batch into micro-batches, so every target needs the batch as its first dim")

    def part(tree: Any, i: int) -> Any:
        return pytree.tree_map(lambda t: t.narrow(0, i * traced, traced)
                               if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == B else t, tree)

    return [(part(inputs, i), part(targets, i)) for i in range(B // traced)]


def _numel(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel()
    if isinstance(t, dict) and "labels" in t:
        return t["labels"].numel()
    raise MoecompileError("targets must be a tensor (the next-token ids, one per input position)")


def _apply(module: Any, inputs: Any) -> Any:
    """``module`` called on a batch given as a tensor, a tuple of positional inputs or a dict of named ones."""
    if isinstance(inputs, dict):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or tuples, lists and dicts of them) with its tensors on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


_AUTOCAST_DONE: set[str] = set()
_AUTOCAST_OPS = ("moecompile::grouped_mm",)  # the expert GEMMs; route and combine keep their dtypes


def _register_moe_autocast(device_type: str) -> None:
    """Let autocast run the expert GEMMs in bf16 like the dense linears, and cast the tokens to bf16 before the
    permute copies each k times and the dispatch sends them (once per device type)."""
    if device_type in _AUTOCAST_DONE:
        return
    for op in _AUTOCAST_OPS:
        torch.library.register_autocast(op, device_type, torch.bfloat16)
    _register_tokens_autocast("moecompile::permute", device_type, torch.bfloat16)
    _AUTOCAST_DONE.add(device_type)


def _register_tokens_autocast(qualname: str, device_type: str, dtype: torch.dtype) -> None:
    """Autocast for an op whose first argument is the tokens: only they are cast (``register_autocast`` would
    cast every float argument, here the routing probabilities that order a capacity's drops). Under autocast the
    residual stream stays fp32 and the experts' GEMMs cast their input to bf16 anyway, so the values the GEMMs
    see are the same; the bytes of the permute's gather and of the dispatch all-to-all halve."""
    namespace, name = qualname.split("::")
    op = getattr(getattr(torch.ops, namespace), name).default
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(_keyset: Any, x: torch.Tensor, *args: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(x.to(dtype) if x.is_floating_point() else x, *args)

    if namespace not in _AUTOCAST_LIBS:
        _AUTOCAST_LIBS[namespace] = torch.library.Library(namespace, "FRAGMENT")
    _AUTOCAST_LIBS[namespace].impl(name, kernel, key, with_keyset=True)


_AUTOCAST_LIBS: dict[str, torch.library.Library] = {}  # kept alive: dropping a Library unregisters its kernels


def build_train_step(
    result: Any,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    **options: Any,
) -> TrainStep:
    """The training step for a ``convert`` result.

    ``optimizer``: a factory ``params -> torch.optim.Optimizer`` (default AdamW, lr 1e-3); the
    step builds the optimizer over the parameters it owns (fp32 masters for a bf16 model; under
    ``parallel.shard_optimizer`` it is called on the parameters, and its param groups then hold
    this rank's parts of them, so it must be elementwise: SGD, Adam, AdamW, ...).
    ``loss_fn(output, targets)``: default next-token cross-entropy on ``output.logits``.
    Options: ``world`` (default: the one ``convert`` used), ``clip_grad_norm``, ``precision``
    ("fp32" | "bf16"; default bf16 on CUDA, fp32 on CPU), ``bucket_mb`` (gradient bucket size),
    ``expert_bias_rate`` (default ``plan.experts.expert_bias_rate``), ``cuda_graph``
    ("none" | "partial" | "full"; default ``plan.cuda_graph.mode``), ``keep_host_memory`` (default
    True on CPU and with ``parallel.offload_optimizer``: ``moecompile.host_memory.keep_freed_memory``, process-wide),
    ``compile`` (False; True or ``torch.compile``'s keyword arguments: the forward runs compiled,
    ``TrainStep._compile``).
    The batch the step is called with may be any multiple of the batch ``convert`` traced: it
    runs as that many micro-batches (gradient accumulation), so convert at the micro-batch.
    """
    return TrainStep(result, optimizer, loss_fn, **options)
