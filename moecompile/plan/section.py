"""The base of every Plan section: a frozen dataclass that validates itself.

A section is declared beside the concept it configures, with one docstring per
field (``field(metadata={"doc": ...})``). ``from_dict`` rejects unknown keys by
name and checks each value against the field's annotation, so a typo in a YAML
plan fails at load time, not three passes later.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

from ..errors import PlanError


def doc_field(default: Any, doc: str, **kwargs: Any) -> Any:
    """A dataclass field carrying its documentation (shown by ``Plan.describe``)."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"doc": doc}, **kwargs)
    return dataclasses.field(default=default, metadata={"doc": doc}, **kwargs)


def _type_ok(value: Any, tp: Any) -> bool:
    origin = get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return value in get_args(tp)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, a) for a in get_args(tp))
    if origin in (list, tuple):
        (inner, *_) = get_args(tp) or (Any,)
        return isinstance(value, (list, tuple)) and all(_type_ok(v, inner) for v in value)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _describe_type(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_describe_type(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _accepts_list(tp: Any) -> bool:
    return tp is list or get_origin(tp) is list or any(get_origin(a) is list or a is list for a in get_args(tp))


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A section's resolved field annotations, once per class (``typing.get_type_hints`` is slow, and the
    planner builds thousands of plans)."""
    return typing.get_type_hints(cls)


@dataclasses.dataclass(frozen=True)
class Section:
    """Base class; subclasses are frozen dataclasses with a ``name`` and a ``validate``."""

    name: ClassVar[str] = "section"

    def __post_init__(self) -> None:
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple) and get_origin(hints[f.name]) is list:
                object.__setattr__(self, f.name, list(value))
                value = list(value)
            if not _type_ok(value, hints[f.name]):
                rule = f"must be {_describe_type(hints[f.name])}"
                if _accepts_list(hints[f.name]) and not isinstance(value, (list, dict)):
                    rule += f" (a list is written [{value}], in YAML as in --set)"
                raise PlanError(f"{self.name}.{f.name}", value, rule)
        self.validate()

    def validate(self) -> None:
        """Check rules between fields; raise PlanError naming field, value and rule."""

    def fail(self, field: str, rule: str) -> typing.NoReturn:
        raise PlanError(f"{self.name}.{field}", getattr(self, field), rule)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "Section":
        data = dict(data or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in valid:
                raise PlanError(f"{cls.name}.{key}", data[key], f"unknown key; valid keys are {', '.join(valid)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def describe(cls) -> list[tuple[str, str, str]]:
        """(field, default, doc) rows: the plan's reference documentation."""
        rows = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            rows.append((f"{cls.name}.{f.name}", repr(default), f.metadata.get("doc", "")))
        return rows
