"""Train a tiny Llama, upcycled to 8 experts, with expert parallelism (ep = 2) over gloo on CPU.

    torchrun --nproc-per-node 2 examples/ep_train.py            # or 4 ranks: ep 2 x edp 2
    python examples/ep_train.py --nproc 2                       # spawns the ranks itself
    ... --check                                                 # also run ep = 1 in each rank, compare

A deliberately minimal loop (the full training step is ``moecompile.build_train_step``): every rank
converts the same model with the same plan and keeps its experts; each step it runs its shard of
the global batch (byte-level text of a Python stdlib file), adds the router losses, backpropagates,
averages gradients as the world's layout needs (dense over dp, experts over edp) and takes an SGD
step. ``--check`` replays the step in a single-process ep = 1 model on the whole global batch and
prints the difference of the losses (float32 round-off, ~1e-7).
"""

from __future__ import annotations

import argparse
import inspect
import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F

import moecompile as mc

VOCAB, SEQ = 256, 32


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def text_batches(global_batch: int, steps: int) -> list[torch.Tensor]:
    """Byte windows of real text (the source of ``inspect``), the same on every rank."""
    data = torch.tensor(list(open(inspect.__file__, "rb").read()), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - SEQ - 1, (steps, global_batch), generator=g)
    return [torch.stack([data[s:s + SEQ + 1] for s in row.tolist()]) for row in starts]


def lm_loss(result: mc.ConversionResult, ids: torch.Tensor) -> torch.Tensor:
    logits = result.module(ids[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) + result.router_loss()


def sgd(module: torch.nn.Module, lr: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def train(args: argparse.Namespace, rank: int | None = None, world_size: int | None = None, port: int = 0) -> None:
    plan = mc.Plan.from_dict({
        "experts": {"num_experts": 8, "top_k": 2, "aux_loss": "aux", "z_loss_coeff": 1e-3, "router_noise": 0.05},
        "parallel": {"ep": args.ep, "dispatcher": args.dispatcher, "timeout_s": 60},
    })
    init = {} if rank is None else {"rank": rank, "world_size": world_size, "init_method": f"tcp://127.0.0.1:{port}"}
    world = mc.distributed.init(plan, backend="gloo", **init)
    per_rank = args.batch // world.world_size
    batches = text_batches(args.batch, args.steps)
    model = tiny_llama()
    result = mc.convert(model, plan, (batches[0][:per_rank, :-1],))  # picks up the world; keeps my experts
    reference = mc.convert(model, plan.replace(parallel={"ep": 1}), (batches[0][:per_rank, :-1],)) if args.check else None
    if world.rank == 0:
        print(f"world {world.world_size}: ep groups of {world.ep} (mine {world.ep_ranks}), edp {world.edp}; "
              f"rank 0 keeps experts {sorted({(s.lo, s.hi) for s in mc.distributed.expert_shards(result.module).values()})}")
    for step, ids in enumerate(batches):
        mine = ids.chunk(world.world_size)[world.rank]
        loss = lm_loss(result, mine)
        loss.backward()
        mc.distributed.reduce_gradients(result.module, world)
        sgd(result.module, args.lr)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world.world_size
        line = f"step {step}: loss {float(mean):.5f}"
        if reference is not None:
            ref = sum(lm_loss(reference, s) for s in ids.chunk(world.world_size)) / world.world_size
            ref.backward()
            sgd(reference.module, args.lr)
            line += f"   ep=1 {float(ref.detach()):.5f}   |diff| {abs(float(mean) - float(ref.detach())):.1e}"
        if world.rank == 0:
            load = result.expert_load()
            print(line + f"   load(layer 0, rank 0) {load[next(iter(load))].tolist()}", flush=True)
    dist.destroy_process_group()


def _spawned(rank: int, args: argparse.Namespace, port: int) -> None:
    train(args, rank, args.nproc, port)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over the ranks")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--dispatcher", choices=["alltoall", "allgather"], default="alltoall")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not launched by torchrun")
    p.add_argument("--check", action="store_true", help="also run ep=1 in each rank and print the difference")
    args = p.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # torchrun
        train(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(args, port), nprocs=args.nproc)


if __name__ == "__main__":
    main()
