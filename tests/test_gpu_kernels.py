"""GPU check of the bundle: every default-preset variant against the torch reference.

Same bar as the CPU check (tvm_rmsquant.checks), on random data with outliers, at
M in {1, 7, 64, 200, 1000, 4096} (every M bucket's kernel: schedules.database.ROW_BUCKETS);
outputs are poisoned first so an unwritten element fails.
Each scale tensor's layout is checked too: strides, TMA alignment, powers of two, and
the byte order of packed words.
"""

from __future__ import annotations

import mx_tiles
import pytest
import torch

from tvm_rmsquant import launch, reference
from tvm_rmsquant.checks import compare, random_inputs
from tvm_rmsquant.presets import preset
from tvm_rmsquant.scale_layout import TMA_ALIGN_ROWS, round_up
from tvm_rmsquant.schedules.database import ROW_BUCKETS, bucket_of
from tvm_rmsquant.spec import VariantSpec

pytestmark = pytest.mark.gpu

ROWS = (1, 7, 64, 200, 1000, 4096)
DYNAMIC_HIDDEN = (2048, 5120)


def test_the_rows_reach_every_m_bucket_kernel():
    assert {bucket_of(rows) for rows in ROWS} == {max_rows for max_rows, _ in ROW_BUCKETS}


def _cases():
    for spec in preset("default"):
        for hidden in ([spec.hidden] if spec.hidden else DYNAMIC_HIDDEN):
            yield pytest.param(spec, hidden, id=f"{spec.name}-k{hidden}")


def run_bundle_kernel(bundle, spec, inputs, eps=1e-6):
    x = inputs["x"]
    rows, hidden = x.shape
    q = torch.full((rows, hidden), float("nan"), dtype=torch.float32, device="cuda").to(torch.float8_e4m3fn)
    scales = reference.empty_scales(spec, rows, hidden, "cuda")
    if spec.scale.tiled:  # 0xFF (NaN) where the kernel must write, the zero padding kept
        poison = torch.full((rows, hidden // spec.group), float("nan"), device="cuda")
        scales.copy_(reference.laid_out(poison, spec, hidden))
    else:
        scales.view(torch.int32).fill_(-1) if scales.dtype == torch.int32 else scales.fill_(float("nan"))
    residual_out = torch.full_like(x, float("nan")) if spec.residual else None
    launch.run(bundle.function(spec.name), spec, x, inputs["weight"], eps, q, scales, inputs["residual"], residual_out, inputs["scale_ub"])
    torch.cuda.synchronize()
    return q, scales, residual_out


def check_layout(spec: VariantSpec, scales: torch.Tensor, rows: int, hidden: int):
    groups = hidden // spec.group
    cols = (groups + 3) // 4 if spec.format == "ue8m0_packed" else groups
    if spec.layout == "tiled":
        padded_cols = round_up(groups, 4)
        assert tuple(scales.shape) == (round_up(rows, 128), padded_cols) and scales.is_contiguous()
        assert scales.dtype == torch.float8_e8m0fnu
        matrix = torch.tensor([[mx_tiles.offset(row, col, padded_cols) for col in range(groups)] for row in range(rows)])
        flat = scales.view(torch.uint8).flatten().cpu()
        exponents = (reference.scales_fp32(scales, spec, hidden, rows).cpu().view(torch.int32) >> 23) & 0xFF
        assert torch.equal(flat[matrix].to(torch.int32), exponents), "scale (r, c) must sit where cuBLAS reads it"
        assert torch.equal(flat, mx_tiles.swizzle(flat[matrix])), "the padding must stay zero"
        return
    shape, strides, _, _ = spec.scale.geometry(rows, groups)  # the layout record's own allocation
    assert tuple(scales.shape) == shape == (rows, cols) and scales.stride() == strides
    if spec.scale.column_major and spec.scale.row_align == TMA_ALIGN_ROWS:
        assert scales.stride(1) * scales.element_size() % 16 == 0, "col scales must be TMA (16-byte) aligned"
    values = reference.scales_fp32(scales, spec, hidden)
    if spec.pow2_scales:
        mantissa = values.view(torch.int32) & 0x7FFFFF
        assert int(mantissa.abs().sum()) == 0, "UE8M0 scales must be powers of two"
    if spec.format == "ue8m0_packed":
        words = scales.cpu().to(torch.int64) & 0xFFFFFFFF
        first_byte = (words[:, 0] & 0xFF).to(torch.int32)
        assert torch.equal(first_byte, (values[:, 0].cpu().view(torch.int32) >> 23) & 0xFF), "group 0 must be byte 0 (little-endian)"
        if groups % 4:
            padding = words[:, -1] >> (8 * (groups % 4))
            assert int(padding.sum()) == 0, "padding bytes must be 0"


@pytest.mark.parametrize("spec,hidden", list(_cases()))
def test_variant_matches_reference(gpu_bundle, spec, hidden, record_property):
    summaries = []
    for seed, rows in enumerate(ROWS):
        inputs = random_inputs(spec, rows, hidden, seed=seed, device="cuda")
        got = run_bundle_kernel(gpu_bundle, spec, inputs)
        cpu_inputs = {key: (value.cpu() if value is not None else None) for key, value in inputs.items()}
        want = reference.rms_norm_group_quant(cpu_inputs["x"], cpu_inputs["weight"], 1e-6, spec, cpu_inputs["residual"], cpu_inputs["scale_ub"])
        check_layout(spec, got[1], rows, hidden)
        agreement = compare(spec, got, want, hidden)
        summaries.append(f"M={rows}: {agreement.describe()}")
        assert agreement.passed, f"{spec.name} K={hidden} M={rows}: {agreement.describe()}"
    record_property("agreement", "; ".join(summaries))
    print(f"{spec.name} K={hidden}: " + "; ".join(summaries))
