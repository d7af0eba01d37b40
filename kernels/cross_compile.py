"""Compile the Triton bodies for a GPU this machine does not have, at the launches a run makes.

The interpreter (``TRITON_INTERPRET=1``) checks what a kernel computes, not that it compiles: a
``tl.dot`` tile under 16, an fp8 type the target lacks, more shared memory or registers than an SM has
are found only by Triton's compiler and ptxas. Both run without a GPU: Triton lowers through LLVM to PTX
in-process and ships ptxas and cuobjdump. So inside ``cross_compiling(arch=90)`` code runs on CPU
tensors as usual, except that

- every op with a Triton body calls it (its launches compile for ``sm_<arch>`` instead of running;
  its output is garbage) and then returns its torch reference's result, so the run goes on with
  correct values and every later launch sees the arguments a GPU run would pass;
- an autotuned kernel compiles every config it could pick, not the one a benchmark would.

Each distinct compiled kernel is recorded with the resources ptxas gave it (registers, spilled bytes)
and the shared memory Triton allots, against the target's limits. What this does not check: that the
kernel runs, its results and its speed (``python -m pytest -m gpu``, ``benchmarks/kernels_gpu.py``).
Patches Triton's launch path for the whole process while active; not for use beside real launches.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from typing import Any, Iterator

from moecompile.errors import KernelError

from . import backend

# Shared memory one block may opt into, bytes (CUDA programming guide, compute capabilities table).
MAX_SHARED = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
MAX_REGISTERS = 255  # per thread, every architecture since sm_50


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """One specialization of one Triton kernel, compiled for ``arch``."""

    name: str
    module: str
    arch: int
    signature: dict[str, str]  # argument -> Triton type (``*bf16``, ``i32``, ...), runtime arguments only
    constants: dict[str, Any]  # constexpr argument -> value
    num_warps: int
    num_stages: int
    shared: int  # bytes of shared memory a block needs
    registers: int | None  # per thread, as ptxas allotted (None without cuobjdump)
    local: int | None  # bytes of local memory per thread (register spills, stack)
    autotune_config: bool  # one of an autotuner's configs (which may not all fit: it skips those)

    @property
    def problems(self) -> list[str]:
        """Why this kernel could not launch on ``arch`` (empty if it can)."""
        out = []
        limit = MAX_SHARED.get(self.arch)
        if limit is not None and self.shared > limit:
            out.append(f"needs {self.shared} bytes of shared memory, sm_{self.arch} has {limit}")
        if self.registers is not None and self.registers > MAX_REGISTERS:
            out.append(f"needs {self.registers} registers a thread, the limit is {MAX_REGISTERS}")
        return out

    def describe(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.constants.items())
        dtypes = ",".join(sorted({t for t in self.signature.values() if t.startswith("*")}))
        regs = "?" if self.registers is None else self.registers
        spill = "" if not self.local else f", {self.local} B local (spills)"
        return (f"{self.name}[{dtypes}] {consts}; warps {self.num_warps}, stages {self.num_stages}: "
                f"{self.shared} B shared, {regs} registers{spill}")


class _TargetDriver:
    """Answers the questions Triton's launch path asks of a driver, for a target without one."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.device = f"cross-compile:sm_{arch}"  # the JIT caches' key: never a real device's

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> str:
        return self.device

    def get_current_stream(self, device: Any = None) -> int:
        return 0


@contextlib.contextmanager
def cross_compiling(arch: int = 90) -> Iterator[list[CompiledKernel]]:
    """Inside: Triton launches compile for ``sm_<arch>`` and op results come from the references.

    Yields the list the compiled kernels are appended to (one entry per distinct kernel binary)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or backend.interpreting():
        raise KernelError("cross_compiling needs the Triton bodies compiled, not interpreted: run it in a process "
                          "without TRITON_INTERPRET=1")
    if not backend.triton_available():
        raise KernelError("cross_compiling needs Triton: pip install moecompile[triton]")
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    compiled: list[CompiledKernel] = []
    seen: set[str] = set()
    touched: set[Any] = set()
    in_autotune = [False]
    jit_run, autotune_run = JITFunction.run, Autotuner.run

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        touched.add(self)
        kernel = jit_run(self, *args, grid=grid, warmup=True, **kwargs)
        if kernel.hash not in seen:
            seen.add(kernel.hash)
            compiled.append(_record(self, kernel, arch, in_autotune[0]))
        return kernel

    def every_config(self: Any, *args: Any, **kwargs: Any) -> None:
        in_autotune[0] = True
        try:
            for config in self.configs:
                self.fn.run(*args, **{**kwargs, **config.all_kwargs()})
        finally:
            in_autotune[0] = False

    saved_driver, target = driver._active, _TargetDriver(arch)
    driver.set_active(target)
    JITFunction.run, Autotuner.run = compile_only, every_config
    backend._CROSS.append(arch)
    try:
        yield compiled
    finally:
        backend._CROSS.pop()
        JITFunction.run, Autotuner.run = jit_run, autotune_run
        driver._active = saved_driver
        for fn in touched:  # drop the binders built for the target, keyed by its sentinel device
            fn.device_caches.pop(target.device, None)


def _record(fn: Any, kernel: Any, arch: int, autotune_config: bool) -> CompiledKernel:
    signature = {k: v for k, v in kernel.src.signature.items() if v != "constexpr"}
    names = list(kernel.src.signature)
    constants = {names[path[0]]: value for path, value in kernel.src.constants.items() if len(path) == 1}
    meta = kernel.metadata
    registers, local = _resource_usage(kernel.asm["cubin"], kernel.name)
    return CompiledKernel(
        name=kernel.name, module=fn.module.rpartition(".")[2], arch=arch, signature=signature, constants=constants,
        num_warps=meta.num_warps, num_stages=meta.num_stages, shared=meta.shared, registers=registers, local=local,
        autotune_config=autotune_config)


def _resource_usage(cubin: bytes, name: str) -> tuple[int | None, int | None]:
    """(registers, local bytes) of ``name`` in ``cubin`` from the cuobjdump Triton ships, or (None, None)."""
    try:
        from triton import knobs

        tool = knobs.nvidia.cuobjdump.path
    except Exception:  # an install without the NVIDIA tools
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True)
    match = re.search(rf"Function {re.escape(name)}:\s*REG:(\d+) STACK:\d+ SHARED:\d+ LOCAL:(\d+)", done.stdout)
    return (int(match[1]), int(match[2])) if match else (None, None)


def unfit(kernels: list[CompiledKernel]) -> list[str]:
    """Kernels that could not launch: a fixed kernel that does not fit, or an autotuned kernel none of
    whose configs fits (the autotuner skips a config that runs out of resources)."""
    out, families = [], {}
    for k in kernels:
        if k.autotune_config:
            families.setdefault((k.name, tuple(sorted(k.signature.items()))), []).append(k)
        elif k.problems:
            out.append(f"{k.describe()}: {'; '.join(k.problems)}")
    for (name, _), configs in families.items():
        if all(k.problems for k in configs):
            out.append(f"{name}: none of its {len(configs)} autotune configs fits ({configs[0].problems[0]}, ...)")
    return out


__all__ = ["CompiledKernel", "MAX_SHARED", "cross_compiling", "unfit"]
