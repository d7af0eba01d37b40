"""``moecompile inspect``: one command, a report and a clickable graph for every pass."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from moecompile.cli import build_parser, main
from moecompile.models import build_model
from moecompile.plan import Plan

ROOT = Path(__file__).resolve().parents[1]


def _svg_node_count(path: Path) -> int:
    root = ET.parse(path).getroot()
    return sum(1 for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "node")


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed (apt-get install graphviz)")
def test_inspect_writes_report_html_and_svg_per_pass(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("experts:\n  num_experts: 4\n  top_k: 2\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "moecompile", "inspect", "--model", "tiny-llama", "--plan", str(plan),
         "--set", "experts.aux_loss=aux", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout
    assert printed.splitlines()[0].split()[:2] == ["pass", "nodes"]  # the report, plain: stdout is a pipe
    assert "model.layers.0.mlp: glu FFN -> 4 experts top-2" in printed
    assert "wrote " in printed and str(out) in printed

    passes = [p.stem.split("_", 1)[1] for p in sorted(out.glob("[0-9][0-9]_*.py"))]
    assert passes[:4] == ["trace", "import_moe", "find_ffn", "upcycle"]
    for i, name in enumerate(passes):
        assert any(line.startswith(name + " ") for line in printed.splitlines()), name  # a report row each
        for ext in ("html", "svg", "py"):
            assert (out / f"{i:02d}_{name}.{ext}").stat().st_size > 0, (name, ext)
        if i:
            assert (out / f"{i:02d}_{name}.diff").exists()
    # the upcycle picture holds the upcycled graph, node for node
    code = (out / "03_upcycle.py").read_text()
    assert "torch.ops.moecompile.grouped_mm.default" in code
    html = (out / "03_upcycle.html").read_text()
    data = json.loads(re.search(r'id="graph-data">(.*?)</script>', html, re.S).group(1))
    assert data["title"] == "after upcycle" and any(n["role"] == "experts" for n in data["nodes"])
    assert _svg_node_count(out / "03_upcycle.svg") == len(data["nodes"])
    assert "+    route = torch.ops.moecompile.route.default" in (out / "03_upcycle.diff").read_text()

    report = (out / "report.md").read_text()
    assert "| upcycle |" in report and "### upcycle" in report and "[svg](03_upcycle.svg)" in report
    assert "- model.layers.1.mlp: glu FFN -> 4 experts top-2" in report
    saved = Plan.from_file(out / "plan.yaml")
    assert (saved.experts.num_experts, saved.experts.aux_loss) == (4, "aux")
    index = (out / "index.html").read_text()
    assert 'href="03_upcycle.html"' in index and 'href="report.md"' in index


def test_inspect_a_config_json_one_layer(tmp_path, capsys):
    model, _ = build_model("tiny-gpt2")
    model.config.to_json_file(tmp_path / "config.json")
    out = tmp_path / "gpt2"
    rc = main(["inspect", "--model", str(tmp_path / "config.json"), "--config", "n_layer=3", "--set",
               "experts.num_experts=2", "--set", "experts.top_k=1", "--layer", "1", "--formats", "html",
               "--out", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "pass " not in printed and "wrote " in printed  # --quiet: only where the files are
    report = (out / "report.md").read_text()
    assert "transformer.h.2.mlp: mlp FFN -> 2 experts top-1" in report
    assert not list(out.glob("*.svg"))
    data = json.loads(re.search(r'id="graph-data">(.*?)</script>', (out / "03_upcycle.html").read_text(), re.S).group(1))
    assert data["title"] == "after upcycle · transformer.h.1"
    assert {g["path"] for g in data["groups"]} >= {"transformer.h.1", "transformer.h.1.mlp"}
    assert "transformer.h.0" not in {g["path"] for g in data["groups"]}


def test_help_documents_every_option_files_models_and_plan_fields(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["inspect", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("--model", "--plan", "--set", "--out", "--config", "--batch-size", "--seq-len", "--seed",
                   "--passes", "--import", "--layer", "--formats", "--svg-max-nodes", "--style", "--quiet"):
        assert option in text, option
    for name in ("report.md", "NN_<pass>.html", "NN_<pass>.svg", "NN_<pass>.diff", "index.html", "tiny-llama",
                 "tiny-gpt2", "experts.num_experts=8", "config.json"):
        assert name in text, name


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope"], "neither a zoo model"),
    (["--model", "tiny-llama", "--set", "experts.top_k=9"], "plan field 'experts.top_k' = 9"),
    (["--model", "tiny-llama", "--set", "experts"], "must look like KEY=VALUE"),
    (["--model", "tiny-llama", "--set", "nosection.x=1"], "sections: experts"),
    (["--model", "tiny-llama", "--formats", "html,jpg"], "--formats jpg: unknown"),
    (["--model", "tiny-llama", "--config", "hiden_size=3"], "has no field 'hiden_size'"),
])
def test_inspect_errors_say_what_to_change(argv, message, tmp_path, capsys):
    assert main(["inspect", *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_inspect_a_model_that_is_an_moe_already_takes_its_experts(tmp_path, capsys):
    """No plan given: the plan's experts are the model's own (4, top-2), and import_moe adopts them."""
    out = tmp_path / "mixtral"
    assert main(["inspect", "--model", "tiny-mixtral", "--formats", "html", "--out", str(out), "--quiet"]) == 0
    report = (out / "report.md").read_text()
    assert "model.layers.1.mlp: adopted MixtralSparseMoeBlock, 4 experts top-2 softmax renormalised silu GLUs" in report
    assert (out / "01_import_moe.html").stat().st_size > 0
    assert Plan.from_file(out / "plan.yaml").experts.num_experts == 4
