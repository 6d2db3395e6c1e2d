"""Schedule rules for the fused op, and the choice of one per spec.

Installed as ``tvm_rmsquant.schedules``. Importing this package does not import the
TVM compiler; applying a rule does.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

from tvm_rmsquant.spec import VariantSpec
from tvm_rmsquant.target import Target

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


def default_schedule(spec: VariantSpec, target: Target) -> Tuple[str, Knobs]:
    """(rule name, knobs) of the first rule that applies to ``spec`` on ``target``."""
    reasons: Dict[str, str] = {}
    for rule in RULES:
        knobs = rule.default(spec, target)
        if knobs is not None:
            return rule.name, knobs
        reasons[rule.name] = "no valid default knobs"
    raise ValueError(f"no schedule rule applies to {spec.name}: {reasons}")


def check_overrides(overrides: Knobs, specs: Iterable[VariantSpec], target: Target) -> Optional[str]:
    """Why ``overrides`` (``build --knobs``) name a knob, or a value of it, that no rule's space
    has for any of ``specs``; None if each is valid somewhere. ``overriding`` applies a knob only
    where it is valid, so without this a misspelt name or vector=0 would be dropped without a word."""
    space: Dict[str, set] = {}
    for spec in specs:
        for rule in RULES:
            for name, values in rule.space(spec, target).items():
                space.setdefault(name, set()).update(values)
    for name, value in sorted(overrides.items()):
        if name not in space:
            return f"{name} is no schedule rule's knob; the knobs are {sorted(space)}"
        if value not in space[name]:
            return f"{name}={value} is no schedule rule's value; {name} takes {sorted(space[name])}"
    return None


def overriding(overrides: Knobs, target: Target):
    """A ``choose`` for a build for ``target``: the default schedule with ``overrides`` applied
    where the rule has those knobs and accepts the result (else the default stands);
    ``check_overrides`` refuses names and values that are valid nowhere."""

    def choose(spec: VariantSpec) -> Tuple[str, Knobs]:
        name, knobs = default_schedule(spec, target)
        rule = rule_by_name(name)
        wanted = {**knobs, **{key: value for key, value in overrides.items() if key in knobs}}
        return (name, wanted) if rule.check(spec, wanted, target) is None else (name, knobs)

    return choose
