"""Schedule rules as a search space: enumerable, sampleable, validated, TVM-free until applied."""

import re

import pytest
from conftest import require_toolchain

from tvm_rmsquant.schedules import RULES, default_schedule, overriding, rule_by_name
from tvm_rmsquant.spec import VariantSpec
from tvm_rmsquant.target import DEFAULT_ARCHS, scheduling_target

#: What the default build schedules for.
TARGET = scheduling_target(DEFAULT_ARCHS)


@pytest.mark.parametrize("spec", [VariantSpec("bf16", 7168, 128, True, "col", "ue8m0_packed"), VariantSpec("fp32", 2048, 64), VariantSpec("fp16", None, 128)])
def test_every_candidate_is_valid_and_the_default_is_one_of_them(spec):
    name, knobs = default_schedule(spec, TARGET)
    rule = rule_by_name(name)
    candidates = list(rule.candidates(spec, TARGET))
    assert knobs in candidates and all(rule.check(spec, c, TARGET) is None for c in candidates)
    sample = rule.sample(spec, TARGET, 3, seed=1)
    assert len(sample) == min(3, len(candidates)) and all(s in candidates for s in sample)


def test_static_specs_get_the_register_rule_and_dynamic_specs_the_fallback():
    assert default_schedule(VariantSpec("bf16", 4096), TARGET)[0] == "row_resident"
    assert default_schedule(VariantSpec("bf16", None), TARGET)[0] == "dynamic_rows"
    assert [rule.name for rule in RULES] == ["row_resident", "dynamic_rows"]


def test_bad_knobs_are_refused_with_the_reason():
    rule = rule_by_name("row_resident")
    spec = VariantSpec("bf16", 7168, 128, layout="col", format="ue8m0_packed")
    with pytest.raises(ValueError, match="4 groups must belong to one thread"):
        rule.validate(spec, {"vector": 8, "groups_per_thread": 2, "min_blocks_per_sm": 0}, TARGET)
    with pytest.raises(ValueError, match="no knob"):
        rule.validate(spec, {"vector": 8, "groups_per_thread": 4, "min_blocks_per_sm": 0, "unroll": 2}, TARGET)
    with pytest.raises(ValueError, match=r"needs knob\(s\) \['min_blocks_per_sm'\]"):
        rule.validate(spec, {"vector": 8, "groups_per_thread": 4}, TARGET)
    # An override the rule cannot take leaves the default in place.
    assert overriding({"groups_per_thread": 2}, TARGET)(spec) == default_schedule(spec, TARGET)


def test_default_blocks_are_whole_warps_so_reductions_use_shuffles():
    """A partial warp makes TVM reduce warp-synchronously through shared memory (a racecheck hazard)."""
    from tvm_rmsquant.presets import preset

    rule = rule_by_name("row_resident")
    for spec in preset("default"):
        name, knobs = default_schedule(spec, TARGET)
        if name == "row_resident":
            lanes = spec.group // knobs["vector"]
            assert lanes * (spec.hidden // spec.group // knobs["groups_per_thread"]) % 32 == 0, spec.name
    assert "not a whole number of warps" in rule.check(VariantSpec("bf16", 2560, 128), {"vector": 8, "groups_per_thread": 4}, TARGET)


def test_rules_take_the_target_as_an_argument():
    """Occupancy is the target's fact, not the rule's: a hypothetical sm_90a with half the
    resident threads per SM loses exactly the candidates whose min_blocks_per_sm overflow it."""
    import dataclasses

    from tvm_rmsquant.target import TARGETS

    small = dataclasses.replace(TARGETS["sm_90a"], threads_per_sm=1024)
    spec = VariantSpec("bf16", 7168, 128)
    rule = rule_by_name(default_schedule(spec, TARGET)[0])
    full, halved = list(rule.candidates(spec, TARGET)), list(rule.candidates(spec, small))
    assert halved and set(map(str, halved)) < set(map(str, full))
    lost = [knobs for knobs in full if knobs not in halved]
    assert lost and all("threads of an sm_90a SM" in rule.check(spec, knobs, small) for knobs in lost)
    assert all(rule.check(spec, knobs, TARGET) is None for knobs in lost)


def test_one_schedule_serves_every_arch_of_a_build_or_the_build_is_refused(monkeypatch):
    import dataclasses

    from tvm_rmsquant import target

    assert scheduling_target(("sm_100a", "sm_90a")) is target.TARGETS["sm_90a"]
    assert scheduling_target(("sm_100a",)) is target.TARGETS["sm_100a"]
    monkeypatch.setitem(target.TARGETS, "sm_100a", dataclasses.replace(target.TARGETS["sm_100a"], threads_per_sm=1024))
    with pytest.raises(ValueError, match="arch=sm_100a has 1024 threads per SM, fewer than the 2048 of sm_90a"):
        scheduling_target(("sm_90a", "sm_100a"))


@pytest.mark.parametrize("per_thread,word_stores,byte_stores", [(4, 1, 0), (8, 2, 0), (2, 0, 2)])
def test_tiled_scales_are_stored_a_tile_word_at_a_time(per_thread, word_stores, byte_stores):
    """A thread's groups that share a 4-column tile word are stored as one 4-byte vector
    (4 byte stores cost tiled:mxfp8 12 points of the copy ceiling against packed UE8M0, which
    stores words; docs/perf.md); fewer than 4 groups per thread keep one store each."""
    require_toolchain(nvcc=False)
    from tvm_rmsquant.codegen import lower

    spec = VariantSpec("bf16", 8192, 32, False, "tiled", "mxfp8")
    knobs = {"vector": 8, "groups_per_thread": per_thread, "min_blocks_per_sm": 0}
    source = lower.cuda_source([(spec, "row_resident", knobs, "k", None)], DEFAULT_ARCHS)
    body = source[source.index("k_grouped_kernel(") :]
    assert len(re.findall(r"\*\(__nv_fp8x4_e8m0\*\)\(scales_tiles_ptr \+", body)) == word_stores
    assert len(re.findall(r"^\s*scales_tiles_ptr\[", body, flags=re.M)) == byte_stores


def test_groups_per_thread_takes_every_divisor_so_warps_can_fill_the_four_schedulers():
    """K = 7168 has 56 groups: powers of two give 28, 14 or 7 warps of 16-lane groups, and four
    schedulers share 14 or 7 unevenly; 7 groups per thread gives 4 warps, or 8 at 32 lanes per
    group. The search steps from 4 to 7 there, and a K = 4096 row keeps the powers of two."""
    from tvm_rmsquant.schedules.search import neighbours

    rule = rule_by_name("row_resident")
    spec = VariantSpec("bf16", 7168, 128, True, "col", "fp32")
    assert rule.space(spec, TARGET)["groups_per_thread"] == [1, 2, 4, 7, 8, 14]
    assert rule.space(VariantSpec("bf16", 5120, 128), TARGET)["groups_per_thread"] == [1, 2, 4, 5, 8, 10]
    assert rule.space(VariantSpec("bf16", 4096, 128), TARGET)["groups_per_thread"] == [1, 2, 4, 8, 16]
    warps = {(k["vector"], k["groups_per_thread"]): (128 // k["vector"]) * (56 // k["groups_per_thread"]) // 32 for k in rule.candidates(spec, TARGET)}
    assert warps[(8, 7)] == 4 and warps[(4, 7)] == 8 and warps[(4, 14)] == 4
    default = default_schedule(spec, TARGET)[1]
    assert {**default, "groups_per_thread": 7} in neighbours(rule, spec, TARGET, default)
    assert "is not one of its values [1, 2, 4, 8, 16]" in rule.check(VariantSpec("bf16", 4096, 128), {**default, "groups_per_thread": 7}, TARGET)


def test_the_non_power_of_two_thread_rows_compile_without_a_spill(tmp_path):
    """7 groups per thread hold 56 values of h and of y at vector 8: under MAX_RESIDENT, and ptxas agrees."""
    require_toolchain()
    from tvm_rmsquant.codegen import lower, nvcc

    spec = VariantSpec("bf16", 7168, 128, True, "col", "fp32")
    kernels = [(spec, "row_resident", {"vector": vector, "groups_per_thread": per_thread, "min_blocks_per_sm": 0}, f"k{vector}_{per_thread}", None)
               for vector, per_thread in ((8, 7), (4, 7), (4, 14))]
    source = tmp_path / "k.cu"
    source.write_text(lower.cuda_source(kernels, ["sm_90a"]))
    figures = nvcc.compile_library(nvcc.find_nvcc(), source, tmp_path / "k.so", ["sm_90a"])
    assert len(figures) == 3 and all(arch["sm_90a"]["spill_stores"] == arch["sm_90a"]["spill_loads"] == 0 for arch in figures.values())
