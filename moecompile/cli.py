"""``moecompile <command>``: the shell face of the library.

Each command is a module in ``moecompile/commands/`` with ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import moecompile.commands as commands


def _command_modules() -> dict[str, object]:
    return {
        m.name.replace("_", "-"): importlib.import_module(f"moecompile.commands.{m.name}")
        for m in pkgutil.iter_modules(commands.__path__)
        if not m.name.startswith("_")
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moecompile", description="A compiler for Mixture-of-Experts training.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in sorted(_command_modules().items()):
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)  # type: ignore[attr-defined]
        module.add_arguments(p)  # type: ignore[attr-defined]
        p.set_defaults(_run=module.run)  # type: ignore[attr-defined]
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a MoecompileError (or a missing file) is its message and exit status 2, not a traceback."""
    from .errors import MoecompileError

    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (MoecompileError, FileNotFoundError) as e:
        print(f"moecompile {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
