"""Passes, their registry, and the manager that runs them and keeps the books.

A pass is a plain function ``(gm, ctx) -> gm | None`` (``None``: changed in
place; a ``torch.fx.passes.infra.pass_base.PassResult`` is accepted too). It is
registered with a name, ordering constraints and what it needs / provides::

    @register_pass("log_router_entropy", after="upcycle", requires=("moe",))
    def log_router_entropy(gm, ctx): ...

After every pass the manager lints and recompiles the graph, re-propagates fake
shapes, runs the IR verifiers of every pass so far, and records a snapshot in
``ctx.history``. A pass that returns ``PassResult(gm, False)`` (it had nothing
to do) keeps the shapes it was given: the manager checks that its nodes are
indeed untouched instead of propagating them again. Failures become a
``PassError`` naming the pass and what ran before it, so a broken graph is
reported where it broke.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Union

import networkx as nx
import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from .errors import PassError
from .history import PassRecord, snapshot
from .plan import Plan
from .shapes import ShapePropError, propagate_fake

log = logging.getLogger(__name__)

PassFn = Callable[[fx.GraphModule, "PassContext"], Union[fx.GraphModule, PassResult, None]]
Verifier = Callable[[fx.GraphModule, "PassContext"], None]


@dataclasses.dataclass(frozen=True)
class PassSpec:
    name: str
    fn: PassFn
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()  # facts earlier passes must provide ("ffn", "moe", ...)
    provides: tuple[str, ...] = ()


_REGISTRY: dict[str, PassSpec] = {}
_VERIFIERS: dict[str, list[Verifier]] = {}

# The built-in pipeline, in order; user passes slot in with after= / before=.
PIPELINE: list[str] = ["import_moe", "find_ffn", "upcycle", "expert_parallel", "overlap", "fp8", "recompute"]


def _as_tuple(x: str | Iterable[str] | None) -> tuple[str, ...]:
    if x is None:
        return ()
    return (x,) if isinstance(x, str) else tuple(x)


def register_pass(
    name: str,
    fn: PassFn | None = None,
    *,
    after: str | Iterable[str] | None = None,
    before: str | Iterable[str] | None = None,
    requires: Iterable[str] = (),
    provides: Iterable[str] = (),
) -> Any:
    """Register ``fn`` as pass ``name``; usable as a decorator. Re-registering replaces."""

    def deco(f: PassFn) -> PassFn:
        _REGISTRY[name] = PassSpec(name, f, _as_tuple(after), _as_tuple(before), tuple(requires), tuple(provides))
        return f

    return deco(fn) if fn is not None else deco


def register_verifier(after_pass: str, fn: Verifier) -> Verifier:
    """An IR rule that must hold after ``after_pass`` and every pass after it."""
    _VERIFIERS.setdefault(after_pass, []).append(fn)
    return fn


def registered_passes() -> dict[str, PassSpec]:
    return dict(_REGISTRY)


@dataclasses.dataclass
class Options:
    """Settings read once from the environment when ``convert`` runs (tests override in scope)."""

    dump_dir: Path | None = None
    verify: bool = True

    @classmethod
    def from_env(cls, **overrides: Any) -> "Options":
        dump = os.environ.get("MOECOMPILE_DUMP")
        opts = cls(dump_dir=Path(dump) if dump else None)
        return dataclasses.replace(opts, **overrides)


@dataclasses.dataclass
class PassContext:
    """What a pass may read besides the graph: the plan, example inputs, the world, options."""

    plan: Plan
    example_inputs: list[Any]  # flat, one per placeholder
    options: Options = dataclasses.field(default_factory=Options)
    world: Any = None  # moecompile.distributed.World when distributed
    history: list[PassRecord] = dataclasses.field(default_factory=list)
    facts: set[str] = dataclasses.field(default_factory=set)
    _decisions: list[str] = dataclasses.field(default_factory=list)
    _data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def decide(self, text: str) -> None:
        """Record what the running pass decided (shown in the report)."""
        self._decisions.append(text)
        log.info(text)

    def record(self, **data: Any) -> None:
        """Attach structured facts to the running pass's record (for report / visualize)."""
        self._data.update(data)

    @property
    def passes_run(self) -> list[str]:
        return [r.name for r in self.history]


def resolve_order(extra: Iterable[str | PassFn | PassSpec] = ()) -> list[PassSpec]:
    """The built-in pipeline plus user passes, ordered by every after/before constraint.

    A user pass is a registered name, a function (run last unless registered with constraints), or a
    ``PassSpec``: a pass with its own constraints that is not registered (a closure, one conversion's).
    """
    specs = [_REGISTRY[name] for name in PIPELINE if name in _REGISTRY]
    for i, p in enumerate(extra):
        if isinstance(p, PassSpec):
            spec = p
        elif callable(p) and not isinstance(p, str):
            name = getattr(p, "__name__", f"user_pass_{i}")
            spec = next((s for s in _REGISTRY.values() if s.fn is p), None) or PassSpec(name, p, after=(specs[-1].name,) if specs else ())
        elif p in _REGISTRY:
            spec = _REGISTRY[p]
        else:
            raise PassError(str(p), [], f"no pass of that name is registered; registered: {', '.join(sorted(_REGISTRY))}")
        if spec.name not in {s.name for s in specs}:
            specs.append(spec)
    names = {s.name for s in specs}
    rank = {s.name: i for i, s in enumerate(specs)}
    g = nx.DiGraph()
    g.add_nodes_from(names)
    builtin = [n for n in PIPELINE if n in names]
    g.add_edges_from(zip(builtin, builtin[1:]))
    for s in specs:
        g.add_edges_from((a, s.name) for a in s.after if a in names)
        g.add_edges_from((s.name, b) for b in s.before if b in names)
    try:
        order = list(nx.lexicographical_topological_sort(g, key=lambda n: rank[n]))
    except nx.NetworkXUnfeasible as e:
        cycle = " -> ".join(a for a, _ in nx.find_cycle(g))
        raise PassError(cycle.split(" -> ")[0], [], f"pass ordering constraints form a cycle: {cycle}") from e
    by_name = {s.name: s for s in specs}
    return [by_name[n] for n in order]


def run_passes(gm: fx.GraphModule, ctx: PassContext, specs: list[PassSpec]) -> fx.GraphModule:
    """Run ``specs`` in order, with lint, recompile, shape propagation, verify and a record after each."""
    ctx.history.append(snapshot("trace", gm, True, 0.0, ["traced the model"], {}))
    _dump(ctx, 0, "trace", gm)
    if _symbolic(gm):  # a dynamic trace: every pass sees the example's sizes, as after any pass
        propagate_fake(gm, ctx.example_inputs)
    for i, spec in enumerate(specs, start=1):
        missing = [f for f in spec.requires if f not in ctx.facts]
        if missing:
            raise PassError(spec.name, ctx.passes_run, f"needs {missing} which no earlier pass provided")
        ctx._decisions, ctx._data = [], {}
        before = _structure(gm)
        start = time.perf_counter()
        try:
            out = spec.fn(gm, ctx)
        except PassError:
            raise
        except Exception as e:
            raise PassError(spec.name, ctx.passes_run, f"{type(e).__name__}: {e}") from e
        changed = True
        if isinstance(out, PassResult):
            gm, changed = out.graph_module, out.modified
        elif isinstance(out, fx.GraphModule):
            gm = out
        if changed:
            _check_graph(gm, ctx, spec.name)
        elif _structure(gm) != before:
            raise PassError(spec.name, ctx.passes_run, "returned PassResult(modified=False) but changed the graph; "
                            "return modified=True (or the graph module) when it changes anything")
        _verify(gm, ctx, spec.name)
        ctx.facts.update(spec.provides)
        ctx.history.append(snapshot(spec.name, gm, changed, time.perf_counter() - start, ctx._decisions, ctx._data))
        _dump(ctx, i, spec.name, gm)
    return gm


def _symbolic(gm: fx.GraphModule) -> bool:
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return any(isinstance(d, torch.SymInt) for v in vals if isinstance(v, torch.Tensor) for d in v.shape)


def _check_graph(gm: fx.GraphModule, ctx: PassContext, name: str) -> None:
    try:
        gm.graph.lint()
        gm.recompile()
    except Exception as e:
        raise PassError(name, ctx.passes_run, f"left an invalid graph: {e}") from e
    try:
        propagate_fake(gm, ctx.example_inputs)
    except ShapePropError as e:
        raise PassError(name, ctx.passes_run, f"shape propagation failed: {e}", node=e.node.format_node()) from e


def _structure(gm: fx.GraphModule) -> list[tuple]:
    """The graph's nodes with what they compute and read: equal before and after a pass that changed nothing."""
    return [(n, n.op, n.target, n.args, n.kwargs) for n in gm.graph.nodes]


def _verify(gm: fx.GraphModule, ctx: PassContext, name: str) -> None:
    """The IR rules of every pass run so far, ``name`` included."""
    if ctx.options.verify:
        for after in [*ctx.passes_run, name]:
            for verifier in _VERIFIERS.get(after, []):
                try:
                    verifier(gm, ctx)
                except AssertionError as e:
                    raise PassError(name, ctx.passes_run, f"IR rule of '{after}' broken: {e}") from e


def _dump(ctx: PassContext, index: int, name: str, gm: fx.GraphModule) -> None:
    if ctx.options.dump_dir is None:
        return
    ctx.options.dump_dir.mkdir(parents=True, exist_ok=True)
    (ctx.options.dump_dir / f"{index:02d}_{name}.py").write_text(gm.code)
