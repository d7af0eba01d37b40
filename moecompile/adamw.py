"""AdamW with its two moments stored in a lower precision: half the optimizer state in bf16.

DeepSeek-V3 trains with AdamW's first and second moments in bf16 next to fp32 master weights;
Megatron-Core offers the same as ``--use-precision-aware-optimizer --exp-avg-dtype bf16``, through
Transformer Engine's fused CUDA Adam. torch.optim.AdamW keeps its moments in the parameter's
dtype (fp32 masters: 8 bytes a parameter), and no CPU library stores them in bf16 with fp32 math,
so this is that update: torch.optim.AdamW's formula, computed in fp32 from the stored moments and
rounded to ``moment_dtype`` when stored back (4 bytes a parameter in bf16).

The update reads only each element's gradient, moments and value, so it can update any part of a
parameter on its own: build_train_step accepts it under ``parallel.shard_optimizer``. The bias
corrections are tensor ops on the step count (no host sync), as torch's ``capturable`` AdamW does.
The update of each tensor is the ``adamw_update`` kernel: on CUDA one Triton pass over gradient,
moments and value (kernels/adamw_triton.py); on CPU torch's fused AdamW kernel over cache-sized
chunks with the bf16 moments widened to fp32 (what an offloaded optimizer's host step runs).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .errors import MoecompileError
from .kernels.adamw import adamw_update


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (no amsgrad) whose ``exp_avg`` and ``exp_avg_sq`` are kept in ``moment_dtype``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, moment_dtype: torch.dtype = torch.bfloat16):
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and all(0 <= b < 1 for b in betas)):
            raise MoecompileError(f"moecompile.AdamW: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0 "
                                  f"and betas={betas} in [0, 1)")
        if not isinstance(moment_dtype, torch.dtype) or not moment_dtype.is_floating_point:
            raise MoecompileError(f"moecompile.AdamW: moment_dtype={moment_dtype!r} must be a floating torch.dtype, "
                                  "e.g. torch.bfloat16 (half of fp32's state) or torch.float32")
        # by name in the param groups: a checkpoint writes their hyperparameters as JSON
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      moment_dtype=str(moment_dtype).removeprefix("torch.")))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, self.state[p], group, beta1, beta2)
        return loss

    def _update(self, p: torch.Tensor, state: dict, group: dict, beta1: float, beta2: float) -> None:
        if not state:
            # a float64 count: the bias corrections in double precision, as torch's Python floats are
            state["step"] = torch.zeros((), dtype=torch.float64, device=p.device)
            dtype = getattr(torch, group["moment_dtype"])
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
        state["step"] += 1
        adamw_update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr=group["lr"],
                     weight_decay=group["weight_decay"], beta1=beta1, beta2=beta2, eps=group["eps"])
