"""The functional Python API: one call, the variant resolved from the arguments."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .dispatch import _DTYPE_NAMES, BoundKernel, Candidate
from .loader import BundleError, open_bundle
from .spec import VariantSpec


@functools.lru_cache(maxsize=None)
def _resolve(spec: VariantSpec, device_type: str) -> BoundKernel:
    """Static kernel, else dynamic, else reference; from bundle contents only (no device query)."""
    if device_type != "cuda":
        return BoundKernel(spec, spec.name, [Candidate(spec.name, True, "CPU op")])
    try:
        bundle = open_bundle()
    except BundleError as error:
        return BoundKernel(spec, None, [Candidate("bundle", False, str(error))])
    for candidate in (spec, spec.with_hidden(None)):
        if candidate in bundle and candidate.accepts_hidden(spec.hidden) is None:
            return BoundKernel(spec, candidate.name, [Candidate(candidate.name, True, "in the default bundle")])
    return BoundKernel(spec, None, [Candidate(spec.name, False, "no static or dynamic kernel in the default bundle")])


def rms_norm_group_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    group_size: int = 128,
    scale_layout: str = "row",
    scale_format: str = "fp32",
    residual: Optional[torch.Tensor] = None,
    scale_ub: Optional[torch.Tensor] = None,
):
    """RMSNorm (after ``residual += x`` when given, in place) and per-group FP8 quantization.

    x is [..., K]; returns q [..., K] float8_e4m3fn and the scales in the requested layout.
    For repeated calls in a model, prefer ``tvm_rmsquant.select`` at init.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPE_NAMES:
        raise TypeError(f"x must be a bf16, fp16 or fp32 tensor, got {getattr(x, 'dtype', type(x))}")
    if not eps > 0:
        raise ValueError(f"eps={eps!r} must be a positive number, such as 1e-6")
    spec = VariantSpec(_DTYPE_NAMES[x.dtype], x.shape[-1], group_size, residual is not None, scale_layout, scale_format, scale_ub is not None)
    return _resolve(spec, x.device.type)(x, weight, eps, residual, scale_ub)
