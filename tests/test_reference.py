"""The torch reference is the numerics contract; these pin its definition down."""

import math

import pytest
import torch

from tvm_rmsquant import reference
from tvm_rmsquant.scale_layout import FP8_MAX, MIN_SCALE
from tvm_rmsquant.spec import VariantSpec


def test_pow2_rounding_is_exponent_plus_one_if_mantissa_nonzero():
    values = torch.tensor([1.0, 1.5, 0.75, 2.0**-20, 3.0 * 2.0**-10, 448.0, 1.0000001])
    rounded = reference.round_up_pow2(values)
    expected = [2.0 ** math.ceil(math.log2(v)) for v in values.tolist()]
    assert rounded.tolist() == expected
    assert torch.isnan(reference.round_up_pow2(torch.tensor([float("nan")]))).all()


def test_packing_is_little_endian_with_zero_padding():
    scales = torch.tensor([[2.0**-1, 2.0**0, 2.0**1, 2.0**2, 2.0**3]])
    packed = reference.pack_ue8m0(scales)
    assert packed.shape == (1, 2) and packed.dtype == torch.int32
    words = packed.to(torch.int64) & 0xFFFFFFFF
    assert int(words[0, 0]) == 126 | 127 << 8 | 128 << 16 | 129 << 24
    assert int(words[0, 1]) == 130, "groups past the last are zero bytes"
    assert torch.equal(reference.unpack_ue8m0(packed, 5), scales)


def test_col_scales_are_column_major_and_tma_padded():
    spec = VariantSpec("bf16", 1024, 128, layout="col")
    x = torch.randn(5, 1024).bfloat16()
    _, scales, _ = reference.rms_norm_group_quant(x, torch.ones(1024).bfloat16(), 1e-6, spec)
    assert scales.shape == (5, 8) and scales.stride() == (1, 8)


def test_zero_rows_give_the_minimum_scale_and_zero_codes():
    spec = VariantSpec("bf16", 256, 128)
    q, scales, _ = reference.rms_norm_group_quant(torch.zeros(2, 256).bfloat16(), torch.ones(256).bfloat16(), 1e-6, spec)
    assert torch.all(scales == torch.tensor(MIN_SCALE, dtype=torch.float32))
    assert torch.all(q.float() == 0)


def test_nan_propagates_to_its_group_only():
    spec = VariantSpec("fp32", 256, 128)
    x = torch.randn(1, 256)
    x[0, 200] = float("nan")
    q, scales, _ = reference.rms_norm_group_quant(x, torch.ones(256), 1e-6, spec)
    # rms of the row is NaN, so the whole row is NaN: the garbage is loud, never a finite scale.
    assert torch.isnan(scales).all() and torch.isnan(q.float()).all()


def test_scale_ub_caps_the_absmax():
    spec = VariantSpec("fp32", 128, 128, scale_ub=True)
    x = torch.randn(3, 128) * 10
    _, scales, _ = reference.rms_norm_group_quant(x, torch.ones(128), 1e-6, spec, scale_ub=torch.tensor([0.5]))
    assert torch.all(scales <= 0.5 / FP8_MAX)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_dequantized_output_is_close_to_the_normalized_input(dtype):
    spec = VariantSpec(dtype, 512, 128, residual=True)
    torch_dtype = reference.TORCH_DTYPES[dtype]
    x, r = torch.randn(64, 512).to(torch_dtype), torch.randn(64, 512).to(torch_dtype)
    w = torch.rand(512).to(torch_dtype) + 0.5
    q, scales, residual_out = reference.rms_norm_group_quant(x, w, 1e-6, spec, residual=r)
    h = x.float() + r.float()
    assert torch.equal(residual_out, h.to(torch_dtype))
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    error = (reference.dequantize(q, scales, spec) - normed).norm() / normed.norm()
    assert error < 0.05, "fp8 e4m3 keeps about 3 significant bits"


def test_a_ue8m0_group_one_power_of_two_off_is_judged_by_dequantized_values():
    from tvm_rmsquant.checks import compare

    spec = VariantSpec("bf16", 256, 128, layout="col", format="ue8m0")
    x, w = torch.randn(4, 256).bfloat16(), torch.ones(256).bfloat16()
    want = reference.rms_norm_group_quant(x, w, 1e-6, spec)
    q, scales = want[0].clone(), want[1].clone()
    scales[0, 0] *= 2
    q[0, :128] = (want[0][0, :128].float() / 2).to(torch.float8_e4m3fn)
    assert compare(spec, (q, scales, None), want, 256).passed
    q[0, 5] = torch.tensor(100.0).to(torch.float8_e4m3fn)
    assert not compare(spec, (q, scales, None), want, 256).passed


def test_a_ue8m0_scale_that_is_not_a_power_of_two_fails_the_check():
    """The README's "bit-exact" UE8M0 rounding is enforced on the kernels' scales: a scale
    within one power of two of the reference but with mantissa bits fails."""
    from tvm_rmsquant.checks import compare

    spec = VariantSpec("bf16", 256, 128, layout="col", format="ue8m0")
    x, w = torch.randn(4, 256).bfloat16(), torch.ones(256).bfloat16()
    want = reference.rms_norm_group_quant(x, w, 1e-6, spec)
    scales = want[1].clone()
    scales[1, 1] *= 1.25
    agreement = compare(spec, (want[0], scales, None), want, 256)
    assert agreement.scales_max_units < 1 and agreement.scales_not_pow2 == 1 and not agreement.passed
    assert "NOT powers of two" in agreement.describe()
