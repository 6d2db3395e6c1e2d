"""Schedule rules as a search space: enumerable, sampleable, validated, TVM-free until applied."""

import pytest

from tvm_rmsquant.schedules import RULES, default_schedule, overriding, rule_by_name
from tvm_rmsquant.spec import VariantSpec


@pytest.mark.parametrize("spec", [VariantSpec("bf16", 7168, 128, True, "col", "ue8m0_packed"), VariantSpec("fp32", 2048, 64), VariantSpec("fp16", None, 128)])
def test_every_candidate_is_valid_and_the_default_is_one_of_them(spec):
    name, knobs = default_schedule(spec)
    rule = rule_by_name(name)
    candidates = list(rule.candidates(spec))
    assert knobs in candidates and all(rule.check(spec, c) is None for c in candidates)
    sample = rule.sample(spec, 3, seed=1)
    assert len(sample) == min(3, len(candidates)) and all(s in candidates for s in sample)


def test_static_specs_get_the_register_rule_and_dynamic_specs_the_fallback():
    assert default_schedule(VariantSpec("bf16", 4096))[0] == "row_resident"
    assert default_schedule(VariantSpec("bf16", None))[0] == "dynamic_rows"
    assert [rule.name for rule in RULES] == ["row_resident", "dynamic_rows"]


def test_bad_knobs_are_refused_with_the_reason():
    rule = rule_by_name("row_resident")
    spec = VariantSpec("bf16", 7168, 128, layout="col", format="ue8m0_packed")
    with pytest.raises(ValueError, match="4 groups must belong to one thread"):
        rule.validate(spec, {"vector": 8, "groups_per_thread": 2, "min_blocks_per_sm": 0})
    with pytest.raises(ValueError, match="no knob"):
        rule.validate(spec, {"vector": 8, "groups_per_thread": 4, "min_blocks_per_sm": 0, "unroll": 2})
    with pytest.raises(ValueError, match=r"needs knob\(s\) \['min_blocks_per_sm'\]"):
        rule.validate(spec, {"vector": 8, "groups_per_thread": 4})
    # An override the rule cannot take leaves the default in place.
    assert overriding({"groups_per_thread": 2})(spec) == default_schedule(spec)


def test_default_blocks_are_whole_warps_so_reductions_use_shuffles():
    """A partial warp makes TVM reduce warp-synchronously through shared memory (a racecheck hazard)."""
    from tvm_rmsquant.presets import preset

    rule = rule_by_name("row_resident")
    for spec in preset("default"):
        name, knobs = default_schedule(spec)
        if name == "row_resident":
            lanes = spec.group // knobs["vector"]
            assert lanes * (spec.hidden // spec.group // knobs["groups_per_thread"]) % 32 == 0, spec.name
    assert "not a whole number of warps" in rule.check(VariantSpec("bf16", 2560, 128), {"vector": 8, "groups_per_thread": 4})
