"""Which device a rank of a command trains or measures on, and the collective backend that goes with it.

NCCL runs one rank per GPU and refuses CPU tensors; gloo runs CPU tensors. So a rank takes GPU
``<local rank>`` when every rank on its machine has one (``auto``) or when asked (``cuda``), and the CPU
otherwise; its process group is NCCL exactly when its tensors live on a GPU.
"""
from __future__ import annotations

import os

import torch

from .errors import MoecompileError

CHOICES = ("auto", "cpu", "cuda")


def resolve_device(choice: str, rank: int, world_size: int) -> torch.device:
    """``cuda:<local rank>`` when asked for, or under ``auto`` when each rank on this machine has a GPU of its own;
    else the CPU. ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` (torchrun's) override ``rank`` / ``world_size``."""
    if choice not in CHOICES:
        raise MoecompileError(f"device {choice!r}: choose from {', '.join(CHOICES)}")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cpu" or (choice == "auto" and gpus < local_ranks):
        return torch.device("cpu")
    if not gpus:
        raise MoecompileError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); "
                              "run on the CPU with --device cpu")
    if gpus < local_ranks:
        raise MoecompileError(f"--device cuda: the {local_ranks} rank(s) on this machine need a GPU each and torch "
                              f"sees {gpus}; launch at most {gpus} (--nproc {gpus}, --nproc-per-node under torchrun) "
                              "or run on the CPU with --device cpu")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """The process-group backend for ranks whose tensors live on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


__all__ = ["CHOICES", "backend_for", "resolve_device"]
