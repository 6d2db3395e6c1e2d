"""Torch custom ops in the ``tvm_rmsquant`` namespace.

``variant`` names a ``VariantSpec`` (static or dynamic K; ``group_quant`` takes the
standalone quant's ``_nonorm`` variants, the other allocating ops the fused ones). CUDA kernels come from the
registered bundle (``use_bundle``, called by the dispatcher at init, or the default
bundle on first use). On CUDA the allocating ops run the bundle's C++ implementation
(``tvm_rmsquant.native``) where this torch can load it, else the Python one below, which
is registered for every backend without a kernel of its own; CPU calls run the llvm build
of the same tensor expression where the TVM compiler is installed, else the torch
reference. Fake implementations give the exact shapes, dtypes and strides, the
TMA-padded col layout included, and refuse tensors on mixed devices (a meta weight with a
CPU x dispatches to them, and would otherwise return outputs nothing wrote).

The ops are inference-only. The functional ones fall through autograd, so their outputs
carry no gradient (a backward through q or the scales raises torch's "does not require
grad"). The two that mutate a tensor (the residual, vLLM's out buffers) refuse one that
requires grad while grad mode is on, as torch refuses an in-place update of a leaf that
requires grad; under ``torch.inference_mode()`` that check costs nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Optional, Tuple

import torch

from . import cpu, launch, reference, serving
from .loader import open_bundle
from .spec import VariantSpec, check_eps

FP8 = torch.float8_e4m3fn

NAMESPACE = "tvm_rmsquant"
_library = torch.library.Library(NAMESPACE, "DEF")
_library.define("rms_norm_group_quant(Tensor x, Tensor weight, float eps, str variant, Tensor? scale_ub=None) -> (Tensor, Tensor)")
_library.define(
    "fused_add_rms_norm_group_quant(Tensor x, Tensor(a!) residual, Tensor weight, float eps, str variant, "
    "Tensor? scale_ub=None) -> (Tensor, Tensor)"
)
# The functional form, for graphs (the fusion pass): residual_out is a new tensor.
_library.define(
    "add_rms_norm_group_quant(Tensor x, Tensor residual, Tensor weight, float eps, str variant, "
    "Tensor? scale_ub=None) -> (Tensor, Tensor, Tensor)"
)
# The standalone quant (a ``_nonorm`` variant): vLLM's per_token_group_fp8_quant, for linear
# layers that follow no norm.
_library.define("group_quant(Tensor x, str variant, Tensor? scale_ub=None) -> (Tensor, Tensor)")
# vLLM 0.33's ``_C.rms_norm_per_block_quant``: its argument names, types, order and
# mutations (vLLM calls it by keyword: result=, scale=), so that a vLLM graph node can be
# retargeted here as is. One trailing argument with a default, scale_ue8m0, asks for the
# UE8M0 scales that vLLM's kernel cannot write (vLLM issue #50773).
_library.define(
    "rms_norm_per_block_quant(Tensor(a!) result, Tensor input, Tensor weight, Tensor(b!) scale, float epsilon, "
    "Tensor? scale_ub, Tensor(c!)? residual, int group_size, bool is_scale_transposed, bool scale_ue8m0=False) -> ()"
)

def use_bundle(bundle) -> Optional[str]:
    """Route CUDA calls of this bundle's variants to it (``serving.serve``: later registrations
    win), through the C++ ops where this torch can load them; returns why not, or None when it does."""
    reason = serving.serve(bundle, torch.cuda.is_available())
    _KERNELS.clear()
    _per_block_variant.cache_clear()
    return reason


def _served_bundle(name: str):
    """The bundle serving ``name``; before any is served, the default bundle (opened and served)."""
    bundle = serving.bundle_for(name)
    if bundle is None:
        bundle = open_bundle()
        use_bundle(bundle)
    return bundle


@functools.lru_cache(maxsize=None)
def spec_of(variant: str) -> VariantSpec:
    return VariantSpec.parse(variant)


class Kernel:
    """One variant's entry point on one device, with what every call needs worked out once.

    ``function`` follows ``tvm_rmsquant.launch`` (a bundle's CUDA kernel, the llvm build,
    or the reference). On CUDA this is the Python implementation, for a torch that cannot
    load the C++ ops (``tvm_rmsquant.native``), which do the same: a call allocates q and
    the scales and makes one tvm-ffi call; the entry point checks the arguments, views rows
    by groups and skips M = 0 in C++.
    """

    def __init__(self, spec: VariantSpec, function, checks_natively: bool):
        self.spec = spec
        self.function = function
        #: A bundle entry point checks dtypes, shapes and devices itself (codegen/row_views.cuh).
        self.checks_natively = checks_natively
        self.dtype = reference.TORCH_DTYPES[spec.dtype]
        self.scale = spec.scale
        self.scale_dtype = reference.scale_dtype(spec)

    def scales(self, rows: int, hidden: int, device) -> torch.Tensor:
        """``reference.empty_scales``, from the layout record looked up once."""
        shape, strides, _, _ = self.scale.geometry(rows, hidden // self.spec.group)
        if self.scale.tiled:
            return torch.zeros(shape, dtype=self.scale_dtype, device=device)
        return torch.empty_strided(shape, strides, dtype=self.scale_dtype, device=device)

    def __call__(self, x, weight, eps, q=None, scales=None, residual=None, scale_ub=None, residual_out=None):
        """(q, scales), written into the given buffers or into new ones.

        The updated residual goes to ``residual_out`` when given, else into ``residual`` in
        place. A standalone quant (``norm=False``) takes weight=None and eps=None.
        """
        spec = self.spec
        if spec.norm:
            check_eps(eps)
        if residual is not None and residual_out is None:
            check_mutable("residual", residual)
        if not self.checks_natively or (residual is None) == spec.residual or (scale_ub is None) == spec.scale_ub or (weight is None) == spec.norm:
            check_arguments(spec, x, weight, residual, scale_ub)
        if not x.is_contiguous():
            if x.stride(-1) != 1:
                check_arguments(spec, x, weight, residual, scale_ub)
            x = x.contiguous()  # strided rows: the kernel reads compact rows
        if weight is not None and not weight.is_contiguous():
            weight = weight.contiguous()
        if q is None:
            q = torch.empty_like(x, dtype=FP8)
            scales = self.scales(x.shape[0], x.shape[1], x.device)
        if residual is None:
            self.function(*launch.kernel_args(spec, x, weight, eps, q, scales, scale_ub=scale_ub))
            return q, scales
        if residual.stride(-1) != 1:
            raise ValueError(f"residual must have a contiguous last dimension, got strides {residual.stride()}")
        if residual_out is None:
            _check_rows_own_memory("residual", residual)
        source = residual if residual.is_contiguous() else residual.contiguous()
        # In place, each residual element is read and then overwritten by the same thread.
        target = source if residual_out is None else residual_out
        self.function(*launch.kernel_args(spec, x, weight, eps, q, scales, source, target, scale_ub))
        if residual_out is None and target is not residual:
            residual.copy_(target)
        return q, scales


_KERNELS: Dict[Tuple[str, int], Kernel] = {}


def kernel(variant: str, device) -> Kernel:
    """The kernel of ``variant`` on ``device``, loaded once per (variant, device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (variant, -1 if device.type == "cpu" else device.index)
    found = _KERNELS.get(key)
    if found is None:
        found = _KERNELS[key] = _load_kernel(spec_of(variant), device)
    return found


def _kernel_of(variant: str, x: torch.Tensor) -> Kernel:
    """``kernel`` for x's device, in one dict lookup once loaded (``x.get_device()`` is -1 on CPU)."""
    return _KERNELS.get((variant, x.get_device())) or kernel(variant, x.device)


def _load_kernel(spec: VariantSpec, device: torch.device) -> Kernel:
    if device.type == "cuda":
        bundle = _served_bundle(spec.name)
        bundle.check_device(torch.cuda.get_device_capability(device))
        return Kernel(spec, bundle.function(spec.name), checks_natively=True)
    if device.type == "cpu":
        return Kernel(spec, cpu.by_row_chunks(spec, cpu.function(spec) if cpu.available() else _reference_function(spec)), checks_natively=False)
    raise ValueError(f"x is on {device}; tvm_rmsquant runs on CUDA (bundle kernels) and CPU (llvm build or reference)")


def _reference_function(spec: VariantSpec):
    """The torch reference behind the kernel calling convention (CPU without TVM)."""
    parameters = [name for name, _ in launch.parameters(spec)]

    def call(*args):
        named = dict(zip(parameters, args))
        q, scales, residual = reference.rms_norm_group_quant(
            named["x"], named.get("weight"), named.get("eps"), spec, named.get("residual"), named.get("scale_ub")
        )
        named["q"].copy_(q)
        named["scales"].copy_(scales)
        if residual is not None:
            named["residual_out"].copy_(residual)

    return call


def check_mutable(name: str, tensor: torch.Tensor) -> None:
    """Refuse to update in place a tensor that requires grad (see the module docstring)."""
    if tensor.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name} requires grad, and tvm_rmsquant's ops are inference-only: they would update it in place "
            f"with no gradient; call under torch.no_grad() or torch.inference_mode(), or pass {name}.detach()"
        )


def _check_rows_own_memory(name: str, tensor: torch.Tensor) -> None:
    """Refuse an in-place target whose rows share memory (an expanded tensor): one write
    would land in several rows."""
    if tensor.dim() == 2 and tensor.shape[0] > 1 and tensor.stride(0) < tensor.shape[1]:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} and strides {tensor.stride()}: its rows overlap (an expanded "
            f"tensor?), so it cannot be updated in place; pass {name}.clone()"
        )


def _check_devices(x: torch.Tensor, **tensors) -> None:
    """Every tensor on x's device, or an error naming the first one that is not."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}; put every tensor on one device")


def check_arguments(spec: VariantSpec, x: torch.Tensor, weight: torch.Tensor, residual=None, scale_ub=None, weight_dtype=None) -> None:
    """Refuse input the variant cannot run, naming the argument, the value and what works.

    ``weight_dtype`` is the norm weight's dtype where the layer runs the reference with a
    weight of another dtype than x (``select(weight_dtype=...)``)."""
    dtype = reference.TORCH_DTYPES[spec.dtype]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"x.dtype={x.dtype} does not match variant {spec.name}, which takes {dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K] here, got shape {tuple(x.shape)}; the Python API flattens [..., K]")
    hidden = x.shape[1]
    reason = spec.accepts_hidden(hidden)
    if reason is not None:
        raise ValueError(f"x.shape[-1]={hidden}: variant {spec.name} {reason}")
    if x.stride(-1) != 1:
        raise ValueError(f"x must have a contiguous last dimension, got strides {x.stride()}")
    if not spec.norm:
        if weight is not None:
            raise ValueError(f"variant {spec.name} is a standalone quant: it takes no weight (call group_quant)")
    elif not isinstance(weight, torch.Tensor):
        raise TypeError(
            f"weight must be a tensor, got {type(weight).__name__}"
            + ("" if weight is not None else f"; variant {spec.name} normalizes (a _nonorm variant quantizes x alone)")
        )
    elif weight_dtype is not None and weight_dtype != dtype:
        if weight.dtype != weight_dtype:
            raise TypeError(f"weight.dtype={weight.dtype}; this layer was selected for a {weight_dtype} norm weight")
    elif weight.dtype != (wanted := reference.TORCH_DTYPES[spec.weight_dtype_name]):
        raise TypeError(
            f"weight.dtype={weight.dtype}, but variant {spec.name} takes a {wanted} weight. For a {weight.dtype} norm "
            f"weight with {dtype} activations use tvm_rmsquant.select(..., weight_dtype={weight.dtype})"
            + (" (fp32: the _wf32 kernels)" if weight.dtype == torch.float32 else ", which routes to the torch reference")
        )
    if weight is not None and weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}] (x.shape[-1]), got shape {tuple(weight.shape)}")
    if spec.residual != (residual is not None):
        raise ValueError(
            f"variant {spec.name} {'updates a residual: call fused_add_rms_norm_group_quant' if spec.residual else 'has no residual: use a _res variant'}"
        )
    if residual is not None:
        if residual.stride(-1) != 1:
            raise ValueError(f"residual must have a contiguous last dimension, got strides {residual.stride()}")
        if residual.shape != x.shape or residual.dtype != dtype:
            raise ValueError(f"residual must be {tuple(x.shape)} {dtype} like x, got {tuple(residual.shape)} {residual.dtype}")
    if spec.scale_ub != (scale_ub is not None):
        raise ValueError(f"variant {spec.name} {'needs' if spec.scale_ub else 'takes no'} scale_ub, got {None if scale_ub is None else tuple(scale_ub.shape)}")
    if scale_ub is not None:
        if scale_ub.numel() != 1 or scale_ub.dtype != torch.float32:
            raise ValueError(f"scale_ub must be a one-element float32 tensor, got {tuple(scale_ub.shape)} {scale_ub.dtype}")
    _check_devices(x, weight=weight, residual=residual, scale_ub=scale_ub)


def _outputs(spec: VariantSpec, x: torch.Tensor, **inputs):
    _check_devices(x, **inputs)
    rows, hidden = x.shape
    q = torch.empty((rows, hidden), dtype=FP8, device=x.device)
    return q, reference.empty_scales(spec, rows, hidden, x.device)


def _rms_norm_group_quant(x, weight, eps, variant, scale_ub=None):
    return _kernel_of(variant, x)(x, weight, eps, scale_ub=scale_ub)


def _fused_add_rms_norm_group_quant(x, residual, weight, eps, variant, scale_ub=None):
    return _kernel_of(variant, x)(x, weight, eps, residual=residual, scale_ub=scale_ub)


def _standalone(variant: str) -> VariantSpec:
    spec = spec_of(variant)
    if spec.norm:
        raise ValueError(f"variant={variant!r} normalizes; group_quant takes a standalone quant variant, such as {dataclasses.replace(spec, residual=False, norm=False).name!r}")
    return spec


def _group_quant(x, variant, scale_ub=None):
    _standalone(variant)
    return _kernel_of(variant, x)(x, None, None, scale_ub=scale_ub)


def _add_rms_norm_group_quant(x, residual, weight, eps, variant, scale_ub=None):
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    q, scales = _kernel_of(variant, x)(x, weight, eps, residual=residual, scale_ub=scale_ub, residual_out=residual_out)
    return q, scales, residual_out


@functools.lru_cache(maxsize=None)
def _per_block_variant(dtype: torch.dtype, hidden: int, group_size: int, residual: bool, col: bool, ue8m0: bool, scale_ub: bool, device_type: str) -> str:
    """vLLM's arguments -> our variant: ``serving.choose`` on the bundle serving the static-K
    kernel, else the dynamic-K one (the default bundle before any is served); on CPU the
    static spec, which the llvm build or the reference runs."""
    if dtype not in reference.DTYPE_NAMES:
        raise TypeError(f"input.dtype={dtype} is not supported; accepted: {sorted(map(str, reference.DTYPE_NAMES))}")
    layout, fmt = "col" if col else "row", "ue8m0" if ue8m0 else "fp32"
    static = VariantSpec(reference.DTYPE_NAMES[dtype], hidden, group_size, residual, layout, fmt, scale_ub=scale_ub)
    if device_type != "cuda":
        return static.name
    dynamic = static.with_hidden(None)
    bundle = serving.bundle_for(static.name) or _served_bundle(dynamic.name)
    chosen, why = serving.choose(static, bundle)
    if chosen is None:
        raise ValueError(f"no kernel runs {static.name}: " + "; ".join(f"{c.name}: {c.reason}" for c in why))
    return chosen.name


def _rms_norm_per_block_quant(result, input, weight, scale, epsilon, scale_ub, residual, group_size, is_scale_transposed, scale_ue8m0=False):
    if input.dim() != 2:
        raise ValueError(f"input must be 2-D [M, K], got shape {tuple(input.shape)}")
    variant = _per_block_variant(
        input.dtype, input.shape[1], group_size, residual is not None, is_scale_transposed, scale_ue8m0, scale_ub is not None, input.device.type
    )
    spec = spec_of(variant)
    check_arguments(spec, input, weight, residual, scale_ub)
    rows, hidden = input.shape
    if result.shape != input.shape or result.dtype != FP8 or not result.is_contiguous() or result.device != input.device:
        raise ValueError(
            f"result must be a contiguous {tuple(input.shape)} float8_e4m3fn tensor on {input.device}, "
            f"got {tuple(result.shape)} {result.dtype} strides {result.stride()} on {result.device}"
        )
    shape = (rows, hidden // group_size)
    refusal = None if scale.dim() != 2 else spec.scale.strides_refusal(shape, scale.stride())
    if tuple(scale.shape) != shape or refusal is not None or scale.dtype != torch.float32 or scale.device != input.device:
        raise ValueError(
            f"scale must be {shape} float32 on {input.device} with {refusal or spec.scale.strides_refusal(shape, (0, 0)) or 'any strides'} "
            f"(is_scale_transposed={is_scale_transposed}), got {tuple(scale.shape)} {scale.dtype} strides {scale.stride()} on {scale.device}"
        )
    _kernel_of(variant, input)(input, weight, epsilon, result, scale, residual, scale_ub)


for _name, _function in (
    ("rms_norm_group_quant", _rms_norm_group_quant),
    ("fused_add_rms_norm_group_quant", _fused_add_rms_norm_group_quant),
    ("add_rms_norm_group_quant", _add_rms_norm_group_quant),
    ("group_quant", _group_quant),
):
    _library.impl(_name, _function, "CPU")
    # CUDA, until the C++ implementation registers its own CUDA kernel (which then wins).
    _library.impl(_name, _function, "CompositeExplicitAutograd")
_library.impl("rms_norm_per_block_quant", _rms_norm_per_block_quant, "CPU")
_library.impl("rms_norm_per_block_quant", _rms_norm_per_block_quant, "CUDA")
for _name in ("rms_norm_group_quant", "add_rms_norm_group_quant", "group_quant"):
    _library.impl(_name, torch.library.fallthrough_kernel, "Autograd")


def _autograd_fused_add(x, residual, weight, eps, variant, scale_ub=None):
    check_mutable("residual", residual)
    with torch._C._AutoDispatchBelowAutograd():
        return fused_add_rms_norm_group_quant(x, residual, weight, eps, variant, scale_ub)


def _autograd_per_block(result, input, weight, scale, epsilon, scale_ub, residual, group_size, is_scale_transposed, scale_ue8m0=False):
    for name, tensor in (("result", result), ("scale", scale), ("residual", residual)):
        if tensor is not None:
            check_mutable(name, tensor)
    with torch._C._AutoDispatchBelowAutograd():
        return rms_norm_per_block_quant(result, input, weight, scale, epsilon, scale_ub, residual, group_size, is_scale_transposed, scale_ue8m0)


_library.impl("fused_add_rms_norm_group_quant", _autograd_fused_add, "Autograd")
_library.impl("rms_norm_per_block_quant", _autograd_per_block, "Autograd")


@torch.library.register_fake(f"{NAMESPACE}::rms_norm_group_quant")
def _fake(x, weight, eps, variant, scale_ub=None):
    return _outputs(spec_of(variant), x, weight=weight, scale_ub=scale_ub)


@torch.library.register_fake(f"{NAMESPACE}::fused_add_rms_norm_group_quant")
def _fake_fused(x, residual, weight, eps, variant, scale_ub=None):
    return _outputs(spec_of(variant), x, residual=residual, weight=weight, scale_ub=scale_ub)


@torch.library.register_fake(f"{NAMESPACE}::add_rms_norm_group_quant")
def _fake_add(x, residual, weight, eps, variant, scale_ub=None):
    return (*_outputs(spec_of(variant), x, residual=residual, weight=weight, scale_ub=scale_ub), torch.empty_like(x, memory_format=torch.contiguous_format))


@torch.library.register_fake(f"{NAMESPACE}::group_quant")
def _fake_group_quant(x, variant, scale_ub=None):
    return _outputs(_standalone(variant), x, scale_ub=scale_ub)


@torch.library.register_fake(f"{NAMESPACE}::rms_norm_per_block_quant")
def _fake_out(result, input, weight, scale, epsilon, scale_ub, residual, group_size, is_scale_transposed, scale_ue8m0=False):
    _check_devices(input, result=result, weight=weight, scale=scale, scale_ub=scale_ub, residual=residual)


rms_norm_group_quant = torch.ops.tvm_rmsquant.rms_norm_group_quant
fused_add_rms_norm_group_quant = torch.ops.tvm_rmsquant.fused_add_rms_norm_group_quant
add_rms_norm_group_quant = torch.ops.tvm_rmsquant.add_rms_norm_group_quant
rms_norm_per_block_quant = torch.ops.tvm_rmsquant.rms_norm_per_block_quant
group_quant = torch.ops.tvm_rmsquant.group_quant
