"""What this machine gives moecompile, and what it will not run here: ``moecompile env``.

One place that answers the questions a failed run raises (is this torch in range? will CUDA ops run
Triton or the torch reference? can this GPU take FP8 plans? which collective backend?), each fact
read from the library that decides it, so the answer is the one a run would act on.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
from typing import Any

import torch
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from .kernels import backend
from .kernels.fp8_quantize import FP8_MIN_ARCH

OPTIONAL = ("triton", "transformers", "safetensors")  # extras: moecompile[triton], moecompile[hf]


def torch_requirement() -> str | None:
    """The torch range moecompile was installed with ("<2.15,>=2.11"), or None when it is not installed."""
    try:
        requires = importlib.metadata.requires("moecompile") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        req = Requirement(line)
        if req.name == "torch" and req.marker is None:
            return str(req.specifier)
    return None


def in_range(version: str, requirement: str) -> bool:
    """Does ``version`` meet ``requirement`` as pip reads it (PEP 440: ``~=``, ``==2.13.*`` and local
    tags included; a pre-release of 2.15 is below 2.15)?"""
    return SpecifierSet(requirement).contains(version, prereleases=True)


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # not installed, or an install that fails to import
        return None


def _gpus() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        arch = 10 * props.major + props.minor
        gpus.append({"index": i, "name": props.name, "arch": f"sm_{arch}", "memory_gib": round(props.total_memory / 2**30, 1),
                     "fp8": arch >= FP8_MIN_ARCH, "bf16": props.major >= 8})
    return gpus


def _kernels_on(device: str) -> str:
    """What a moecompile op on ``device`` runs under the current backend choice."""
    try:
        triton = backend.uses_triton(torch.device(device))
    except Exception as e:  # the choice cannot run there: say why, as the op would
        return f"error: {e}"
    if not triton:
        return "torch"  # each op's reference, or its faster host body on the CPU
    return "triton interpreter" if device == "cpu" else "triton"


def environment() -> dict[str, Any]:
    """The facts, as plain data (``moecompile env --json`` prints this)."""
    gpus = _gpus()
    facts: dict[str, Any] = {
        "moecompile": _version("moecompile"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_required": torch_requirement(),
        "cuda_runtime": torch.version.cuda,
        **{name: _version(name) for name in OPTIONAL},
        "kernel_choice": backend.choice(),
        "triton_interpreter": backend.interpreting(),
        "kernels_cpu": _kernels_on("cpu"),
        "kernels_cuda": _kernels_on("cuda") if gpus else None,
        "cpu_threads": torch.get_num_threads(),
        "gpus": gpus,
        "collectives": [b for b, ok in (("gloo", dist.is_available() and dist.is_gloo_available()),
                                        ("nccl", dist.is_available() and dist.is_nccl_available())) if ok],
    }
    facts["problems"] = problems(facts)
    return facts


def problems(facts: dict[str, Any]) -> list[str]:
    """What will not run (or not as fast) here, each with its fix."""
    found = []
    required = facts["torch_required"]
    if required and not in_range(facts["torch"], required):
        found.append(f"torch {facts['torch']} is outside moecompile's range {required}: "
                     f"pip install 'torch{required}'")
    if facts["triton"] is None:
        found.append("Triton does not import: on a GPU every op runs its torch reference (slower); "
                     "pip install 'moecompile[triton]'")
    if facts["transformers"] is None:
        found.append("transformers is not installed: Hugging Face models, import_moe and export_hf need it; "
                     "pip install 'moecompile[hf]'")
    for gpu in facts["gpus"]:
        if not gpu["fp8"]:
            found.append(f"GPU {gpu['index']} ({gpu['name']}, {gpu['arch']}) has no FP8 arithmetic: plans with an "
                         f"fp8 recipe are refused there; set fp8.recipe: none")
    if facts["gpus"] and "nccl" not in facts["collectives"]:
        found.append("this torch has no NCCL: GPU ranks cannot form a process group; install a CUDA build of torch")
    if "gloo" not in facts["collectives"]:
        found.append("this torch has no gloo: CPU ranks cannot form a process group")
    for device in ("cpu", "cuda"):
        if (facts[f"kernels_{device}"] or "").startswith("error"):
            found.append(f"kernels on {device}: {facts[f'kernels_{device}'][len('error: '):]}")
    return found
