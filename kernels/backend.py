"""Which implementation runs a moecompile op: the one place that decides.

    choice      CUDA tensors      CPU tensors
    auto        Triton            host body if the op has one, else reference   (default)
    triton      Triton            Triton under TRITON_INTERPRET=1, else KernelError
    reference   reference         reference

Inside `cross_compile.cross_compiling(arch)` an op with a Triton body calls it, on any device, for
its launches to compile for that GPU (nothing runs), and returns its reference's result.

A host body is a faster torch implementation for CPU tensors than the reference's readable
one-op-a-pass formula (adamw_update: torch's fused CPU AdamW over cache-sized chunks); the
reference stays the oracle both are tested against.

The choice comes from `MOECOMPILE_KERNELS` (read once, on first use, not at
import) and can be overridden in a scope with `use("triton")`. Every op body
asks `implementation("<op>", device)` and calls what it gets, so call sites
never test what is installed.

Why not one `register_kernel(op, "cuda", ...)` per op: the ops stay single
operators (`library.op`) whose body consults this table on every device, so
(1) forcing a backend works on CUDA and CPU alike, (2) export graphs keep one
`moecompile.<op>` node per MoE op (the passes' contract), and (3) tracing
(FakeTensorProp, export, torch.compile) uses the ops' fake impls and never
reaches a Triton launch with fake tensors.

Triton bodies live in `<op>_triton.py` modules, imported lazily on first use:
`@triton.jit` picks compiled or interpreted mode from TRITON_INTERPRET at
decoration, so the variable must be set before the first Triton call.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from typing import Callable, Iterator, Optional

import torch

from moecompile.errors import KernelError  # a leaf module: errors imports nothing of ours

CHOICES = ("auto", "triton", "reference")
ENV_VAR = "MOECOMPILE_KERNELS"
log = logging.getLogger(__name__)

_REFERENCE: dict[str, Callable] = {}
_TRITON: dict[str, str] = {}  # op name -> "module:function" inside moecompile.kernels
_HOST: dict[str, Callable] = {}  # op name -> its body for CPU tensors under "auto", where it has one
# A process-wide stack, not a ContextVar: autograd runs CUDA backward on its own
# threads, which would not see a context-local override.
_SCOPE: list[str] = []
# Target archs of the active cross_compile.cross_compiling() blocks: inside one, an op with a Triton body
# calls it (its launches compile for the target, nothing runs) and returns its reference's result.
_CROSS: list[int] = []


def register(name: str, reference: Callable, triton: Optional[str] = None, host: Optional[Callable] = None) -> None:
    """Declare op `name`'s reference, (lazily imported) Triton body, "module:function", and host body."""
    _REFERENCE[name] = reference
    if triton is not None:
        _TRITON[name] = triton
    if host is not None:
        _HOST[name] = host


def _validate(choice: str, source: str) -> str:
    if choice not in CHOICES:
        raise KernelError(f"{source} = {choice!r} is not a kernel backend; use one of {CHOICES}")
    return choice


@functools.cache
def _env_choice() -> str:
    return _validate(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)


def choice() -> str:
    """The backend choice in force: the innermost `use(...)`, else MOECOMPILE_KERNELS, else auto."""
    return _SCOPE[-1] if _SCOPE else _env_choice()


@contextlib.contextmanager
def use(backend: str) -> Iterator[None]:
    """Force `backend` ("auto" | "triton" | "reference") for every op called inside the block."""
    _SCOPE.append(_validate(backend, "use(backend)"))
    try:
        yield
    finally:
        _SCOPE.pop()


@functools.cache
def _triton_probe() -> Optional[str]:
    """None if Triton imports, else why not (probed once)."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything
        return f"{type(e).__name__}: {e}"
    return None


def triton_available() -> bool:
    return _triton_probe() is None


_INTERPRETED: dict[str, bool] = {}  # Triton module -> imported under TRITON_INTERPRET=1?


@functools.cache
def _load(target: str) -> Callable:
    module, _, fn = target.partition(":")
    loaded = importlib.import_module(f"{__package__}.{module}")
    _INTERPRETED[module] = _interpret_env()
    return getattr(loaded, fn)


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True if the Triton bodies run (or, not yet imported, will run) in the CPU interpreter."""
    return any(_INTERPRETED.values()) if _INTERPRETED else _interpret_env()


def uses_triton(device: torch.device) -> bool:
    """Does an op on `device` run its Triton body under the current choice? Raises if it can't."""
    wanted = choice()
    if wanted == "reference" or (wanted == "auto" and device.type != "cuda"):
        return False
    why_not = _triton_probe()
    if why_not is not None:
        if wanted == "auto":
            _warn_fallback(why_not)
            return False
        raise KernelError(
            f"{ENV_VAR}=triton but Triton does not import ({why_not}); "
            f"install the extra (`pip install moecompile[triton]`) or use {ENV_VAR}=reference"
        )
    if device.type != "cuda" and not interpreting():
        raise KernelError(
            f"{ENV_VAR}=triton on {device.type} tensors needs the Triton interpreter: set "
            f"TRITON_INTERPRET=1 before the first kernel call, move the tensors to CUDA, or use "
            f"{ENV_VAR}=reference"
        )
    return True


@functools.cache
def _warn_fallback(why_not: str) -> None:
    log.warning("moecompile kernels: Triton unavailable (%s); CUDA ops run the torch reference", why_not)


def implementation(name: str, device: torch.device) -> Callable:
    """The callable that runs op `name` on `device`: its Triton body, host body or reference."""
    if name not in _REFERENCE:
        raise KernelError(f"no kernel registered as {name!r}; known: {sorted(_REFERENCE)}")
    if _CROSS and name in _TRITON:
        return functools.partial(_compile_then_reference, name)
    if not uses_triton(device):
        if choice() == "auto" and device.type == "cpu" and name in _HOST:
            return _HOST[name]
        return _REFERENCE[name]
    if name not in _TRITON:
        raise KernelError(f"op {name!r} has no Triton body; run it with {ENV_VAR}=reference")
    return _load(_TRITON[name])


def _compile_then_reference(name: str, *args, **kwargs):
    _load(_TRITON[name])(*args, **kwargs)  # compiles its launches for the cross target; writes nothing
    return _REFERENCE[name](*args, **kwargs)


def target_arch(device: torch.device) -> Optional[int]:
    """The GPU architecture ops on ``device`` compile for (90 for sm_90): the cross-compile target inside
    ``cross_compile.cross_compiling``, the device's own on CUDA, else None (CPU, interpreter)."""
    if _CROSS:
        return _CROSS[-1]
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return None


def registered() -> dict[str, bool]:
    """Every op name -> whether it has a Triton body (for reports and tests)."""
    return {name: name in _TRITON for name in sorted(_REFERENCE)}
