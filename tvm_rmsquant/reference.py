"""The torch reference: the numerics contract, written once in plain torch.

It is the oracle for every test, the fallback where no kernel exists, and the model
that the tensor expression (``tvm_rmsquant.expr``) mirrors stage by stage.
"""

from __future__ import annotations

from typing import Optional

import torch

from .spec import VariantSpec, num_groups, scale_geometry

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: torch dtype -> the spec's dtype name.
DTYPE_NAMES = {torch_dtype: name for name, torch_dtype in TORCH_DTYPES.items()}


def empty_scales(spec: VariantSpec, rows: int, hidden: int, device) -> torch.Tensor:
    """Allocate the scale tensor in the variant's layout (col: TMA-padded column-major).

    One ``empty_strided``: the col storage ends at the last element rather than the last
    padded row. A TMA consumer that reads whole padded columns reads at most 3 elements
    past it, inside the caching allocator's 512-byte rounding, and only for rows >= M.
    """
    shape, strides, _, dtype = scale_geometry(spec, rows, hidden)
    return torch.empty_strided(shape, strides, dtype=torch.int32 if dtype == "int32" else torch.float32, device=device)


def round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales up to a power of two, bit-exactly; NaN stays NaN."""
    bits = scale.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    rounded = (exponent.clamp(max=255) << 23).view(torch.float32)
    return torch.where(torch.isnan(scale), scale, rounded)


def ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Biased exponent byte of each power-of-two scale (0xFF, UE8M0's NaN, for NaN)."""
    exponent = (scale.view(torch.int32) >> 23) & 0xFF
    return torch.where(torch.isnan(scale), torch.full_like(exponent, 0xFF), exponent)


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """[M, G] power-of-two scales -> int32 [M, ceil(G/4)], group 4j+b in byte b (little-endian)."""
    rows, groups = scale.shape
    padded = torch.zeros(rows, (groups + 3) // 4 * 4, dtype=torch.int64, device=scale.device)
    padded[:, :groups] = ue8m0_bytes(scale).to(torch.int64)
    words = padded.view(rows, padded.shape[1] // 4, 4)
    packed = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 [M, ceil(G/4)] -> fp32 [M, G] scales (0xFF decodes to NaN)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    exponents = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], dim=-1).flatten(1)[:, :groups]
    values = (exponents.to(torch.int32) << 23).view(torch.float32)
    return torch.where(exponents == 0xFF, torch.full_like(values, float("nan")), values)


def scales_fp32(scales: torch.Tensor, spec: VariantSpec, hidden: int) -> torch.Tensor:
    """The per-group fp32 scales, [M, K/G], whatever the variant's format."""
    if spec.scale.packed:
        return unpack_ue8m0(scales, num_groups(hidden, spec.group))
    return scales.float()


def dequantize(q: torch.Tensor, scales: torch.Tensor, spec: VariantSpec) -> torch.Tensor:
    """q * s broadcast per group, as fp32 [M, K]."""
    rows, hidden = q.shape
    per_group = scales_fp32(scales, spec, hidden)
    return (q.float().view(rows, -1, spec.group) * per_group.unsqueeze(-1)).view(rows, hidden)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """(y, residual_out): RMSNorm of x (after the fp32 residual add), rounded as the contract says.

    y has the input dtype; residual_out (None without residual) is h rounded to it, while
    the norm itself uses the unrounded fp32 h. A model written with this and
    ``group_quant`` is what ``tvm_rmsquant.fusion`` rewrites into the fused op.
    """
    dtype = x.dtype
    h = x.float() if residual is None else x.float() + residual.float()
    residual_out = None if residual is None else h.to(dtype)
    # 1 / sqrt rather than torch.rsqrt: both roundings are exact on CPU and CUDA alike,
    # where CUDA's rsqrt is approximate; the kernels compute it the same way.
    rms = 1.0 / torch.sqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = ((h * rms).to(dtype).float() * weight.float()).to(dtype)
    return y, residual_out


def group_quant(y: torch.Tensor, spec: VariantSpec, scale_ub: Optional[torch.Tensor] = None):
    """(q, scales): per-token-group FP8 quantization of 2-D y [M, K] in the spec's layout and format."""
    rows, hidden = y.shape
    grouped = y.float().view(rows, num_groups(hidden, spec.group), spec.group)
    absmax = grouped.abs().amax(dim=-1)
    if scale_ub is not None:
        # A cap that is not > 0 (or NaN) cannot give a valid scale: every scale is NaN.
        ub = scale_ub.float().reshape(())
        absmax = torch.where(ub > 0, torch.minimum(absmax, ub), torch.full_like(absmax, float("nan")))
    traits = spec.scale.traits
    scale = torch.clamp(absmax / traits.qmax, min=traits.min_scale)
    if traits.pow2:
        scale = round_up_pow2(scale)

    q = torch.clamp(grouped / scale.unsqueeze(-1), -traits.qmax, traits.qmax).to(torch.float8_e4m3fn).view(rows, hidden)

    scales = pack_ue8m0(scale) if spec.scale.packed else scale
    if not spec.scale.column_major:
        return q, empty_scales(spec, rows, hidden, y.device).copy_(scales)
    # Out of place: a copy_ into the padded col buffer makes Dynamo guard on
    # round_up(M, 4) == M, so a model compiled with a symbolic M compiled M % 4 == 0 apart.
    shape, strides, storage_rows, _ = scale_geometry(spec, rows, hidden)
    padded = torch.nn.functional.pad(scales, (0, 0, 0, storage_rows - rows)).t().contiguous()
    return q, padded.as_strided(shape, strides)


def rms_norm_group_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    spec: VariantSpec,
    residual: Optional[torch.Tensor] = None,
    scale_ub: Optional[torch.Tensor] = None,
):
    """Return (q, scales, residual_out) for 2-D x [M, K]; residual_out is None without residual.

    Non-finite values propagate, never to a finite garbage scale: see the README's
    "Edge cases" for what NaN, Inf, overflow and a bad ``scale_ub`` give.
    """
    y, residual_out = rms_norm(x, weight, eps, residual)
    q, scales = group_quant(y, spec, scale_ub)
    return q, scales, residual_out
