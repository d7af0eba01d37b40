"""``moecompile.Plan``: a validated, serialisable description of a conversion.

One section per pass, each a frozen dataclass beside its own validation::

    plan = Plan.from_dict({"experts": {"num_experts": 8, "top_k": 2}})
    plan = Plan.from_file("plan.yaml")
    assert Plan.from_dict(plan.to_dict()) == plan
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..errors import PlanError
from .cuda_graph import CudaGraphConfig
from .experts import ExpertsConfig
from .fp8 import FP8Config
from .overlap import OverlapConfig
from .parallel import ParallelConfig
from .recompute import RecomputeConfig
from .section import Section

__all__ = ["Plan", "CudaGraphConfig", "ExpertsConfig", "FP8Config", "OverlapConfig", "ParallelConfig", "RecomputeConfig", "Section"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to do to the model; each field is one pass's section."""

    experts: ExpertsConfig = dataclasses.field(default_factory=ExpertsConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    overlap: OverlapConfig = dataclasses.field(default_factory=OverlapConfig)
    fp8: FP8Config = dataclasses.field(default_factory=FP8Config)
    recompute: RecomputeConfig = dataclasses.field(default_factory=RecomputeConfig)
    cuda_graph: CudaGraphConfig = dataclasses.field(default_factory=CudaGraphConfig)

    def __post_init__(self) -> None:
        types = _section_types()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):  # Plan(experts={...}) as a convenience
                object.__setattr__(self, f.name, types[f.name].from_dict(value))
            elif not isinstance(value, types[f.name]):
                raise PlanError(f.name, value, f"must be a mapping or {types[f.name].__name__}")
        self.validate()

    def validate(self) -> None:
        """Rules that span sections live here; per-section rules live in the section."""
        self.parallel.check_against(self.experts)
        self.cuda_graph.check_against(self.parallel)
        self.overlap.check_against(self.parallel)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "Plan":
        data = dict(data or {})
        types = _section_types()
        for key, value in data.items():
            if key not in types:
                raise PlanError(key, value, f"unknown plan section; valid sections are {', '.join(types)}")
            if not isinstance(value, dict):
                raise PlanError(key, value, "a plan section must be a mapping of field: value")
        return cls(**{k: types[k].from_dict(v) for k, v in data.items()})

    @classmethod
    def from_file(cls, path: str | Path) -> "Plan":
        path = Path(path)
        text = path.read_text()
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
        if data is not None and not isinstance(data, dict):
            raise PlanError("<root>", data, f"{path} must hold a mapping of section: fields")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name).to_dict() for f in dataclasses.fields(self)}

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".json":
            path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        else:
            import yaml

            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    def replace(self, **sections: Any) -> "Plan":
        """A copy with some sections replaced (given as sections or dicts of fields to change)."""
        updated = {}
        for name, value in sections.items():
            if isinstance(value, dict):
                value = dataclasses.replace(getattr(self, name), **value)
            updated[name] = value
        return dataclasses.replace(self, **updated)

    @classmethod
    def describe(cls) -> list[tuple[str, str, str]]:
        return [row for t in _section_types().values() for row in t.describe()]


def _section_types() -> dict[str, type[Section]]:
    return {f.name: f.default_factory().__class__ for f in dataclasses.fields(Plan)}  # type: ignore[misc]
