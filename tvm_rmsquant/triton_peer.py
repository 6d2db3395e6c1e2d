"""A hand-written fused Triton kernel: the peer a user would write instead of this project.

One program per row; the row is loaded once as a [groups, G] tile, so it is as fused as
ours (one read of x, r and w). It is written here independently, for the benchmark only,
with IEEE sqrt and division so that it meets the same numerics contract.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .reference import TORCH_DTYPES
from .scale_layout import FP8_MAX, MIN_SCALE
from .spec import VariantSpec

_TL_DTYPES = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _fused_kernel(
    x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, r_out_ptr,
    hidden, s_stride_row, s_stride_group, eps,
    DTYPE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, POW2: tl.constexpr,
    G: tl.constexpr, GROUPS: tl.constexpr, GROUPS_PADDED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.arange(0, GROUPS_PADDED)
    cols = group[:, None] * G + tl.arange(0, G)[None, :]
    mask = group[:, None] < GROUPS
    offsets = row * hidden + cols
    h = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(r_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_out_ptr + offsets, h.to(DTYPE), mask=mask)
    sumsq = tl.sum(tl.sum(h * h, axis=1), axis=0)
    rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sumsq, hidden.to(tl.float32)) + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = ((h * rms).to(DTYPE).to(tl.float32) * w).to(DTYPE).to(tl.float32)
    absmax = tl.max(tl.abs(y), axis=1)
    scale = tl.maximum(tl.div_rn(absmax, _FP8_MAX), _MIN_SCALE)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
    q = tl.clamp(tl.div_rn(y, scale[:, None]), -_FP8_MAX, _FP8_MAX)
    tl.store(q_ptr + offsets, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * s_stride_row + group * s_stride_group, scale, mask=group < GROUPS)


def rms_norm_group_quant_triton(spec: VariantSpec, x, weight, eps, q, scales, residual=None, residual_out=None) -> None:
    rows, hidden = x.shape
    groups = hidden // spec.group
    assert x.dtype == TORCH_DTYPES[spec.dtype] and not spec.scale.packed
    padded = triton.next_power_of_2(groups)
    _fused_kernel[(rows,)](
        x, residual if residual is not None else x, weight, q, scales, residual_out if residual_out is not None else x,
        hidden, scales.stride(0), scales.stride(1), eps,
        DTYPE=_TL_DTYPES[spec.dtype], HAS_RESIDUAL=residual is not None, POW2=spec.pow2_scales,
        G=spec.group, GROUPS=groups, GROUPS_PADDED=padded,
        num_warps=max(1, min(16, padded * spec.group // 512)),
    )
