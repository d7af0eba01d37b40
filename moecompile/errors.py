"""One error family, so callers can catch moecompile's own failures precisely.

Every message says what was found and what to change.
"""

from __future__ import annotations


class MoecompileError(Exception):
    """Base of every error moecompile raises on purpose."""


class PlanError(MoecompileError, ValueError):
    """A plan field has a value that can't work; the message names field, value and rule."""

    def __init__(self, field: str, value: object, rule: str):
        self.field, self.value, self.rule = field, value, rule
        super().__init__(f"plan field '{field}' = {value!r}: {rule}")


class TraceError(MoecompileError):
    """The frontend could not turn the model into a graph."""


class PassError(MoecompileError):
    """A pass failed or left an illegal graph; names the pass, what ran before it and the node."""

    def __init__(self, pass_name: str, ran_before: list[str], reason: str, node: str | None = None):
        self.pass_name, self.ran_before, self.node = pass_name, list(ran_before), node
        where = f" at node {node}" if node else ""
        before = ", ".join(ran_before) if ran_before else "nothing"
        super().__init__(f"pass '{pass_name}' failed{where} (ran before it: {before}): {reason}")


class KernelError(MoecompileError):
    """A kernel was called with inputs it cannot handle, or its backend is unavailable."""


class DistributedError(MoecompileError):
    """A collective failed, timed out, or the world does not fit the plan."""
