"""The overlap pass against the same plan without it, on N local gloo ranks (tests/_dist.py spawn).

``scenario(rank, world_size, cases, train)`` converts a two-layer GLU stack once per case
(overlap off, then each overlap variant of the same parallel settings), perturbs the experts per
global id (upcycled experts start as identical copies, which would hide a mix-up of chunks), runs
forward + backward on this rank's batch and returns, per case, the largest relative difference of
the output, the input gradient, every parameter gradient and the expert load against the
non-overlapped graph, plus the pass record. It also logs the ops the backward runs, and with
``train`` takes a few optimizer steps of the first two cases.
Legend: H hidden, E experts, K top-k.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

H, E, K = 16, 4, 2
TRAIN_STEPS = 3


class GLU(nn.Module):
    def __init__(self, h: int = H, f: int = 32):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Stack(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([GLU() for _ in range(layers)])
        self.norm = nn.LayerNorm(H)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.norm(x)


def plan(ep: int, overlap: dict | None = None, mode: str = "dropless", dispatcher: str = "alltoall",
         pack: bool | None = None) -> dict:
    experts = {"num_experts": E, "top_k": K, "shared_experts": 1, "aux_loss": "aux", "z_loss_coeff": 1e-2,
               "router_noise": 0.05}
    parallel = {"ep": ep, "dispatcher": dispatcher, "dispatch_mode": mode, "timeout_s": 30.0,
                "pack_routing_weights": pack}
    if mode == "static":
        parallel["capacity_factor"] = 1.0
    out = {"experts": experts, "parallel": parallel}
    if overlap is not None:
        out["overlap"] = {"enabled": True, **overlap}
    return out


def perturb(gm: nn.Module) -> None:
    import moecompile as mc

    for name, shard in mc.distributed.expert_shards(gm).items():
        p = gm.get_parameter(name)
        with torch.no_grad():
            for i, e in enumerate(range(shard.lo, shard.hi)):
                p[i] += 0.2 * p[i].abs().mean() * torch.randn(p[i].shape, generator=torch.Generator().manual_seed(100 + e))


class OpLog(TorchDispatchMode):
    """The names of the ops that run, in order (collectives, expert GEMMs, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) if b.numel() else 0.0


def _run(result: Any, x: torch.Tensor, target: torch.Tensor, log: bool) -> dict:
    xx = x.clone().requires_grad_(True)
    y = result.module(xx)
    loss = (y * target).mean() + result.router_loss()
    with OpLog() as ops:
        loss.backward()
    return {"y": y.detach(), "x_grad": xx.grad, "load": {k: v.clone() for k, v in result.expert_load().items()},
            "grads": {n: p.grad.clone() for n, p in result.module.named_parameters() if p.grad is not None},
            "backward_ops": ops.ops if log else []}


def scenario(rank: int, world_size: int, cases: list[tuple[str, dict]], train: bool = False, layers: int = 2) -> dict:
    import moecompile as mc
    from moecompile import schedule

    torch.manual_seed(0)
    model = Stack(layers)
    g = torch.Generator().manual_seed(10 + rank)
    x, target = torch.randn(2, 8, H, generator=g), torch.randn(2, 8, H, generator=g)
    results, runs, report = {}, {}, {}
    for name, p in cases:
        result = mc.convert(model, p, (x,))
        perturb(result.module)
        results[name], runs[name] = result, _run(result, x, target, log=True)
        rec = result.record("overlap")
        report[name] = {"decisions": rec.decisions, "data": rec.data, "legal": schedule.check_schedule(result.module.graph),
                        "backward_ops": [o for o in runs[name]["backward_ops"] if o in _WATCHED],
                        "packs": sum(n.target is torch.ops.moecompile.pack_row_weights.default
                                     for n in result.module.graph.nodes)}
    base = {}
    for name, _p in cases:
        ref = base.setdefault(_key(name), runs[name])
        r = runs[name]
        report[name]["diff"] = {
            "y": rel(r["y"], ref["y"]), "x_grad": rel(r["x_grad"], ref["x_grad"]),
            "grads": max(rel(r["grads"][k], ref["grads"][k]) for k in ref["grads"]),
            "load": max(float((r["load"][k] - ref["load"][k]).abs().max()) for k in ref["load"]),
            "same_params": sorted(r["grads"]) == sorted(ref["grads"]),
        }
    if train:
        report["train"] = {name: _train(results[name], x, target) for name, _p in cases[:2]}
    return report


_WATCHED = {"all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor", "grouped_mm",
            "grouped_mm_wgrad", "glu_backward", "mm"}


def _key(name: str) -> str:
    """Cases named '<settings>/<variant>' compare against the first case of the same settings."""
    return name.split("/")[0]


def _train(result: Any, x: torch.Tensor, target: torch.Tensor) -> list[float]:
    import moecompile as mc

    for p in result.module.parameters():
        p.grad = None
    step = mc.build_train_step(result, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                               loss_fn=lambda y, t: (y * t).mean())
    return [float(step(x, target).loss) for _ in range(TRAIN_STEPS)]
