"""How a kernel's outputs are judged against the torch reference (tests, GPU check, benchmarks).

The bar: the residual output bit-identical; >= 99.9% of fp8 codes identical and the rest
exactly one code apart; NaN exactly where the reference has NaN; and every scale within
one unit of the reference, where the unit is what the scale can honestly resolve:

* UE8M0: one power of two; and every finite scale must itself be a power of two
  (zero mantissa bits), since the contract rounds it up bit-exactly.
* fp32 scales of bf16/fp16 input: one ulp of the dtype at the group's absmax (s * 448),
  since y is rounded to the dtype before its absmax is taken, with a tolerance of two
  units: y = dtype(dtype(h * rms) * w) rounds twice, so one flip of the inner rounding
  (an rms one fp32 ulp off, from another summation order) moves y by up to two ulps.
* fp32 scales of fp32 input: y is not rounded, so the order in which the kernel sums
  h^2 shows through. The unit is then K/2 fp32 ulps, the worst-case error bound of an
  fp32 sum of K terms relative to any other order (Higham's gamma_K); the measured
  figure is reported beside it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .reference import scales_fp32
from .spec import VariantSpec

MIN_IDENTICAL_CODES = 0.999
_MANTISSA_BITS = {"bf16": 7, "fp16": 10, "fp32": 23}


@dataclasses.dataclass
class Agreement:
    elements: int
    codes_identical: float
    codes_max_distance: int
    scales_exact: float
    scales_max_units: float
    scales_max_ulps: float
    residual_identical: Optional[bool]
    nan_mismatch: int
    scale_tolerance: float = 1.0
    #: UE8M0 formats: finite scales that are not a power of two (the rounding was skipped).
    scales_not_pow2: int = 0

    @property
    def passed(self) -> bool:
        return (
            self.codes_identical >= MIN_IDENTICAL_CODES
            and self.codes_max_distance <= 1
            # s = a / 448 is itself rounded in fp32: allow that last-bit slack on the unit.
            and self.scales_max_units <= self.scale_tolerance * (1 + 1e-3)
            and self.residual_identical is not False
            and self.nan_mismatch == 0
            and self.scales_not_pow2 == 0
        )

    def describe(self) -> str:
        residual = "" if self.residual_identical is None else f", residual {'identical' if self.residual_identical else 'DIFFERS'}"
        return (
            f"codes identical {self.codes_identical:.6f} (max distance {self.codes_max_distance}), "
            f"scales exact {self.scales_exact:.6f} (max {self.scales_max_units:.3g} units, {self.scales_max_ulps:g} fp32 ulps){residual}, "
            f"NaN mismatches {self.nan_mismatch}" + (f", {self.scales_not_pow2} UE8M0 scales NOT powers of two" if self.scales_not_pow2 else "")
        )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaN payloads and signed zeros compare too."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def code_ordinal(q: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3fn codes as signed ordinals, so adjacent values differ by one."""
    bits = q.view(torch.uint8).to(torch.int32)
    return torch.where(bits >= 0x80, -(bits & 0x7F), bits)


def scale_units(ours: torch.Tensor, ref: torch.Tensor, spec: VariantSpec, hidden: int) -> torch.Tensor:
    """|ours - ref| in the scale's unit (see the module docstring)."""
    finite = torch.isfinite(ref) & torch.isfinite(ours)
    ours, ref = torch.where(finite, ours, 1.0), torch.where(finite, ref, 1.0)
    if spec.pow2_scales:
        return (torch.log2(ours) - torch.log2(ref)).abs()
    qmax = spec.scale.traits.qmax
    absmax = ref * qmax
    ulp = torch.exp2(torch.floor(torch.log2(absmax)) - _MANTISSA_BITS[spec.dtype])
    if spec.dtype == "fp32":
        ulp = ulp * max(1.0, hidden / 2)
    return (ours - ref).abs() * qmax / ulp


def _fp32_ulps(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(ref) & torch.isfinite(ours)
    distance = (ours.view(torch.int32).to(torch.int64) - ref.view(torch.int32).to(torch.int64)).abs()
    return torch.where(finite, distance, 0)


def compare(spec: VariantSpec, got, want, hidden: int) -> Agreement:
    """Judge ``got`` = (q, scales, residual_out) against the reference's ``want``."""
    q, scales, residual = got
    q_ref, scales_ref, residual_ref = want
    q, q_ref = q.cpu(), q_ref.cpu()
    rows = q.shape[0]
    ours, ref = scales_fp32(scales.cpu(), spec, hidden, rows), scales_fp32(scales_ref.cpu(), spec, hidden, rows)

    q_float, q_ref_float = q.float(), q_ref.float()
    nan_codes, nan_codes_ref = torch.isnan(q_float), torch.isnan(q_ref_float)
    nan_mismatch = int((nan_codes != nan_codes_ref).sum() + (torch.isnan(ours) != torch.isnan(ref)).sum())
    # A UE8M0 group whose scale legitimately differs by one power of two has every code
    # shifted by 8: its codes are judged by their dequantized values instead, against one
    # fp8 step at the coarser scale. (fp32 scales differ by ulps; codes compare directly.)
    if rows and spec.pow2_scales:
        same_scale = ((ours == ref) | (torch.isnan(ours) & torch.isnan(ref))).repeat_interleave(spec.group, dim=1)
    else:
        same_scale = torch.ones_like(q_float, dtype=torch.bool)
    comparable = ~(nan_codes | nan_codes_ref) & same_scale
    identical = (q.view(torch.uint8) == q_ref.view(torch.uint8)) | (nan_codes & nan_codes_ref)
    distance = (code_ordinal(q) - code_ordinal(q_ref)).abs()[comparable]
    if not bool(same_scale.all()):
        coarser = torch.maximum(ours, ref).repeat_interleave(spec.group, dim=1)
        value, value_ref = q_float * ours.repeat_interleave(spec.group, dim=1), q_ref_float * ref.repeat_interleave(spec.group, dim=1)
        magnitude = torch.maximum(value.abs(), value_ref.abs()) / coarser
        step = coarser * torch.exp2(torch.clamp(torch.floor(torch.log2(magnitude.clamp(min=2.0**-9))), min=-6.0) - 3)
        close = (value - value_ref).abs() <= step
        identical = identical | (~same_scale & close)
        if not bool(close[~same_scale].all()):
            distance = torch.cat([distance, torch.tensor([99])])
    units = scale_units(ours, ref, spec, hidden)
    residual_identical = None
    if residual_ref is not None:
        # Bit-identical, except that NaN payloads and signs are not part of the contract.
        residual, residual_ref = residual.cpu(), residual_ref.cpu()
        residual_identical = residual.dtype == residual_ref.dtype and bool(
            ((_bits(residual) == _bits(residual_ref)) | (torch.isnan(residual) & torch.isnan(residual_ref))).all()
        )
    elements = q.numel()
    not_pow2 = int((torch.isfinite(ours) & ((ours.view(torch.int32) & 0x7FFFFF) != 0)).sum()) if spec.pow2_scales else 0
    return Agreement(
        elements=elements,
        codes_identical=float(identical.float().mean()) if elements else 1.0,
        codes_max_distance=int(distance.max()) if distance.numel() else 0,
        scales_exact=float((ours == ref).float().mean()) if ours.numel() else 1.0,
        scales_max_units=float(units.max()) if units.numel() else 0.0,
        scales_max_ulps=float(_fp32_ulps(ours, ref).max()) if ours.numel() else 0.0,
        residual_identical=residual_identical,
        nan_mismatch=nan_mismatch,
        scale_tolerance=2.0 if spec.dtype in ("bf16", "fp16") and not spec.pow2_scales else 1.0,
        scales_not_pow2=not_pow2,
    )


def random_inputs(spec: VariantSpec, rows: int, hidden: int, seed: int, device="cpu", outliers: bool = True):
    """Normal inputs with a few large outliers (what activations look like), never zeros."""
    from .reference import TORCH_DTYPES

    # Drawn on the target device: generating GPU-sized inputs on the CPU is far slower.
    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = TORCH_DTYPES[spec.dtype]

    def normal(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, device=device) * scale

    x = normal(rows, hidden, scale=2.0)
    if outliers and x.numel():
        spots = torch.randint(0, x.numel(), (max(1, x.numel() // 1000),), generator=generator, device=device)
        x.view(-1)[spots] *= 40.0
    inputs = {
        "x": x.to(dtype),
        "weight": (1.0 + normal(hidden, scale=0.2)).to(TORCH_DTYPES[spec.weight_dtype_name]) if spec.norm else None,
        "residual": normal(rows, hidden).to(dtype) if spec.residual else None,
        "scale_ub": torch.tensor([6.0], device=device) if spec.scale_ub else None,
    }
    return inputs
