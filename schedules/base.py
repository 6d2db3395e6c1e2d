"""The schedule-rule interface, after TVM's dlight rules.

A rule looks at a spec and says whether it applies (``check``: the space's names and
values, then the rule's own ``refuses``), what it can tune
(``space``), what it would pick by hand (``default``), and turns the tensor expression's
PrimFunc into an ``s_tir.Schedule`` for given knobs (``apply``). Knobs are a plain
``{name: int}`` dict, so they serialize into manifests and tuning records as they are.
Every judgement takes the GPU ``Target`` (``tvm_rmsquant.target``) as an argument, as
dlight's ``apply(func, target, ...)`` does: a build passes its ``scheduling_target``.

Every rule also has ``min_blocks_per_sm``, the occupancy hint of CUDA's
``__launch_bounds__``: ptxas then caps registers so that many blocks fit on an SM
(0 leaves it unset). It changes no TIR, only the register budget, so codegen applies it.
"""

from __future__ import annotations

import itertools
import random
from typing import Dict, Iterator, List, Optional

from tvm_rmsquant.spec import VariantSpec
from tvm_rmsquant.target import Target

Knobs = Dict[str, int]

#: Values of the ``min_blocks_per_sm`` knob (0: no hint). 1 is not the same as no hint: with
#: ``__launch_bounds__(896)`` alone ptxas aims at two blocks per SM and gave
#: bf16_k7168_g128_res_col_fp32 at one group per thread (896 threads) 32 registers and an 8-byte
#: spill; ``__launch_bounds__(896, 1)`` gives it 40 registers and no spill (nvcc 13.0, sm_90a).
MIN_BLOCKS_PER_SM = [0, 1, 2, 4, 8, 16]


class ScheduleRule:
    """One scheduling strategy for the fused op."""

    name: str = ""

    def space(self, spec: VariantSpec, target: Target) -> Dict[str, List[int]]:
        """Each knob's candidate values; ``check`` filters the product of them."""
        raise NotImplementedError

    def check(self, spec: VariantSpec, knobs: Knobs, target: Target) -> Optional[str]:
        """None when the rule can schedule ``spec`` with ``knobs`` for ``target``; otherwise why not.

        The one judge of knobs, wherever they come from (``--knobs``, a tuning record, a
        search): every name must be a knob of the space and every value one of its values
        (the rules' arithmetic assumes so: vector=0 would divide by zero, vector=-8 pass as
        -16 lanes), then ``refuses`` judges the combination. Missing knobs are ``validate``'s.
        """
        space = self.space(spec, target)
        unknown = sorted(set(knobs) - set(space))
        if unknown:
            return f"no knob(s) named {unknown}; the knobs are {sorted(space)}"
        for name, value in sorted(knobs.items()):
            if type(value) is not int or value not in space[name]:
                return f"{name}={value!r} is not one of its values {space[name]}"
        return self.refuses(spec, knobs, target)

    def refuses(self, spec: VariantSpec, knobs: Knobs, target: Target) -> Optional[str]:
        """Why the rule cannot schedule ``spec`` with ``knobs`` (each a value of its space), or None."""
        raise NotImplementedError

    def default(self, spec: VariantSpec, target: Target) -> Optional[Knobs]:
        """The hand-picked knobs for ``spec`` on ``target``, or None if the rule does not apply."""
        raise NotImplementedError

    def apply(self, func, target: Target, spec: VariantSpec, knobs: Knobs):
        """Return an ``s_tir.Schedule`` of ``func`` (the spec's PrimFunc) for ``target`` with ``knobs``."""
        raise NotImplementedError

    def min_blocks_per_sm(self, knobs: Knobs) -> int:
        """The ``__launch_bounds__`` occupancy hint codegen gives the kernel (0: none)."""
        return knobs.get("min_blocks_per_sm", 0)

    @staticmethod
    def check_occupancy(threads: int, knobs: Knobs, target: Target) -> Optional[str]:
        """Why ``min_blocks_per_sm`` cannot hold for blocks of ``threads`` on ``target``, or None."""
        blocks = knobs.get("min_blocks_per_sm", 0)
        if blocks and threads * blocks > target.threads_per_sm:
            return (f"min_blocks_per_sm={blocks} blocks of {threads} threads exceed the {target.threads_per_sm} "
                    f"threads of an {target.name} SM")
        return None

    # -- the search space, shared by every rule -----------------------------------------------

    def candidates(self, spec: VariantSpec, target: Target) -> Iterator[Knobs]:
        """Every valid knob assignment, in a stable order."""
        space = self.space(spec, target)
        names = sorted(space)
        for values in itertools.product(*(space[name] for name in names)):
            knobs = dict(zip(names, values))
            if self.check(spec, knobs, target) is None:
                yield knobs

    def sample(self, spec: VariantSpec, target: Target, count: int, seed: int = 0) -> List[Knobs]:
        """``count`` distinct valid knob assignments drawn uniformly (all of them if fewer)."""
        everything = list(self.candidates(spec, target))
        random.Random(seed).shuffle(everything)
        return everything[:count]

    def validate(self, spec: VariantSpec, knobs: Knobs, target: Target) -> Knobs:
        """``knobs`` completed and checked; raises ValueError naming what is wrong."""
        missing = sorted(set(self.space(spec, target)) - set(knobs))
        if missing:
            raise ValueError(f"rule {self.name!r} needs knob(s) {missing} for {spec.name}")
        reason = self.check(spec, knobs, target)
        if reason is not None:
            raise ValueError(f"rule {self.name!r} cannot schedule {spec.name} with {knobs}: {reason}")
        return dict(knobs)
