"""``moecompile inspect``: convert a model and show what every pass did.

    moecompile inspect --model tiny-llama --plan plan.yaml --out out/inspect
    moecompile inspect --model path/to/config.json --set experts.num_experts=16 --layer 0

Writes to ``--out``: ``report.md``, and per pass ``NN_<pass>.html`` (interactive graph),
``NN_<pass>.svg`` (graphviz), ``NN_<pass>.py`` (generated code), ``NN_<pass>.diff``
(code diff against the pass before); ``index.html`` links them all; ``plan.yaml`` is the
plan that ran. Then prints the report.
"""

from __future__ import annotations

import argparse
import html
import importlib
import time
from pathlib import Path
from typing import Any

HELP = "Convert a model and write, per pass, an interactive HTML graph, an SVG, the code and its diff, plus report.md."

_EPILOG = """\
files written to --out:
  report.md           the report: per pass nodes (+/-), parameters, FLOPs/token, activations,
                      communication per step, wall time, and what the pass decided
  NN_<pass>.html      the graph after that pass: self-contained, open it in any browser
                      (collapse module groups, search, pick a layer, click a node for its meta)
  NN_<pass>.svg       the same graph through graphviz (needs `dot`: apt-get install graphviz)
  NN_<pass>.py        the generated code after the pass
  NN_<pass>.diff      unified diff of that code against the pass before
  index.html          links to all of the above
  plan.yaml           the plan that ran (after --set)

zoo models (random weights, no downloads):
{zoo}

plan fields for --plan / --set (Plan.describe() has each one's documentation):
{fields}

examples:
  moecompile inspect --model tiny-llama --out out/inspect
  moecompile inspect --model tiny-qwen3 --plan plan.yaml --set experts.num_experts=16 --layer 1
  moecompile inspect --model ./config.json --config num_hidden_layers=2 --formats html,png
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..models import list_models

    import textwrap

    from ..plan import Plan

    zoo = "\n".join(f"  {name:<14}{desc}" for name, desc in list_models())
    fields = textwrap.fill(", ".join(f"{name}={default}" for name, default, _doc in Plan.describe()), width=96,
                           initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _EPILOG.format(zoo=zoo, fields=fields)
    p.add_argument("--model", required=True, metavar="NAME|CONFIG",
                   help="a zoo model (see below), a Hugging Face config.json (random weights) or a "
                        "save_pretrained directory (its weights are loaded)")
    p.add_argument("--plan", metavar="PLAN.yaml", default=None,
                   help="the plan (YAML or JSON); default: every section's defaults")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="change one plan field, value parsed as YAML (repeatable), e.g. experts.num_experts=16")
    p.add_argument("--out", default="out/inspect", metavar="DIR", help="where to write (default: out/inspect)")
    p.add_argument("--config", dest="configs", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the model's config (repeatable), e.g. num_hidden_layers=4")
    p.add_argument("--batch-size", type=int, default=2, help="sequences in the example batch (default 2)")
    p.add_argument("--seq-len", type=int, default=8, help="tokens per example sequence (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the example batch (default 0)")
    p.add_argument("--passes", default="", metavar="NAME,...",
                   help="extra registered passes to run after the built-in pipeline (see --import)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import a module first, e.g. one that registers your own passes (repeatable)")
    p.add_argument("--layer", default=None, metavar="N|PATH",
                   help="draw only this layer in every picture: an index of a repeating block (0) or a module path")
    p.add_argument("--formats", default="html,svg", metavar="FMT,...",
                   help="pictures per pass, from html, svg, png, dot (default html,svg)")
    p.add_argument("--svg-max-nodes", type=int, default=1000, metavar="N",
                   help="above N nodes, graphviz pictures show the first repeating layer open and the others "
                        "collapsed (graphviz takes minutes on a few thousand nodes); default 1000")
    p.add_argument("--style", choices=("rich", "plain", "markdown"), default=None,
                   help="how to print the report (default: rich on a terminal, plain otherwise)")
    p.add_argument("--quiet", action="store_true", help="write the files, print only where they are")
    p.add_argument("--kernels", type=_arch, default=None, metavar="ARCH",
                   help="also compile, for GPU architecture ARCH (90: H100/H200, 80: A100), every Triton kernel one "
                        "bf16 training step of the converted model launches, without a GPU (Triton's compiler and "
                        "ptxas); writes kernels_sm<ARCH>.txt: registers and shared memory per kernel, and exits 1 "
                        "if one cannot launch there")


def _arch(text: str) -> int:
    digits = text.lower().removeprefix("sm_").removeprefix("sm")
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU architecture: give its number, e.g. 90 or sm_90")
    return int(digits)


def _parse_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text) if text != "" else ""


def _key_value(item: str, what: str) -> tuple[str, Any]:
    from ..errors import MoecompileError

    key, sep, value = item.partition("=")
    if not sep or not key:
        raise MoecompileError(f"{what} {item!r} must look like KEY=VALUE")
    return key.strip(), _parse_value(value)


def load_plan(path: str | None, sets: list[str], experts: dict[str, Any] | None = None) -> Any:
    """The plan file (or the defaults, with ``experts`` fields) with each ``section.field=value`` applied."""
    from ..plan import Plan

    return apply_sets(Plan.from_file(path) if path else Plan.from_dict({"experts": experts or {}}), sets)


def apply_sets(plan: Any, sets: list[str]) -> Any:
    """``plan`` with each ``--set section.field=value`` applied, validated as a new Plan."""
    from ..errors import PlanError
    from ..plan import Plan

    if not sets:
        return plan
    data = plan.to_dict()
    for item in sets:
        key, value = _key_value(item, "--set")
        section, dot, field = key.partition(".")
        if not dot or section not in data:
            raise PlanError(key, value, f"--set takes SECTION.FIELD=VALUE; sections: {', '.join(data)}")
        data[section][field] = value
    return Plan.from_dict(data)


def _layer(text: str | None) -> str | int | None:
    return int(text) if text is not None and text.lstrip("-").isdigit() else text


def run(args: argparse.Namespace) -> int:
    from .. import convert
    from ..diff import diff
    from ..errors import MoecompileError
    from ..models import build_model, load_config, own_experts
    from ..report import render_markdown, render_report, report_rows
    from ..visualize import FORMATS, visualize

    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise MoecompileError(f"--formats {','.join(bad)}: unknown; choose from {', '.join(FORMATS)}")
    for module in args.imports:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise MoecompileError(f"--import {module}: {e}") from e
    overrides = dict(_key_value(item, "--config") for item in args.configs)
    plan = load_plan(args.plan, args.sets, experts=own_experts(load_config(args.model, **overrides)))
    model, example = build_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed, **overrides)
    start = time.perf_counter()
    result = convert(model, plan, example, passes=[p for p in args.passes.split(",") if p])
    convert_s = time.perf_counter() - start

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / "plan.yaml")
    layer = _layer(args.layer)
    files: list[tuple[str, dict[str, str]]] = []
    notes: list[str] = []
    for i, rec in enumerate(result.history):
        stem = f"{i:02d}_{rec.name}"
        written: dict[str, str] = {}
        (out / f"{stem}.py").write_text(rec.code)
        written["code"] = f"{stem}.py"
        if i:
            (out / f"{stem}.diff").write_text(diff(result, rec.name) + "\n")
            written["diff"] = f"{stem}.diff"
        for fmt in formats:
            collapse: list[str] = []
            if fmt != "html" and layer is None and rec.num_nodes > args.svg_max_nodes:
                collapse = _all_but_first_layer(rec)
                if collapse and not notes:
                    notes.append(f"graphs over {args.svg_max_nodes} nodes: graphviz pictures show the first layer "
                                 f"open and {len(collapse)} collapsed (the HTML toggles them; or use --layer)")
            visualize(result, out / f"{stem}.{fmt}", after=rec.name, layer=layer, collapse=collapse)
            written[fmt] = f"{stem}.{fmt}"
        files.append((rec.name, written))

    rows = report_rows(result)
    md = render_markdown(rows)
    md += f"\n## Model\n\n- `{args.model}`: {type(model).__name__}, example batch {args.batch_size} x {args.seq_len}, " \
          f"converted in {convert_s:.2f} s\n- plan: [plan.yaml](plan.yaml)\n"
    md += "\n## Files\n\n| pass | " + " | ".join([*formats, "code", "diff"]) + " |\n"
    md += "|" + "---|" * (len(formats) + 3) + "\n"
    for name, written in files:
        cells = [f"[{k}]({written[k]})" if k in written else "-" for k in [*formats, "code", "diff"]]
        md += f"| {name} | " + " | ".join(cells) + " |\n"
    md += "".join(f"\n_{n}_\n" for n in notes)
    (out / "report.md").write_text(md)
    (out / "index.html").write_text(_index(args.model, render_report(result, style="plain"), files, notes))

    if not args.quiet:
        print(render_report(result, style=args.style))
        print()
        for n in notes:
            print(n)
    print(f"wrote {len(files)} passes to {out}/: report.md, index.html, " + ", ".join(
        sorted({k for _, w in files for k in w})) + " per pass")
    return 0 if args.kernels is None else _kernels(result, example, args.kernels, out)


def _kernels(result: Any, example: tuple, arch: int, out: Path) -> int:
    """Compile the step's Triton kernels for ``sm_<arch>``, print and write their table; 1 if one cannot launch."""
    from ..kernels.cross_compile import unfit
    from ..step_kernels import kernel_table, step_kernels

    kernels = step_kernels(result, example[0], arch=arch)
    table = kernel_table(kernels)
    (out / f"kernels_sm{arch}.txt").write_text(table + "\n")
    print(table)
    print(f"wrote {out}/kernels_sm{arch}.txt")
    return 1 if unfit(kernels) else 0


def _all_but_first_layer(rec: Any) -> list[str]:
    from ..visualize import build_view, layer_groups

    return [g.path for g in layer_groups(build_view(rec.graph))[1:]]


def _index(model: str, report: str, files: list[tuple[str, dict[str, str]]], notes: list[str]) -> str:
    rows = "\n".join(
        f"<tr><td>{html.escape(name)}</td>" + "".join(
            f'<td><a href="{html.escape(v)}">{html.escape(k)}</a></td>' for k, v in written.items()) + "</tr>"
        for name, written in files
    )
    note = "".join(f"<p><em>{html.escape(n)}</em></p>" for n in notes)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>moecompile inspect: {html.escape(model)}</title>
<style>body{{font-family:Helvetica,Arial,sans-serif;margin:24px}} td{{padding:3px 10px}} pre{{background:#f3f4f6;padding:10px;overflow:auto}}</style>
</head><body>
<h1>moecompile inspect: {html.escape(model)}</h1>
<table>{rows}</table>
{note}
<p><a href="report.md">report.md</a> · <a href="plan.yaml">plan.yaml</a></p>
<pre>{html.escape(report)}</pre>
</body></html>
"""
