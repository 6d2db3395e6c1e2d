"""Hugging Face transformers' fine-grained FP8 models on tvm_rmsquant's kernels: one call at init.

A model loaded with ``FineGrainedFP8Config`` holds ``FP8Linear`` layers: an fp8 weight in
128 x 128 blocks with its ``weight_scale_inv``. transformers quantizes each activation per
token in groups of 128 with kernels it fetches from the Hub at run time, so without network
such a model does not run at all. ``install(model)`` replaces each ``FP8Linear`` with a
``BlockFP8Linear`` that keeps transformers' own weight and ``weight_scale_inv`` (the same
Parameters), quantizes its activation with this package's ops and multiplies with torch's
cuBLAS block-scaled ``scaled_mm`` (BlockWise1x128 activations x BlockWise128x128 weights).

Where an RMSNorm feeds FP8 linears and nothing else (``FUSED_BLOCKS``: the blocks whose data
flow the tests check on transformers' own classes), the norm is replaced by a
``FusedRMSNormQuant`` that returns the fp8 codes and hands the scales to its consumers: the
activation quant is fused into the norm. Every other FP8 linear quantizes with the standalone
quant (``select(norm=False)``). Every site's variant comes from ``select()`` at init:
hidden size, dtype, no residual (transformers adds the residual outside the norm module, so
the add is not fused), and the layout the GEMM reads: ``cublas_blockwise``, column-major
scales with strides exactly (1, M), the only strides torch's BlockWise1x128 ``scaled_mm``
accepts. cuBLAS itself runs that GEMM only where M % 4 == 0, so the GEMM is one custom op,
``torch.ops.tvm_rmsquant.block_fp8_mm``, that pads odd M to a multiple of 4 rows inside
(``GEMM_ROW_ALIGN``): Dynamo sees one opaque op, whatever M is, where torch 2.11's
``scaled_mm`` itself breaks the graph. Nothing is decided at call time, so eager mode,
``torch.compile(fullgraph=True)`` with a dynamic token count and CUDA graphs all run the same ops.

Sites it cannot serve keep a working path, and ``install`` returns a ``SiteReport`` saying
why for each: a norm with an fp32 weight is fused through the mixed-dtype kernels (``_wf32``);
one whose weight has another dtype stays transformers' (its linears take the standalone quant of
what it returns, cast to the activations' dtype); a linear whose sizes the block GEMM cannot take, or any
linear on a device without cuBLAS's block-scaled GEMM (the CPU), multiplies its dequantized
weight in fp32 (``gemm="dequantized"``), slowly and with the same activation quant.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import reference
from ..dispatch import CONSUMERS, BoundKernel, select
from ..scale_layout import TMA_ALIGN_ROWS, round_up, scale_layout
from ..spec import mixed_weight_dtype

logger = logging.getLogger(__name__)

#: The block size of the weights and of the activation groups: cuBLAS's BlockWise128x128
#: weights and BlockWise1x128 activations.
BLOCK = 128
#: The consumer (``dispatch.CONSUMERS``) the block-scaled GEMM reads, every site's default.
CONSUMER = "cublas_blockwise"
#: Rows cuBLAS's BlockWise1x128 GEMM needs M to be a multiple of: at M = 1, 3, 5, 7 and 255 it
#: returns CUBLAS_STATUS_NOT_SUPPORTED with the (1, M) scale strides torch asks for (H100 and
#: H200, torch 2.11+cu130), and torch refuses TMA's (1, round_up(M, 4)) there: the same
#: 16-byte alignment of the scales' leading dimension as TMA's.
GEMM_ROW_ALIGN = TMA_ALIGN_ROWS
#: Blocks (by class name) in which an RMSNorm's output goes to FP8 linears and nowhere else,
#: as (norm attribute, the linears it feeds): checked on transformers' own classes by
#: ``tests/test_transformers.py``, which runs each block with hooks on the norms and linears.
#: A block not listed keeps its norms; its linears take the standalone quant.
_DECODER = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))
FUSED_BLOCKS: Dict[str, Tuple[Tuple[str, Tuple[str, ...]], ...]] = {
    "LlamaDecoderLayer": _DECODER,
    "Qwen2DecoderLayer": _DECODER,
    "Qwen3DecoderLayer": _DECODER,
    "Qwen2_5_VLDecoderLayer": _DECODER,
    # The vision tower: RMSNorm at its own hidden size (1280 in Qwen2.5-VL-7B).
    "Qwen2_5_VLVisionBlock": (("norm1", ("attn.qkv",)), ("norm2", ("mlp.gate_proj", "mlp.up_proj"))),
}


def _fp8_linear_class():
    from transformers.integrations.finegrained_fp8 import FP8Linear

    return FP8Linear


@dataclasses.dataclass
class Site:
    """One FP8 linear layer and how it runs."""

    name: str
    #: "fused" (quant fused into the norm ``norm``), "standalone" (its own quant), or
    #: "unserved" (no activation quant: x times the dequantized weight).
    quant: str
    #: "scaled_mm" (cuBLAS BlockWise1x128 x BlockWise128x128), "dequantized" (an fp32 matmul of
    #: the dequantized activation and weight, reading any scale layout), or "transformers"
    #: (the module left as it was: its weight is not fp8, and FP8Linear runs it as a plain linear).
    gemm: str
    variant: Optional[str]
    norm: Optional[str] = None
    why: str = ""

    def __str__(self) -> str:
        where = f" <- {self.norm}" if self.norm else ""
        return f"{self.name}: {self.quant}{where}, {self.variant or 'no variant'}, {self.gemm}" + (f" ({self.why})" if self.why else "")


@dataclasses.dataclass
class SiteReport:
    """Every FP8 linear of the model, and every norm left unfused with the reason."""

    sites: List[Site]
    #: (norm module name, why it was not fused) for the norms of ``FUSED_BLOCKS`` left as they were.
    unfused_norms: List[Tuple[str, str]]

    def count(self, quant: Optional[str] = None, gemm: Optional[str] = None) -> int:
        return sum((quant is None or site.quant == quant) and (gemm is None or site.gemm == gemm) for site in self.sites)

    def __str__(self) -> str:
        lines = [f"tvm_rmsquant: {len(self.sites)} FP8 linears: {self.count('fused')} fused into their RMSNorm, "
                 f"{self.count('standalone')} standalone quant, {self.count('unserved')} unserved; "
                 f"{self.count(gemm='scaled_mm')} on scaled_mm"]
        lines += [f"  {site}" for site in self.sites]
        lines += [f"  norm {name} not fused: {why}" for name, why in self.unfused_norms]
        return "\n".join(lines)


class _Handoff:
    """The scales a fused norm made for its consumers, in the same forward. A plain attribute:
    torch.compile traces the write and the reads as data flow inside one graph."""

    scales: Optional[torch.Tensor] = None


class FusedRMSNormQuant(nn.Module):
    """An RMSNorm whose only consumers are FP8 linears: returns the fp8 codes of its output
    and hands the scales to them (``BlockFP8Linear.handoff``)."""

    def __init__(self, norm: nn.Module, eps: float, kernel: BoundKernel, handoff: _Handoff):
        super().__init__()
        self.weight = norm.weight  # transformers' Parameter, shared
        self.eps = eps
        self.kernel = kernel
        self.handoff = handoff

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, scales = self.kernel(hidden_states, self.weight, self.eps)
        self.handoff.scales = scales
        return q

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, variant={self.kernel.variant or 'torch reference'}"


def padded_to_gemm_rows(q: torch.Tensor, scales: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of M rows as cuBLAS's block GEMM takes them: round_up(M, ``GEMM_ROW_ALIGN``)
    rows, the added ones zero codes with zero scales, and the scales column-major with
    strides (1, rows). At M % 4 == 0 they are returned as they are; else both are copied
    (M x K bytes of codes: decode batches, in practice), in four small kernels: a fill and a
    copy each."""
    rows = q.shape[0]
    padded = round_up(rows, GEMM_ROW_ALIGN)
    if padded == rows:
        return q, scales
    codes = q.new_empty(padded, q.shape[1])
    codes[rows:].zero_()
    codes[:rows] = q
    columns = scales.new_zeros(scales.shape[1], padded)  # [C, M4]: its transpose has strides (1, M4)
    columns[:, :rows] = scales.t()
    return codes, columns.t()


@torch.library.custom_op("tvm_rmsquant::block_fp8_mm", mutates_args=())
def block_fp8_mm(q: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                 output_dtype: torch.dtype) -> torch.Tensor:
    """q [M, K] fp8 with its BlockWise1x128 scales [M, K/128] (strides (1, M)) times weight
    [N, K] fp8 with BlockWise128x128 ``weight_scales`` ([round_up(K/128, 4), N/128] column-major):
    [M, N] in ``output_dtype``, by cuBLAS through ``torch.nn.functional.scaled_mm``, at any M."""
    from torch.nn.functional import ScalingType, scaled_mm

    rows = q.shape[0]
    q, scales = padded_to_gemm_rows(q, scales)
    out = scaled_mm(q, weight.t(), scales, ScalingType.BlockWise1x128, weight_scales, ScalingType.BlockWise128x128,
                    output_dtype=output_dtype)
    return out[:rows]  # a view of the op's own output: contiguous, as the fake says


@block_fp8_mm.register_fake
def _block_fp8_mm_fake(q, scales, weight, weight_scales, output_dtype):
    return q.new_empty((q.shape[0], weight.shape[0]), dtype=output_dtype)


class BlockFP8Linear(nn.Module):
    """transformers' ``FP8Linear`` on this package's activation quant and cuBLAS's block GEMM.

    Keeps the linear's ``weight``, ``weight_scale_inv`` and ``bias`` Parameters. ``scale_b``
    is ``weight_scale_inv`` as ``scaled_mm`` reads BlockWise128x128 scales: [round_up(K/128, 4),
    N/128] column-major, a view where K/128 % 4 == 0, else a padded copy (N/128 x 4 floats
    at most).
    """

    def __init__(self, linear: nn.Module, quant: Optional[BoundKernel], gemm: str, output_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.weight_scale_inv = linear.weight_scale_inv
        self.block_size = tuple(linear.block_size or (BLOCK, BLOCK))
        self.bias = linear.bias
        self.quant = quant
        self.gemm = gemm
        self.output_dtype = output_dtype
        #: Set by ``install`` where a fused norm feeds this layer: x is then the norm's fp8 codes.
        self.handoff: Optional[_Handoff] = None
        scales = linear.weight_scale_inv.detach().float()  # the Parameter itself where it is fp32
        columns = scales.shape[1]
        if columns % 4:
            scales = torch.nn.functional.pad(scales, (0, round_up(columns, 4) - columns))
        self.register_buffer("scale_b", scales.t(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        if self.quant is None:  # unserved: no activation quant
            return torch.nn.functional.linear(x, self._dequantized_weight().to(x.dtype), self.bias)
        if self.handoff is not None:
            q, scales = x.reshape(-1, self.in_features), self.handoff.scales
        else:
            if x.dtype != self.output_dtype:
                # transformers' norm with an fp32 weight returns fp32 (where it is not fused): the
                # quant takes the activations' dtype, as the unquantized model's next op would.
                x = x.to(self.output_dtype)
            q, scales = self.quant(x.reshape(-1, self.in_features))
        if self.gemm == "scaled_mm":
            out = torch.ops.tvm_rmsquant.block_fp8_mm(q, scales, self.weight, self.scale_b, self.output_dtype)
        else:
            per_group = reference.scales_fp32(scales, self.quant.spec, self.in_features, q.shape[0])
            activations = (q.float().view(q.shape[0], -1, BLOCK) * per_group.unsqueeze(-1)).view(q.shape)
            out = (activations @ self._dequantized_weight().t()).to(self.output_dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*leading, self.out_features)

    def _dequantized_weight(self) -> torch.Tensor:
        """The fp32 weight: each block (``block_size``, 128 x 128 where served) times its ``weight_scale_inv``."""
        (n, k), (block_n, block_k) = self.weight.shape, self.block_size
        scales = self.weight_scale_inv.float().repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
        return self.weight.float() * scales

    def extra_repr(self) -> str:
        source = "fused norm" if self.handoff is not None else (self.quant.variant or "torch reference") if self.quant else "none"
        return f"in_features={self.in_features}, out_features={self.out_features}, quant={source}, gemm={self.gemm}"


def _gemm_refusal(linear: nn.Module, device: torch.device, consumer: str) -> Optional[str]:
    """Why cuBLAS's block GEMM cannot run this linear on ``device`` for ``consumer``, or None."""
    if consumer != CONSUMER:
        return f"consumer {consumer!r}: the dequantized GEMM reads its {'/'.join(CONSUMERS[consumer])} scales"
    if device.type != "cuda":
        return f"the weight is on {device}; cuBLAS's block-scaled GEMM runs on CUDA"
    if linear.out_features % BLOCK or linear.in_features % BLOCK:
        return f"BlockWise128x128 needs N and K multiples of {BLOCK}, the weight is [{linear.out_features}, {linear.in_features}]"
    return None


def _quant_refusal(linear: nn.Module) -> Optional[str]:
    """Why this package cannot quantize the linear's activation as its weights were made, or None."""
    if tuple(linear.block_size or ()) != (BLOCK, BLOCK):
        return f"block_size={linear.block_size}; the activation groups follow 128 x 128 weight blocks"
    if linear.activation_scheme != "dynamic":
        return f"activation_scheme={linear.activation_scheme!r}; only dynamic per-token-group quant is served"
    if linear.in_features % BLOCK:
        return f"in_features={linear.in_features} is not a multiple of {BLOCK}"
    return None


def _norm_eps(norm: nn.Module) -> Optional[float]:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    return None


def install(model: nn.Module, dtype: Optional[torch.dtype] = None, bundle=None, fuse: bool = True,
            consumers: Optional[Dict[str, str]] = None) -> SiteReport:
    """Run ``model``'s FP8 linears on tvm_rmsquant's kernels; returns the per-site report.

    Call once, at init, after the model is loaded (with ``FineGrainedFP8Config``) and on its
    device. ``dtype`` is the activations' dtype (default: the input embeddings'). ``bundle``
    is passed to every ``select()``. ``fuse=False`` leaves every norm as it is (the unfused
    path: transformers' norm, then the standalone quant, then the GEMM), for comparison.
    ``consumers`` maps module-name prefixes to the consumer (``dispatch.CONSUMERS``) whose
    scale layout their linears read, the longest prefix winning: ``cublas_blockwise`` (the
    default) multiplies with ``scaled_mm``; any other G = 128 consumer with the dequantized
    GEMM, which reads every layout. Modules are replaced in place; the Parameters are kept.
    """
    fp8_linear = _fp8_linear_class()
    if dtype is None:
        dtype = model.get_input_embeddings().weight.dtype
    consumers = dict(consumers or {})
    for prefix, consumer in consumers.items():
        _check_consumer(prefix, consumer)
    linears = {name: module for name, module in model.named_modules() if type(module) is fp8_linear}
    sites: Dict[str, Site] = {}
    replacements: Dict[str, BlockFP8Linear] = {}
    for name, linear in linears.items():
        device = linear.weight.device
        consumer = _consumer_of(name, consumers)
        if linear.weight.dtype != torch.float8_e4m3fn:
            # transformers left the weight unquantized (sizes not a multiple of its blocks).
            sites[name] = Site(name, "unserved", "transformers", None, why=f"transformers kept the weight in {linear.weight.dtype}")
            continue
        refusal = _quant_refusal(linear)
        if refusal is not None:
            sites[name] = Site(name, "unserved", "dequantized", None, why=refusal)
            replacements[name] = BlockFP8Linear(linear, None, "dequantized", dtype)
            continue
        gemm_refusal = _gemm_refusal(linear, device, consumer)
        gemm = "dequantized" if gemm_refusal else "scaled_mm"
        quant = select(linear.in_features, dtype, BLOCK, consumer=consumer, device=device, bundle=bundle, norm=False)
        sites[name] = Site(name, "standalone", gemm, quant.variant, why=gemm_refusal or _chosen(quant))
        replacements[name] = BlockFP8Linear(linear, quant, gemm, dtype)

    unfused: List[Tuple[str, str]] = []
    norms: Dict[str, FusedRMSNormQuant] = {}
    for block_name, block in model.named_modules():
        for norm_attr, consumer_paths in FUSED_BLOCKS.get(type(block).__name__, ()):
            norm_name = f"{block_name}.{norm_attr}"
            names = [f"{block_name}.{path}" for path in consumer_paths]
            reason, kernel = _fusion(block, norm_attr, names, sites, dtype, bundle, consumers) if fuse else ("fuse=False", None)
            if reason is not None:
                unfused.append((norm_name, reason))
                continue
            handoff = _Handoff()
            norms[norm_name] = FusedRMSNormQuant(getattr(block, norm_attr), _norm_eps(getattr(block, norm_attr)), kernel, handoff)
            for name in names:
                replacements[name].handoff = handoff
                site = sites[name]
                sites[name] = dataclasses.replace(site, quant="fused", norm=norm_name, variant=kernel.variant,
                                                  why=site.why if site.gemm != "scaled_mm" else _chosen(kernel))
    for name, module in {**replacements, **norms}.items():
        model.set_submodule(name, module)
    report = SiteReport([sites[name] for name in linears], unfused)
    logger.info("%s", report)
    return report


def _check_consumer(prefix: str, consumer: str) -> None:
    if consumer not in CONSUMERS:
        raise ValueError(f"consumers[{prefix!r}]={consumer!r} is unknown; choose one of {sorted(CONSUMERS)}")
    record = scale_layout(*CONSUMERS[consumer])
    if record.group not in (None, BLOCK):
        raise ValueError(f"consumers[{prefix!r}]={consumer!r} scales groups of {record.group}; "
                         f"transformers' FP8 weights are in {BLOCK} x {BLOCK} blocks, so its activations in groups of {BLOCK}")


def _consumer_of(name: str, consumers: Dict[str, str]) -> str:
    """The consumer of the longest prefix of ``name`` in ``consumers`` (a prefix ends at a dot), else CONSUMER."""
    matches = [prefix for prefix in consumers if name == prefix or name.startswith(prefix + ".") or not prefix]
    return consumers[max(matches, key=len)] if matches else CONSUMER


def _chosen(kernel: BoundKernel) -> str:
    taken = [candidate.reason for candidate in kernel.why if candidate.taken]
    return taken[-1] if taken else ""


def _fusion(block: nn.Module, norm_attr: str, consumers: List[str], sites: Dict[str, Site], dtype: torch.dtype, bundle,
            consumer_map: Dict[str, str]):
    """(why the norm cannot be fused with its consumers, None) or (None, its kernel)."""
    norm = getattr(block, norm_attr, None)
    if norm is None:
        return f"the block has no {norm_attr}", None
    weight, eps = getattr(norm, "weight", None), _norm_eps(norm)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        return f"{type(norm).__name__} is not an RMSNorm with a 1-D weight and an eps", None
    missing = [name for name in consumers if name not in sites]
    if missing:
        return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not FP8 linears", None
    unserved = [name for name in consumers if sites[name].quant == "unserved"]
    if unserved:
        return f"{', '.join(unserved)} cannot take a quantized activation ({sites[unserved[0]].why})", None
    try:
        mixed_weight_dtype(reference.DTYPE_NAMES[dtype], reference.DTYPE_NAMES[weight.dtype])
    except (KeyError, ValueError):
        return (f"the norm weight is {weight.dtype} and the activations {dtype}; the kernels take the activations' "
                f"dtype or fp32, so its linears take the standalone quant of what it returns"), None
    layouts = {_consumer_of(name, consumer_map) for name in consumers}
    if len(layouts) > 1:
        return f"its linears read different consumers' layouts ({', '.join(sorted(layouts))}): one quantized output cannot serve them", None
    # An fp32 weight (Gemma- and Qwen-style) selects the mixed-dtype kernels: one rounding after the
    # fp32 multiply, where transformers' norm returns the fp32 product itself.
    kernel = select(weight.shape[0], dtype, BLOCK, consumer=layouts.pop(), device=weight.device, bundle=bundle,
                    weight_dtype=weight.dtype)
    return None, kernel
