"""GPU: our scales feed real block-FP8 GEMMs as they come out of the op, with no transpose or copy.

Col fp32 scales go to ``torch.nn.functional.scaled_mm`` (cuBLAS, BlockWise1x128 for the
activations, BlockWise128x128 for the weight); row fp32 scales go to a Triton block-FP8
GEMM written here. Each result is compared with a bf16 matmul of the normalized
activations; the quantization error must match the torch reference path's within 1%.

torch 2.11's scaled_mm takes 1x128 scales with strides exactly (1, M), and cuBLAS refuses
M % 4 != 0 even then (measured on the H200 at M = 1, 3, 7, 255 and on the H100 at M = 1, 5:
CUBLAS_STATUS_NOT_SUPPORTED). So our scales feed it as they are at M % 4 == 0, and at odd M
the transformers integration's GEMM op (``torch.ops.tvm_rmsquant.block_fp8_mm``) pads the rows.
"""

from __future__ import annotations

import pytest
import torch

from tvm_rmsquant import reference, select

pytestmark = pytest.mark.gpu
K, N, EPS = 4096, 2048, 1e-6
BLOCK = 128
#: Kernel names that would mean the scales (or anything else) were copied or transposed.
COPY_KERNELS = ("copy", "transpose", "elementwise", "contiguous")


def _weight_128x128(n: int, k: int, seed: int):
    """A bf16 weight and its fp8 [N, K] codes with one fp32 scale per 128 x 128 block [N/128, K/128]."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn(n, k, device="cuda", generator=generator) / k**0.5).bfloat16()
    blocks = weight.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scales = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    codes = (blocks / scales[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, k)
    return weight, codes, scales


def _activations(rows: int, seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, K, device="cuda", generator=generator) * 3).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(K, device="cuda", generator=generator)).bfloat16()
    return x, norm_weight


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _kernels_launched_by(call) -> list:
    """Names of the CUDA kernels one call launches, from the profiler."""
    call()  # warm up (autotuning, cuBLAS handles) outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        call()
        torch.cuda.synchronize()
    return [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def _assert_error_matches_reference_path(gemm, kernel, rows: int, seed: int):
    """Run ``gemm(q, scales)`` on our op's output and on the torch reference's; return our (q, scales)."""
    x, norm_weight = _activations(rows, seed)
    q, scales = kernel(x, norm_weight, EPS)
    want_q, want_scales, _ = reference.rms_norm_group_quant(x, norm_weight, EPS, kernel.spec)
    y, _ = reference.rms_norm(x, norm_weight, EPS)
    exact = y @ gemm.weight.t()
    ours = _relative_error(gemm(q, scales), exact)
    theirs = _relative_error(gemm(want_q, want_scales), exact)
    assert 0 < theirs < 0.1, f"the reference path's FP8 error {theirs:.4f} is not an FP8-sized error"
    assert abs(ours - theirs) <= 0.01 * theirs, f"relative error {ours:.5f}, reference path {theirs:.5f}"
    return q, scales


class ScaledMM:
    """cuBLAS blockwise FP8 through torch: activations 1x128, weight 128x128 (both col-major scales)."""

    def __init__(self, seed: int):
        self.weight, codes, scales = _weight_128x128(N, K, seed)
        self.codes_t = codes.t()  # [K, N], column-major, as cuBLAS takes B
        self.scales_t = scales.t()  # [K/128, N/128] with strides (1, K/128)

    def __call__(self, q, scales):
        from torch.nn.functional import ScalingType, scaled_mm

        return scaled_mm(q, self.codes_t, scales, ScalingType.BlockWise1x128, self.scales_t, ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


class TritonBlockGEMM:
    """The row-layout consumer: a Triton block-FP8 GEMM reading row-major scales through their strides."""

    def __init__(self, seed: int):
        self.weight, self.codes, self.scales = _weight_128x128(N, K, seed)

    def __call__(self, q, scales):
        from triton_block_gemm import block_fp8_gemm

        return block_fp8_gemm(q, scales, self.codes, self.scales)


@pytest.mark.parametrize("rows", [4, 256, 1024])
def test_col_scales_feed_scaled_mm_blockwise_as_they_are(gpu_bundle, rows):
    kernel = select(K, torch.bfloat16, consumer="cublas_blockwise", device="cuda", bundle=gpu_bundle.root)
    assert (kernel.spec.layout, kernel.spec.format) == ("col_dense", "fp32")
    gemm = ScaledMM(seed=1)
    q, scales = _assert_error_matches_reference_path(gemm, kernel, rows, seed=2)
    # What cuBLAS takes for BlockWise1x128: [M, K/128] with strides (1, M); ours already is.
    assert scales.shape == (rows, K // BLOCK) and scales.stride() == (1, rows)
    pointer = scales.data_ptr()
    names = _kernels_launched_by(lambda: gemm(q, scales))
    assert scales.data_ptr() == pointer and names, names
    assert not [name for name in names if any(word in name.lower() for word in COPY_KERNELS)], names


@pytest.mark.parametrize("rows", [1, 5])
def test_odd_m_runs_through_the_padding_gemm_op(gpu_bundle, rows):
    """cuBLAS refuses M % 4 != 0 (the fact ``GEMM_ROW_ALIGN`` records); the integration's op
    pads to a multiple of 4 rows and returns M, with the reference path's error."""
    from tvm_rmsquant.integrations.transformers import block_fp8_mm

    kernel = select(K, torch.bfloat16, consumer="cublas_blockwise", device="cuda", bundle=gpu_bundle.root)
    gemm = ScaledMM(seed=1)
    x, norm_weight = _activations(rows, seed=2)
    q, scales = kernel(x, norm_weight, EPS)
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_NOT_SUPPORTED"):
        gemm(q, scales)

    def padded(q, scales):
        out = block_fp8_mm(q, scales, gemm.codes_t.t(), gemm.scales_t, torch.bfloat16)
        assert out.shape == (q.shape[0], N)
        return out

    padded.weight = gemm.weight
    _assert_error_matches_reference_path(padded, kernel, rows, seed=2)
    # The op's fake (shapes, strides, dtype) against the real one. opcheck's schema test cannot
    # run on fp8 inputs (it compares them with allclose: "mul_cuda" not implemented for fp8).
    torch.library.opcheck(block_fp8_mm, (q, scales, gemm.codes_t.t(), gemm.scales_t, torch.bfloat16),
                          test_utils=("test_faketensor",))


@pytest.mark.parametrize("rows", [7, 256])
def test_row_scales_feed_a_triton_block_fp8_gemm_as_they_are(gpu_bundle, rows):
    kernel = select(K, torch.bfloat16, consumer="triton", device="cuda", bundle=gpu_bundle.root)
    assert (kernel.spec.layout, kernel.spec.format) == ("row", "fp32")
    gemm = TritonBlockGEMM(seed=3)
    q, scales = _assert_error_matches_reference_path(gemm, kernel, rows, seed=4)
    assert scales.is_contiguous() and scales.shape == (rows, K // BLOCK)
    names = _kernels_launched_by(lambda: gemm(q, scales))
    assert names == ["_block_fp8_gemm"], names
