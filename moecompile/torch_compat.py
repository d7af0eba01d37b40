"""Names torch renamed between the releases moecompile runs on (2.11 to 2.14; 2.11 on the lent GPUs).

torch 2.13 named the tensor-in, tensor-out collectives ``all_gather_single`` / ``reduce_scatter_single``
and deprecated ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; 2.11 has only the old names. Each
name is looked up when called, so a test that wraps torch's function still sees the call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    """Gather every rank's ``input`` into ``output`` (ranks' inputs concatenated in rank order)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, **kwargs)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    """Sum ``input`` over the ranks and leave rank k the k-th equal range of it in ``output``."""
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return reduce_scatter(output, input, **kwargs)
