"""The training step's post-accumulate-grad hooks: how it learns, during backward, that a gradient is in.

ZeRO-2 (moecompile.grad_shards) copies each gradient into a bucket buffer; ``overlap_grad_reduce``
(moecompile.grad_overlap) counts them to launch a bucket's collective once it is complete. A parameter
carries one such hook, the newest step's: a step built later on the same module ``release``s the
earlier step's hooks before it places its own, so an old step can never act on a new step's backward.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch.nn as nn

_HOOKS: dict[int, tuple[weakref.ref, Any]] = {}  # id(parameter) -> (it, its hook)


class _Arrived:
    """A parameter's hook, holding its owner weakly: a strong reference would make a cycle (parameter -> hook
    -> owner -> buckets -> parameter) that only the garbage collector frees, and that can leave a process group
    to be torn down at interpreter exit, where gloo aborts the process."""

    def __init__(self, owner: Any):
        self.owner = weakref.ref(owner)

    def __call__(self, p: nn.Parameter) -> None:
        owner = self.owner()
        if owner is not None:
            owner.arrived(p)


def release(params: Iterable[nn.Parameter]) -> None:
    """Remove whatever step's hooks these parameters carry."""
    for p in params:
        earlier = _HOOKS.pop(id(p), None)
        if earlier is not None and earlier[0]() is p:
            earlier[1].remove()


def watch(owner: Any, params: Iterable[nn.Parameter]) -> None:
    """Call ``owner.arrived(p)`` each time backward has accumulated ``p``'s gradient."""
    for p in params:
        release([p])
        _HOOKS[id(p)] = (weakref.ref(p), p.register_post_accumulate_grad_hook(_Arrived(owner)))
