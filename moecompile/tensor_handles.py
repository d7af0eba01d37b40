"""Handles kept in place of tensors whose memory a runtime frees between uses (core: passes import it).

ZeRO-3 (moecompile/param_shards.py) frees a gathered parameter bucket after its last read in the
forward and gathers it again in backward. Whatever would hold such a tensor from forward to backward
(autograd's saved tensors, the recompute and offload regions of passes/regions.py) keeps
``pack(t)`` instead and reads it back with ``unpack``. The runtime that frees the memory registers
a packer here, so a region needs no import of that runtime and holds the tensor as it is when no
packer claims it.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import torch


class Handle(abc.ABC):
    """What a holder keeps instead of a tensor; ``tensor()`` gives the tensor back (rebuilding its memory)."""

    @abc.abstractmethod
    def tensor(self) -> torch.Tensor: ...


Packer = Callable[[torch.Tensor], "Handle | None"]
_PACKERS: list[Packer] = []


def register_packer(packer: Packer) -> None:
    """Let ``packer`` claim tensors: it returns a Handle for one whose memory its runtime may free, else None."""
    if packer not in _PACKERS:
        _PACKERS.append(packer)


def pack(t: Any) -> Any:
    """A Handle for a tensor some runtime may free before it is read again; anything else as it is."""
    if isinstance(t, torch.Tensor):
        for packer in _PACKERS:
            handle = packer(t)
            if handle is not None:
                return handle
    return t


def unpack(x: Any) -> Any:
    """The tensor behind ``pack``'s Handle; anything else as it is."""
    return x.tensor() if isinstance(x, Handle) else x
