"""The variant spec: one frozen object that names, validates and hashes one kernel.

Everything downstream (tensor expression, schedules, codegen, bundle, ops) is keyed
on a ``VariantSpec``; its ``name`` is the stable identifier stored in manifests.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import re
from typing import Optional

from .scale_layout import FORMATS, LAYOUTS, RECORDS, ScaleLayout, choice_error, round_up, scale_layout

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
OUT_DTYPES = ("float8_e4m3fn",)


def _alternatives(names) -> str:
    """A regex alternation of ``names``, longest first (so ue8m0_packed is not read as ue8m0)."""
    return "|".join(sorted(names, key=len, reverse=True))


_NAME_RE = re.compile(
    rf"^(?P<dtype>{_alternatives(DTYPES)})_k(?P<hidden>\d+|dyn)_g(?P<group>\d+)"
    rf"(?P<residual>_res)?(?P<no_norm>_nonorm)?(?P<weight>_wf32)?_(?P<layout>{_alternatives(LAYOUTS)})_(?P<format>{_alternatives(FORMATS)})"
    r"(?P<scale_ub>_ub)?$"
)


def check_eps(eps) -> None:
    """Refuse an eps the fp32 kernels cannot use: it must be a number that stays positive and
    finite in fp32, the precision the norm adds it in (1e39 becomes inf and zeroes every
    row; 1e-50 becomes 0 and gives an all-zero row NaN scales)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps={eps!r} must be a float, such as 1e-6")
    as_fp32 = ctypes.c_float(eps).value
    if not 0.0 < as_fp32 < float("inf"):
        raise ValueError(f"eps={eps!r} must be positive and finite in fp32 (it is {as_fp32!r} there), such as 1e-6")


@dataclasses.dataclass(frozen=True)
class VariantSpec:
    """One fused RMSNorm + per-token-group FP8 quant kernel.

    ``hidden=None`` is the dynamic-K variant: K is a runtime argument that must be a
    multiple of ``group``. ``norm=False`` is the standalone quant (vLLM's
    ``per_token_group_fp8_quant``) for linear layers that follow no norm (attention output,
    MLP down projection): the same tensor expression with the norm stage left out, so the
    same layouts, formats, rules, bundle and ops; its name carries ``_nonorm``.
    ``weight_dtype="fp32"`` takes an fp32 norm weight with bf16/fp16 activations (Gemma- and
    Qwen-style checkpoints): the weight multiply in fp32, then one rounding to the activation
    dtype, as vLLM's mixed-dtype RMSNorm does; its name carries ``_wf32``.
    """

    dtype: str
    hidden: Optional[int]
    group: int = 128
    residual: bool = False
    layout: str = "row"
    format: str = "fp32"
    scale_ub: bool = False
    out_dtype: str = "float8_e4m3fn"
    norm: bool = True
    #: The norm weight's dtype where it is not ``dtype`` (only "fp32", with bf16/fp16 activations).
    weight_dtype: Optional[str] = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise choice_error("dtype", self.dtype, DTYPES)
        layout = scale_layout(self.layout, self.format)  # refuses an unknown layout, format or pair
        if self.out_dtype not in OUT_DTYPES:
            raise choice_error("out_dtype", self.out_dtype, OUT_DTYPES)
        for flag in ("residual", "scale_ub", "norm"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag}={getattr(self, flag)!r} must be a bool")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group <= 0 or self.group % 8:
            raise ValueError(f"group={self.group!r} must be a positive multiple of 8 (64 and 128 are the usual sizes)")
        if self.weight_dtype is not None:
            if self.weight_dtype != "fp32":
                raise choice_error("weight_dtype", self.weight_dtype, (None, "fp32"))
            if self.dtype == "fp32" or not self.norm:
                raise ValueError(
                    f"weight_dtype='fp32' is for a bf16 or fp16 norm, got dtype={self.dtype!r}, norm={self.norm}; "
                    f"leave weight_dtype=None where the weight has the activations' dtype or there is no norm"
                )
        if self.residual and not self.norm:
            raise ValueError("residual=True needs norm=True: the residual is added before the norm (a standalone quant takes x only)")
        refusal = layout.group_refusal(self.group)
        if refusal is not None:
            raise ValueError(f"group={self.group}: {refusal}")
        if self.hidden is not None:
            if isinstance(self.hidden, bool) or not isinstance(self.hidden, int) or self.hidden <= 0:
                raise ValueError(f"hidden={self.hidden!r} must be a positive int, or None for the dynamic-K variant")
            if self.hidden % self.group:
                raise ValueError(
                    f"hidden={self.hidden} is not divisible by group={self.group}; "
                    f"use a group that divides it, or hidden={round_up(self.hidden, self.group)}"
                )

    # -- naming -------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        hidden = "dyn" if self.hidden is None else str(self.hidden)
        parts = [self.dtype, f"k{hidden}", f"g{self.group}"]
        if self.residual:
            parts.append("res")
        if not self.norm:
            parts.append("nonorm")
        if self.weight_dtype is not None:
            parts.append("wf32")
        parts += [self.layout, self.format]
        if self.scale_ub:
            parts.append("ub")
        return "_".join(parts)

    @classmethod
    def parse(cls, name: str) -> "VariantSpec":
        match = _NAME_RE.match(name)
        if not match:
            raise ValueError(
                f"variant name {name!r} does not parse; expected e.g. 'bf16_k7168_g128_res_col_ue8m0' "
                f"(dtype_k<K|dyn>_g<G>[_res|_nonorm][_wf32]_<layout>_<format>[_ub], a layout:format pair of "
                f"{', '.join(f'{layout}:{fmt}' for layout, fmt in RECORDS)})"
            )
        groups = match.groupdict()
        return cls(
            dtype=groups["dtype"],
            hidden=None if groups["hidden"] == "dyn" else int(groups["hidden"]),
            group=int(groups["group"]),
            residual=groups["residual"] is not None,
            layout=groups["layout"],
            format=groups["format"],
            scale_ub=groups["scale_ub"] is not None,
            norm=groups["no_norm"] is None,
            weight_dtype="fp32" if groups["weight"] else None,
        )

    def to_json(self) -> dict:
        """The fields; ``norm`` only where False and ``weight_dtype`` only where set, so that
        every other spec keeps the JSON and ``digest`` it had before they existed (manifests,
        tuning records)."""
        data = dataclasses.asdict(self)
        if self.norm:
            del data["norm"]
        if self.weight_dtype is None:
            del data["weight_dtype"]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "VariantSpec":
        return cls(**data)

    def digest(self) -> str:
        """A content hash of the spec, stable across processes and Python versions."""
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def __str__(self) -> str:
        return self.name

    # -- derived facts ------------------------------------------------------------------------

    @property
    def tvm_dtype(self) -> str:
        return DTYPES[self.dtype]

    @property
    def weight_dtype_name(self) -> str:
        """The norm weight's dtype: ``weight_dtype`` where set, else the activations'."""
        return self.weight_dtype or self.dtype

    @property
    def weight_tvm_dtype(self) -> str:
        """The norm weight's dtype, as TVM and torch name it."""
        return DTYPES[self.weight_dtype_name]

    @property
    def itemsize(self) -> int:
        """Bytes per element of the input dtype."""
        return {"bf16": 2, "fp16": 2, "fp32": 4}[self.dtype]

    @property
    def is_dynamic(self) -> bool:
        return self.hidden is None

    @property
    def scale(self) -> ScaleLayout:
        """The scale layout record (``tvm_rmsquant.scale_layout``): geometry and quant traits."""
        return scale_layout(self.layout, self.format)

    @property
    def pow2_scales(self) -> bool:
        return self.scale.traits.pow2

    def accepts_hidden(self, hidden: int) -> Optional[str]:
        """None when this variant can run rows of ``hidden`` elements; otherwise why not."""
        if self.hidden is not None:
            return None if hidden == self.hidden else f"built for hidden={self.hidden}, not {hidden}"
        if hidden <= 0 or hidden % self.group:
            return f"hidden={hidden} is not a positive multiple of group={self.group}"
        words = self.scale.groups_refusal(hidden // self.group)
        if words is not None:
            multiple = self.scale.groups_per_word * self.group
            return f"the dynamic-K {self.format} kernel needs hidden % {multiple} == 0 ({words}), got {hidden}"
        return None

    def with_hidden(self, hidden: Optional[int]) -> "VariantSpec":
        return dataclasses.replace(self, hidden=hidden)


def mixed_weight_dtype(dtype: str, weight: str) -> Optional[str]:
    """The ``weight_dtype`` of a norm with ``dtype`` activations and a ``weight`` weight (spec
    dtype names): None where they are one dtype, else ``weight`` where some kernel takes the pair
    (an fp32 weight with 16-bit activations). ValueError, from the spec's own checks, where none does."""
    if weight == dtype:
        return None
    VariantSpec(dtype, None, weight_dtype=weight)
    return weight


def num_groups(hidden: int, group: int) -> int:
    return hidden // group


def scale_geometry(spec: VariantSpec, rows: int, hidden: Optional[int] = None):
    """(shape, strides, storage rows, dtype name) of ``spec``'s scales for ``rows`` tokens
    (``ScaleLayout.geometry``; K from the spec unless given)."""
    hidden = spec.hidden if hidden is None else hidden
    if hidden is None:
        raise ValueError("scale_geometry of a dynamic-K spec needs hidden=")
    return spec.scale.geometry(rows, num_groups(hidden, spec.group))
