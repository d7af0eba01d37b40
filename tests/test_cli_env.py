"""``moecompile env``: the facts a run acts on, and each problem named with its fix."""

from __future__ import annotations

import json
import re

import pytest
import torch

from moecompile.cli import main
from moecompile.environment import environment, in_range, problems
from moecompile.kernels import backend


def test_env_json_reports_this_machine(capsys):
    assert main(["env", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["torch"] == torch.__version__ and facts["python"].count(".") == 2
    assert facts["torch_required"] is not None and in_range(torch.__version__, facts["torch_required"])
    assert "gloo" in facts["collectives"]
    assert facts["kernels_cpu"] in ("torch", "triton interpreter")
    if not torch.cuda.is_available():
        assert facts["gpus"] == [] and facts["kernels_cuda"] is None
    assert facts["problems"] == []  # the test extras install Triton and transformers; torch is in range


def test_env_table_ends_with_the_problems(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^\s*torch\s+{re.escape(torch.__version__)}\s*$", out, re.M)
    assert out.rstrip().endswith("problems: none")


@pytest.mark.parametrize("version,inside", [("2.11.0+cu130", True), ("2.14.1", True), ("2.13.0+cpu", True),
                                            ("2.10.1", False), ("2.15.0", False), ("2.15.0a0+git1234", False)])
def test_torch_range(version, inside):
    assert in_range(version, "<2.15,>=2.11") is inside


@pytest.mark.parametrize("requirement,version,inside", [("~=2.13.0", "2.13.1+cpu", True), ("~=2.13.0", "2.14.0", False),
                                                        ("==2.13.*", "2.13.0+cu130", True), ("!=2.12.0", "2.12.0", False)])
def test_torch_range_reads_every_pep440_clause(requirement, version, inside):
    assert in_range(version, requirement) is inside


def test_each_problem_names_its_fix():
    facts = environment()
    old = dict(facts, torch="2.10.0", torch_required="<2.15,>=2.11", triton=None, transformers=None,
               gpus=[{"index": 0, "name": "A100", "arch": "sm_80", "memory_gib": 80.0, "fp8": False, "bf16": True}],
               collectives=["gloo"])
    found = problems(old)
    assert len(found) == 5, found
    assert "torch 2.10.0 is outside moecompile's range <2.15,>=2.11: pip install 'torch<2.15,>=2.11'" in found
    assert any("Triton does not import" in p and "moecompile[triton]" in p for p in found)
    assert any("transformers is not installed" in p and "moecompile[hf]" in p for p in found)
    assert any("GPU 0 (A100, sm_80) has no FP8" in p and "fp8.recipe: none" in p for p in found)
    assert any("no NCCL" in p for p in found)


def test_a_kernel_choice_that_cannot_run_is_a_problem(monkeypatch):
    monkeypatch.setattr(backend, "_triton_probe", lambda: "ImportError: No module named 'triton'")
    with backend.use("triton"):  # as MOECOMPILE_KERNELS=triton on a machine without Triton
        facts = environment()
    assert facts["kernels_cpu"].startswith("error")
    assert any(p.startswith("kernels on cpu:") and "Triton does not import" in p and "=reference" in p
               for p in facts["problems"])
