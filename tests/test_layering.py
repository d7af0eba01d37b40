"""DESIGN.md's layering, checked on the source: kernels import nothing of ours above them, and passes
import only the core of ``moecompile/`` (IR helpers, node metadata, Plan, errors, pass-manager types,
process groups, the analyses they run), never the driver (convert, the emitted step and its runtime,
inspect / visualize, CLI), directly or through a core module."""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"moecompile": ROOT / "moecompile", "moecompile.passes": ROOT / "passes",
           "moecompile.kernels": ROOT / "kernels"}

# the part of moecompile/ that passes build on; anything else there is driver
CORE = {"errors", "meta", "graph", "plan", "pass_manager", "history", "outputs", "distributed", "shapes", "schedule",
        "costs", "memory", "bucket_layout", "tensor_handles", "expert_slices"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """Our modules ``name`` imports anywhere in its file (a function-level import counts too)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    known = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(known)
    for name, path in known.items():
        g.add_edges_from((name, t) for t in _imports(name, path, known))
    return g


def _is_core(module: str) -> bool:
    parts = module.split(".")
    return len(parts) >= 2 and parts[0] == "moecompile" and parts[1] in CORE | {"passes", "kernels"}


def test_kernels_import_nothing_above_them(graph: nx.DiGraph) -> None:
    kernels = [m for m in graph if m.startswith("moecompile.kernels")]
    above = {f"{k} -> {t}" for k in kernels for t in graph.successors(k)
             if not t.startswith("moecompile.kernels") and t != "moecompile.errors"}  # errors: a leaf
    assert not above


def test_passes_reach_only_the_core(graph: nx.DiGraph) -> None:
    bad = []
    for module in graph:
        if module.startswith("moecompile.passes"):
            for target in nx.descendants(graph, module):
                if not _is_core(target):
                    bad.append(f"{module} -> ... -> {target}: {nx.shortest_path(graph, module, target)}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_driver_import(graph: nx.DiGraph) -> None:
    """The scan follows imports at all: a pass reaches the kernels and the core it names."""
    reached = nx.descendants(graph, "moecompile.passes.regions")
    assert {"moecompile.tensor_handles", "moecompile.meta"} <= reached
    assert "moecompile.train_step" in nx.descendants(graph, "moecompile")  # the package itself is the driver


def test_every_package_is_in_the_wheel():
    """pyproject lists packages by hand (passes/ and kernels/ sit outside moecompile/): a package missing from it
    imports in an editable install and is absent from a wheel (moecompile.plan and .commands were)."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in FOLDERS.items():
        for init in folder.rglob("__init__.py"):
            found.add(".".join([package, *init.parent.relative_to(folder).parts]))
    assert found == set(tool["packages"])
    assert {tool["package-dir"][p] for p in ("moecompile.passes", "moecompile.kernels")} == {"passes", "kernels"}
