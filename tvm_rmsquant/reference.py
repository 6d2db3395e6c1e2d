"""The torch reference: the numerics contract, written once in plain torch.

It is the oracle for every test, the fallback where no kernel exists, and the model
that the tensor expression (``tvm_rmsquant.expr``) mirrors stage by stage.
"""

from __future__ import annotations

from typing import Optional

import torch

from .scale_layout import TILE_COLUMNS, TILE_ROWS, TILE_STRIP
from .spec import VariantSpec, num_groups, scale_geometry

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: torch dtype -> the spec's dtype name.
DTYPE_NAMES = {torch_dtype: name for name, torch_dtype in TORCH_DTYPES.items()}


def scale_dtype(spec: VariantSpec) -> torch.dtype:
    """The torch dtype of the variant's scale elements (the record's element name is torch's)."""
    return getattr(torch, spec.scale.element)


def empty_scales(spec: VariantSpec, rows: int, hidden: int, device) -> torch.Tensor:
    """Allocate the scale tensor in the variant's layout (col: TMA-padded column-major;
    tiled: zero-filled, since the kernels write only the rows and groups there are).

    One ``empty_strided``: the col storage ends at the last element rather than the last
    padded row. A TMA consumer that reads whole padded columns reads at most 3 elements
    past it, inside the caching allocator's 512-byte rounding, and only for rows >= M.
    """
    shape, strides, _, _ = scale_geometry(spec, rows, hidden)
    if spec.scale.tiled:
        return torch.zeros(shape, dtype=scale_dtype(spec), device=device)
    return torch.empty_strided(shape, strides, dtype=scale_dtype(spec), device=device)


def round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales up to a power of two, bit-exactly; NaN stays NaN."""
    bits = scale.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    rounded = (exponent.clamp(max=255) << 23).view(torch.float32)
    return torch.where(torch.isnan(scale), scale, rounded)


def ocp_scale(absmax: torch.Tensor, qmax: float, min_scale: float, emax: int) -> torch.Tensor:
    """The OCP MX rule: 2^(floor(log2(max(a, qmax * min_scale))) - emax); NaN for an inf or NaN a."""
    floored = torch.clamp(absmax, min=qmax * min_scale)  # clamp keeps NaN
    exponent = (floored.view(torch.int32) >> 23) & 0xFF
    scale = ((exponent - emax) << 23).view(torch.float32)
    return torch.where(torch.isfinite(floored), scale, torch.full_like(scale, float("nan")))


def ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Biased exponent byte of each power-of-two scale (0xFF, UE8M0's NaN, for NaN)."""
    exponent = (scale.view(torch.int32) >> 23) & 0xFF
    return torch.where(torch.isnan(scale), torch.full_like(exponent, 0xFF), exponent)


def pack_ue8m0(scale: torch.Tensor, per_word: int = 4) -> torch.Tensor:
    """[M, G] power-of-two scales -> int32 [M, ceil(G/4)], group 4j+b in byte b (little-endian)."""
    rows, groups = scale.shape
    padded = torch.zeros(rows, (groups + per_word - 1) // per_word * per_word, dtype=torch.int64, device=scale.device)
    padded[:, :groups] = ue8m0_bytes(scale).to(torch.int64)
    words = padded.view(rows, padded.shape[1] // per_word, per_word)
    packed = sum(words[..., byte] << (8 * byte) for byte in range(per_word))
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, groups: int, per_word: int = 4) -> torch.Tensor:
    """int32 [M, ceil(G/4)] -> fp32 [M, G] scales (0xFF decodes to NaN)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    exponents = torch.stack([(words >> (8 * b)) & 0xFF for b in range(per_word)], dim=-1).flatten(1)[:, :groups]
    return _from_exponents(exponents)


def _from_exponents(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(b - 127); 0xFF is NaN."""
    values = (exponents.to(torch.int32) << 23).view(torch.float32)
    return torch.where(exponents == 0xFF, torch.full_like(values, float("nan")), values)


def _tile_offsets(spec: VariantSpec, rows: int, groups: int, columns: int, device) -> torch.Tensor:
    """[rows, groups] flat byte offsets of each scale in tiled storage of ``columns`` columns,
    from the record's ``tile_coordinates`` (the view [M/128, C/4, 32, 4, 4], row-major)."""
    row = torch.arange(rows, device=device).unsqueeze(1)
    group = torch.arange(groups, device=device).unsqueeze(0)
    extents = (columns // TILE_COLUMNS, TILE_STRIP, TILE_ROWS // TILE_STRIP, TILE_COLUMNS)
    offset = torch.zeros((), dtype=torch.int64, device=device)
    for coordinate, extent in zip(spec.scale.tile_coordinates(row, group), (None,) + extents):
        offset = coordinate if extent is None else offset * extent + coordinate
    return offset


def scales_fp32(scales: torch.Tensor, spec: VariantSpec, hidden: int, rows: Optional[int] = None) -> torch.Tensor:
    """The per-group fp32 scales, [M, K/G], whatever the variant's format (``rows``: M,
    needed only where the storage is padded past it, as tiled scales are)."""
    layout, groups = spec.scale, num_groups(hidden, spec.group)
    rows = scales.shape[0] if rows is None else rows
    if layout.tiled:
        flat = scales.contiguous().view(torch.uint8).flatten().to(torch.int64)
        return _from_exponents(flat[_tile_offsets(spec, rows, groups, scales.shape[1], scales.device)])
    if layout.packed:
        return unpack_ue8m0(scales, groups, layout.groups_per_word)
    if layout.encoded:
        return _from_exponents(scales.view(torch.uint8).to(torch.int64))
    return scales.float()


def laid_out(scale: torch.Tensor, spec: VariantSpec, hidden: int) -> torch.Tensor:
    """fp32 [M, K/G] scales stored as the variant's layout and format say (out of place)."""
    layout, (rows, groups) = spec.scale, scale.shape
    if layout.packed:
        scale = pack_ue8m0(scale, layout.groups_per_word)
    elif layout.encoded:
        scale = ue8m0_bytes(scale).to(torch.uint8).view(scale_dtype(spec))
    if layout.tiled:
        storage = empty_scales(spec, rows, hidden, scale.device)
        flat = storage.view(torch.uint8).view(-1)
        flat[_tile_offsets(spec, rows, groups, storage.shape[1], scale.device).flatten()] = scale.view(torch.uint8).flatten()
        return storage
    if not layout.column_major:
        return empty_scales(spec, rows, hidden, scale.device).copy_(scale)
    # Out of place: a copy_ into the padded col buffer makes Dynamo guard on
    # round_up(M, 4) == M, so a model compiled with a symbolic M compiled M % 4 == 0 apart.
    shape, strides, storage_rows, _ = scale_geometry(spec, rows, hidden)
    padded = torch.nn.functional.pad(scale, (0, 0, 0, storage_rows - rows)).t().contiguous()
    return padded.as_strided(shape, strides)


def dequantize(q: torch.Tensor, scales: torch.Tensor, spec: VariantSpec) -> torch.Tensor:
    """q * s broadcast per group, as fp32 [M, K]."""
    rows, hidden = q.shape
    per_group = scales_fp32(scales, spec, hidden, rows)
    return (q.float().view(rows, -1, spec.group) * per_group.unsqueeze(-1)).view(rows, hidden)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """(y, residual_out): RMSNorm of x (after the fp32 residual add), rounded as the contract says.

    y has the input dtype; residual_out (None without residual) is h rounded to it, while
    the norm itself uses the unrounded fp32 h. With an fp32 weight and 16-bit x (a
    ``weight_dtype="fp32"`` spec) y is rounded once, after the fp32 weight multiply, as vLLM's
    mixed-dtype RMSNorm does; otherwise twice, as its fused kernel does. A model written with this and
    ``group_quant`` is what ``tvm_rmsquant.fusion`` rewrites into the fused op.
    """
    dtype = x.dtype
    h = x.float() if residual is None else x.float() + residual.float()
    residual_out = None if residual is None else h.to(dtype)
    # 1 / sqrt rather than torch.rsqrt: both roundings are exact on CPU and CUDA alike,
    # where CUDA's rsqrt is approximate; the kernels compute it the same way.
    rms = 1.0 / torch.sqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and dtype != torch.float32:
        # A mixed-dtype norm (fp32 weight, 16-bit activations): the multiply in fp32, one rounding.
        return (h * rms * weight).to(dtype), residual_out
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
    if traits.rounding == "ocp":
        scale = ocp_scale(absmax, traits.qmax, traits.min_scale, traits.emax)
    else:
        scale = torch.clamp(absmax / traits.qmax, min=traits.min_scale)
        if traits.rounding == "up":
            scale = round_up_pow2(scale)

    q = torch.clamp(grouped / scale.unsqueeze(-1), -traits.qmax, traits.qmax).to(torch.float8_e4m3fn).view(rows, hidden)
    return q, laid_out(scale, spec, hidden)


def rms_norm_group_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    spec: VariantSpec,
    residual: Optional[torch.Tensor] = None,
    scale_ub: Optional[torch.Tensor] = None,
):
    """Return (q, scales, residual_out) for 2-D x [M, K]; residual_out is None without residual.

    The reference of every spec: a standalone quant (``norm=False``) quantizes x itself
    and ignores weight and eps. Non-finite values propagate, never to a finite garbage
    scale: see the README's "Edge cases" for what NaN, Inf, overflow and a bad ``scale_ub`` give.
    """
    y, residual_out = rms_norm(x, weight, eps, residual) if spec.norm else (x, None)
    q, scales = group_quant(y, spec, scale_ub)
    return q, scales, residual_out
