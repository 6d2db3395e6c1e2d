"""The init-time dispatcher: pick the variant once, return a kernel with everything bound.

``select`` runs at model init, where device queries and shape checks are safe. The
``BoundKernel`` it returns calls one fixed op with fixed arguments: no device query,
capability check, environment read or shape heuristic happens at call time, so
torch.compile traces it as a single custom op.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional, Tuple

import torch

from . import ops, reference, serving
from .loader import BundleError, open_bundle
from .reference import DTYPE_NAMES
from .serving import Candidate
from .spec import VariantSpec, check_eps, mixed_weight_dtype

logger = logging.getLogger(__name__)

#: Consumer GEMM -> (scale layout, scale format) it reads.
CONSUMERS = {
    "deepgemm_sm90": ("col", "fp32"),
    "deepgemm_sm90_ue8m0": ("col", "ue8m0"),
    "deepgemm_sm100": ("col", "ue8m0_packed"),
    # torch's BlockWise1x128 scaled_mm: strides exactly (1, M) (it refuses TMA padding).
    "cublas_blockwise": ("col_dense", "fp32"),
    # cuBLAS MXFP8 (torch's scaled_mm, BlockWise1x32 with SWIZZLE_32_4_4; Blackwell): G = 32.
    "cublas_mxfp8": ("tiled", "mxfp8"),
    "triton": ("row", "fp32"),
    "row": ("row", "fp32"),
}


def _dispatcher_entry(overload):
    """An op overload's C++ callable: the same dispatcher entry without OpOverload's Python frame."""
    return getattr(overload, "_op", overload)


#: The ops a BoundKernel calls, (without residual, with residual, the standalone quant): while
#: torch.compile traces (the graph records these), and eagerly.
TRACED_OPS = (ops.rms_norm_group_quant.default, ops.fused_add_rms_norm_group_quant.default, ops.group_quant.default)
EAGER_OPS = tuple(map(_dispatcher_entry, TRACED_OPS))


def _op_index(spec: VariantSpec) -> int:
    """Which of TRACED_OPS / EAGER_OPS runs ``spec``."""
    return 2 if not spec.norm else int(spec.residual)
_is_compiling = torch.compiler.is_compiling


@dataclasses.dataclass
class BoundKernel:
    """One layer's fused norm + quant, fixed at init. Call with (x, weight, eps, residual), or
    with x alone where the spec is the standalone quant (``select(norm=False)``).

    It calls the torch op, which torch.compile records and which, eagerly on CUDA, is one
    dispatcher entry into the bundle's C++ implementation. Where that cannot load,
    ``kernel`` (bound at init) is the Python implementation, called directly in eager mode
    to save the dispatcher's cost; every path runs the same kernel with the same checks.
    """

    spec: VariantSpec
    variant: Optional[str]
    why: List[Candidate]
    kernel: Optional[ops.Kernel] = dataclasses.field(default=None, repr=False)
    #: Where the variant was chosen to run: the fusion pass traces its pattern there
    #: (the reference's scale allocation names its device).
    device_type: str = "cuda"
    #: The norm weight's dtype where it is neither x's nor the spec's (a reference layer,
    #: ``select(weight_dtype=)`` with a pair no kernel takes).
    weight_dtype: Optional[torch.dtype] = None

    def __post_init__(self):
        # The eager op for this variant's arguments, looked up once (None: take the general path).
        eager = self.variant is not None and self.kernel is None and not self.spec.scale_ub
        self._eager_op = EAGER_OPS[_op_index(self.spec)] if eager else None

    def __call__(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6, residual: Optional[torch.Tensor] = None, scale_ub=None):
        """(q, scales) for x [..., K]; ``residual`` (if the variant has one) is updated in place."""
        op = self._eager_op
        # The per-step path, kept to a few bytecodes: 2-D x, the variant's own arguments, eager.
        if op is not None and (residual is None) is not self.spec.residual and x.dim() == 2 and not _is_compiling():
            if not self.spec.norm:
                if weight is None:
                    return op(x, self.variant)
            elif residual is None:
                return op(x, weight, eps, self.variant)
            else:
                return op(x, residual, weight, eps, self.variant)
        return self._call(x, weight, eps, residual, scale_ub)

    def _call(self, x, weight, eps, residual, scale_ub):
        flat, residual_flat = x, residual
        if isinstance(x, torch.Tensor) and x.dim() == 0:
            raise ValueError("x is 0-D; it must be [..., K] with K the hidden size")
        if x.dim() != 2:
            flat = x.reshape(-1, x.shape[-1])
            if residual is not None:
                if residual.shape != x.shape:
                    raise ValueError(f"residual must be {tuple(x.shape)} like x, got {tuple(residual.shape)}")
                try:
                    residual_flat = residual.view(flat.shape)
                except RuntimeError:
                    raise ValueError(
                        f"residual of shape {tuple(residual.shape)} and strides {residual.stride()} cannot be viewed as "
                        f"{tuple(flat.shape)} rows, which it is updated in place as; pass a contiguous residual"
                    ) from None
        compiling = _is_compiling()
        norm = self.spec.norm
        if self.variant is None:
            # The reference runs the contract's checks too: a layer routed here is no less checked.
            if norm:
                check_eps(eps)
            ops.check_arguments(self.spec, flat, weight, residual_flat, scale_ub, self.weight_dtype)
            if residual is not None:
                ops.check_mutable("residual", residual)
            q, scales, residual_out = reference.rms_norm_group_quant(flat, weight, eps, self.spec, residual_flat, scale_ub)
            if residual is not None:
                residual.copy_(residual_out.view(residual.shape))
        elif self.kernel is not None and not compiling:
            q, scales = self.kernel(flat, weight, eps if norm else None, residual=residual_flat, scale_ub=scale_ub)
        else:
            plain, fused, standalone = TRACED_OPS if compiling else EAGER_OPS
            # scale_ub only when given: an explicit None costs the dispatcher's argument parsing.
            cap = () if scale_ub is None else (scale_ub,)
            if not norm:
                if weight is not None or residual is not None:
                    ops.check_arguments(self.spec, flat, weight, residual_flat, scale_ub)
                q, scales = standalone(flat, self.variant, *cap)
            elif residual_flat is None:
                q, scales = plain(flat, weight, eps, self.variant, *cap)
            else:
                q, scales = fused(flat, residual_flat, weight, eps, self.variant, *cap)
        return (q if flat is x else q.view(x.shape)), scales


def consumer_layout(consumer: Optional[str], scale_layout: Optional[str], scale_format: Optional[str]) -> Tuple[str, str]:
    if scale_layout is not None or scale_format is not None:
        return scale_layout or "row", scale_format or "fp32"
    if consumer not in CONSUMERS:
        raise ValueError(f"consumer={consumer!r} is unknown; choose one of {sorted(CONSUMERS)} or pass scale_layout/scale_format")
    return CONSUMERS[consumer]


def deepgemm_applies(consumer_weight: torch.Tensor, output_dtype: torch.dtype) -> Optional[str]:
    """None when DeepGEMM can consume this layer (vLLM's should_use_deepgemm_for_fp8_linear); else why not."""
    if consumer_weight.dim() != 2:
        raise ValueError(
            f"consumer_weight must be the consuming linear layer's 2-D weight [N, K], got shape "
            f"{tuple(consumer_weight.shape)}; a norm's 1-D weight is not a linear weight"
        )
    n, k = consumer_weight.shape
    if output_dtype != torch.bfloat16:
        return f"DeepGEMM needs a bf16 output, the layer outputs {output_dtype}"
    if n % 64 or k % 128:
        return f"DeepGEMM needs N % 64 == 0 and K % 128 == 0, the weight is [{n}, {k}]"
    return None


def select(
    hidden_size: int,
    dtype: torch.dtype,
    group_size: int = 128,
    residual: bool = False,
    consumer: Optional[str] = "row",
    device="cuda",
    bundle=None,
    scale_layout: Optional[str] = None,
    scale_format: Optional[str] = None,
    consumer_weight: Optional[torch.Tensor] = None,
    output_dtype: torch.dtype = torch.bfloat16,
    scale_ub: bool = False,
    weight_dtype: Optional[torch.dtype] = None,
    norm: bool = True,
) -> BoundKernel:
    """Choose the kernel for one layer: static-K, then dynamic-K, then the torch reference.

    ``norm=False`` selects the standalone quant (no norm, no residual): call the result with x.

    ``weight_dtype`` is the norm weight's dtype where it differs from the activations':
    an fp32 weight with bf16/fp16 activations (Gemma- and Qwen-style checkpoints) selects the
    mixed-dtype kernels (``_wf32`` variants); any other pair runs the torch reference, with a
    warning, rather than failing at init.
    """
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype={dtype} is not supported; accepted: {sorted(map(str, DTYPE_NAMES))}")
    if weight_dtype is not None and weight_dtype not in DTYPE_NAMES:
        raise TypeError(f"weight_dtype={weight_dtype} is not supported; accepted: {sorted(map(str, DTYPE_NAMES))}")
    why: List[Candidate] = []
    layout, fmt = consumer_layout(consumer, scale_layout, scale_format)
    if consumer_weight is not None and consumer is not None and consumer.startswith("deepgemm"):
        refusal = deepgemm_applies(consumer_weight, output_dtype)
        if refusal is not None:
            why.append(Candidate(f"consumer {consumer}", False, refusal + "; falling back to Triton's row-major fp32 scales"))
            layout, fmt = CONSUMERS["triton"]
    weight_field, weight_refusal = None, None
    if norm and weight_dtype is not None:
        try:
            weight_field = mixed_weight_dtype(DTYPE_NAMES[dtype], DTYPE_NAMES[weight_dtype])
        except ValueError as error:
            weight_refusal = str(error)
    spec = VariantSpec(DTYPE_NAMES[dtype], hidden_size, group_size, residual, layout, fmt, scale_ub, norm=norm, weight_dtype=weight_field)
    device = torch.device(device)

    chosen = None
    if weight_refusal is not None:
        why.append(Candidate(spec.name, False, f"the norm weight is {weight_dtype} and the activations {dtype}; no kernel takes the pair ({weight_refusal})"))
    elif device.type == "cuda" and not torch.cuda.is_available():
        why.append(Candidate("device", False, f"device={device}, but this torch {torch.__version__} has no CUDA device"))
    elif device.type == "cuda":
        try:
            opened = open_bundle(bundle)
            opened.check_device(torch.cuda.get_device_capability(device))
        except BundleError as error:
            opened = None
            why.append(Candidate("bundle", False, str(error)))
        if opened is not None:
            chosen, refused = serving.choose(spec, opened)
            why += refused
        if chosen is not None:
            no_native = ops.use_bundle(opened)
            route = "the C++ torch op" if no_native is None else f"the Python torch op: {no_native}"
            why.append(Candidate(chosen.name, True, f"{opened.entry(chosen.name)['rule']} kernel from {opened.path}, called through {route}"))
    elif device.type == "cpu":
        # CPU: the op runs the llvm build of this static spec (or the reference without TVM).
        chosen = spec
        why.append(Candidate(spec.name, True, "CPU op (TVM llvm build where installed, else the reference)"))
    else:
        why.append(Candidate(spec.name, False, f"device={device} is neither CUDA nor CPU"))
    if chosen is None:
        logger.warning("tvm_rmsquant: no kernel for %s; using the torch reference. Why: %s", spec.name, "; ".join(c.reason for c in why))
        why.append(Candidate("torch_reference", True, "no kernel applies; eager torch reference (slow)"))
        return BoundKernel(spec=spec, variant=None, why=why, device_type=device.type, weight_dtype=weight_dtype if weight_refusal else None)
    spec_bound = chosen.with_hidden(hidden_size) if chosen.is_dynamic else chosen
    kernel = ops.kernel(chosen.name, device) if device.type == "cuda" and no_native is not None else None
    return BoundKernel(spec=spec_bound, variant=chosen.name, why=why, kernel=kernel, device_type=device.type)
