"""``moecompile env``: versions, devices, kernels and collectives here, and what will not run (with the fix).

    moecompile env            # a table, then the problems found
    moecompile env --json     # the same facts as JSON
"""

from __future__ import annotations

import argparse
import json

HELP = "Show what this machine gives moecompile (torch, Triton, GPUs, FP8, collectives) and what will not run."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the facts as JSON")


def _shown(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..environment import environment

    facts = environment()
    if args.json:
        print(json.dumps(facts, indent=1))
        return 0
    table = Table(show_header=False, box=None)
    for key, value in facts.items():
        if key in ("gpus", "problems"):
            continue
        table.add_row(key, _shown(value))
    for gpu in facts["gpus"]:
        table.add_row(f"gpu {gpu['index']}", f"{gpu['name']} {gpu['arch']} {gpu['memory_gib']} GiB"
                                             f"{' fp8' if gpu['fp8'] else ''}{' bf16' if gpu['bf16'] else ''}")
    if not facts["gpus"]:
        table.add_row("gpus", "none (torch.cuda.is_available() is False)")
    console = Console(highlight=False)
    console.print(table)
    console.print("problems: none" if not facts["problems"] else "problems:")
    for problem in facts["problems"]:
        console.print(f"  - {problem}", soft_wrap=True)
    return 0
