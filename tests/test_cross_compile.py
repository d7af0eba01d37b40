"""Every Triton kernel compiles for an H100 (sm_90) at the launches real training steps make, on a CPU.

The interpreter tests (test_triton_kernels.py) check what the kernels compute; these check what only the
compiler and ptxas can: that each kernel lowers to a cubin for sm_90 with the GPU tile configurations (not
the interpreter's), fits an SM's shared memory and registers, and that FP8 on an sm_80 GPU is refused by
name. The steps run in a child process: the Triton bodies must be imported compiled, which a process that
imported them interpreted (test_triton_kernels sets TRITON_INTERPRET=1 at collection) cannot undo.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from moecompile.errors import KernelError  # noqa: E402
from moecompile.kernels.cross_compile import MAX_SHARED, CompiledKernel, cross_compiling, unfit  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, str(HERE / "_cross_compile_workload.py")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_triton_kernel_compiles_for_sm90(compiled):
    names = {k["name"] for k in compiled["kernels"]}
    assert len(compiled["defined"]) >= 15, compiled["defined"]
    assert set(compiled["defined"]) <= names, f"never compiled: {sorted(set(compiled['defined']) - names)}"
    assert {k["arch"] for k in compiled["kernels"]} == {90}
    assert all(k["registers"] is not None for k in compiled["kernels"]), "cuobjdump gave no register counts"
    assert compiled["restored"], "cross_compiling left Triton's launch path patched"


def test_kernels_fit_an_sm90(compiled):
    kernels = [CompiledKernel(**k) for k in compiled["kernels"]]
    assert unfit(kernels) == []
    fixed = [k for k in kernels if not k.autotune_config]
    assert all(k.shared <= MAX_SHARED[90] for k in fixed)
    # under ptxas's cap (255 is where it starts to spill; the glu backward sat there on 4 warps), no spills at all
    assert max(k.registers for k in fixed) < 255, max(fixed, key=lambda k: k.registers).describe()
    assert all(k.local == 0 for k in kernels), [k.describe() for k in kernels if k.local]
    # the GPU tiles, not the interpreter's small ones: the expert GEMMs autotune over 6 configs up to 128 x 256
    gemm = [k for k in kernels if k.name == "_grouped_mm_kernel"]
    assert {(k.constants["BLOCK_M"], k.constants["BLOCK_N"]) for k in gemm} >= {(128, 256), (64, 64)}
    assert {k.signature["x_ptr"] for k in gemm} >= {"*bf16"}


def test_fp8_on_an_sm80_gpu_is_refused_by_name(compiled):
    message = compiled["sm80_fp8"]
    assert message and "compute capability 8.9" in message and "sm_80" in message and "fp8.recipe: none" in message


def test_cross_compiling_refuses_interpreted_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(KernelError, match="without TRITON_INTERPRET=1"):
        with cross_compiling(90):
            pass


def _kernel(name: str, shared: int, registers: int = 64, autotune: bool = False) -> CompiledKernel:
    return CompiledKernel(name=name, module="m", arch=90, signature={"x": "*bf16"}, constants={}, num_warps=4,
                          num_stages=3, shared=shared, registers=registers, local=0, autotune_config=autotune)


def test_unfit_names_fixed_kernels_and_autotuners_with_no_config_that_fits():
    too_big = MAX_SHARED[90] + 1
    assert unfit([_kernel("a", 1024), _kernel("b", too_big, autotune=True), _kernel("b", 2048, autotune=True)]) == []
    problems = unfit([_kernel("a", too_big), _kernel("c", 0, registers=300),
                      _kernel("b", too_big, autotune=True), _kernel("b", too_big, autotune=True)])
    assert len(problems) == 3
    assert "232449 bytes of shared memory, sm_90 has 232448" in problems[0]
    assert "300 registers" in problems[1]
    assert problems[2].startswith("b: none of its 2 autotune configs fits")


def test_inspect_kernels_writes_the_step_kernel_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(HERE.parent), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-m", "moecompile", "inspect", "--model", "tiny-llama", "--kernels", "sm_90",
                           "--formats", "", "--quiet", "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    table = (tmp_path / "kernels_sm90.txt").read_text()
    assert "Triton kernels compiled for sm_90" in table and "all fit sm_90's limits" in table
    for kernel in ("_route_fwd_kernel", "_grouped_mm_kernel", "_grouped_wgrad_kernel", "_glu_bwd_kernel",
                   "_adamw_kernel"):
        assert kernel in table
    assert table.splitlines()[0] in done.stdout


def test_inspect_kernels_takes_an_architecture_number(capsys):
    from moecompile.cli import main

    with pytest.raises(SystemExit):
        main(["inspect", "--model", "tiny-llama", "--kernels", "hopper"])
    assert "'hopper' is not a GPU architecture: give its number, e.g. 90 or sm_90" in capsys.readouterr().err
