"""Expert slices (``parallel.etp``): whole experts <-> slice-experts, the layout ``expert_parallel`` shards.

Expert tensors are ``[E, ...]`` with the FFN width on one dim; cut into Q slices they become
``[Q*E, ...]``, slice-major (row ``q*E + e`` is slice q of expert e, keeping width columns
``[q*F/Q, (q+1)*F/Q)``). A glu's ``w_in`` / ``b_in`` hold gate rows then up rows: each slice keeps
its part of both. The pass cuts; export joins them back into whole experts.
"""

from __future__ import annotations

import torch

WIDTH_DIM = {"w_in": 1, "w_out": 2, "b_in": 1}  # the dim of [E, ...] expert tensors that runs over the FFN width


def cut_slices(t: torch.Tensor, key: str, Q: int, glu: bool) -> torch.Tensor:
    """[E, ...] whole experts -> [Q*E, ...] slice-experts, slice-major (row q*E + e: slice q of expert e).

    A glu's ``w_in`` / ``b_in`` hold gate rows then up rows; each slice keeps its part of both halves."""
    dim = WIDTH_DIM[key]
    halves = 2 if glu and key in ("w_in", "b_in") else 1
    E, width = t.shape[0], t.shape[dim]
    shape = list(t.shape)
    parts = t.reshape(*shape[:dim], halves, Q, width // (halves * Q), *shape[dim + 1:])  # [E, .., 2, Q, F/Q, ..]
    parts = parts.movedim(dim + 1, 0)  # [Q, E, .., 2, F/Q, ..]
    return parts.reshape(Q * E, *shape[1:dim], width // Q, *shape[dim + 1:]).contiguous()


def join_slices(t: torch.Tensor, key: str, Q: int, glu: bool) -> torch.Tensor:
    """The inverse of :func:`cut_slices`: [Q*E, ...] slice-experts (all of them) -> [E, ...] whole experts."""
    dim = WIDTH_DIM[key]
    halves = 2 if glu and key in ("w_in", "b_in") else 1
    QE, part = t.shape[0], t.shape[dim]
    shape = list(t.shape)
    E = QE // Q
    parts = t.reshape(Q, E, *shape[1:dim], halves, part // halves, *shape[dim + 1:])  # [Q, E, .., 2, F/Q, ..]
    parts = parts.movedim(0, dim + 1)  # [E, .., 2, Q, F/Q, ..]
    return parts.reshape(E, *shape[1:dim], part * Q, *shape[dim + 1:]).contiguous()


def whole_experts(info: dict) -> int:
    """E of an MoE block's info: its experts before any slicing."""
    return info["num_experts"] // info.get("slices", 1)


def whole_boxes(key: str, q: int, Q: int, glu: bool, sub_shape: tuple[int, ...], offsets: tuple[int, ...],
                sizes: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """A box of slice q of one expert (``offsets``/``sizes`` in the slice's own ``sub_shape``, no expert dim) as
    boxes of the whole expert: (whole offsets, sizes, offsets in the slice). Two where it spans a glu's gate and
    up halves, which sit F apart in the whole expert."""
    d = WIDTH_DIM[key] - 1
    halves = 2 if glu and key in ("w_in", "b_in") else 1
    part = sub_shape[d] // halves  # F/Q: one half's width in the slice
    out = []
    for h in range(halves):
        lo, hi = max(offsets[d], h * part), min(offsets[d] + sizes[d], (h + 1) * part)
        if lo >= hi:
            continue
        whole, size, sub = list(offsets), list(sizes), list(offsets)
        whole[d], size[d], sub[d] = h * part * Q + q * part + (lo - h * part), hi - lo, lo
        out.append((tuple(whole), tuple(size), tuple(sub)))
    return out


def whole_shape(key: str, Q: int, sub_shape: tuple[int, ...]) -> tuple[int, ...]:
    """One whole expert's shape from one slice's (no expert dim)."""
    d = WIDTH_DIM[key] - 1
    return (*sub_shape[:d], sub_shape[d] * Q, *sub_shape[d + 1:])
