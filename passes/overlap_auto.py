"""``overlap.chunks: auto``: pick the chunk count N from a cost model of one MoE layer.

Measured at conversion, on this machine and this group (a few ms):

    experts(rows) = x0 + x1 * rows          the layer's own expert section, timed at two row counts
    exchange(b)   = a  + b / bw              an all-to-all on the ep group, timed at two sizes

then agreed over the ep group (element-wise max), so every rank picks the same N and the ranks'
graphs issue the same collectives. The model replays the schedule the pass emits: every chunk's
dispatch starts up front and the link serves exchanges in order (one link for dispatch and
combine), chunk c's experts run once its rows arrived and chunk c-1's experts are done, and its
combine is queued when they finish. Layer time(N) is when the last combine lands; exposed
communication is that minus the compute. N is the fastest of 1..N_max (a smaller N wins ties
within 2%: fewer collectives and buffers). The backward mirrors the forward, so the same N serves.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from moecompile.distributed import World
from moecompile.graph import get_attr_value

from .ep_dedup import ranks_reached
from .expert_parallel import row_weights_of
from .overlap_chunks import MoELayer

MAX_AUTO_CHUNKS = 8


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    rows: int  # expert rows this rank computes per step (about T*k)
    payload_bytes: int  # bytes one full-batch dispatch sends from this rank (the combine sends as many back)
    exchanges: int  # collectives per chunk on the dispatch side (counts + rows when dropless)
    x0_s: float  # expert section: fixed time per call
    x1_s: float  # ... and per row
    latency_s: float  # one exchange: fixed time
    s_per_byte: float  # ... and per byte (1 / bandwidth)

    def simulate(self, n: int) -> tuple[float, float]:
        """(layer time, compute time) of the pipelined schedule with ``n`` chunks."""
        d = self.exchanges * self.latency_s + self.payload_bytes / n * self.s_per_byte
        c = self.latency_s + self.payload_bytes / n * self.s_per_byte
        x = self.x0_s + self.x1_s * self.rows / n
        link = arrived = done = 0.0
        dispatched = []
        for _ in range(n):  # all dispatches start up front, in order
            link += d
            dispatched.append(link)
        for i in range(n):
            done = max(dispatched[i], done) + x
            arrived = max(link, done) + c  # the combine queues behind what the link already holds
            link = arrived
        return arrived, n * x

    def table(self, max_n: int) -> dict[int, float]:
        return {n: self.simulate(n)[0] for n in range(1, max_n + 1)}


def choose(costs: LayerCosts, max_n: int) -> tuple[int, str]:
    """The N to use and a sentence saying why."""
    table = costs.table(max_n)
    best = min(table.values())
    n = min(k for k, v in table.items() if v <= best * 1.02)
    t1, c1 = costs.simulate(1)
    tn, cn = costs.simulate(n)
    bw = f"{1e-9 / costs.s_per_byte:.2f} GB/s" if costs.s_per_byte > 0 else "no measurable per-byte cost"
    shown = ", ".join(f"N={k} {v * 1e3:.2f} ms" for k, v in table.items() if k in (1, 2, 4, n, max_n))
    why = (
        f"experts {costs.x0_s * 1e3:.3f} ms + {costs.x1_s * 1e6:.3f} us/row x {costs.rows} rows, exchange "
        f"{costs.latency_s * 1e3:.3f} ms + {costs.payload_bytes / 1e6:.3f} MB at {bw}; "
        f"predicted layer {shown}; exposed comm {max(t1 - c1, 0) * 1e3:.2f} -> {max(tn - cn, 0) * 1e3:.2f} ms"
    )
    return n, why


def _best_time(fn: Any, device: torch.device, reps: int = 3) -> float:
    """Best of ``reps`` timed calls after one warm-up; on a GPU each ends when its kernels have (they are async)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _fit(small: int, t_small: float, big: int, t_big: float) -> tuple[float, float]:
    slope = max(t_big - t_small, 0.0) / max(big - small, 1)
    return max(t_big - slope * big, 0.0), slope


@torch.no_grad()
def _time_experts(gm: fx.GraphModule, layer: MoELayer, rows: int, local_experts: int) -> float:
    section = layer.experts
    x_in, sizes_in = section[0].args[0], section[0].args[2]
    H = int(section[0].args[1].meta["val"].shape[-1])  # type: ignore[union-attr]
    weights = {m: get_attr_value(gm, m.target) for s in section for m in s.all_input_nodes if m.op == "get_attr"}
    dtype, device = next(iter(weights.values())).dtype, next(iter(weights.values())).device
    x = torch.randn(rows, H, dtype=dtype, device=device)
    per, extra = divmod(rows, local_experts)
    sizes = torch.tensor([per + (i < extra) for i in range(local_experts)], dtype=torch.int64, device=device)

    env0: dict[fx.Node, Any] = {x_in: x, sizes_in: sizes, **weights}  # type: ignore[dict-item]
    row_weights = row_weights_of(section)
    if row_weights is not None:  # the glu applies the routing weights: any row weights time the same
        env0[row_weights] = torch.rand(rows, dtype=row_weights.meta["val"].dtype, device=device)

    def run() -> None:
        env = dict(env0)
        for m in section:
            env[m] = m.target(*fx.node.map_arg(m.args, env.__getitem__), **fx.node.map_arg(m.kwargs, env.__getitem__))

    return _best_time(run, device)


def _time_exchange(world: World, nbytes: int, device: torch.device) -> float:
    P = world.ep
    per = max(nbytes // 4 // P, 1)
    x = torch.randn(per * P, device=device)
    out = torch.empty_like(x)
    return _best_time(lambda: dist.all_to_all_single(out, x, group=world.ep_group), device)


def measure(gm: fx.GraphModule, layer: MoELayer, world: World, dispatcher: str, dropless: bool) -> LayerCosts:
    """Time this layer's experts and the ep group's exchange; the same numbers on every rank."""
    T = int(layer.x_TH.meta["val"].shape[0])
    H = int(layer.x_TH.meta["val"].shape[1])
    k = int(layer.info["top_k"])
    item = layer.x_TH.meta["val"].dtype.itemsize
    if layer.permute is not None and not dropless:
        rows = int(layer.permute.args[4]) * layer.info["num_experts"]  # E * C fixed rows
    else:
        rows = T * k
    sent = {"allgather": world.ep * T,  # every peer's tokens
            "alltoall_dedup": round(T * ranks_reached(layer.info["num_experts"], k, world.ep))}.get(dispatcher, rows)
    payload = sent * H * item
    L = max(layer.info["num_experts"] // world.ep, 1)
    small = max(rows // 4, 1)
    x0, x1 = _fit(small, _time_experts(gm, layer, small, L), rows, _time_experts(gm, layer, rows, L))
    device = layer.x_TH.meta["val"].device  # NCCL exchanges GPU tensors only
    a, per_byte = _fit(payload // 4, _time_exchange(world, payload // 4, device), payload,
                       _time_exchange(world, payload, device))
    agreed = torch.tensor([x0, x1, a, per_byte], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=world.ep_group)
    x0, x1, a, per_byte = agreed.tolist()
    # dispatch-side collectives per chunk: allgather x, ids, weights; dedup counts, x, ids, weights (per hop)
    hops = 2 if world.node_ranks > 1 else 1
    exchanges = {"allgather": 3, "alltoall_dedup": 4 * hops}.get(dispatcher, 2 if dropless else 1)
    return LayerCosts(rows, payload, exchanges, x0, x1, a, per_byte)
