"""Dynamic-K fallback: K is a runtime argument, so the row cannot live in registers.

``rows_per_block`` rows share a CUDA block (threadIdx.y), and the ``group / vector``
lanes of threadIdx.x walk one row a group at a time. The row is read once for the sum
of squares (none in the standalone quant) and again, from cache, for each group's absmax
and its quantization; every
reduction is a shuffle inside one warp, so no block barrier depends on K or M.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from tvm_rmsquant.spec import VariantSpec
from tvm_rmsquant.target import Target

from .base import MIN_BLOCKS_PER_SM, Knobs, ScheduleRule

class DynamicRows(ScheduleRule):
    name = "dynamic_rows"

    def space(self, spec: VariantSpec, target: Target) -> Dict[str, List[int]]:
        return {"vector": [2, 4, 8], "rows_per_block": [1, 2, 4, 8, 16], "min_blocks_per_sm": MIN_BLOCKS_PER_SM}

    def refuses(self, spec: VariantSpec, knobs: Knobs, target: Target) -> Optional[str]:
        vector, rows = knobs["vector"], knobs["rows_per_block"]
        if vector * spec.itemsize > 16:
            return f"vector={vector} is wider than 16 bytes of {spec.dtype}"
        if spec.group % vector:
            return f"vector={vector} does not divide group={spec.group}"
        lanes = spec.group // vector
        if lanes > 32 or 32 % lanes:
            return f"a group of {lanes} lanes must tile a warp"
        if lanes * rows > 1024:
            return f"{lanes * rows} threads per block is more than 1024"
        return self.check_occupancy(lanes * rows, knobs, target)

    def default(self, spec: VariantSpec, target: Target) -> Optional[Knobs]:
        knobs = {"vector": 16 // spec.itemsize, "rows_per_block": 8, "min_blocks_per_sm": 0}
        return knobs if self.check(spec, knobs, target) is None else None

    def apply(self, func, target: Target, spec: VariantSpec, knobs: Knobs):
        knobs = self.validate(spec, knobs, target)
        vector, rows = knobs["vector"], knobs["rows_per_block"]
        lanes = spec.group // vector
        encoded, per_word = spec.scale.encoded, spec.scale.groups_per_word
        from tvm import s_tir  # build time only: the rule's space and checks need no TVM

        sch = s_tir.Schedule(func)
        block = sch.get_sblock

        def bind_lanes(loop, vectorize: bool):
            tx, v = sch.split(loop, [lanes, vector])
            sch.bind(tx, "threadIdx.x")
            sch.vectorize(v) if vectorize else sch.unroll(v)
            return tx

        sch.compute_inline(block("h"))
        sch.compute_inline(block("y"))
        sch.compute_inline(block("ratio"))
        q_store = sch.cache_write(block("q"), 0, "local")
        residual_store = sch.cache_write(block("residual"), 0, "local") if spec.residual else None
        if encoded:
            scale_store = None
            sch.set_scope(block("scale"), 0, "local")
        else:
            scale_store = sch.cache_write(block("scale"), 0, "local", consumer_blocks=[block("q")])

        # One row loop for every stage: merge the sibling row loops, then split it
        # into (blockIdx.x, threadIdx.y).
        children = sch.get_child_blocks(sch.get_sblock("root"))
        row = _merge(sch, [sch.get_loops(child)[0] for child in children])
        blocks_x, thread_y = sch.split(row, [None, rows])
        sch.bind(blocks_x, "blockIdx.x")
        sch.bind(thread_y, "threadIdx.y")
        for name in ("sumsq", "rms", "absmax") if spec.norm else ("absmax",):
            sch.set_scope(block(name), 0, "local")

        if residual_store is not None:
            writers = [block("residual"), residual_store]
            _merge(sch, [sch.get_loops(writer)[-2] for writer in writers])
            for writer in writers:
                bind_lanes(sch.get_loops(writer)[-1], vectorize=writer == residual_store)

        if spec.norm:
            g, j = sch.get_loops(block("sumsq"))[-2:]
            tx = bind_lanes(j, vectorize=False)
            sch.reorder(tx, g)

        # The group pipeline, one group (packed: one word of four groups) at a time:
        # absmax -> scale -> q, and the scale or word written out.
        group_loops = [sch.get_loops(block("absmax"))[-2], sch.get_loops(block("scale"))[-1]]
        if scale_store is not None:
            group_loops.append(sch.get_loops(scale_store)[-1])
        group_loops += [sch.get_loops(block("q"))[-2], sch.get_loops(q_store)[-2]]
        if encoded:
            group_loops = [sch.split(loop, [None, per_word])[0] for loop in group_loops]
            group_loops.append(sch.get_loops(block("scales"))[-1])
        _merge(sch, group_loops)
        bind_lanes(sch.get_loops(block("absmax"))[-1], vectorize=False)
        bind_lanes(sch.get_loops(block("q"))[-1], vectorize=False)
        bind_lanes(sch.get_loops(q_store)[-1], vectorize=True)
        return sch


def _merge(sch, loops):
    """Merge sibling loops of one extent into one, pairwise (a many-way merge of loops of
    different depths below them is refused by TVM 0.27)."""
    merged = loops[0]
    for loop in loops[1:]:
        merged = sch.merge(merged, loop)
    return merged
