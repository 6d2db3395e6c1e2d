"""The variant spec: naming, parsing, hashing, validation and scale geometry."""

import pytest

from tvm_rmsquant.presets import preset
from tvm_rmsquant.spec import VariantSpec, scale_geometry


def test_name_is_stable_and_round_trips():
    spec = VariantSpec("bf16", 7168, 128, True, "col", "ue8m0")
    assert spec.name == "bf16_k7168_g128_res_col_ue8m0"
    for spec in preset("all"):
        assert VariantSpec.parse(spec.name) == spec


def test_specs_are_frozen_hashable_and_digests_are_content_hashes():
    a, b = VariantSpec("fp16", 4096, 64), VariantSpec("fp16", 4096, 64)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.digest() == b.digest() and len(a.digest()) == 16
    assert a.digest() != VariantSpec("fp16", 4096, 128).digest()
    with pytest.raises(Exception):
        a.group = 128


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dtype="int8", hidden=4096), "dtype='int8'"),
        (dict(dtype="bf16", hidden=4100), "hidden=4100 is not divisible by group=128"),
        (dict(dtype="bf16", hidden=4096, group=100), "group=100"),
        (dict(dtype="bf16", hidden=4096, layout="diag"), "layout='diag'"),
        (dict(dtype="bf16", hidden=4096, format="fp8"), "format='fp8'"),
        (dict(dtype="bf16", hidden=4096, layout="row", format="ue8m0_packed"), "needs layout='col'"),
        (dict(dtype="bf16", hidden=-128), "hidden=-128"),
    ],
)
def test_bad_specs_name_the_argument_and_what_works(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        VariantSpec(**kwargs)


def test_any_group_that_divides_k_and_is_a_multiple_of_8_is_accepted():
    assert VariantSpec("bf16", 960, 96).group == 96
    assert VariantSpec("bf16", None, 32).is_dynamic


def test_parse_rejects_unknown_names_with_an_example():
    with pytest.raises(ValueError, match="bf16_k7168_g128_res_col_ue8m0"):
        VariantSpec.parse("bf16-k7168")


def test_scale_geometry_of_each_layout():
    row = VariantSpec("bf16", 7168, 128)
    assert scale_geometry(row, 5) == ((5, 56), (56, 1), 5, "float32")
    col = VariantSpec("bf16", 7168, 128, layout="col")
    assert scale_geometry(col, 5) == ((5, 56), (1, 8), 8, "float32")
    packed = VariantSpec("bf16", 640, 128, layout="col", format="ue8m0_packed")
    assert scale_geometry(packed, 9) == ((9, 2), (1, 12), 12, "int32")


def test_dynamic_packed_kernels_need_whole_words():
    spec = VariantSpec("bf16", None, 128, layout="col", format="ue8m0_packed")
    assert spec.accepts_hidden(2048) is None
    assert "hidden % 512" in spec.accepts_hidden(640)
    assert VariantSpec("bf16", None, 128).accepts_hidden(640) is None


def test_default_preset_covers_the_consumer_table():
    everything = preset("default")
    specs = [s for s in everything if s.norm and s.weight_dtype is None]
    hidden = {s.hidden for s in specs}
    assert {2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192, None} <= hidden
    assert {(s.layout, s.format) for s in specs} == {("row", "fp32"), ("col", "fp32"), ("col", "ue8m0"), ("col", "ue8m0_packed"),
                                                     ("tiled", "mxfp8"), ("col_dense", "fp32")}
    assert {s.hidden for s in specs if s.group == 64} == {4096, 7168, None}
    assert {s.dtype for s in specs} == {"bf16", "fp16"} and {s.residual for s in specs} == {False, True}
    dynamic = [s for s in specs if s.is_dynamic and not s.scale_ub]
    # (dtype, residual) x G in {128, 64} x 4 consumer layouts, plus G = 32 packed UE8M0 and MXFP8 tiles,
    # plus G = 128 dense col (torch's BlockWise1x128 scaled_mm).
    assert len(dynamic) == 2 * 2 * 2 * 4 + 2 * 2 * 2 + 2 * 2
    # G = 32: the two Blackwell consumers (DeepGEMM's packed UE8M0, cuBLAS MXFP8 tiles), at every default
    # hidden size and dynamic K.
    grouped32 = {(s.dtype, s.hidden, s.residual, s.layout, s.format) for s in specs if s.group == 32}
    assert grouped32 == {(d, k, r, layout, fmt) for d in ("bf16", "fp16") for r in (False, True)
                         for k in (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192, None)
                         for layout, fmt in (("col", "ue8m0_packed"), ("tiled", "mxfp8"))}
    dense = {(s.hidden, s.group) for s in specs if s.layout == "col_dense"}
    assert dense == {(k, 128) for k in (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192, None)}
    # The standalone quant: dynamic K, every (group, layout, format) the fused kernels have, and
    # the same scale_ub variants; static K for the blockwise layout at the hidden and intermediate sizes.
    standalone = [s for s in everything if not s.norm and s.is_dynamic]
    assert not any(s.residual for s in everything if not s.norm)
    static = {(s.dtype, s.hidden, s.group, s.layout, s.format, s.scale_ub) for s in everything if not s.norm and not s.is_dynamic}
    assert static == {(d, k, 128, "col_dense", "fp32", False) for d in ("bf16", "fp16")
                      for k in (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192, 12288, 14336)}
    assert {(s.dtype, s.group, s.layout, s.format, s.scale_ub) for s in standalone} == {
        (s.dtype, s.group, s.layout, s.format, s.scale_ub) for s in specs if s.is_dynamic and not s.residual}
    # An fp32 norm weight with 16-bit activations: dynamic K, every (group, layout, format), residual or
    # not; and static K for bf16 with col fp32 scales at every default hidden size, G = 128.
    mixed = [s for s in everything if s.weight_dtype is not None]
    assert all(s.norm and s.weight_dtype == "fp32" and not s.scale_ub for s in mixed)
    assert {(s.dtype, s.group, s.residual, s.layout, s.format) for s in mixed if s.is_dynamic} == {
        (s.dtype, s.group, s.residual, s.layout, s.format) for s in dynamic}
    assert {(s.dtype, s.hidden, s.group, s.residual, s.layout, s.format) for s in mixed if not s.is_dynamic} == {
        ("bf16", k, 128, r, "col", "fp32") for k in (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192) for r in (False, True)}
    capped = {(s.dtype, s.hidden, s.group, s.residual, s.layout, s.format) for s in specs if s.scale_ub}
    assert capped == {(d, None, 128, r, layout, "fp32") for d in ("bf16", "fp16") for r in (False, True) for layout in ("row", "col")}
