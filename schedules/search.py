"""Search strategies over a rule's knob space, better than trying everything.

A strategy proposes knobs, is told each one's measured cost, and proposes again. The
cost comes from a GPU run; since the GPU machine has no compiler, a live search goes in
rounds (``tune build`` proposes from earlier results, ``tune measure`` times them), and
a strategy is judged by replaying it against an exhaustive measurement
(``evaluate``), where each trial is one lookup of a measured cost.

``evolve``: start from the hand-picked knobs plus a few random ones, then repeatedly
mutate one of the best few found so far, one knob moved to a neighbouring value of its
range; fall back to a random untried candidate when no neighbour is left.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Callable, Dict, List, Sequence, Tuple

from tvm_rmsquant.spec import VariantSpec

from .base import Knobs, ScheduleRule

Trial = Tuple[Knobs, float]


def _key(knobs: Knobs) -> Tuple[Tuple[str, int], ...]:
    return tuple(sorted(knobs.items()))


def neighbours(rule: ScheduleRule, spec: VariantSpec, knobs: Knobs) -> List[Knobs]:
    """Valid knobs that differ from ``knobs`` in one knob, moved one step along its range."""
    found = []
    for name, values in sorted(rule.space(spec).items()):
        index = values.index(knobs[name])
        for step in (-1, 1):
            if 0 <= index + step < len(values):
                moved = {**knobs, name: values[index + step]}
                if rule.check(spec, moved) is None:
                    found.append(moved)
    return found


def propose_evolve(rule: ScheduleRule, spec: VariantSpec, measured: Sequence[Trial], count: int, seed: int = 0,
                   elite: int = 3, initial_random: int = 2) -> List[Knobs]:
    """The next ``count`` untried knobs, given the trials ``measured`` so far."""
    rng = random.Random(seed)
    everything = list(rule.candidates(spec))
    tried = {_key(knobs) for knobs, _ in measured}
    proposals: List[Knobs] = []

    def take(knobs: Knobs) -> None:
        tried.add(_key(knobs))
        proposals.append(knobs)

    if not measured:
        default = rule.default(spec)
        if default is not None:
            take(default)
        for knobs in rng.sample(everything, len(everything)):
            if len(proposals) >= min(count, 1 + initial_random):
                break
            if _key(knobs) not in tried:
                take(knobs)
    finite = sorted((trial for trial in measured if math.isfinite(trial[1])), key=lambda trial: trial[1])
    parents = [knobs for knobs, _ in finite[:elite]]
    while len(proposals) < count and len(tried) < len(everything):
        children = [child for parent in parents + proposals[-1:] for child in neighbours(rule, spec, parent) if _key(child) not in tried]
        if children:
            take(rng.choice(children))
        else:
            take(rng.choice([knobs for knobs in everything if _key(knobs) not in tried]))
    return proposals


def run_search(strategy: str, rule: ScheduleRule, spec: VariantSpec, cost: Callable[[Knobs], float], trials: int, seed: int = 0) -> List[Trial]:
    """Run ``strategy`` (``random`` or ``evolve``) for ``trials`` trials, one proposal at a time."""
    if strategy == "random":
        return [(knobs, cost(knobs)) for knobs in rule.sample(spec, trials, seed)]
    if strategy != "evolve":
        raise ValueError(f"strategy={strategy!r} is unknown; choose random or evolve")
    history: List[Trial] = []
    while len(history) < trials:
        proposed = propose_evolve(rule, spec, history, 1 if history else min(trials, 3), seed=seed + len(history))
        if not proposed:
            break
        history += [(knobs, cost(knobs)) for knobs in proposed]
    return history[:trials]


def best_so_far(history: Sequence[Trial]) -> List[float]:
    best, curve = math.inf, []
    for _, value in history:
        best = min(best, value) if math.isfinite(value) else best
        curve.append(best)
    return curve


def evaluate(rule: ScheduleRule, spec: VariantSpec, costs: Dict[Tuple, float], budget: int, seeds: int = 50,
             tolerance: float = 0.03) -> Dict[str, Dict[str, float]]:
    """Replay each strategy ``seeds`` times against measured ``costs`` (knob key -> cost).

    Returns, per strategy, the share of runs within ``tolerance`` of the exhaustive best
    after ``budget`` trials, the median gap to it, and the median best-so-far curve.
    """
    exhaustive = min(value for value in costs.values() if math.isfinite(value))
    lookup = lambda knobs: costs.get(_key(knobs), math.inf)  # noqa: E731  (a knob the run did not time)
    out = {}
    for strategy in ("random", "evolve"):
        curves = [best_so_far(run_search(strategy, rule, spec, lookup, budget, seed)) for seed in range(seeds)]
        gaps = [curve[-1] / exhaustive - 1 for curve in curves]
        out[strategy] = {
            "within_tolerance": sum(gap <= tolerance for gap in gaps) / seeds,
            "median_gap": statistics.median(gaps),
            "median_curve": [statistics.median(curve[i] for curve in curves) / exhaustive for i in range(budget)],
        }
    return out


def knob_key(knobs: Knobs):
    """The hashable form of ``knobs`` that ``evaluate``'s cost table is keyed by."""
    return _key(knobs)

