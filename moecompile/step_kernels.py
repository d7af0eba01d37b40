"""The Triton kernels one training step of a converted model launches on a GPU, compiled without one.

``step_kernels(result, inputs, arch=90)`` builds the step a GPU run would (bf16 compute, fp32 masters,
``moecompile.AdamW``), runs one step on CPU inside ``kernels.cross_compile.cross_compiling`` and returns
every kernel it compiled for ``sm_<arch>``: the MoE ops' forward and backward and the optimizer's update,
at the dtypes, strides and tile configurations that run would use. ``moecompile inspect --kernels 90``
prints them. Compiling is not running: results and speed need the GPU (``pytest -m gpu``).
"""
from __future__ import annotations

from typing import Any

import torch

from .adamw import AdamW
from .kernels.cross_compile import CompiledKernel, cross_compiling, unfit
from .train_step import build_train_step


def step_kernels(result: Any, inputs: torch.Tensor, arch: int = 90) -> list[CompiledKernel]:
    """Compile for ``sm_<arch>`` every Triton kernel of one bf16 training step on ``inputs`` (token ids)."""
    step = build_train_step(result, optimizer=lambda ps: AdamW(ps, lr=1e-4), precision="bf16",
                            keep_host_memory=False)
    targets = torch.roll(inputs, -1, dims=-1)
    with cross_compiling(arch) as kernels:
        step(inputs, targets)
    return kernels


def kernel_table(kernels: list[CompiledKernel]) -> str:
    """One line per kernel, grouped by module, then the kernels that could not launch (if any)."""
    arch = kernels[0].arch if kernels else "?"
    lines = [f"{len(kernels)} Triton kernels compiled for sm_{arch} (registers from ptxas; shared memory as Triton "
             "allots it; * marks an autotune config)"]
    for k in sorted(kernels, key=lambda k: (k.module, k.name)):
        lines.append(f"  {k.module:<20} {'*' if k.autotune_config else ' '} {k.describe()}")
    problems = unfit(kernels)
    lines += [f"cannot launch on sm_{arch}: {p}" for p in problems] or [f"all fit sm_{arch}'s limits"]
    return "\n".join(lines)


__all__ = ["kernel_table", "step_kernels"]
