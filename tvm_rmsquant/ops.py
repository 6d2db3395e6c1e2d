"""Torch custom ops in the ``tvm_rmsquant`` namespace.

``variant`` names a ``VariantSpec`` (static or dynamic K). CUDA kernels come from the
registered bundle (``use_bundle``, called by the dispatcher at init, or the default
bundle on first use); CPU calls run the llvm build of the same tensor expression where
the TVM compiler is installed, else the torch reference. Fake implementations give the
exact shapes, dtypes and strides, the TMA-padded col layout included.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from . import cpu, launch, reference
from .loader import open_bundle
from .spec import VariantSpec

NAMESPACE = "tvm_rmsquant"
_library = torch.library.Library(NAMESPACE, "DEF")
_library.define("rms_norm_group_quant(Tensor x, Tensor weight, float eps, str variant, Tensor? scale_ub=None) -> (Tensor, Tensor)")
_library.define(
    "fused_add_rms_norm_group_quant(Tensor x, Tensor(a!) residual, Tensor weight, float eps, str variant, "
    "Tensor? scale_ub=None) -> (Tensor, Tensor)"
)
# vLLM's signature, so that vLLM could swap this kernel in.
_library.define(
    "rms_norm_per_block_quant(Tensor(a!) out, Tensor input, Tensor weight, Tensor(b!) scales, float epsilon, "
    "Tensor? scale_ub, Tensor(c!)? residual, int group_size, bool is_scale_transposed) -> ()"
)

_BUNDLES = {}


def use_bundle(bundle) -> None:
    """Route CUDA calls of this bundle's variants to it (later registrations win)."""
    for name in bundle.names():
        _BUNDLES[name] = bundle
    _cuda_kernel.cache_clear()


@functools.lru_cache(maxsize=None)
def spec_of(variant: str) -> VariantSpec:
    return VariantSpec.parse(variant)


@functools.lru_cache(maxsize=None)
def _cuda_kernel(variant: str, device_index: int):
    bundle = _BUNDLES.get(variant) or open_bundle()
    bundle.check_device(torch.cuda.get_device_capability(device_index))
    return bundle.function(variant)


def _kernel_for(x: torch.Tensor, spec: VariantSpec):
    if x.device.type == "cuda":
        return _cuda_kernel(spec.name, x.device.index if x.device.index is not None else torch.cuda.current_device())
    if x.device.type == "cpu" and cpu.available():
        return cpu.function(spec)
    return None


def _check(spec: VariantSpec, x: torch.Tensor, weight: torch.Tensor, residual=None, scale_ub=None) -> None:
    """Refuse input the variant cannot run, naming the argument, the value and what works."""
    dtype = reference.TORCH_DTYPES[spec.dtype]
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K] here, got shape {tuple(x.shape)}; the Python API flattens [..., K]")
    hidden = x.shape[1]
    if x.dtype != dtype:
        raise TypeError(f"x.dtype={x.dtype} does not match variant {spec.name}, which takes {dtype}")
    reason = spec.accepts_hidden(hidden)
    if reason is not None:
        raise ValueError(f"x.shape[-1]={hidden}: variant {spec.name} {reason}")
    if x.stride(-1) != 1:
        raise ValueError(f"x must have a contiguous last dimension, got strides {x.stride()}")
    if weight.shape != (hidden,) or weight.dtype != dtype:
        raise ValueError(f"weight must be [{hidden}] {dtype}, got {tuple(weight.shape)} {weight.dtype}")
    tensors = {"weight": weight}
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != dtype:
            raise ValueError(f"residual must be {tuple(x.shape)} {dtype} like x, got {tuple(residual.shape)} {residual.dtype}")
        tensors["residual"] = residual
    if spec.scale_ub != (scale_ub is not None):
        raise ValueError(f"variant {spec.name} {'needs' if spec.scale_ub else 'takes no'} scale_ub, got {None if scale_ub is None else tuple(scale_ub.shape)}")
    if scale_ub is not None:
        if scale_ub.numel() != 1 or scale_ub.dtype != torch.float32:
            raise ValueError(f"scale_ub must be a one-element float32 tensor, got {tuple(scale_ub.shape)} {scale_ub.dtype}")
        tensors["scale_ub"] = scale_ub
    for name, tensor in tensors.items():
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}; put every tensor on one device")


def _quantize_into(spec, x, weight, eps, q, scales, residual=None, residual_out=None, scale_ub=None) -> None:
    """Run the kernel (or the reference) writing q, scales and residual_out in place."""
    kernel = _kernel_for(x, spec)
    if kernel is None:
        q_ref, scales_ref, residual_ref = reference.rms_norm_group_quant(x, weight, eps, spec, residual, scale_ub)
        q.copy_(q_ref)
        scales.copy_(scales_ref)
        if residual_out is not None:
            residual_out.copy_(residual_ref)
        return
    contiguous = x if x.is_contiguous() else x.contiguous()
    launch.run(kernel, spec, contiguous, weight.contiguous(), eps, q, scales, residual, residual_out, scale_ub)


def _outputs(spec: VariantSpec, x: torch.Tensor):
    rows, hidden = x.shape
    q = torch.empty((rows, hidden), dtype=torch.float8_e4m3fn, device=x.device)
    return q, reference.empty_scales(spec, rows, hidden, x.device)


def _rms_norm_group_quant(x, weight, eps, variant, scale_ub=None):
    spec = spec_of(variant)
    _check(spec, x, weight, scale_ub=scale_ub)
    q, scales = _outputs(spec, x)
    _quantize_into(spec, x, weight, eps, q, scales, scale_ub=scale_ub)
    return q, scales


def _fused_add_rms_norm_group_quant(x, residual, weight, eps, variant, scale_ub=None):
    spec = spec_of(variant)
    if not spec.residual:
        raise ValueError(f"variant {variant} has no residual; use a '_res' variant for fused_add_rms_norm_group_quant")
    _check(spec, x, weight, residual, scale_ub)
    q, scales = _outputs(spec, x)
    # The kernel reads each residual element before the same thread overwrites it.
    target = residual if residual.is_contiguous() else torch.empty_like(residual, memory_format=torch.contiguous_format)
    source = residual if residual.is_contiguous() else residual.contiguous()
    _quantize_into(spec, x, weight, eps, q, scales, source, target, scale_ub)
    if target is not residual:
        residual.copy_(target)
    return q, scales


def _rms_norm_per_block_quant(out, input, weight, scales, epsilon, scale_ub, residual, group_size, is_scale_transposed):
    spec = VariantSpec(
        dtype={value: key for key, value in reference.TORCH_DTYPES.items()}[input.dtype],
        hidden=None,
        group=group_size,
        residual=residual is not None,
        layout="col" if is_scale_transposed else "row",
        scale_ub=scale_ub is not None,
    )
    static = spec.with_hidden(input.shape[-1])
    spec = static if static.name in _BUNDLES or input.device.type != "cuda" else spec
    _check(spec, input, weight, residual, scale_ub)
    expected = reference.empty_scales(spec, input.shape[0], input.shape[1], "meta")
    if out.shape != input.shape or out.dtype != torch.float8_e4m3fn:
        raise ValueError(f"out must be {tuple(input.shape)} float8_e4m3fn, got {tuple(out.shape)} {out.dtype}")
    if scales.shape != expected.shape or scales.stride() != expected.stride() or scales.dtype != torch.float32:
        raise ValueError(
            f"scales must be {tuple(expected.shape)} float32 with strides {expected.stride()} "
            f"(is_scale_transposed={is_scale_transposed}), got {tuple(scales.shape)} {scales.dtype} strides {scales.stride()}"
        )
    _quantize_into(spec, input, weight, epsilon, out, scales, residual, residual, scale_ub)


for _name, _function in (
    ("rms_norm_group_quant", _rms_norm_group_quant),
    ("fused_add_rms_norm_group_quant", _fused_add_rms_norm_group_quant),
    ("rms_norm_per_block_quant", _rms_norm_per_block_quant),
):
    _library.impl(_name, _function, "CPU")
    _library.impl(_name, _function, "CUDA")


@torch.library.register_fake(f"{NAMESPACE}::rms_norm_group_quant")
def _fake(x, weight, eps, variant, scale_ub=None):
    return _outputs(spec_of(variant), x)


@torch.library.register_fake(f"{NAMESPACE}::fused_add_rms_norm_group_quant")
def _fake_fused(x, residual, weight, eps, variant, scale_ub=None):
    return _outputs(spec_of(variant), x)


@torch.library.register_fake(f"{NAMESPACE}::rms_norm_per_block_quant")
def _fake_out(out, input, weight, scales, epsilon, scale_ub, residual, group_size, is_scale_transposed):
    return None


rms_norm_group_quant = torch.ops.tvm_rmsquant.rms_norm_group_quant
fused_add_rms_norm_group_quant = torch.ops.tvm_rmsquant.fused_add_rms_norm_group_quant
rms_norm_per_block_quant = torch.ops.tvm_rmsquant.rms_norm_per_block_quant
