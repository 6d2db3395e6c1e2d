"""Kernel sets for the offline build: which variants a bundle holds."""

from __future__ import annotations

import itertools
from typing import Iterable, List, Optional, Sequence

from .scale_layout import MX_GROUP, RECORDS
from .spec import VariantSpec

#: Hidden sizes of real models (Llama, Qwen, Mistral, DeepSeek-V3's 7168, ...).
DEFAULT_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
#: Hidden sizes that also get G = 64 kernels.
GROUP64_HIDDEN = (4096, 7168)
DEFAULT_DTYPES = ("bf16", "fp16")
#: (layout, format) of the README's consumer table: Triton, DeepGEMM/cuBLAS, DeepGEMM sm90
#: with UE8M0 scales, Blackwell DeepGEMM.
CONSUMER_LAYOUTS = (("row", "fp32"), ("col", "fp32"), ("col", "ue8m0"), ("col", "ue8m0_packed"))
ALL_LAYOUTS = CONSUMER_LAYOUTS + (("row", "ue8m0"),)
#: The default's scale_ub kernels (vLLM's ``rms_norm_per_block_quant`` takes a cap): dynamic
#: K, G = 128, fp32 scales in both layouts, fused and standalone (12 variants), so that every
#: kernel the ops can be asked for is built, and so run by the GPU tests, without doubling the build.
DEFAULT_SCALE_UB_LAYOUTS = (("row", "fp32"), ("col", "fp32"))
#: The default's G = 32 kernels, for every default hidden size and dynamic K (72 variants):
#: packed UE8M0, which Blackwell DeepGEMM (``deepgemm_sm100``) also reads at group 32, and
#: MXFP8 with its scale rounded up (``cublas_mxfp8``).
GROUP32_LAYOUTS = (("col", "ue8m0_packed"), ("tiled", "mxfp8"))
#: cuBLAS BlockWise1x128 through torch's ``scaled_mm`` (``cublas_blockwise``, the transformers
#: integration): G = 128 only, every default hidden size and dynamic K (36 variants).
BLOCKWISE_LAYOUTS = (("col_dense", "fp32"),)
#: Static-K standalone quant for that consumer, at every default hidden size (attention output)
#: and these MLP intermediate sizes (down projection: Qwen3-8B 12288, Llama-3-8B and Mistral-7B
#: 14336; 11008 and 18944 split into groups no whole number of warps covers, so ``row_resident``
#: refuses them). At dynamic K, ``dynamic_rows`` walks a row's K / 128 groups one after another:
#: the decode layer's norm + quant work took 61 us of its 253 us on the H200 (docs/perf.md).
STANDALONE_INTERMEDIATE = (12288, 14336)
#: The all preset's G = 32 kernels add every other format defined for G = 32 (the OCP MX rule).
ALL_GROUP32_LAYOUTS = GROUP32_LAYOUTS + tuple(
    pair for pair, record in RECORDS.items() if record.group == MX_GROUP and pair not in GROUP32_LAYOUTS
)
#: The fp32-norm-weight variant (``weight_dtype="fp32"``) that also has static-K kernels: bf16
#: activations (Gemma- and Qwen-style checkpoints keep the norm weight in fp32 beside them), col
#: fp32 scales (DeepGEMM's and CUTLASS's, the job issue 24 times), at every default hidden size,
#: residual or not (16 variants): the dynamic-K kernel walks a row's K / 128 groups one after
#: another (~0.4 µs each at M = 1, measured on its standalone quant), the static-K one ran
#: K = 7168, M = 1 with a residual in 2.24 µs tuned (H100; the bf16 weight's 2.16). Every other
#: mixed pair runs the dynamic-K kernel: all four consumer layouts (64 variants) took the cold
#: default build here from 2:55 to 3:32, col fp32 alone (16) from 2:46 to 3:00 (docs/perf.md,
#: build time).
STATIC_MIXED_WEIGHT = ("bf16", ("col", "fp32"))
PRESETS = ("default", "all")


def _specs(dtypes, hidden_groups, layouts, scale_ubs, norm: bool = True, weight_dtype: Optional[str] = None) -> List[VariantSpec]:
    """Every combination, with and without residual where the spec normalizes."""
    specs = []
    residuals = (False, True) if norm else (False,)
    for dtype, (hidden, group), residual, (layout, fmt), scale_ub in itertools.product(
        dtypes, hidden_groups, residuals, layouts, scale_ubs
    ):
        if weight_dtype is None or dtype != weight_dtype:
            specs.append(VariantSpec(dtype, hidden, group, residual, layout, fmt, scale_ub, norm=norm, weight_dtype=weight_dtype))
    return specs


def preset(name: str, hidden: Optional[Sequence[int]] = None, dtypes: Optional[Iterable[str]] = None) -> List[VariantSpec]:
    """The variants of preset ``name``, optionally narrowed to some hidden sizes and dtypes.

    Every preset includes one dynamic-K variant per (dtype, group, residual, layout, format),
    so any hidden size divisible by the group runs without a rebuild; and the standalone
    quant (``norm=False``) of each (dtype, group, layout, format) at dynamic K: the layers it
    serves (attention output, MLP down projection) have sizes no short list covers; at static
    K too for cuBLAS's blockwise layout, the decode path of the transformers integration, at
    the default hidden and ``STANDALONE_INTERMEDIATE`` sizes (at ``hidden`` where given); and,
    at dynamic K as the standalone quant, the fp32-weight norm (``weight_dtype="fp32"``) of each
    16-bit dtype, at static K too for ``STATIC_MIXED_WEIGHT``.
    """
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is unknown; choose one of {PRESETS}")
    dtypes = tuple(dtypes) if dtypes is not None else (DEFAULT_DTYPES if name == "default" else ("bf16", "fp16", "fp32"))
    standalone = tuple(hidden) if hidden is not None else DEFAULT_HIDDEN + STANDALONE_INTERMEDIATE
    hidden = tuple(hidden) if hidden is not None else DEFAULT_HIDDEN
    static = [(k, 128) for k in hidden] + [(k, 64) for k in hidden if name == "all" or k in GROUP64_HIDDEN]
    layouts = CONSUMER_LAYOUTS if name == "default" else ALL_LAYOUTS
    scale_ubs = (False,) if name == "default" else (False, True)
    dynamic = [(None, 128), (None, 64)]
    group32 = [(k, 32) for k in hidden] + [(None, 32)]
    group32_layouts = GROUP32_LAYOUTS if name == "default" else ALL_GROUP32_LAYOUTS
    blockwise = BLOCKWISE_LAYOUTS if name == "default" else tuple(pair for pair in RECORDS if pair[0] == "col_dense")
    specs = _specs(dtypes, static + dynamic, layouts, scale_ubs)
    specs += _specs(dtypes, [(k, 128) for k in hidden] + [(None, 128)], blockwise, scale_ubs)
    specs += _specs(dtypes, group32, group32_layouts, scale_ubs)
    specs += _specs(dtypes, [(k, 128) for k in standalone], blockwise, (False,), norm=False)
    if name == "default":
        specs += _specs(dtypes, [(None, 128)], DEFAULT_SCALE_UB_LAYOUTS, (True,))
        specs += _specs(dtypes, [(None, 128)], DEFAULT_SCALE_UB_LAYOUTS, (True,), norm=False)
    mixed_dtype, mixed_layout = STATIC_MIXED_WEIGHT
    specs += _specs([d for d in dtypes if d == mixed_dtype], [(k, 128) for k in hidden], [mixed_layout], scale_ubs, weight_dtype="fp32")
    for groups, pairs in (([(None, 128)], layouts + blockwise), ([(None, 64)], layouts), ([(None, 32)], group32_layouts)):
        specs += _specs(dtypes, groups, pairs, scale_ubs, norm=False)
        # An fp32 norm weight with 16-bit activations (Gemma, Qwen checkpoints): dynamic K, as the standalone quant.
        specs += _specs(dtypes, groups, pairs, scale_ubs, weight_dtype="fp32")
    return sorted(set(specs), key=lambda spec: spec.name)
