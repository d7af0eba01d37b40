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
_PACKERS: list[tuple[Packer, Callable[[], bool]]] = []


def register_packer(packer: Packer, active: Callable[[], bool]) -> None:
    """Let ``packer`` claim tensors while ``active()``: it returns a Handle for one whose memory its runtime may
    free, else None. ``active`` is cheap and traceable: it reads a module-level int (compiled code guards on its
    value, so it must change only when a runtime comes or goes, not with what that runtime holds)."""
    if all(p is not packer for p, _ in _PACKERS):
        _PACKERS.append((packer, active))


@torch._disable_dynamo
def pack(t: Any) -> Any:
    """A Handle for a tensor some runtime may free before it is read again; anything else as it is.

    Eager only (dynamo-disabled): a packer reads storage pointers, and as a saved-tensor hook called inside a
    compiled forward, dynamo compiled it as a frame of its own once per tensor rank, up to its recompile limit."""
    if isinstance(t, torch.Tensor):
        for packer, active in _PACKERS:
            handle = packer(t) if active() else None
            if handle is not None:
                return handle
    return t


def pack_all(values: Any) -> list:
    """``pack`` over ``values``; traceable when no runtime holds handles (then no graph break under compile)."""
    if not any(active() for _, active in _PACKERS):
        return list(values)
    return [pack(v) for v in values]


def unpack(x: Any) -> Any:
    """The tensor behind ``pack``'s Handle; anything else as it is."""
    return x.tensor() if isinstance(x, Handle) else x
