"""The tensors the training step's optimizer updates, and the optimizer built over them.

Unsharded, each trainable parameter is updated whole: the parameter itself, or an fp32 master
copy of it in a low-precision model. Sharded (``parallel.shard_optimizer``), this rank updates
only its range of each gradient bucket (:class:`moecompile.grad_sync.Shard`): a 1-D part of a
parameter that shares its storage, or an fp32 copy of that part. So optimizer state and masters
exist once across the ranks that reduce a bucket, never on every rank.

Sharded, the user's optimizer factory is called on the model's own parameters, so param groups
built from them (no weight decay on norms, another lr for routers) keep their hyperparameters;
each group then holds this rank's tensors in their place. (Unsharded it is called on the
updated tensors, as before: the parameters, or their masters.) A part of a parameter is only updated
correctly by an optimizer that works element by element, so sharding refuses any other.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import torch
import torch.nn as nn

from .adamw import AdamW
from .errors import MoecompileError
from .grad_sync import Shard

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# torch.optim classes whose update of an element reads only that element's gradient and state
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop")
    if hasattr(torch.optim, n)) + (AdamW,)


@dataclasses.dataclass
class Update:
    """One tensor the optimizer updates: ``shard``'s values, in place or through an fp32 copy."""

    shard: Shard
    tensor: nn.Parameter
    is_copy: bool  # an fp32 master, written back after each step (else the values themselves)

    def load_grad(self) -> None:
        """Hand the reduced gradient to the optimizer (a view, or its fp32 copy)."""
        if self.is_copy:
            self.tensor.grad = self.shard.grad.float()
        elif self.tensor.grad is not self.shard.grad:
            self.tensor.grad = self.shard.grad

    def write_back(self) -> None:
        """A master's new values into the parameter."""
        if self.is_copy:
            with torch.no_grad():
                self.shard.values().copy_(self.tensor)


def updates_for(shards: list[Shard], masters: bool) -> list[Update]:
    """What the optimizer updates for each shard: fp32 copies if ``masters``, else the values themselves."""
    out = []
    for s in shards:
        if masters:
            tensor = nn.Parameter(s.values().detach().float().clone())
        else:
            values = s.values()  # the parameter itself, or a part sharing its storage
            tensor = values if values is s.param else nn.Parameter(values)
        out.append(Update(s, tensor, masters))
    return out


def build_optimizer(factory: OptimizerFactory, params: list[nn.Parameter], updates: list[Update],
                    sharded: bool) -> torch.optim.Optimizer:
    """The step's optimizer over ``updates``' tensors.

    Unsharded, ``factory`` gets those tensors (the parameters, or their fp32 masters). Sharded, it
    gets the model's parameters, and each of its groups then holds this rank's tensors instead.
    """
    if not sharded:
        return _checked(factory([u.tensor for u in updates]))
    optimizer = _checked(factory(params))
    if not isinstance(optimizer, ELEMENTWISE):
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise MoecompileError(
            f"parallel.shard_optimizer gives each rank a range of elements of the parameters, and "
            f"{type(optimizer).__name__} does not update element by element (it may use a whole matrix); use one "
            f"of {names}, or set parallel.shard_optimizer: false")
    mine: dict[int, list[nn.Parameter]] = {}
    for u in updates:
        mine.setdefault(id(u.shard.param), []).append(u.tensor)
    known = {id(p) for p in params}
    for i, group in enumerate(optimizer.param_groups):
        stray = [tuple(p.shape) for p in group["params"] if id(p) not in known]
        if stray:
            raise MoecompileError(f"the optimizer's param_groups[{i}] holds tensors of shapes {stray[:3]} that are "
                                  "not the converted module's parameters; build it from the list the factory gets")
    if optimizer.state:  # built at construction (Adagrad's sums): each tensor keeps its part of it
        built = optimizer.state
        optimizer.state = collections.defaultdict(dict)
        for u in updates:
            optimizer.state[u.tensor] = {k: _part_of(v, u) for k, v in built.get(u.shard.param, {}).items()}
    for group in optimizer.param_groups:
        group["params"] = [t for p in group["params"] for t in mine.get(id(p), [])]
    return optimizer


def _part_of(value: object, u: Update) -> object:
    """``u``'s part of a per-element state tensor; scalars as they are."""
    if not isinstance(value, torch.Tensor) or value.shape != u.shard.param.shape:
        return value.clone() if isinstance(value, torch.Tensor) else value
    part = value.reshape(-1)[u.shard.lo : u.shard.hi]
    return part.to(device=u.tensor.device, dtype=u.tensor.dtype).clone().view(u.tensor.shape)


def _checked(optimizer: object) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise MoecompileError(
            f"optimizer must be a factory params -> torch.optim.Optimizer, it returned {type(optimizer).__name__}")
    return optimizer
