"""Child process of test_cross_compile.py: training steps whose Triton kernels compile for sm_90.

Run without TRITON_INTERPRET (the Triton bodies must be imported compiled). Prints one JSON object:
the kernels compiled (as dicts), every top-level Triton kernel the package defines, and what the
sm_80 FP8 step raised.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil

import torch

import moecompile as mc
import moecompile.kernels as mk
from moecompile.errors import KernelError
from moecompile.kernels.cross_compile import cross_compiling
from moecompile.models import build_model
from moecompile.step_kernels import step_kernels

PLANS = {  # each a training step; together they reach every Triton kernel
    "default": {},
    "sigmoid-groups-bias-capacity-combine": {"score": "sigmoid", "route_groups": 2, "route_group_top_k": 1,
                                             "expert_bias": True, "capacity_factor": 1.0, "apply_weights": "combine"},
    "fp8-tensorwise": {"fp8": "tensorwise"},
    "fp8-delayed": {"fp8": "delayed"},
    "fp8-blockwise": {"fp8": "blockwise"},
}


def _plan(fields: dict) -> mc.Plan:
    fields = dict(fields)
    fp8 = fields.pop("fp8", None)
    data = {"experts": {"num_experts": 4, "top_k": 2, **fields}}
    if fp8:
        data["fp8"] = {"recipe": fp8}
    return mc.Plan.from_dict(data)


def _step(fields: dict, dtype: torch.dtype, arch: int = 90) -> list:
    model, (ids,) = build_model("tiny-llama", seq_len=32, dtype=dtype)
    return step_kernels(mc.convert(model, _plan(fields), (ids,)), ids, arch=arch)


def _rowwise_fp8_ops() -> list:
    """The rowwise recipe is in the op vocabulary but no plan recipe uses it: call the ops."""
    x, w = torch.randn(64, 32), torch.randn(4, 48, 32)
    sizes = torch.tensor([16, 16, 0, 32])
    with cross_compiling(90) as kernels:
        xq, xs = mk.quantize_fp8(x, "rowwise")
        wq, ws = mk.quantize_fp8(w, "rowwise")
        mk.grouped_mm_fp8(xq, xs, wq, ws, sizes, "rowwise", 0, None, torch.bfloat16)
    return kernels


def _defined_kernels() -> list[str]:
    """Every top-level Triton kernel (jit function or autotuner) of the ``*_triton`` modules."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    names = set()
    for info in pkgutil.iter_modules(mk.__path__):
        if info.name.endswith("_triton"):
            module = importlib.import_module(f"moecompile.kernels.{info.name}")
            for name, obj in vars(module).items():
                fn = obj.fn if isinstance(obj, Autotuner) else obj
                if isinstance(fn, JITFunction) and name.endswith("_kernel"):
                    names.add(fn.__name__)
    return sorted(names)


def main() -> None:
    kernels = []
    for name, fields in PLANS.items():
        kernels += _step(fields, torch.float32 if name == "default" else torch.bfloat16)
    kernels += _rowwise_fp8_ops()
    try:
        _step({"fp8": "blockwise"}, torch.bfloat16, arch=80)
        sm80 = None
    except KernelError as e:
        sm80 = str(e)
    from triton.runtime.jit import JITFunction

    print(json.dumps({"kernels": [dataclasses.asdict(k) for k in kernels], "defined": _defined_kernels(),
                      "sm80_fp8": sm80, "restored": JITFunction.run.__name__ == "run"}, default=str))


if __name__ == "__main__":
    main()
