"""The tensor expression, built for TVM's llvm target, against the torch reference.

This is the issue's equivalence bar on every spec dimension: dtypes, group sizes,
residual modes, the standalone quant (no norm), fp32 norm weights with 16-bit activations,
layouts and formats, static and dynamic K, scale_ub; M in
{0, 1, 3, 17, 256}, K in {128, 1024, 4096, 7168}; random normal inputs with outliers.
The measured match fractions are printed in the terminal summary.
"""

import itertools
import math

import pytest
import torch
from conftest import require_toolchain

require_toolchain(nvcc=False)  # the CPU kernels are TVM's llvm build

import tvm  # noqa: E402

from tvm_rmsquant import cpu, expr, reference  # noqa: E402
from tvm_rmsquant.checks import compare, random_inputs  # noqa: E402
from tvm_rmsquant.selfcheck import run_cpu_kernel  # noqa: E402
from tvm_rmsquant.scale_layout import MIN_SCALE  # noqa: E402
from tvm_rmsquant.spec import VariantSpec  # noqa: E402

ROWS = (0, 1, 3, 17, 256)
HIDDEN = (128, 1024, 4096, 7168)
LAYOUT_FORMATS = (("row", "fp32"), ("row", "ue8m0"), ("col", "fp32"), ("col", "ue8m0"), ("col", "ue8m0_packed"),
                  ("col_dense", "fp32"), ("col_dense", "ue8m0"))
AGREEMENTS = []


#: MXFP8 (cuBLAS's tiles of E8M0 bytes) is defined for G = 32 only.
MX_FORMATS = (("tiled", "mxfp8"), ("tiled", "mxfp8_ocp"))


def _static_cases():
    for hidden, dtype, group, residual, (layout, fmt) in itertools.product(HIDDEN, ("bf16", "fp16", "fp32"), (64, 128), (False, True), LAYOUT_FORMATS):
        yield VariantSpec(dtype, hidden, group, residual, layout, fmt)
    for hidden, dtype, residual, (layout, fmt) in itertools.product(HIDDEN, ("bf16", "fp16", "fp32"), (False, True), MX_FORMATS):
        yield VariantSpec(dtype, hidden, 32, residual, layout, fmt)
    for dtype, residual, (layout, fmt) in itertools.product(("bf16", "fp16", "fp32"), (False, True), LAYOUT_FORMATS):
        yield VariantSpec(dtype, 1024, 128, residual, layout, fmt, scale_ub=True)
    for dtype, residual, (layout, fmt) in itertools.product(("bf16", "fp16", "fp32"), (False, True), MX_FORMATS):
        yield VariantSpec(dtype, 1024, 32, residual, layout, fmt, scale_ub=True)
    # The standalone quant (norm=False): the same records, dtypes, groups and scale_ub.
    for hidden, dtype, group, (layout, fmt), scale_ub in itertools.product((128, 4096), ("bf16", "fp16", "fp32"), (64, 128), LAYOUT_FORMATS, (False, True)):
        yield VariantSpec(dtype, hidden, group, False, layout, fmt, scale_ub, norm=False)
    for hidden, dtype, (layout, fmt) in itertools.product((128, 4096), ("bf16", "fp16", "fp32"), MX_FORMATS):
        yield VariantSpec(dtype, hidden, 32, False, layout, fmt, norm=False)
    # An fp32 norm weight with 16-bit activations (weight_dtype): every record, with and without residual.
    for hidden, dtype, residual, (layout, fmt) in itertools.product((128, 4096), ("bf16", "fp16"), (False, True), LAYOUT_FORMATS):
        yield VariantSpec(dtype, hidden, 128, residual, layout, fmt, weight_dtype="fp32")
    for dtype, residual, (layout, fmt) in itertools.product(("bf16", "fp16"), (False, True), MX_FORMATS):
        yield VariantSpec(dtype, 4096, 32, residual, layout, fmt, weight_dtype="fp32")


def _dynamic_cases():
    for dtype, group, residual, (layout, fmt) in itertools.product(("bf16", "fp16", "fp32"), (64, 128), (False, True), LAYOUT_FORMATS):
        yield VariantSpec(dtype, None, group, residual, layout, fmt)
    for dtype, residual, (layout, fmt) in itertools.product(("bf16", "fp16", "fp32"), (False, True), MX_FORMATS):
        yield VariantSpec(dtype, None, 32, residual, layout, fmt)
    for dtype, group, (layout, fmt) in itertools.product(("bf16", "fp16", "fp32"), (64, 128), LAYOUT_FORMATS):
        yield VariantSpec(dtype, None, group, False, layout, fmt, norm=False)
    for dtype, (layout, fmt) in itertools.product(("bf16", "fp16", "fp32"), MX_FORMATS):
        yield VariantSpec(dtype, None, 32, False, layout, fmt, norm=False)
    for dtype, residual, (layout, fmt) in itertools.product(("bf16", "fp16"), (False, True), LAYOUT_FORMATS):
        yield VariantSpec(dtype, None, 128, residual, layout, fmt, weight_dtype="fp32")


def _check(spec, hidden):
    for seed, rows in enumerate(ROWS):
        inputs = random_inputs(spec, rows, hidden, seed=seed * 1000 + hidden)
        want = reference.rms_norm_group_quant(inputs["x"], inputs["weight"], 1e-6, spec, inputs["residual"], inputs["scale_ub"])
        got = run_cpu_kernel(spec, inputs)
        assert got[0].shape == want[0].shape and got[1].shape == want[1].shape and got[1].stride() == want[1].stride()
        agreement = compare(spec, got, want, hidden)
        AGREEMENTS.append((spec.name, hidden, rows, agreement))
        assert agreement.passed, f"{spec.name} K={hidden} M={rows}: {agreement.describe()}"


@pytest.mark.parametrize("spec", list(_static_cases()), ids=lambda spec: spec.name)
def test_static_k_kernel_matches_reference(spec):
    _check(spec, spec.hidden)


@pytest.mark.parametrize("spec", list(_dynamic_cases()), ids=lambda spec: spec.name)
def test_dynamic_k_kernel_matches_reference_at_several_k(spec):
    for hidden in (512, 4096) if spec.format == "ue8m0_packed" else (384, 4096):
        if spec.accepts_hidden(hidden) is None:
            _check(spec, hidden)


def test_portable_fp8_cast_is_bit_exact_for_every_representable_neighbourhood():
    """Every e4m3fn value, each midpoint between neighbours, and one fp32 ulp either side."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = torch.cat([codes, -codes]).unique()
    mids = (codes[1:] + codes[:-1]) / 2
    base = torch.cat([codes, mids])
    bits = base.view(torch.int32)
    values = torch.cat([base, (bits + 1).view(torch.float32), (bits - 1).view(torch.float32), torch.tensor([float("nan"), 448.0, -448.0])])
    values = values[(values.abs() <= 448) | values.isnan()]
    rows = te_cast(values)
    want = values.to(torch.float8_e4m3fn)
    same = (rows.view(torch.uint8) == want.view(torch.uint8)) | (rows.float().isnan() & want.float().isnan())
    assert bool(same.all()), values[~same][:8]


def te_cast(values):
    from tvm import te

    n = te.var("n")
    source = te.placeholder((n,), "float32", name="source")
    out = te.compute((n,), lambda i: expr.e4m3fn_bits(source[i]), name="out")
    function = tvm.compile(te.create_prim_func([source, out]), target="llvm")["main"]
    result = torch.empty(values.shape, dtype=torch.float8_e4m3fn)
    function(values.contiguous(), result)
    return result


def _quotient_function(**forms):
    """``expr.quotient`` with ``forms`` (bounded, power_of_two), built for llvm, as f(y, s) -> y / s."""
    from tvm import te

    n = te.var("n")
    numerator, denominator = te.placeholder((n,), "float32", name="y"), te.placeholder((n,), "float32", name="s")
    out = te.compute((n,), lambda i: expr.quotient(numerator[i], denominator[i], **forms), name="out")
    function = tvm.compile(te.create_prim_func([numerator, denominator, out]), target="llvm")["main"]

    def divide(y, s):
        result = torch.empty_like(y)
        function(y.contiguous(), s.contiguous(), result)
        return result

    return divide


def _assert_is_the_division(result, y, s):
    """Bit-equal to IEEE y / s (NaN where it is NaN); below |y| = 2^-100 equal as fp8 codes."""
    want = y / s
    assert torch.equal(result.isnan(), want.isnan())
    # Below 2^-100 the remainder can underflow, but |y / s| < 2^-82 is an fp8 zero of y's sign either way.
    exact = ~want.isnan() & (y.abs() >= 2.0**-100)
    different = exact & (result.view(torch.int32) != want.view(torch.int32))
    assert not bool(different.any()), list(zip(y[different][:4].tolist(), s[different][:4].tolist()))
    tiny = ~want.isnan() & ~exact
    assert torch.equal(result[tiny].to(torch.float8_e4m3fn).view(torch.uint8), want[tiny].to(torch.float8_e4m3fn).view(torch.uint8))


def _values(count, generator):
    """fp32 values across the whole range, signed zeros, subnormals, the fp8 limits, inf and NaN."""
    y = torch.randn(count, generator=generator) * torch.pow(10.0, torch.randint(-45, 38, (count,), generator=generator).float())
    return torch.cat([y, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 448.0, -448.0, 3.3895e38, float("inf"), float("-inf"), float("nan")])])


def test_quotient_is_the_correctly_rounded_division():
    """y / s from one reciprocal per group is IEEE division, bit for bit, wherever the fp8 code can see it:
    scales from the floor to 1e35, powers of two (UE8M0), inf and NaN; y across the fp32 range,
    signed zeros, subnormals and infinities (so also y / s overflowing, as under a scale_ub cap)."""
    generator = torch.Generator().manual_seed(0)
    y = _values(4000, generator)
    s = torch.exp(torch.empty(600).uniform_(math.log(MIN_SCALE), math.log(1e35), generator=generator))
    s = torch.cat([s, torch.tensor([MIN_SCALE, 1.0, 2.0**-17, 2.0**100, float("inf"), float("nan")])])
    y, s = (grid.reshape(-1) for grid in torch.meshgrid(y, s, indexing="ij"))
    _assert_is_the_division(_quotient_function()(y, s), y, s)


def test_bounded_quotient_is_the_division_for_every_element_of_an_uncapped_group():
    """Without a scale_ub cap, s = max(absmax / 448, floor) of a group holding y, so |y| <= 448 s;
    or s = inf where the group holds an inf. There the quotient needs no per-element check."""
    generator = torch.Generator().manual_seed(1)
    y = _values(20000, generator)
    finite = y[torch.isfinite(y)]
    # The group's absmax: y itself, or a larger element (up to 1e4 x, capped at fp32's max).
    absmax = torch.cat([finite.abs(), (finite.abs() * torch.exp(torch.empty(finite.numel()).uniform_(0, math.log(1e4), generator=generator))).clamp(max=3.4e38)])
    numerators = torch.cat([finite, finite])
    s = torch.clamp(absmax / 448.0, min=MIN_SCALE)
    # A group holding an inf or NaN: s is inf or NaN for all its elements.
    numerators = torch.cat([numerators, y, y])
    s = torch.cat([s, torch.full_like(y, float("inf")), torch.full_like(y, float("nan"))])
    _assert_is_the_division(_quotient_function(bounded=True)(numerators, s), numerators, s)


def test_power_of_two_quotient_is_one_exact_multiply():
    """UE8M0 scales are 2^n (n from the floor's -18 to 127), inf or NaN: y * (1 / s) is y / s exactly."""
    generator = torch.Generator().manual_seed(2)
    y = _values(4000, generator)
    s = torch.cat([torch.pow(2.0, torch.arange(-18, 128).float()), torch.tensor([float("inf"), float("nan")])])
    y, s = (grid.reshape(-1) for grid in torch.meshgrid(y, s, indexing="ij"))
    result, want = _quotient_function(power_of_two=True)(y, s), y / s
    assert torch.equal(result.isnan(), want.isnan())
    assert torch.equal(result[~want.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))


def test_portable_bf16_rounding_matches_torch():
    from tvm import te

    values = torch.cat([torch.randn(50000) * 100, torch.tensor([float("nan"), float("inf"), 3.3895e38, 1e-40])])
    n = te.var("n")
    source = te.placeholder((n,), "float32", name="source")
    out = te.compute((n,), lambda i: expr.bf16_round_bits(source[i]), name="out")
    function = tvm.compile(te.create_prim_func([source, out]), target="llvm")["main"]
    result = torch.empty_like(values)
    function(values, result)
    want = values.bfloat16().float()
    assert torch.equal(result.isnan(), want.isnan())
    assert torch.equal(result[~want.isnan()], want[~want.isnan()])


def test_cpu_kernels_are_cached_per_spec():
    spec = VariantSpec("bf16", 128, 128)
    assert cpu.function(spec) is cpu.function(spec)


@pytest.mark.parametrize("name", ["bf16_k4096_g128_res_col_fp32", "fp16_kdyn_g128_col_ue8m0", "bf16_k7168_g128_res_col_ue8m0_packed"])
def test_column_layout_function_is_what_its_tvmscript_says(name):
    """The column layouts' strided scale parameter is made structurally, not by a TVMScript round
    trip, and must still be the function its text parses to: kernel digests hash that text, and
    the names the CUDA source keeps are the printer's (the rows' loops ``m_1``, the let-bound
    ``r_1`` beside the residual ``r``, the outer of two nested ``s``)."""
    import tvm_ffi

    func = expr.prim_func(VariantSpec.parse(name))
    parsed = tvm.script.from_source(func.script())
    assert func.script() == parsed.script()
    assert tvm_ffi.structural_equal(func, parsed, map_free_vars=True)

    def names(function):
        seen = []
        tvm_ffi.structural_walk(function.body, [(tvm.tirx.Var, lambda var: seen.append(var.name))], order="pre")
        return seen

    assert names(func) == names(parsed)
    scale = func.params[-1 if not VariantSpec.parse(name).residual else -2]
    assert [str(stride) for stride in scale.ty.strides] == ["T.int64(1)", expr.PADDED_ROWS]
