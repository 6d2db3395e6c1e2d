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
#: K, G = 128, fp32 scales in both layouts: 8 variants, so that every kernel the ops can be
#: asked for is built, and so run by the GPU tests, without doubling the build.
DEFAULT_SCALE_UB_LAYOUTS = (("row", "fp32"), ("col", "fp32"))
#: The default's G = 32 kernels, for every default hidden size and dynamic K (72 variants):
#: packed UE8M0, which Blackwell DeepGEMM (``deepgemm_sm100``) also reads at group 32, and
#: MXFP8 with its scale rounded up (``cublas_mxfp8``).
GROUP32_LAYOUTS = (("col", "ue8m0_packed"), ("tiled", "mxfp8"))
#: The all preset's G = 32 kernels add every other format defined for G = 32 (the OCP MX rule).
ALL_GROUP32_LAYOUTS = GROUP32_LAYOUTS + tuple(
    pair for pair, record in RECORDS.items() if record.group == MX_GROUP and pair not in GROUP32_LAYOUTS
)
PRESETS = ("default", "all")


def _specs(dtypes, hidden_groups, layouts, scale_ubs) -> List[VariantSpec]:
    specs = []
    for dtype, (hidden, group), residual, (layout, fmt), scale_ub in itertools.product(
        dtypes, hidden_groups, (False, True), layouts, scale_ubs
    ):
        specs.append(VariantSpec(dtype, hidden, group, residual, layout, fmt, scale_ub))
    return specs


def preset(name: str, hidden: Optional[Sequence[int]] = None, dtypes: Optional[Iterable[str]] = None) -> List[VariantSpec]:
    """The variants of preset ``name``, optionally narrowed to some hidden sizes and dtypes.

    Every preset includes one dynamic-K variant per (dtype, group, residual, layout, format),
    so any hidden size divisible by the group runs without a rebuild.
    """
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is unknown; choose one of {PRESETS}")
    dtypes = tuple(dtypes) if dtypes is not None else (DEFAULT_DTYPES if name == "default" else ("bf16", "fp16", "fp32"))
    hidden = tuple(hidden) if hidden is not None else DEFAULT_HIDDEN
    static = [(k, 128) for k in hidden] + [(k, 64) for k in hidden if name == "all" or k in GROUP64_HIDDEN]
    layouts = CONSUMER_LAYOUTS if name == "default" else ALL_LAYOUTS
    scale_ubs = (False,) if name == "default" else (False, True)
    dynamic = [(None, 128), (None, 64)]
    specs = _specs(dtypes, static + dynamic, layouts, scale_ubs)
    group32 = [(k, 32) for k in hidden] + [(None, 32)]
    if name == "default":
        specs += _specs(dtypes, [(None, 128)], DEFAULT_SCALE_UB_LAYOUTS, (True,))
        specs += _specs(dtypes, group32, GROUP32_LAYOUTS, (False,))
    else:
        specs += _specs(dtypes, group32, ALL_GROUP32_LAYOUTS, scale_ubs)
    return sorted(set(specs), key=lambda spec: spec.name)
