"""A rank's range of a tensor as checkpoint chunks, and CRC-32s that combine across ranks.

With ``parallel.shard_optimizer`` a rank holds elements [lo, hi) of a flattened parameter's
master and optimizer state. The checkpoint keeps every tensor in its own shape (so it loads
at any ep, any number of ranks, sharded or not), so the range is written as the rectangular
boxes that tile it, e.g. elements [5, 23) of a [4, 6] tensor::

    row 0 [5:6]   rows 1-2 [:]   row 3 [0:5]

as a ``ShardedTensor`` of those boxes (torch.distributed.checkpoint reads and writes chunks,
and reshards them on load). Each box is a contiguous run of the flattened tensor, so the
checksum of the whole tensor is the CRC-32s of the boxes combined in order
(:func:`crc32_combine`): a checkpoint records one CRC per tensor however it was split.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
import zlib
from typing import Iterator, Sequence

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.api import ShardedTensorBase
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, first flattened element


def boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """Elements [lo, hi) of a row-major tensor of ``shape`` as rectangular boxes, in order."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), lo)] if shape else [((), (), 0)]
    inner = math.prod(shape[1:])
    full_lo, full_hi = -(-lo // inner), hi // inner  # rows [full_lo, full_hi) lie wholly inside
    if full_lo > full_hi:  # inside one row
        return _in_row(shape, lo // inner, lo % inner, hi - lo // inner * inner)
    out: list[Box] = []
    if lo < full_lo * inner:
        out += _in_row(shape, lo // inner, lo % inner, inner)
    if full_hi > full_lo:
        out.append(((full_lo,) + (0,) * (len(shape) - 1), (full_hi - full_lo,) + shape[1:], full_lo * inner))
    if hi > full_hi * inner:
        out += _in_row(shape, full_hi, 0, hi - full_hi * inner)
    return out


def _in_row(shape: tuple[int, ...], row: int, lo: int, hi: int) -> list[Box]:
    inner = math.prod(shape[1:])
    return [((row,) + off, (1,) + size, row * inner + start) for off, size, start in boxes(shape[1:], lo, hi)]


def sharded(values: torch.Tensor, shape: Sequence[int], parts: Sequence[tuple[int, int]], me: int) -> ShardedTensor:
    """``values`` (elements ``parts[me]`` of a tensor of ``shape``, flattened) as this rank's chunks of it.

    ``parts`` holds every rank's range (they tile the tensor), which the metadata describes.
    """
    lo = parts[me][0]
    local, everyone = [], []
    for k, (a, b) in enumerate(parts):
        for off, size, start in boxes(shape, a, b):
            everyone.append((off, size, k))
            if k == me:
                local.append((off, values[start - lo : start - lo + math.prod(size)].view(size)))
    return chunked(shape, local, everyone, values)


def chunked(shape: Sequence[int], local: Sequence[tuple[Sequence[int], torch.Tensor]],
            everyone: Sequence[tuple[Sequence[int], Sequence[int], int]], like: torch.Tensor) -> ShardedTensor:
    """A tensor of ``shape`` as the boxes ``everyone`` (offsets, sizes, owner) that tile it, of which this rank
    holds ``local`` (offsets, data): the container DCP writes chunks from and reads chunks into, in place."""
    device = like.device
    mds = {(tuple(off), tuple(size)): ShardMetadata(shard_offsets=list(off), shard_sizes=list(size),
                                                    placement=f"rank:{k}/{device}") for off, size, k in everyone}
    shards = [Shard(data, mds[(tuple(off), tuple(data.shape))]) for off, data in local]
    props = TensorProperties(dtype=like.dtype, layout=torch.strided, requires_grad=False, memory_format=torch.contiguous_format,
                             pin_memory=False)
    meta = ShardedTensorMetadata(shards_metadata=list(mds.values()), size=torch.Size(shape), tensor_properties=props)
    with quiet_sharded_tensor():
        out = ShardedTensorBase._init_from_local_shards_and_global_metadata(shards, meta)
    out._process_group = None  # a container of chunks for DCP; no sharded ops run on it
    return out


@contextlib.contextmanager
def quiet_sharded_tensor() -> Iterator[None]:
    """ShardedTensor warns that it is deprecated for DTensor, whose shards tile a tensor evenly; these do not."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def chunk_crcs(t: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first byte, bytes, CRC-32) of each contiguous run of ``t`` this rank holds: all of a plain tensor."""
    if isinstance(t, ShardedTensor):
        out = []
        with quiet_sharded_tensor():
            shards, shape = t.local_shards(), t.metadata().size
        for shard in shards:
            out += _runs(shard.metadata.shard_offsets, shard.tensor, shape)
        return out
    return [(0, t.numel() * t.element_size(), crc32(t))]


def _runs(offsets: Sequence[int], data: torch.Tensor, shape: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first byte, bytes, CRC-32) of the contiguous runs of a box of a tensor of ``shape``: one for a box of whole
    trailing dims, one per leading index where an inner dim is cut (an expert slice's columns)."""
    sizes = tuple(data.shape)
    k = len(shape)
    while k > 0 and sizes[k - 1] == shape[k - 1]:  # dims k.. are whole
        k -= 1
    lead = max(k - 1, 0)  # dims before ``lead`` index the runs; a run is data[idx] (dims lead..)
    out = []
    for idx in itertools.product(*(range(n) for n in sizes[:lead])):
        run = data[idx] if idx else data
        start = _flat_start([o + i for o, i in zip(offsets, idx)] + list(offsets[lead:]), shape)
        out.append((start * data.element_size(), run.numel() * data.element_size(), crc32(run)))
    return out


def _flat_start(offsets: Sequence[int], shape: Sequence[int]) -> int:
    start, stride = 0, 1
    for off, size in zip(reversed(offsets), reversed(shape)):
        start += off * stride
        stride *= size
    return start


def crc32(t: torch.Tensor) -> int:
    t = t.detach().contiguous().cpu().reshape(-1)
    return zlib.crc32(t.view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def combine(chunks: Sequence[tuple[int, int, int]]) -> int | None:
    """The CRC-32 of the whole from its runs' (first byte, bytes, CRC); None if they do not tile it."""
    crc, end = 0, 0
    for start, nbytes, c in sorted(set(chunks)):
        if start != end:
            return None
        crc, end = crc32_combine(crc, c, nbytes), end + nbytes
    return crc


# CRC-32 of A+B from crc(A), crc(B) and len(B): crc(A) times x^(8 len B) modulo the CRC
# polynomial, plus crc(B) (zlib's crc32_combine; the reflected polynomial 0xEDB88320).
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order: x^0 is the top bit)."""
    p, m = 0, 1 << 31
    while m and a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the polynomial."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``zlib.crc32(a)``, ``zlib.crc32(b)`` and ``len(b)``."""
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ crc2
