"""Robustness: bad input is refused clearly, edge cases have one defined answer, big M is right.

Every refusal names the argument, the value received and what is accepted. The same cases
run on CPU (the op's llvm build, in CI) and, marked ``gpu``, through the bundle's C++ torch
ops and CUDA entry points (``codegen/torch_ops.cpp``, ``codegen/row_views.cuh``). A dtype
error is TypeError on CPU and ValueError from the C++ ops: a stable-ABI torch extension
can raise ValueError, IndexError or RuntimeError, not TypeError.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from conftest import DEVICES, require_toolchain
from hypothesis import strategies as st

import tvm_rmsquant
from tvm_rmsquant import ops, reference
from tvm_rmsquant.checks import compare, random_inputs
from tvm_rmsquant.dispatch import select
from tvm_rmsquant.scale_layout import FP8_MAX, MIN_SCALE
from tvm_rmsquant.spec import VariantSpec

K = 4096
PLAIN = VariantSpec("bf16", K, 128, layout="col")
RESIDUAL = VariantSpec("bf16", K, 128, True, "col", "ue8m0")
#: The default preset's scale_ub kernels are dynamic-K: the GPU tests run what ships.
CAPPED = VariantSpec("bf16", None, 128, False, "row", "fp32", scale_ub=True)


def _inputs(spec, rows, device, seed=0):
    return random_inputs(spec, rows, K, seed=seed, device=device)


def _run(spec, x, w, eps=1e-6, residual=None, scale_ub=None):
    if spec.residual:
        return ops.fused_add_rms_norm_group_quant(x, residual, w, eps, spec.name, scale_ub)
    return ops.rms_norm_group_quant(x, w, eps, spec.name, scale_ub)


# -- bad input ----------------------------------------------------------------------------------


def _refusals(device):
    """(error, message regex, spec, x, weight, eps, residual): each must be refused."""
    inputs = _inputs(PLAIN, 8, device)
    x, w = inputs["x"], inputs["weight"]
    r = torch.randn_like(x)
    on = dict(device=device)
    dtype_error = TypeError if device == "cpu" else ValueError
    return [
        ("fp8 input", dtype_error, r"x.dtype.*float8_e4m3fn", PLAIN, x.to(torch.float8_e4m3fn), w, 1e-6, None),
        ("int input", dtype_error, r"x.dtype.*int32", PLAIN, torch.ones(8, K, dtype=torch.int32, **on), w, 1e-6, None),
        ("fp32 weight", dtype_error, r"weight.dtype.*float32", PLAIN, x, w.float(), 1e-6, None),
        ("transposed x", ValueError, r"x must (have a contiguous last dimension|be contiguous)", PLAIN, torch.randn(K, 8, **on).bfloat16().t(), w, 1e-6, None),
        ("K not a multiple of G", ValueError, r"x.shape\[-1\]=4000", PLAIN, x[:, :4000], w[:4000], 1e-6, None),
        ("wrong K for the variant", ValueError, r"x.shape\[-1\]=2048", PLAIN, x[:, :2048].contiguous(), w[:2048], 1e-6, None),
        ("short weight", ValueError, r"weight.*(\[4096\]|shape \[2048\])", PLAIN, x, w[:2048], 1e-6, None),
        ("3-D x to the op", ValueError, r"x must be 2-D", PLAIN, x.view(2, 4, K), w, 1e-6, None),
        ("residual of the wrong shape", ValueError, r"residual.*(shape|must be)", RESIDUAL, x, w, 1e-6, r[:4]),
        ("residual of the wrong dtype", ValueError, r"r(esidual)?.*(float32|dtype)", RESIDUAL, x, w, 1e-6, r.float()),
        ("residual with a transposed last dim", ValueError, r"residual must have a contiguous last dimension", RESIDUAL, x, w, 1e-6, torch.randn(K, 8, **on).bfloat16().t()),
        ("residual to the plain op", ValueError, r"has no residual", PLAIN, x, w, 1e-6, r),
        ("no residual to the fused op", ValueError, r"updates a residual", RESIDUAL, x, w, 1e-6, None),
        ("eps = 0", ValueError, r"eps=0(\.0)? .*must be positive and finite in fp32", PLAIN, x, w, 0.0, None),
        ("eps < 0", ValueError, r"eps=-1e-06 .*must be positive and finite in fp32", PLAIN, x, w, -1e-6, None),
        ("eps NaN", ValueError, r"eps=nan .*must be positive and finite in fp32", PLAIN, x, w, math.nan, None),
        # Checked in fp32, the precision the kernels add it in: inf and 0 there.
        ("eps overflowing fp32", ValueError, r"eps=1e\+39 .*(inf|in fp32)", PLAIN, x, w, 1e39, None),
        ("eps underflowing fp32", ValueError, r"eps=1e-50 .*(0|in fp32)", PLAIN, x, w, 1e-50, None),
        ("expanded residual", ValueError, r"residual .*(overlap|contiguous)", RESIDUAL, x, w, 1e-6, r[:1].expand(8, K)),
    ]


def _call_refusal(spec, x, w, eps, residual):
    """The op the caller's arguments pick, whatever the variant (so mismatches reach the op)."""
    if residual is not None:
        return ops.fused_add_rms_norm_group_quant(x, residual, w, eps, spec.name)
    return ops.rms_norm_group_quant(x, w, eps, spec.name)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_bad_input_is_refused_naming_the_argument_and_the_value(device):
    for case, error, message, spec, x, w, eps, residual in _refusals(device):
        with pytest.raises(error, match=message):
            _call_refusal(spec, x, w, eps, residual)
            pytest.fail(f"{case}: not refused")


@pytest.mark.gpu
def test_tensors_on_different_devices_are_refused(gpu_bundle):
    ops.use_bundle(gpu_bundle)
    inputs = _inputs(PLAIN, 8, "cuda")
    with pytest.raises((ValueError, RuntimeError), match=r"weight.*(device|cpu)"):
        ops.rms_norm_group_quant(inputs["x"], inputs["weight"].cpu(), 1e-6, PLAIN.name)


def test_cpu_tensors_run_the_cpu_path_whatever_the_bundle(monkeypatch, tmp_path):
    """A CUDA-only bundle (here: none at all) never stops CPU tensors: they run the llvm build."""
    monkeypatch.setenv("TVM_RMSQUANT_BUNDLE", str(tmp_path / "no-bundle"))
    inputs = _inputs(PLAIN, 5, "cpu")
    got = ops.rms_norm_group_quant(inputs["x"], inputs["weight"], 1e-6, PLAIN.name)
    want = reference.rms_norm_group_quant(inputs["x"], inputs["weight"], 1e-6, PLAIN)
    assert compare(PLAIN, (*got, None), want, K).passed


def test_a_gemma_style_fp32_weight_runs_the_mixed_dtype_kernels_and_other_pairs_the_reference(caplog):
    inputs = _inputs(PLAIN, 6, "cpu")
    weight = inputs["weight"].float() * 1.001  # not representable in bf16
    bound = select(K, torch.bfloat16, scale_layout="col", device="cpu", weight_dtype=torch.float32)
    mixed = VariantSpec("bf16", K, 128, False, "col", "fp32", weight_dtype="fp32")
    assert bound.variant == mixed.name == "bf16_k4096_g128_wf32_col_fp32"
    want_q, want_scales, _ = reference.rms_norm_group_quant(inputs["x"], weight, 1e-6, mixed)
    for q, scales in (bound(inputs["x"], weight), tvm_rmsquant.rms_norm_group_quant(inputs["x"], weight, scale_layout="col")):
        assert compare(mixed, (q, scales, None), (want_q, want_scales, None), K).passed
    # The contract's mixed rule: the weight multiply in fp32, then one rounding (not two).
    h = inputs["x"].float()
    y = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).bfloat16()
    assert torch.equal(reference.rms_norm(inputs["x"], weight, 1e-6)[0], y)
    with caplog.at_level(logging.WARNING, logger="tvm_rmsquant"):
        other = select(K, torch.bfloat16, scale_layout="col", device="cpu", weight_dtype=torch.float16)
    assert other.variant is None and "float16" in other.why[0].reason and "torch reference" in caplog.text


def test_the_api_checks_scale_ub_eps_and_the_weight_up_front():
    inputs = _inputs(PLAIN, 2, "cpu")
    x, w = inputs["x"], inputs["weight"]
    for ub, message in ((torch.tensor([0.0]), r"scale_ub=0.0 must be > 0"), (torch.tensor([-1.0]), r"scale_ub=-1.0 must be > 0"),
                        (torch.tensor([1.0, 2.0]), "one-element float32")):
        with pytest.raises(ValueError, match=message):
            tvm_rmsquant.rms_norm_group_quant(x, w, scale_ub=ub)
    with pytest.raises(ValueError, match="eps=0 must be positive and finite in fp32"):
        tvm_rmsquant.rms_norm_group_quant(x, w, eps=0)
    with pytest.raises(ValueError, match=r"weight must be \[4096\]"):
        tvm_rmsquant.rms_norm_group_quant(x, w[:100])
    with pytest.raises(ValueError, match=r"hidden=4000 .*group=128|4000.*128"):
        tvm_rmsquant.rms_norm_group_quant(x[:, :4000], w[:4000])


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_a_cap_that_is_not_positive_gives_nan_scales_never_finite_garbage(device):
    """The op cannot read a GPU scalar without a sync, so scale_ub <= 0 is defined: NaN."""
    inputs = _inputs(CAPPED, 4, device)
    for cap in (0.0, -1.0, math.nan):
        q, scales = _run(CAPPED, inputs["x"], inputs["weight"], scale_ub=torch.tensor([cap], device=device))
        assert torch.isnan(scales).all() and torch.isnan(q.float()).all(), cap


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_out_variant_refuses_wrong_buffers(device):
    inputs = _inputs(PLAIN, 8, device)
    x, w = inputs["x"], inputs["weight"]
    good_out = torch.empty(8, K, dtype=torch.float8_e4m3fn, device=device)
    good_scales = reference.empty_scales(PLAIN, 8, K, device)
    cases = [
        (torch.empty(8, K, dtype=torch.uint8, device=device), good_scales, True, "result must be a contiguous"),
        (torch.empty(4, K, dtype=torch.float8_e4m3fn, device=device), good_scales, True, r"result must be .*\(8, 4096\)"),
        (good_out, torch.empty(8, 32, device=device), True, r"scale must be \(8, 32\) float32 on \S+ with column-major strides \(1, ld\) with ld >= M=8"),
        (good_out, good_scales.double(), True, "scale must be"),
        (good_out, torch.empty(8, 16, device=device), False, r"scale must be \(8, 32\)"),
    ]
    for out, scales, transposed, message in cases:
        with pytest.raises(ValueError, match=message):
            ops.rms_norm_per_block_quant(out, x, w, scales, 1e-6, None, None, 128, transposed)
    ops.rms_norm_per_block_quant(good_out, x, w, good_scales, 1e-6, None, None, 128, True)
    want = reference.rms_norm_group_quant(x.cpu(), w.cpu(), 1e-6, PLAIN)
    assert compare(PLAIN, (good_out, good_scales, None), want, K).passed


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("rows", [5, 3, 1])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_out_variant_writes_vllms_unpadded_scales(device, rows, ue8m0):
    """vLLM's keyword call with its (1, M) scales at M % 4 != 0 and a residual: the kernel
    reads ld from the tensor and writes nothing past row M (the rest of the buffer keeps its
    sentinel)."""
    spec = VariantSpec("bf16", K, 128, True, "col", "ue8m0" if ue8m0 else "fp32")
    inputs = _inputs(spec, rows, device)
    x, w, r = inputs["x"], inputs["weight"], inputs["residual"]
    before = r.clone()
    result = torch.empty(rows, K, dtype=torch.float8_e4m3fn, device=device)
    storage = torch.full((K // 128, rows + 1), -7.0, device=device)
    scale = storage[:, :rows].t()
    ops.rms_norm_per_block_quant(
        result=result, input=x, weight=w, scale=scale, epsilon=1e-6, scale_ub=None, residual=r, group_size=128,
        is_scale_transposed=True, scale_ue8m0=ue8m0,
    )
    assert scale.stride() == (1, rows + 1) and (storage[:, rows] == -7.0).all()
    want = reference.rms_norm_group_quant(x.cpu(), w.cpu(), 1e-6, spec, before.cpu())
    assert compare(spec, (result, scale, r), want, K).passed


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("spec", [PLAIN, RESIDUAL, VariantSpec("bf16", K, 128, layout="col", format="ue8m0_packed"), VariantSpec("bf16", K, 128)])
def test_zero_rows_give_empty_outputs_with_the_real_shapes_and_strides(device, spec):
    inputs = _inputs(spec, 0, device)
    residual = inputs["residual"] if spec.residual else None
    q, scales = _run(spec, inputs["x"], inputs["weight"], residual=residual)
    expected = reference.empty_scales(spec, 0, K, "meta")
    assert q.shape == (0, K) and q.dtype == torch.float8_e4m3fn and q.device.type == device
    assert scales.shape == expected.shape and scales.stride() == expected.stride() and scales.dtype == expected.dtype


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_strided_rows_weights_and_3d_inputs_are_supported(device):
    inputs = _inputs(RESIDUAL, 12, device)
    wide = torch.randn(12, K + 256, device=device).bfloat16()
    x = wide[:, 128 : 128 + K]  # rows strided, last dim contiguous
    r = inputs["residual"]
    want = reference.rms_norm_group_quant(x.cpu(), inputs["weight"].cpu(), 1e-6, RESIDUAL, r.cpu())
    r_strided = torch.empty(12, K + 64, dtype=torch.bfloat16, device=device)[:, :K]
    r_strided.copy_(r)
    w_strided = torch.empty(2 * K, dtype=torch.bfloat16, device=device)[::2]
    w_strided.copy_(inputs["weight"])
    q, scales = _run(RESIDUAL, x, w_strided, residual=r_strided)
    assert compare(RESIDUAL, (q.cpu(), scales.cpu(), r_strided.cpu()), want, K).passed
    q3, scales3 = tvm_rmsquant.rms_norm_group_quant(x.reshape(3, 4, K), inputs["weight"], scale_layout="col", scale_format="ue8m0",
                                                    residual=r.clone().view(3, 4, K))
    assert q3.shape == (3, 4, K) and torch.equal(q3.view(12, K).view(torch.uint8).cpu(), q.view(torch.uint8).cpu())


# -- numerical edge cases -----------------------------------------------------------------------


def _edge_rows(spec, device):
    """Rows that each hold one edge case (see the README's "Edge cases")."""
    dtype = reference.TORCH_DTYPES[spec.dtype]
    base = random_inputs(spec, 9, K, seed=7, device=device)
    x = base["x"].clone()
    x[0] = 0  # an all-zero row
    x[1, : spec.group] = 0  # one all-zero group
    x[2, 5] = 3.0e4  # a single huge outlier
    x[3] = torch.finfo(dtype).max * 0.99  # near the dtype's max: the fp32 sum of squares overflows
    x[4] = torch.finfo(dtype).tiny / 4  # subnormals
    x[5, 17] = math.nan
    x[6, 300] = math.inf
    residual = base["residual"].clone() if spec.residual else None
    if residual is not None:
        residual[0] = 0
        residual[1, : spec.group] = 0
        residual[7, 9] = math.nan  # NaN in r
    return x, base["weight"], residual


EDGE_SPECS = [RESIDUAL, VariantSpec("bf16", K, 128, layout="col"), VariantSpec("bf16", K, 128, layout="col", format="ue8m0_packed")]


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("spec", EDGE_SPECS)
def test_edge_cases_match_the_reference_and_are_what_the_readme_says(device, spec):
    x, weight, residual = _edge_rows(spec, device)
    got_residual = None if residual is None else residual.clone()
    q, scales = _run(spec, x, weight, residual=got_residual)
    want = reference.rms_norm_group_quant(x.cpu(), weight.cpu(), 1e-6, spec, None if residual is None else residual.cpu())
    agreement = compare(spec, (q, scales, got_residual), want, K)
    assert agreement.passed, agreement.describe()  # NaN in the same places, the rest under the usual bar

    q, per_group = q.cpu().float(), reference.scales_fp32(scales.cpu(), spec, K)
    minimum = MIN_SCALE if not spec.pow2_scales else 2.0 ** math.ceil(math.log2(MIN_SCALE))
    for row in (0, 3):  # zero row; overflowing row (rms = 1 / sqrt(inf) = 0): minimum scale, zero codes
        assert torch.all(per_group[row] == minimum) and torch.all(q[row] == 0), row
    assert per_group[1, 0] == minimum and torch.all(q[1, : spec.group] == 0)  # an all-zero group
    assert torch.all(torch.isfinite(per_group[2])) and q[2].abs().max() == FP8_MAX  # the outlier takes 448
    for row in (5,) + ((7,) if spec.residual else ()):  # NaN in h: rms is NaN, the whole row is NaN
        assert torch.isnan(per_group[row]).all() and torch.isnan(q[row]).all(), row
    # Inf in h: rms = 1 / sqrt(inf) = 0, so the row normalizes to 0 except inf * 0 = NaN itself.
    inf_group = 300 // spec.group
    assert torch.isnan(per_group[6, inf_group]) and torch.isnan(q[6, 300])
    others = torch.ones(per_group.shape[1], dtype=torch.bool)
    others[inf_group] = False
    assert torch.all(per_group[6, others] == minimum)
    assert torch.isfinite(per_group[[0, 1, 2, 3, 4, 8]]).all()


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_nan_in_the_weight_poisons_its_group_only(device):
    spec = EDGE_SPECS[1]
    inputs = _inputs(spec, 5, device)
    weight = inputs["weight"].clone()
    weight[1000] = math.nan
    q, scales = _run(spec, inputs["x"], weight)
    want = reference.rms_norm_group_quant(inputs["x"].cpu(), weight.cpu(), 1e-6, spec)
    assert compare(spec, (q, scales, None), want, K).passed
    per_group, group = reference.scales_fp32(scales.cpu(), spec, K), 1000 // spec.group
    assert torch.isnan(per_group[:, group]).all() and torch.isfinite(per_group[:, :group]).all() and torch.isfinite(per_group[:, group + 1 :]).all()
    assert torch.isnan(q.cpu().float()[:, group * spec.group : (group + 1) * spec.group]).all()


# -- property tests (CPU, llvm build) -----------------------------------------------------------

_LAYOUT_FORMATS = [("row", "fp32"), ("col", "fp32"), ("col", "ue8m0"), ("col", "ue8m0_packed")]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(["bf16", "fp16", "fp32"]),
    group=st.sampled_from([64, 128]),
    residual=st.booleans(),
    layout_format=st.sampled_from(_LAYOUT_FORMATS),
    rows=st.integers(0, 40),
    words=st.integers(1, 6),
    magnitude=st.sampled_from([1e-3, 1.0, 50.0]),
    outliers=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_specs_shapes_and_values_match_the_reference(dtype, group, residual, layout_format, rows, words, magnitude, outliers, seed):
    require_toolchain(nvcc=False)  # the CPU kernels are TVM's llvm build
    layout, fmt = layout_format
    hidden = words * 4 * group  # whole packed words, so every format's dynamic-K kernel applies
    spec = VariantSpec(dtype, None, group, residual, layout, fmt)
    inputs = random_inputs(spec, rows, hidden, seed=seed, outliers=outliers)
    x = (inputs["x"].float() * magnitude).to(inputs["x"].dtype)
    r = inputs["residual"]
    want = reference.rms_norm_group_quant(x, inputs["weight"], 1e-6, spec, r)
    got_r = None if r is None else r.clone()
    if residual:
        q, scales = ops.fused_add_rms_norm_group_quant(x, got_r, inputs["weight"], 1e-6, spec.name)
    else:
        q, scales = ops.rms_norm_group_quant(x, inputs["weight"], 1e-6, spec.name)
    agreement = compare(spec, (q, scales, got_r), want, hidden)
    assert agreement.passed, agreement.describe()


# -- big tensors --------------------------------------------------------------------------------


@pytest.mark.gpu
def test_more_than_2_to_the_31_elements_are_indexed_correctly(gpu_bundle):
    """M * K >= 2^31 (M = 300000, K = 7168): rows past the int32 boundary are right."""
    ops.use_bundle(gpu_bundle)
    spec = VariantSpec("bf16", 7168, 128, True, "col", "fp32")
    rows = 300_000
    assert rows * 7168 >= 2**31
    inputs = random_inputs(spec, rows, 7168, seed=11, device="cuda", outliers=False)
    x, w, r = inputs["x"], inputs["weight"], inputs["residual"]
    boundary = 2**31 // 7168  # the first row whose offset passes int32
    checked = list(range(0, 4)) + list(range(boundary - 2, boundary + 3)) + list(range(rows - 4, rows))
    x_rows, r_rows = x[checked].cpu(), r[checked].cpu()
    q, scales = ops.fused_add_rms_norm_group_quant(x, r, w, 1e-6, spec.name)
    want = reference.rms_norm_group_quant(x_rows, w.cpu(), 1e-6, spec, r_rows)
    got = (q[checked].cpu(), scales[checked].cpu().contiguous(), r[checked].cpu())
    agreement = compare(VariantSpec("bf16", 7168, 128, True, "row", "fp32"), got, (want[0], want[1].contiguous(), want[2]), 7168)
    assert agreement.passed, agreement.describe()


# -- hardening: each case below once misbehaved (silently or with a traceback) --------------------


def test_a_tensor_on_another_device_than_x_is_refused_even_on_meta():
    """A meta tensor beside a CPU x dispatches to the fake kernel; it must refuse, not return
    outputs that nothing wrote (a weight that failed to load after meta-device init)."""
    inputs = _inputs(RESIDUAL, 4, "cpu")
    x, w, r = inputs["x"], inputs["weight"], inputs["residual"]
    meta = dict(device="meta")
    cases = [
        ("weight", lambda: ops.rms_norm_group_quant(x, torch.empty_like(w, **meta), 1e-6, PLAIN.name)),
        ("residual", lambda: ops.fused_add_rms_norm_group_quant(x, torch.empty_like(r, **meta), w, 1e-6, RESIDUAL.name)),
        ("residual", lambda: ops.add_rms_norm_group_quant(x, torch.empty_like(r, **meta), w, 1e-6, RESIDUAL.name)),
        ("weight", lambda: tvm_rmsquant.rms_norm_group_quant(x, torch.empty_like(w, **meta), scale_layout="col")),
        ("scale_ub", lambda: tvm_rmsquant.rms_norm_group_quant(x, w, scale_ub=torch.ones(1, **meta))),
        ("scale", lambda: ops.rms_norm_per_block_quant(torch.empty(4, K, dtype=torch.float8_e4m3fn), x, w,
                                                        reference.empty_scales(PLAIN, 4, K, "meta"), 1e-6, None, None, 128, True)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=rf"{name} is on meta but x is on cpu"):
            call()


def test_every_path_checks_eps_in_fp32_and_the_reference_route_checks_like_the_kernels():
    inputs = _inputs(PLAIN, 3, "cpu")
    x, w = inputs["x"], inputs["weight"]
    # An fp16 weight with bf16 activations: no kernel takes the pair, so the torch reference.
    layer = select(K, torch.bfloat16, scale_layout="col", device="cpu", weight_dtype=torch.float16)
    assert layer.variant is None
    for eps in (1e39, 1e-50, -1.0, math.nan):
        for call in (lambda: tvm_rmsquant.rms_norm_group_quant(x, w, eps=eps), lambda: layer(x, w.half(), eps)):
            with pytest.raises(ValueError, match=r"must be positive and finite in fp32"):
                call()
    with pytest.raises(TypeError, match=r"eps='1e-6' must be a float"):
        tvm_rmsquant.rms_norm_group_quant(x, w, eps="1e-6")
    with pytest.raises(TypeError, match=r"x.dtype=torch.int32"):
        layer(x.to(torch.int32), w.half(), 1e-6)
    with pytest.raises(TypeError, match=r"weight.dtype=torch.bfloat16; this layer was selected for a torch.float16"):
        layer(x, w, 1e-6)
    with pytest.raises(ValueError, match=r"weight must be \[4096\]"):
        layer(x, w.half()[:128], 1e-6)
    q, scales = layer(x, w.half(), 1e-6)  # and the valid call still runs
    assert torch.isfinite(scales).all() and q.shape == x.shape


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_outputs_carry_no_gradient_and_a_residual_that_requires_grad_is_refused(device):
    """The ops are inference-only: outputs are non-differentiable, and a residual that requires
    grad is not updated in place behind autograd's back (outside no_grad/inference_mode)."""
    inputs = _inputs(RESIDUAL, 4, device)
    x = inputs["x"].clone().requires_grad_()
    q, scales = ops.rms_norm_group_quant(x, inputs["weight"], 1e-6, PLAIN.name)
    assert not scales.requires_grad and not q.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        scales.sum().backward()
    residual = inputs["residual"].clone().requires_grad_()
    before = residual.detach().clone()
    layer = select(K, torch.bfloat16, residual=True, scale_layout="col", scale_format="ue8m0", device=device)
    for call in (lambda: ops.fused_add_rms_norm_group_quant(inputs["x"], residual, inputs["weight"], 1e-6, RESIDUAL.name),
                 lambda: layer(inputs["x"], inputs["weight"], 1e-6, residual=residual),
                 lambda: tvm_rmsquant.rms_norm_group_quant(inputs["x"], inputs["weight"], residual=residual, scale_layout="col", scale_format="ue8m0")):
        with pytest.raises(ValueError, match="residual requires grad, and tvm_rmsquant's ops are inference-only"):
            call()
    assert torch.equal(residual.detach(), before)
    with torch.no_grad():
        ops.fused_add_rms_norm_group_quant(inputs["x"], residual, inputs["weight"], 1e-6, RESIDUAL.name)
    assert not torch.equal(residual.detach(), before)


def test_unclear_errors_name_the_argument():
    inputs = _inputs(RESIDUAL, 4, "cpu")
    x, w, r = inputs["x"], inputs["weight"], inputs["residual"]
    with pytest.raises(ValueError, match="x is 0-D"):
        tvm_rmsquant.rms_norm_group_quant(torch.tensor(1.0, dtype=torch.bfloat16), w)
    layer = select(K, torch.bfloat16, residual=True, device="cpu")
    transposed = torch.randn(2, 2, K, dtype=torch.bfloat16).transpose(0, 1)  # cannot be viewed as [4, K] rows
    with pytest.raises(ValueError, match=r"residual of shape \(2, 2, 4096\) and strides .* cannot be viewed as \(4, 4096\) rows"):
        layer(x.view(2, 2, K), w, 1e-6, residual=transposed)
    with pytest.raises(ValueError, match=r"residual has shape \(4, 4096\) and strides \(0, 1\): its rows overlap"):
        layer(x, w, 1e-6, residual=r[:1].expand(4, K))
    empty_col = torch.empty(K // 128, 0).t()  # M = 0 scales as .t() makes them: strides (1, 1)
    ops.rms_norm_per_block_quant(torch.empty(0, K, dtype=torch.float8_e4m3fn), x[:0], w, empty_col, 1e-6, None, None, 128, True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_select_on_a_torch_without_cuda_falls_back_even_with_a_bundle(monkeypatch, caplog):
    from tvm_rmsquant import dispatch

    opened = []
    monkeypatch.setattr(dispatch, "open_bundle", lambda bundle=None: opened.append(bundle))  # "a bundle exists"
    with caplog.at_level(logging.WARNING, logger="tvm_rmsquant"):
        layer = select(K, torch.bfloat16)  # device="cuda" by default
    assert layer.variant is None and not opened
    assert "has no CUDA device" in layer.why[0].reason and "torch reference" in caplog.text


def test_the_cpu_path_runs_large_inputs_in_row_blocks(monkeypatch):
    """M·K >= 2**31 with a residual was killed for memory on CPU: each launch materializes
    fp32 [M, K] stages. The CPU kernels run blocks of rows; every layout's scales land right."""
    from tvm_rmsquant import cpu

    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 3 * 512)
    for spec in (VariantSpec("bf16", 512, 128, True, "col", "ue8m0_packed"), VariantSpec("fp16", 512, 128, False, "col", "fp32"),
                 VariantSpec("bf16", 512, 128, True, "row", "fp32")):
        inputs = random_inputs(spec, 11, 512, seed=3)
        launches = []
        inner = ops._reference_function(spec)

        def counted(*args):
            launches.append(args[0].shape[0])
            inner(*args)

        residual = None if inputs["residual"] is None else inputs["residual"].clone()
        q = torch.empty(11, 512, dtype=torch.float8_e4m3fn)
        scales = reference.empty_scales(spec, 11, 512, "cpu")
        launch_args = [inputs["x"]] + ([residual] if spec.residual else []) + [inputs["weight"], 1e-6, q, scales] + ([residual] if spec.residual else [])
        cpu.by_row_chunks(spec, counted)(*launch_args)
        assert launches == [3, 3, 3, 2]
        want = reference.rms_norm_group_quant(inputs["x"], inputs["weight"], 1e-6, spec, inputs["residual"])
        agreement = compare(spec, (q, scales, residual), want, 512)
        assert agreement.passed and agreement.codes_identical == 1.0 and agreement.scales_exact == 1.0, agreement.describe()
        # Through the op too (its CPU kernel is wrapped the same way).
        got = _run(spec, inputs["x"], inputs["weight"], residual=None if inputs["residual"] is None else inputs["residual"].clone())
        assert compare(spec, (*got, None) if not spec.residual else (*got, want[2]), want, 512).passed


def test_fp16_values_near_its_max_do_not_overflow_and_quantize_as_any_row():
    """fp16's max squared (4.3e9) times K stays far below fp32's max: unlike bf16 (the edge
    case above), such a row normalizes as any other row does."""
    spec = VariantSpec("fp16", K, 128, layout="col")
    inputs = _inputs(spec, 2, "cpu")
    x = inputs["x"].clone()
    x[0] = torch.finfo(torch.float16).max * 0.99
    q, scales = _run(spec, x, inputs["weight"])
    per_group = reference.scales_fp32(scales, spec, K)
    assert torch.isfinite(per_group[0]).all() and (per_group[0] > MIN_SCALE).all()
    assert q[0].float().abs().amax() == FP8_MAX


@pytest.mark.parametrize("argv, message", [
    (["self-check", "--hidden", "100"], r"--hidden: hidden=100 is not divisible"),
    (["bench"], r"sees no CUDA device"),
    (["bench", "--formats", "col"], r"--formats=col: 'col' is not layout:format or layout:format:wf32"),
    (["bench", "--formats", "col:fp32:fp16"], r"--formats=col:fp32:fp16: 'col:fp32:fp16' is not layout:format or layout:format:wf32"),
    (["bench", "--formats", "row:fp32,diagonal:fp32"], r"--formats=row:fp32,diagonal:fp32 --group=128: layout='diagonal'"),
    (["bench", "--formats", "tiled:mxfp8"], r"--formats=tiled:mxfp8 --group=128: .*format='mxfp8' scales groups of 32 elements, not 128"),
    (["bench", "--group", "100", "--formats", "col:fp32"], r"--group=100: group=100 must be a positive multiple of 8"),
    (["bench", "--dtype", "fp32", "--formats", "col:fp32:wf32"], r"weight_dtype='fp32' is for a bf16 or fp16 norm"),
])
def test_cli_misuse_exits_2_with_one_line(argv, message):
    import re
    import subprocess
    import sys

    if argv == ["bench"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = subprocess.run([sys.executable, "-m", "tvm_rmsquant", *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and re.search(message, result.stderr), result.stderr
