"""One CUDA block per row, the row resident in registers, read from global memory once.

Thread (ty, tx) of a block owns ``groups_per_thread`` consecutive groups, and within
each of them the ``vector`` consecutive elements at lane offset ``tx * vector``:

    k = ty * (C * G) + c * G + tx * V + v        C = groups_per_thread, V = vector

so one group is G / V lanes of one warp (16 lanes x 8 bf16 for G = 128), each load is
a 16-byte vector, the sum of squares is a block all-reduce and each group's absmax a
warp-shuffle reduction over its lanes. A thread holds whole groups, so its scales stay
in registers for the quotient, and (with C % 4 == 0) whole packed UE8M0 words too.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from tvm_rmsquant.scale_layout import TILE_COLUMNS
from tvm_rmsquant.spec import VariantSpec, num_groups
from tvm_rmsquant.target import Target

from .base import MIN_BLOCKS_PER_SM, Knobs, ScheduleRule

MAX_THREADS = 1024
WARP = 32
#: fp32 values of the row held per thread (h and y); past this ptxas spills.
MAX_RESIDENT = 64
#: The most groups a thread holds: at the narrowest 16-byte vector (4 fp32) they fill MAX_RESIDENT.
MAX_GROUPS_PER_THREAD = MAX_RESIDENT // 4
#: Vector widths of y (a 16-bit pair) and of q's cast (the widest fp32 -> fp8 cast that
#: compiles, to packed cvt.rn.satfinite.e4m3x2).
PAIR = 2
PACKED_CAST = 4


class RowResident(ScheduleRule):
    name = "row_resident"

    def space(self, spec: VariantSpec, target: Target) -> Dict[str, List[int]]:
        """``groups_per_thread`` takes every divisor of the row's groups up to
        ``MAX_GROUPS_PER_THREAD``, not only powers of two. At M <= 256 a row's block is alone or
        nearly so on its SM, and its warps share the SM's four schedulers: the time tracks the
        busiest scheduler's elements (H100, residual col fp32, M = 1, 16 elements per thread:
        1.41, 1.58, 1.81, 2.08 and 2.11 us for 16, 32, 48, 64 and 64 of them at K = 2048, 4096,
        5120, 7168 and 8192). Powers of two split K = 5120 (40 groups) and 7168 (56) into 5, 10
        or 7, 14 warps, which four schedulers share unevenly; 5 and 7 groups per thread make 4
        or 8 warps (docs/tuning.md)."""
        groups = None if spec.is_dynamic else num_groups(spec.hidden, spec.group)
        per_thread = [count for count in range(1, MAX_GROUPS_PER_THREAD + 1) if groups is None or groups % count == 0]
        return {"vector": [2, 4, 8], "groups_per_thread": per_thread, "min_blocks_per_sm": MIN_BLOCKS_PER_SM}

    def refuses(self, spec: VariantSpec, knobs: Knobs, target: Target) -> Optional[str]:
        if spec.is_dynamic:
            return "needs a static hidden size"
        vector, per_thread = knobs["vector"], knobs["groups_per_thread"]
        if vector * spec.itemsize > 16:
            return f"vector={vector} is wider than 16 bytes of {spec.dtype}"
        if spec.group % vector:
            return f"vector={vector} does not divide group={spec.group}"
        lanes = spec.group // vector
        if lanes > 32:
            return f"a group would span {lanes} lanes, more than a warp"
        groups = num_groups(spec.hidden, spec.group)
        threads = lanes * (groups // per_thread)
        if threads > MAX_THREADS:
            return f"needs {threads} threads per block, more than {MAX_THREADS}"
        if threads % WARP:
            # TVM then reduces through shared memory, warp-synchronously without __syncwarp:
            # a hazard that compute-sanitizer's racecheck reports.
            return f"{threads} threads per block is not a whole number of warps"
        if per_thread * vector > MAX_RESIDENT:
            return f"{per_thread * vector} resident values per thread would spill"
        words = spec.scale.groups_per_word
        if words > 1 and per_thread % words and per_thread != groups:
            return f"a packed word's {words} groups must belong to one thread"
        return self.check_occupancy(threads, knobs, target)

    def default(self, spec: VariantSpec, target: Target) -> Optional[Knobs]:
        if spec.is_dynamic:
            return None
        widest = 16 // spec.itemsize
        for vector in (widest, widest // 2):
            for per_thread in (4, 2, 8, 1, 16):
                knobs = {"vector": vector, "groups_per_thread": per_thread, "min_blocks_per_sm": 0}
                if self.check(spec, knobs, target) is None:
                    return knobs
        return None

    def apply(self, func, target: Target, spec: VariantSpec, knobs: Knobs):
        knobs = self.validate(spec, knobs, target)
        vector, per_thread = knobs["vector"], knobs["groups_per_thread"]
        lanes = spec.group // vector
        thread_rows = num_groups(spec.hidden, spec.group) // per_thread
        from tvm import s_tir  # build time only: the rule's space and checks need no TVM

        sch = s_tir.Schedule(func)
        block = sch.get_sblock

        def bind_groups(loop):
            """Split a group loop into (ty, c): ty is threadIdx.y, c this thread's groups."""
            ty, c = sch.split(loop, [thread_rows, per_thread])
            sch.bind(ty, "threadIdx.y")
            return ty, c

        def bind_lanes(loop):
            """Split an in-group loop into (tx, v): tx is threadIdx.x, v one vector."""
            tx, v = sch.split(loop, [lanes, vector])
            sch.bind(tx, "threadIdx.x")
            return tx, v

        def bind_elements(name_or_block, vectorize: bool):
            target = block(name_or_block) if isinstance(name_or_block, str) else name_or_block
            g, j = sch.get_loops(target)[-2:]
            ty, c = bind_groups(g)
            tx, v = bind_lanes(j)
            sch.reorder(ty, tx, c, v)
            sch.unroll(c)
            sch.vectorize(v) if vectorize else sch.unroll(v)

        # Outputs are computed into registers first: a block that writes an output
        # cannot be moved under the row loop, and the copy out vectorizes.
        q_store = sch.cache_write(block("q"), 0, "local")
        residual_store = sch.cache_write(block("residual"), 0, "local") if spec.residual else None
        if spec.scale.encoded:
            scale_store = None
            sch.set_scope(block("scale"), 0, "local")
        else:
            # ratio reads the register copy: every lane computes its own groups' scales.
            scale_store = sch.cache_write(block("scale"), 0, "local", consumer_blocks=[block("ratio")])

        row = sch.get_loops(block("h"))[0]
        sch.bind(row, "blockIdx.x")
        for child in sch.get_child_blocks(sch.get_sblock("root"))[1:]:
            sch.reverse_compute_at(child, row)
        norm = ("sumsq", "rms") if spec.norm else ()  # the standalone quant has no norm stages
        for name in ("h", "y", "absmax", "ratio") + norm:
            sch.set_scope(block(name), 0, "local")

        for name in ("h", "y", "ratio", "q") + (("residual",) if spec.residual else ()):
            bind_elements(name, vectorize=False)
        # y in pairs: two lanes' 16-bit multiply is one HMUL2. q in vectors of up to 4:
        # fp32x4 -> fp8x4 is two packed conversions (x8 miscompiles).
        for name, width in (("y", PAIR), ("q", PACKED_CAST)):
            _, lanes_of_vector = sch.split(sch.get_loops(block(name))[-1], [None, min(vector, width)])
            sch.vectorize(lanes_of_vector)
        bind_elements(q_store, vectorize=True)
        if residual_store is not None:
            bind_elements(residual_store, vectorize=True)

        if spec.norm:
            g, j = sch.get_loops(block("sumsq"))[-2:]
            ty, c = bind_groups(g)
            tx, v = bind_lanes(j)
            sch.reorder(ty, tx, c, v)

        g, j = sch.get_loops(block("absmax"))[-2:]
        ty, c = bind_groups(g)
        tx, v = bind_lanes(j)
        sch.reorder(ty, c, tx, v)

        sch.unroll(bind_groups(sch.get_loops(block("scale"))[-1])[1])
        if scale_store is not None:
            sch.unroll(bind_groups(sch.get_loops(scale_store)[-1])[1])
        else:
            # Thread row ty writes the encoded elements (packed words, bytes) of its own groups.
            ty, c = sch.split(sch.get_loops(block("scales"))[-1], [thread_rows, None])
            sch.bind(ty, "threadIdx.y")
            if spec.scale.tiled and per_thread % TILE_COLUMNS == 0:
                # A tile keeps a row's TILE_COLUMNS consecutive groups side by side: one 4-byte
                # store each instead of four byte stores (STG.E against 4 STG.E.U8 at K = 8192,
                # where tiled:mxfp8 without a residual reached 83.6 % of the copy ceiling and
                # packed UE8M0, which stores words, 95.8 %; docs/perf.md).
                words, word = sch.split(c, [None, TILE_COLUMNS])
                sch.unroll(words)
                sch.vectorize(word)
            else:
                sch.unroll(c)

        loads = [("h", "x")] + ([("y", "weight")] if spec.norm else []) + ([("h", "r")] if spec.residual else [])
        for consumer, buffer in loads:
            load = sch.cache_read(block(consumer), _read_index(sch, block(consumer), buffer), "local", consumer_blocks=[block(consumer)])
            # First possible point: every load of the row is in flight before the first reduction.
            sch.compute_at(load, row, index=-2)
            bind_elements(load, vectorize=True)
        return sch


def _read_index(sch, block, buffer_name: str) -> int:
    for index, region in enumerate(sch.get(block).reads):
        if region.source.name == buffer_name:
            return index
    raise KeyError(f"block {sch.get(block).name_hint} does not read {buffer_name}")
