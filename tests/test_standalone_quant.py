"""The standalone quant (``norm=False``, ``_nonorm`` variants): the fused ops' contract, without the norm.

Linear layers that follow no norm (attention output, MLP down projection) quantize x
itself, like vLLM's ``per_token_group_fp8_quant``. It is a dimension of the same spec and
tensor expression, so it is held to the same contract as the fused ops: the reference
bar, fake shapes and strides, opcheck, refusals that name the argument, zero rows,
strided and N-D input, edge cases, no gradient, torch.compile without graph breaks. The
kernels themselves are checked against the reference in ``test_expr_cpu.py`` (every record,
dtype, group, static and dynamic K, scale_ub). Each case runs on CPU (the op's llvm build)
and, marked ``gpu``, on the bundle's CUDA kernels through the C++ ops.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICES

import tvm_rmsquant
from tvm_rmsquant import ops, reference
from tvm_rmsquant.checks import compare, random_inputs
from tvm_rmsquant.dispatch import select
from tvm_rmsquant.spec import VariantSpec

K = 4096
#: Dynamic-K variants: the default bundle holds the standalone quant at dynamic K only.
VARIANTS = [
    "bf16_kdyn_g128_nonorm_col_dense_fp32",
    "bf16_kdyn_g128_nonorm_col_fp32",
    "bf16_kdyn_g128_nonorm_row_fp32",
    "bf16_kdyn_g128_nonorm_col_ue8m0",
    "fp16_kdyn_g128_nonorm_col_ue8m0_packed",
    "bf16_kdyn_g32_nonorm_tiled_mxfp8",
]


def _want(spec, x, scale_ub=None):
    return reference.rms_norm_group_quant(x.cpu(), None, None, spec.with_hidden(x.shape[-1]), scale_ub=None if scale_ub is None else scale_ub.cpu())


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_the_op_matches_the_reference_and_the_fake_matches_the_op(device, variant, rows):
    spec = VariantSpec.parse(variant)
    x = random_inputs(spec, rows, K, seed=rows, device=device)["x"]
    q, scales = ops.group_quant(x, variant)
    want = _want(spec, x)
    agreement = compare(spec.with_hidden(K), (q, scales, None), want, K)
    assert agreement.passed, agreement.describe()
    assert scales.shape == want[1].shape and scales.stride() == want[1].stride() and scales.dtype == want[1].dtype
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake_q, fake_scales = ops.group_quant(torch.empty(rows, K, dtype=x.dtype, device=device), variant)
    assert fake_q.shape == q.shape and fake_q.dtype == q.dtype
    assert fake_scales.shape == scales.shape and fake_scales.stride() == scales.stride() and fake_scales.dtype == scales.dtype


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_dense_column_major_scales_have_exactly_m_rows(device, rows):
    """What torch's BlockWise1x128 scaled_mm reads: strides (1, M), also when M % 4 != 0."""
    q, scales = ops.group_quant(torch.randn(rows, K, device=device).bfloat16(), "bf16_kdyn_g128_nonorm_col_dense_fp32")
    assert scales.shape == (rows, K // 128) and scales.stride() == (1, rows)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_a_scale_ub_caps_each_group(device):
    spec = VariantSpec("bf16", None, 128, False, "row", "fp32", scale_ub=True, norm=False)
    x = random_inputs(spec, 7, K, seed=3, device=device)["x"]
    cap = torch.tensor([1.5], device=device)
    q, scales = ops.group_quant(x, spec.name, cap)
    assert compare(spec.with_hidden(K), (q, scales, None), _want(spec, x, cap), K).passed
    assert float(scales.max()) <= 1.5 / 448 * (1 + 1e-6)


def test_opcheck():
    x = torch.randn(6, K).bfloat16()
    torch.library.opcheck(ops.group_quant, (x, "bf16_kdyn_g128_nonorm_col_dense_fp32"))
    torch.library.opcheck(ops.group_quant, (x, "bf16_kdyn_g128_nonorm_row_fp32_ub", torch.tensor([3.0])))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_bad_input_is_refused_naming_the_argument_and_the_value(device):
    x = torch.randn(8, K, device=device).bfloat16()
    weight = torch.ones(K, device=device).bfloat16()
    plain = "bf16_kdyn_g128_nonorm_col_fp32"
    dtype_error = TypeError if device == "cpu" else ValueError
    cases = [
        # Python names the variant to use instead; the C++ op says which op the variant needs.
        (ValueError, r"normalizes(; group_quant takes a standalone quant variant, such as 'bf16_kdyn_g128_nonorm_col_fp32'"
                     r"|: call rms_norm_group_quant \(group_quant takes a _nonorm variant\))",
         lambda: ops.group_quant(x, "bf16_kdyn_g128_col_fp32")),
        (ValueError, r"standalone quant", lambda: ops.rms_norm_group_quant(x, weight, 1e-6, plain)),
        (dtype_error, r"x.dtype.*float16", lambda: ops.group_quant(x.half(), plain)),
        (ValueError, r"x.shape\[-1\]=4000", lambda: ops.group_quant(x[:, :4000], plain)),
        (ValueError, r"x must be 2-D", lambda: ops.group_quant(x.view(2, 4, K), plain)),
        (ValueError, r"needs scale_ub", lambda: ops.group_quant(x, "bf16_kdyn_g128_nonorm_row_fp32_ub")),
        (ValueError, r"takes no scale_ub", lambda: ops.group_quant(x, plain, torch.tensor([1.0], device=device))),
        # No such spec: the Python path says why; the C++ op knows only the variants registered.
        (ValueError, r"residual=True needs norm=True" if device == "cpu"
         else r"'bf16_kdyn_g128_res_nonorm_col_fp32' has no CUDA kernel registered",
         lambda: ops.group_quant(x, "bf16_kdyn_g128_res_nonorm_col_fp32")),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
            pytest.fail(f"not refused: {message}")


def test_a_standalone_spec_takes_no_residual():
    with pytest.raises(ValueError, match=r"residual=True needs norm=True"):
        VariantSpec("bf16", K, residual=True, norm=False)
    with pytest.raises(TypeError, match=r"norm=1 must be a bool"):
        VariantSpec("bf16", K, norm=1)


def test_fused_specs_keep_their_names_and_digests():
    """norm=True is the default and leaves a fused spec's JSON, digest and name as they were:
    manifests and tuning records made before the standalone quant stay valid."""
    spec = VariantSpec("bf16", 7168, 128, True, "col", "ue8m0")
    assert "norm" not in spec.to_json() and spec.name == "bf16_k7168_g128_res_col_ue8m0"
    assert spec.digest() == "9fd48371f7baa51c"
    standalone = VariantSpec("bf16", 7168, 128, False, "col", "ue8m0", norm=False)
    assert standalone.name == "bf16_k7168_g128_nonorm_col_ue8m0" and VariantSpec.parse(standalone.name) == standalone
    assert VariantSpec.from_json(standalone.to_json()) == standalone and standalone.digest() != spec.digest()


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("variant", ["bf16_kdyn_g128_nonorm_col_dense_fp32", "fp16_kdyn_g128_nonorm_col_ue8m0_packed", "bf16_kdyn_g32_nonorm_tiled_mxfp8"])
def test_zero_rows_give_empty_outputs_with_the_real_shapes_and_strides(device, variant):
    spec = VariantSpec.parse(variant).with_hidden(K)
    q, scales = ops.group_quant(torch.empty(0, K, dtype=reference.TORCH_DTYPES[spec.dtype], device=device), variant)
    expected = reference.empty_scales(spec, 0, K, "meta")
    assert q.shape == (0, K) and q.device.type == device
    assert scales.shape == expected.shape and scales.stride() == expected.stride() and scales.dtype == expected.dtype


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_strided_rows_and_nd_input_through_the_api(device):
    wide = torch.randn(12, K + 256, device=device).bfloat16()
    x = wide[:, 128 : 128 + K]  # rows strided, last dim contiguous
    spec = VariantSpec("bf16", K, 128, False, "col", "fp32", norm=False)
    q, scales = tvm_rmsquant.group_quant(x, scale_layout="col")
    assert compare(spec, (q, scales, None), _want(spec, x), K).passed
    q3, scales3 = tvm_rmsquant.group_quant(x.reshape(3, 4, K), scale_layout="col")
    assert q3.shape == (3, 4, K) and torch.equal(q3.reshape(12, K).view(torch.uint8).cpu(), q.view(torch.uint8).cpu())
    assert torch.equal(scales3.cpu(), scales.cpu())


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("variant", ["bf16_kdyn_g128_nonorm_col_fp32", "bf16_kdyn_g128_nonorm_col_ue8m0"])
def test_edge_cases_poison_only_their_group(device, variant):
    """Without a norm no value reaches another group: a NaN or an inf makes its own group's
    scale NaN or inf (and its codes NaN where the ratio is), and every other group is finite."""
    spec = VariantSpec.parse(variant).with_hidden(K)
    x = random_inputs(spec, 6, K, seed=11, device=device)["x"].clone()
    x[0] = 0  # an all-zero row: the minimum scale, zero codes
    x[1, 5] = 3.0e4  # one huge outlier takes 448
    x[2] = torch.finfo(torch.bfloat16).tiny / 4  # subnormals
    x[3, 17] = math.nan
    x[4, 300] = math.inf
    q, scales = ops.group_quant(x, variant)
    agreement = compare(spec, (q, scales, None), _want(spec, x), K)
    assert agreement.passed, agreement.describe()
    per_group, codes = reference.scales_fp32(scales.cpu(), spec, K), q.cpu().float()
    assert torch.all(codes[0] == 0) and torch.isfinite(per_group[0]).all()
    assert codes[1].abs().max() == 448 if not spec.pow2_scales else 224 < codes[1].abs().max() <= 448
    assert torch.isnan(per_group[3, 0]) and torch.isfinite(per_group[3, 1:]).all() and torch.isnan(codes[3, :128]).all()
    assert not torch.isfinite(per_group[4, 2]) and torch.isfinite(per_group[4, :2]).all() and torch.isfinite(per_group[4, 3:]).all()
    assert torch.isnan(codes[4, 300]) and not torch.isnan(codes[4, 256:384][torch.arange(128) != 44]).any()


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_outputs_carry_no_gradient(device):
    x = torch.randn(4, K, device=device, requires_grad=True)
    q, scales = ops.group_quant(x.bfloat16(), "bf16_kdyn_g128_nonorm_col_fp32")
    assert not q.requires_grad and not scales.requires_grad


def test_select_builds_a_standalone_layer_that_compiles_without_graph_breaks():
    layer = select(K, torch.bfloat16, norm=False, consumer="cublas_blockwise", device="cpu")
    assert layer.spec == VariantSpec("bf16", K, 128, False, "col_dense", "fp32", norm=False)
    assert [c.reason for c in layer.why if c.taken]

    def model(x):
        q, scales = layer(x)
        return q.float().sum(dim=-1), scales

    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for rows in (1, 3, 17):
        x = torch.randn(rows, K).bfloat16()
        got, want = compiled(x), model(x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[1].stride() == (1, rows)


def test_select_refuses_a_residual_without_a_norm():
    with pytest.raises(ValueError, match=r"residual=True needs norm=True"):
        select(K, torch.bfloat16, residual=True, norm=False, device="cpu")
