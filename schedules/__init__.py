"""Schedule rules for the fused op, and the choice of one per spec.

Installed as ``tvm_rmsquant.schedules``. Importing this package does not import the
TVM compiler; applying a rule does.
"""

from __future__ import annotations

from typing import Dict, Tuple

from tvm_rmsquant.spec import VariantSpec

from .base import Knobs, ScheduleRule
from .dynamic_rows import DynamicRows
from .row_resident import RowResident

#: In order of preference: the first rule whose default applies schedules the spec.
RULES = (RowResident(), DynamicRows())


def rule_by_name(name: str) -> ScheduleRule:
    for rule in RULES:
        if rule.name == name:
            return rule
    raise ValueError(f"unknown schedule rule {name!r}; known: {[rule.name for rule in RULES]}")


def default_schedule(spec: VariantSpec) -> Tuple[str, Knobs]:
    """(rule name, knobs) of the first rule that applies to ``spec``."""
    reasons: Dict[str, str] = {}
    for rule in RULES:
        knobs = rule.default(spec)
        if knobs is not None:
            return rule.name, knobs
        reasons[rule.name] = "no valid default knobs"
    raise ValueError(f"no schedule rule applies to {spec.name}: {reasons}")


def overriding(overrides: Knobs):
    """A ``choose`` for the build: the default schedule with ``overrides`` applied where the
    rule has those knobs and accepts the result (else the default stands)."""

    def choose(spec: VariantSpec) -> Tuple[str, Knobs]:
        name, knobs = default_schedule(spec)
        rule = rule_by_name(name)
        wanted = {**knobs, **{key: value for key, value in overrides.items() if key in knobs}}
        return (name, wanted) if rule.check(spec, wanted) is None else (name, knobs)

    return choose
