"""Byte-level language-model data from real text every machine has offline: Python's own source.

    data = stdlib_bytes()                                   # uint8 values as int64, ~2 MB
    stream = ByteBatches(data, batch=8, seq=64, seed=0)     # global batch 8 x 64 bytes
    x, y = stream[step]                                     # the same batch for a step, on any rank count
    x, y = stream.shard(step, rank=1, world_size=2)         # this rank's rows of that global batch

A batch is a pure function of (seed, step), so resuming at step s reads exactly the
batches an uninterrupted run would have, and ep = 1 and ep = 2 see the same global batch.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Iterator

import torch

from .errors import MoecompileError

VOCAB = 256  # byte values


def stdlib_root() -> pathlib.Path:
    """The directory holding the Python standard library's source (``logging`` lives in it)."""
    return pathlib.Path(logging.__file__).parent.parent


def stdlib_bytes(limit: int = 2_000_000, root: str | pathlib.Path | None = None) -> torch.Tensor:
    """Bytes of Python's own ``*.py`` files (sorted by name, so every machine reads the same order)."""
    root = pathlib.Path(root) if root is not None else stdlib_root()
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if not chunks:
        raise MoecompileError(f"no *.py files under {root}; point root= at a directory of text files")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class ByteBatches:
    """Random windows of ``seq + 1`` bytes: inputs are the first ``seq``, targets the next byte of each."""

    def __init__(self, data: torch.Tensor, batch: int, seq: int, seed: int = 0):
        if data.dim() != 1 or len(data) <= seq + 1:
            raise MoecompileError(f"need a 1-D byte tensor longer than seq + 1 = {seq + 1}, got shape {tuple(data.shape)}")
        if batch < 1 or seq < 1:
            raise MoecompileError(f"batch and seq must be >= 1, got {batch} and {seq}")
        self.data, self.batch, self.seq, self.seed = data, batch, seq, seed

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - self.seq - 1, (self.batch,), generator=g)
        offsets = torch.arange(self.seq + 1)
        window = self.data[starts[:, None] + offsets[None, :]]
        return window[:, :-1], window[:, 1:]

    def shard(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s contiguous rows of the global batch of ``step``."""
        if self.batch % world_size:
            raise MoecompileError(
                f"global batch {self.batch} does not split over {world_size} ranks; use a multiple of {world_size}"
            )
        per = self.batch // world_size
        x, y = self[step]
        return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = 0
        while True:
            yield self[step]
            step += 1


def batches(data: torch.Tensor, batch: int, seq: int, seed: int = 0, *, start: int = 0,
            rank: int = 0, world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless stream of ``(x, y)`` (this rank's shard of each global batch), from step ``start``."""
    stream = ByteBatches(data, batch, seq, seed)
    step = start
    while True:
        yield stream.shard(step, rank, world_size)
        step += 1
