"""`op`: define a functional `torch.ops.moecompile.<op>` at a fraction of `custom_op`'s host cost.

Same front end as `torch.library.custom_op` (schema inferred from the type hints,
`.register_fake`, `.register_autograd(backward, setup_context=...)`), so graphs,
export, make_fx and opcheck see an ordinary operator with a fake impl. What
differs is the eager path, which every MoE layer pays about 14 times a step:

    custom_op                                     op (this module)
    Autograd kernel: fill defaults, metadata      Autograd kernel: one autograd.Function,
      object, generated Function, output-alias      only when an input needs grad
      check, then a dynamo-disabled backend         backend: the body itself, registered
      wrapper around the body                       as CompositeExplicitAutograd
                                                  (both kernels dynamo-disabled too)

Measured on the 2-core AVX2 box (`benchmarks/op_overhead.py`, a 4-element multiply):
custom_op adds ~13 us to a call without grad and ~80 us to a forward+backward over
the plain aten op; this adds ~7 and ~56 (~5 and ~51 before its kernels were
dynamo-disabled, which a converted module under ``torch.compile`` needs).

Only functional ops (no mutated arguments): the one mutating op keeps `custom_op`,
which also writes its functionalization.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

_LIBS: dict[str, torch.library.Library] = {}  # namespace -> its FRAGMENT (kept alive: dropping it unregisters)


def _library(namespace: str) -> torch.library.Library:
    if namespace not in _LIBS:
        _LIBS[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _LIBS[namespace]


class Op:
    """One operator: call it like the function it was defined from."""

    def __init__(self, qualname: str, fn: Callable) -> None:
        self.qualname = qualname
        namespace, self.name = qualname.split("::")
        self._lib = _library(namespace)
        self._lib.define(self.name + torch.library.infer_schema(fn, mutates_args=()))
        self._lib.impl(self.name, _eager_only(_without_autocast(fn)), "CompositeExplicitAutograd")
        self.default: torch._ops.OpOverload = getattr(getattr(torch.ops, namespace), self.name).default
        # The dispatcher hands a Python kernel its trailing arguments only where they differ from
        # the schema's defaults; the autograd wrapper restores them so setup_context sees all inputs.
        self._defaults = tuple(p.default for p in inspect.signature(fn).parameters.values())
        self.__doc__ = fn.__doc__

    def __call__(self, *args: Any) -> Any:
        return self.default(*args)

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(self.qualname, fake, lib=self._lib)
        return fake

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """`backward(ctx, *grads) -> one grad per input`; `setup_context(ctx, inputs, output)` saves."""
        overload, defaults = self.default, self._defaults

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, *args: Any) -> Any:
                with torch._C._AutoDispatchBelowAutograd():
                    output = overload(*args)
                setup_context(ctx, args, output)
                _mark_integer_outputs(ctx, output)
                return output

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                return backward(ctx, *grads)

        Function.__name__ = Function.__qualname__ = f"{self.name}_autograd"

        def autograd_kernel(*args: Any) -> Any:
            if len(args) < len(defaults):
                args = args + defaults[len(args):]
            if torch.is_grad_enabled() and _any_requires_grad(args):
                return Function.apply(*args)
            with torch._C._AutoDispatchBelowAutograd():
                return overload(*args)

        self._lib.impl(self.name, _eager_only(autograd_kernel), "Autograd")


def _eager_only(kernel: Callable) -> Callable:
    """The kernel with dynamo off inside it (custom_op does the same). A graph traced by dynamo holds
    the op itself, through its fake impl; the Python kernel runs only eagerly, and under
    ``torch.compile`` that includes the code between graph breaks (a dropless dispatch's splits),
    where dynamo would otherwise trace into the body and fail on what only its fake impl describes."""
    return torch._disable_dynamo(kernel)


def _without_autocast(kernel: Callable) -> Callable:
    """The kernel with autocast off inside it: an op's body sets its own precision (an FP8 GEMM accumulates in
    float32), and autocast already cast the op's inputs at its boundary where the op is registered for it
    (``register_autocast``). Left on, the body's aten ops were cast again: on CPU ``_scaled_mm`` is a bf16 ``mm``
    under autocast, so FP8 GEMMs came out rounded to bf16; and a TorchDispatchMode (a CUDA-graph capture's
    checks, ``make_fx``) runs the body without it, so the same step gave other numbers under a mode. A Triton
    kernel ignores autocast too: the reference bodies now compute what the GPU kernels do."""

    def kernel_without_autocast(*args: Any) -> Any:
        with torch._C._DisableAutocast():  # every device's autocast key excluded: ~0.4 us, torch.autocast's ~7
            return kernel(*args)

    return functools.wraps(kernel)(kernel_without_autocast)


def _any_requires_grad(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _mark_integer_outputs(ctx: Any, output: Any) -> None:
    """Index and count outputs carry no gradient (custom_op's rule too)."""
    outputs = output if isinstance(output, tuple) else (output,)
    integer = [t for t in outputs if isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex())]
    if integer:
        ctx.mark_non_differentiable(*integer)


def _tag_compile_caches() -> str:
    """Key torch.compile's caches on this package's source as well: a compiled backward traces the ops'
    autograd formulas, which torch's cache keys do not cover, so a changed formula would otherwise be
    served its stale compiled graph from the on-disk cache (seen while the fp8 backwards became ops)."""
    import hashlib
    import os

    import torch.compiler.config as compile_config

    folder = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".py")):
        with open(os.path.join(folder, name), "rb") as f:
            digest.update(name.encode() + f.read())
    tag = f"moecompile-kernels-{digest.hexdigest()[:16]}"
    if tag not in compile_config.cache_key_tag:
        compile_config.cache_key_tag = "+".join(t for t in (compile_config.cache_key_tag, tag) if t)
    return tag


CACHE_TAG = _tag_compile_caches()


def op(qualname: str) -> Callable[[Callable], Op]:
    """Decorator: `@op("moecompile::name")` over a fully type-hinted function."""
    return lambda fn: Op(qualname, fn)


__all__ = ["CACHE_TAG", "Op", "op"]
