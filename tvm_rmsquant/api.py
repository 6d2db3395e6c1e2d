"""The functional Python API: one call, the variant resolved from the arguments."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional

import torch

from . import serving
from .dispatch import BoundKernel
from .loader import BundleError, open_bundle
from .reference import DTYPE_NAMES, TORCH_DTYPES
from .serving import Candidate
from .spec import VariantSpec, check_eps, mixed_weight_dtype

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _resolve(spec: VariantSpec, device_type: str, weight_dtype: torch.dtype) -> BoundKernel:
    """``serving.choose`` on the default bundle (contents only: no device query); the first
    call then serves that bundle, as ``select`` does."""
    if weight_dtype != TORCH_DTYPES[spec.dtype] and spec.norm:
        try:  # the mixed-dtype kernels (_wf32) where some take the pair
            mixed = mixed_weight_dtype(spec.dtype, DTYPE_NAMES[weight_dtype])
            return _resolve(dataclasses.replace(spec, weight_dtype=mixed), device_type, TORCH_DTYPES[spec.dtype])
        except ValueError as error:
            reason = f"the weight is {weight_dtype} and x {TORCH_DTYPES[spec.dtype]}; no kernel takes the pair ({error})"
        logger.warning("tvm_rmsquant: %s; using the torch reference for %s", reason, spec.name)
        return BoundKernel(spec, None, [Candidate(spec.name, False, reason)], device_type=device_type, weight_dtype=weight_dtype)
    if device_type != "cuda":
        return BoundKernel(spec, spec.name, [Candidate(spec.name, True, "CPU op")], device_type=device_type)
    try:
        bundle = open_bundle()
    except BundleError as error:
        return BoundKernel(spec, None, [Candidate("bundle", False, str(error))])
    chosen, why = serving.choose(spec, bundle)
    if chosen is None:
        return BoundKernel(spec, None, why)
    return BoundKernel(spec, chosen.name, why + [Candidate(chosen.name, True, "in the default bundle")])


def _check_scale_ub(x: torch.Tensor, scale_ub: Optional[torch.Tensor]) -> None:
    if scale_ub is not None:
        # The functional API is not the hot path: check the cap's value here (one sync on CUDA).
        if not isinstance(scale_ub, torch.Tensor) or scale_ub.numel() != 1 or scale_ub.dtype != torch.float32:
            raise ValueError(f"scale_ub must be a one-element float32 tensor, got {scale_ub!r}")
        if scale_ub.device != x.device:
            raise ValueError(f"scale_ub is on {scale_ub.device} but x is on {x.device}; put every tensor on one device")
        if not float(scale_ub) > 0:
            raise ValueError(f"scale_ub={float(scale_ub)} must be > 0 (it caps each group's absmax)")


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
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPE_NAMES:
        raise TypeError(f"x must be a bf16, fp16 or fp32 tensor, got {getattr(x, 'dtype', type(x))}")
    if not isinstance(weight, torch.Tensor) or weight.dtype not in DTYPE_NAMES:
        raise TypeError(f"weight must be a bf16, fp16 or fp32 tensor, got {getattr(weight, 'dtype', type(weight))}")
    check_eps(eps)
    if x.dim() < 1:
        raise ValueError(f"x is 0-D; it must be [..., K] with K the hidden size, got shape {tuple(x.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must be [{x.shape[-1]}] (x.shape[-1]), got shape {tuple(weight.shape)} for x {tuple(x.shape)}")
    if residual is not None and (not isinstance(residual, torch.Tensor) or residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype} like x, got {tuple(getattr(residual, 'shape', ()))} {getattr(residual, 'dtype', type(residual))}")
    _check_scale_ub(x, scale_ub)
    spec = VariantSpec(DTYPE_NAMES[x.dtype], x.shape[-1], group_size, residual is not None, scale_layout, scale_format, scale_ub is not None)
    return _resolve(spec, x.device.type, weight.dtype)(x, weight, eps, residual, scale_ub)


def group_quant(
    x: torch.Tensor,
    group_size: int = 128,
    scale_layout: str = "row",
    scale_format: str = "fp32",
    scale_ub: Optional[torch.Tensor] = None,
):
    """Per-group FP8 quantization of x [..., K] alone (no norm): vLLM's
    ``per_token_group_fp8_quant``, for linear layers that follow no norm. Returns q and the
    scales as ``rms_norm_group_quant`` does. For repeated calls, prefer ``select(norm=False)``."""
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPE_NAMES:
        raise TypeError(f"x must be a bf16, fp16 or fp32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1:
        raise ValueError(f"x is 0-D; it must be [..., K] with K the hidden size, got shape {tuple(x.shape)}")
    _check_scale_ub(x, scale_ub)
    spec = VariantSpec(DTYPE_NAMES[x.dtype], x.shape[-1], group_size, False, scale_layout, scale_format, scale_ub is not None, norm=False)
    return _resolve(spec, x.device.type, x.dtype)(x, scale_ub=scale_ub)
