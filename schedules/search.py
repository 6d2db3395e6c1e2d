"""Search strategies over a rule's knob space, better than trying everything.

A strategy proposes knobs, is told each one's measured costs, and proposes again. One
trial is one candidate kernel, timed at every M, so its costs are one per M bucket, and a
search looks for every bucket's best at once. The costs come from a GPU run; since the GPU
machine has no compiler, a live search goes in rounds (``tune build`` proposes from earlier
results, ``tune measure`` times them), and a strategy is judged by replaying it against an
exhaustive measurement (``evaluate``), where each trial is one lookup of measured costs.

``evolve``: start from the hand-picked knobs plus a random one; then, the buckets taking
turns, move one knob of the bucket's best candidate so far to a neighbouring value of its
range (the next best when the best has no untried neighbour left), falling back to a
random untried candidate.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Callable, Dict, List, Sequence, Tuple

from tvm_rmsquant.spec import VariantSpec
from tvm_rmsquant.target import Target

from .base import Knobs, ScheduleRule

#: (knobs, cost per objective); lower is better, inf for a candidate that failed its check.
Trial = Tuple[Knobs, Tuple[float, ...]]


def knob_key(knobs: Knobs) -> Tuple[Tuple[str, int], ...]:
    """The hashable form of ``knobs``, which ``evaluate``'s cost table is keyed by."""
    return tuple(sorted(knobs.items()))


def neighbours(rule: ScheduleRule, spec: VariantSpec, target: Target, knobs: Knobs) -> List[Knobs]:
    """Valid knobs that differ from ``knobs`` in one knob, moved one step along its range."""
    found = []
    for name, values in sorted(rule.space(spec, target).items()):
        index = values.index(knobs[name])
        for step in (-1, 1):
            if 0 <= index + step < len(values):
                moved = {**knobs, name: values[index + step]}
                if rule.check(spec, moved, target) is None:
                    found.append(moved)
    return found


def _ranked(measured: Sequence[Trial], objective: int) -> List[Knobs]:
    """Measured knobs, best first for ``objective`` (failed ones left out)."""
    finite = [trial for trial in measured if math.isfinite(trial[1][objective])]
    return [knobs for knobs, _ in sorted(finite, key=lambda trial: trial[1][objective])]


def propose_evolve(rule: ScheduleRule, spec: VariantSpec, target: Target, measured: Sequence[Trial], count: int, seed: int = 0,
                   initial_random: int = 1) -> List[Knobs]:
    """The next ``count`` untried knobs, given the trials ``measured`` so far.

    Objectives take turns; each proposal is an untried neighbour of the best trial of its
    objective that still has one (a hill climb per M bucket sharing one trial budget).
    """
    rng = random.Random(seed)
    everything = list(rule.candidates(spec, target))
    tried = {knob_key(knobs) for knobs, _ in measured}
    proposals: List[Knobs] = []

    def take(knobs: Knobs) -> None:
        tried.add(knob_key(knobs))
        proposals.append(knobs)

    if not measured:
        default = rule.default(spec, target)
        if default is not None:
            take(default)
        for knobs in rng.sample(everything, len(everything)):
            if len(proposals) >= min(count, 1 + initial_random):
                break
            if knob_key(knobs) not in tried:
                take(knobs)
    objectives = len(measured[0][1]) if measured else 1
    while len(proposals) < count and len(tried) < len(everything):
        objective = (len(measured) + len(proposals)) % objectives
        parents = _ranked(measured, objective) if measured else proposals
        children = []
        for parent in parents:
            children = [child for child in neighbours(rule, spec, target, parent) if knob_key(child) not in tried]
            if children:
                break
        take(rng.choice(children) if children else rng.choice([knobs for knobs in everything if knob_key(knobs) not in tried]))
    return proposals


def run_search(strategy: str, rule: ScheduleRule, spec: VariantSpec, target: Target, cost: Callable[[Knobs], Tuple[float, ...]], trials: int,
               seed: int = 0) -> List[Trial]:
    """Run ``strategy`` (``random`` or ``evolve``) for ``trials`` trials, one proposal at a time.

    Both start from the hand-picked knobs, as every candidate bundle does (``tune build``):
    a comparison that gave only evolve that start measured the start, not the strategy
    (random reached 23 of the H200's 36 (spec, bucket) pairs from nothing, 29 from it)."""
    if strategy == "random":
        start = [knobs for knobs in [rule.default(spec, target)] if knobs is not None]
        drawn = start + [knobs for knobs in rule.sample(spec, target, trials, seed) if knobs not in start]
        return [(knobs, cost(knobs)) for knobs in drawn[:trials]]
    if strategy != "evolve":
        raise ValueError(f"strategy={strategy!r} is unknown; choose random or evolve")
    history: List[Trial] = []
    while len(history) < trials:
        proposed = propose_evolve(rule, spec, target, history, 1 if history else min(trials, 2), seed=seed + len(history))
        if not proposed:
            break
        history += [(knobs, cost(knobs)) for knobs in proposed]
    return history[:trials]


def best_so_far(history: Sequence[Trial], objective: int) -> List[float]:
    best, curve = math.inf, []
    for _, costs in history:
        value = costs[objective]
        best = min(best, value) if math.isfinite(value) else best
        curve.append(best)
    return curve


def evaluate(rule: ScheduleRule, spec: VariantSpec, target: Target, costs: Dict[Tuple, Tuple[float, ...]], budget: int,
             seeds: int = 50, tolerance: float = 0.03) -> Dict[str, List[Dict]]:
    """Replay each strategy ``seeds`` times against ``costs`` (knob key -> cost per objective)
    measured on ``target``, each from the hand-picked knobs (``run_search``).

    Returns, per strategy and objective, the share of runs within ``tolerance`` of the
    exhaustive best after ``budget`` trials, the median gap to it, and the median
    best-so-far curve relative to it.
    """
    objectives = len(next(iter(costs.values())))
    missing = (math.inf,) * objectives
    lookup = lambda knobs: costs.get(knob_key(knobs), missing)  # noqa: E731  (a knob the run did not time)
    out = {}
    for strategy in ("random", "evolve"):
        histories = [run_search(strategy, rule, spec, target, lookup, budget, seed) for seed in range(seeds)]
        out[strategy] = []
        for objective in range(objectives):
            exhaustive = min(value[objective] for value in costs.values() if math.isfinite(value[objective]))
            curves = [best_so_far(history, objective) for history in histories]
            gaps = [curve[-1] / exhaustive - 1 for curve in curves]
            out[strategy].append({
                "within_tolerance": sum(gap <= tolerance for gap in gaps) / seeds,
                "median_gap": statistics.median(gaps),
                "median_curve": [statistics.median(curve[i] for curve in curves) / exhaustive for i in range(budget)],
            })
    return out

