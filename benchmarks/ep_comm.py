"""Expert-parallel communication on gloo (CPU): bytes each rank sends per step, and time share.

    python benchmarks/ep_comm.py                       # 2 and 4 ranks, both dispatchers, dropless + static
    python benchmarks/ep_comm.py --eps 2 --tokens 4096 --hidden 256
    python benchmarks/ep_comm.py --eps 2 4 --etps 1 2 --modes dropless   # the same ranks as ep or as ep x etp
    python benchmarks/ep_comm.py --dispatchers alltoall alltoall_dedup --modes dropless --experts 64 --top-k 8
    python benchmarks/ep_comm.py --eps 4 --node-ranks 1 2 --dispatchers alltoall alltoall_dedup --modes dropless
    python benchmarks/ep_comm.py ... --experts 64 --top-k 8 --route-groups 4 --route-group-top-k 2   # node-limited

Each rank count runs in its own spawned world (world = ep x etp; etp = 1 unless --etps). A model of
MoE layers only (residual GLU FFNs upcycled to E experts, top-k) is converted with the plan; every
collective the step runs, forward and backward (torch's autograd replays them transposed), is
intercepted by a dispatch mode that counts the bytes leaving the rank and the wall time spent inside
the collective (start + wait).

    ideal     = tokens x k x hidden x dtype bytes x 2 directions per MoE layer, forward; the backward
                moves the same again, so a step's ideal is 2x that x layers
    off-rank  = the part of the ideal that must leave the rank: (ep-1)/ep of the copies under uniform
                routing (copies routed to the rank's own experts stay); under etp each copy goes to the etp
                ranks holding its expert's slices, as Megatron-Core's all-gather inside the ETP group does,
                so the ideal is etp x that: (P-1)/P x etp with P = ep x etp ranks
    sent      = bytes handed to other ranks, forward + backward, counted at every collective (under
                alltoall_dedup a token goes once per distinct rank of its experts, so it can be below the
                off-rank ideal of the copies; its expert ids and weights are counted too)
    off-node  = the part of sent that went to ranks of another node, nodes being --node-size consecutive
                ranks (all on this machine here: what would cross the slow links on a cluster). alltoall_dedup
                at node level (--node-ranks G, parallel.node_ranks) sends a token once per node over the rail,
                then fans it out inside the node
    comm %    = time inside collectives (start + wait, i.e. exposed) / step time (forward + backward)

Numbers are measured on this machine; nothing is hard-coded. Gloo over loopback on shared CPU cores
makes communication cheap relative to CPU expert GEMMs, so the shares are low here.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moecompile.distributed import free_port

_fc = torch.ops._c10d_functional
_STARTS = {_fc.all_to_all_single.default, _fc.all_gather_into_tensor.default, _fc.reduce_scatter_tensor.default}


class GLU(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoEStack(nn.Module):
    def __init__(self, h: int, f: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(GLU(h, f) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class CommMeter(TorchDispatchMode):
    """Bytes sent to other ranks (and to other nodes' ranks, ``node_size`` consecutive ranks a node) and seconds
    spent in functional collectives (forward and backward), on whichever group each runs."""

    def __init__(self, rank: int, node_size: int):
        super().__init__()
        self.rank, self.node_size = rank, node_size
        self.bytes_sent, self.off_node, self.seconds = 0, 0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        is_comm = func in _STARTS or func is _fc.wait_tensor.default
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if is_comm:
            self.seconds += time.perf_counter() - start
        if func in _STARTS:
            for dest, nbytes in self._sent(func, args):
                if dest != self.rank:
                    self.bytes_sent += nbytes
                    self.off_node += nbytes if dest // self.node_size != self.rank // self.node_size else 0
        return out

    def _sent(self, func, args) -> list[tuple[int, int]]:
        """(global destination rank, bytes) of one collective."""
        from moecompile.distributed import _GROUPS

        x, group = args[0], args[-1]
        members = _GROUPS[group][1]
        nbytes = x.numel() * x.element_size()
        if func is _fc.all_to_all_single.default:
            row = nbytes // max(x.shape[0], 1)
            return [(members[j], row * int(s)) for j, s in enumerate(args[2])]
        if func is _fc.all_gather_into_tensor.default:
            return [(m, nbytes) for m in members]
        return [(m, nbytes // len(members)) for m in members]  # reduce-scatter: every chunk but ours leaves


def worker(rank: int, world: int, port: int, cfg: dict, out: Any) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import moecompile as mc

    results = []
    first = None
    etps = [t for t in cfg["etps"] if world % t == 0 and cfg["experts"] % (world // t) == 0]
    for etp, dispatcher, mode, node_ranks in [(t, d, m, g) for t in etps for d in cfg["dispatchers"]
                                              for m in cfg["modes"] for g in cfg["node_ranks"]]:
        if node_ranks > 1 and (dispatcher != "alltoall_dedup" or world % node_ranks or node_ranks == world):
            continue
        ep = world // etp
        parallel = {"ep": ep, "etp": etp, "dispatcher": dispatcher, "dispatch_mode": mode, "node_ranks": node_ranks}
        if mode == "static":
            parallel["capacity_factor"] = cfg["capacity_factor"]
        try:
            plan = mc.Plan.from_dict({"experts": {"num_experts": cfg["experts"], "top_k": cfg["top_k"],
                                                  "route_groups": cfg["route_groups"],
                                                  "route_group_top_k": cfg["route_group_top_k"],
                                                  "router_noise": 0.1}, "parallel": parallel})
        except mc.PlanError:  # e.g. alltoall_dedup is dropless only: the same on every rank, skipped by all
            continue
        if first is None:
            first = mc.distributed.init(plan, backend="gloo", rank=rank, world_size=world,
                                        init_method=f"tcp://127.0.0.1:{port}")
        torch.manual_seed(0)
        model = MoEStack(cfg["hidden"], cfg["ffn"], cfg["layers"])
        x = torch.randn(cfg["tokens"] // cfg["seq"], cfg["seq"], cfg["hidden"], generator=torch.Generator().manual_seed(rank))
        result = mc.convert(model, plan, (x,))
        for _ in range(cfg["warmup"]):
            result.module(x).square().mean().backward()
        meter = CommMeter(rank, cfg["node_size"])
        torch.distributed.barrier()
        start = time.perf_counter()
        with meter:
            for _ in range(cfg["steps"]):
                result.module(x).square().mean().backward()
        step_s = (time.perf_counter() - start) / cfg["steps"]
        results.append({"ep": ep, "etp": etp, "mode": mode, "bytes": meter.bytes_sent / cfg["steps"],
                        "dispatcher": dispatcher + (f"/node{node_ranks}" if node_ranks > 1 else ""),
                        "off_node": meter.off_node / cfg["steps"],
                        "comm_s": meter.seconds / cfg["steps"], "step_s": step_s})
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        out.put(gathered)
    torch.distributed.destroy_process_group()


def run_ep(world: int, cfg: dict) -> list[list[dict]]:
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()  # one rendezvous for all the ranks
    procs = [ctx.Process(target=worker, args=(r, world, port, cfg, out)) for r in range(world)]
    for p in procs:
        p.start()
    gathered = out.get(timeout=cfg["timeout"])
    for p in procs:
        p.join(timeout=60)
    return gathered


def main() -> None:
    p = argparse.ArgumentParser(description="bytes and time of expert-parallel communication on gloo")
    p.add_argument("--eps", type=int, nargs="+", default=[2, 4], help="ranks: ep x etp")
    p.add_argument("--etps", type=int, nargs="+", default=[1], help="etp values tried at each rank count")
    p.add_argument("--dispatchers", nargs="+", default=["alltoall", "allgather"])
    p.add_argument("--modes", nargs="+", default=["dropless", "static"])
    p.add_argument("--node-ranks", dest="node_ranks", type=int, nargs="+", default=[1],
                   help="parallel.node_ranks tried for alltoall_dedup (1: rank level)")
    p.add_argument("--node-size", dest="node_size", type=int, default=2,
                   help="consecutive ranks counted as one node for the off-node column")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", dest="top_k", type=int, default=2)
    p.add_argument("--route-groups", dest="route_groups", type=int, default=1,
                   help="group-limited routing (DeepSeek-V3's n_group): this many expert groups")
    p.add_argument("--route-group-top-k", dest="route_group_top_k", type=int, default=1,
                   help="groups a token may pick from (topk_group)")
    p.add_argument("--capacity-factor", dest="capacity_factor", type=float, default=1.25)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    cfg = vars(args)
    ideal = 2 * args.tokens * args.top_k * args.hidden * 4 * 2 * args.layers  # per rank per step: fwd + bwd, fp32
    groups = f" within {args.route_group_top_k} of {args.route_groups} groups" if args.route_groups > 1 else ""
    print(f"tokens/rank {args.tokens}, hidden {args.hidden}, ffn {args.ffn}, E {args.experts}, k {args.top_k}{groups}, "
          f"{args.layers} MoE layers, fp32; ideal per step = (T*k*H*4 B*2 directions)*layers*2 (fwd+bwd) "
          f"= {ideal / 2**20:.2f} MiB per rank")
    header = (f"{'ranks':>5} {'ep':>3} {'etp':>3} {'dispatcher':>20} {'mode':>9} {'sent MiB/step':>14} {'sent/ideal':>10} "
              f"{'sent/off-rank ideal':>20} {'off-node MiB':>12} {'comm ms':>8} {'step ms':>8} {'comm %':>7}")
    print(header)
    print("-" * len(header))
    for ranks in args.eps:
        gathered = run_ep(ranks, cfg)
        for i, row in enumerate(gathered[0]):
            per_rank = [g[i] for g in gathered]
            sent = sum(r["bytes"] for r in per_rank) / ranks
            off_node = sum(r["off_node"] for r in per_rank) / ranks
            comm = sum(r["comm_s"] for r in per_rank) / ranks
            step = max(r["step_s"] for r in per_rank)
            off_rank_ideal = ideal * (ranks - 1) / ranks * row["etp"]  # uniform routing; etp copies of each
            print(f"{ranks:>5} {row['ep']:>3} {row['etp']:>3} {row['dispatcher']:>20} {row['mode']:>9} "
                  f"{sent / 2**20:>14.2f} {sent / ideal:>10.2f} {sent / off_rank_ideal:>20.2f} {off_node / 2**20:>12.2f} "
                  f"{comm * 1e3:>8.1f} "
                  f"{step * 1e3:>8.1f} {100 * comm / step:>6.1f}%", flush=True)


if __name__ == "__main__":
    main()
