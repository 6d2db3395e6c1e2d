"""Scale layouts: the one home of the scale tensor's geometry and of the quant traits.

A variant's (layout, format) pair names one ``ScaleLayout`` record: the element dtype,
how many groups share one element, row- or column-major, the row alignment of the
storage, and the ``QuantTraits`` that say how a group's scale is computed. The tensor
expression, the schedule rules, the reference, the Python and C++ allocators and the
argument checks all read these records; the C++ ops receive ``cxx_record()`` instead of
flags of their own. Imports neither torch nor TVM.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

#: The largest float8_e4m3fn value.
FP8_MAX = 448.0
#: The smallest scale: keeps an all-zero group finite (q = 0) and matches vLLM's floor.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
#: Column-major scale rows are padded to this many for TMA's 16-byte alignment (4 fp32).
TMA_ALIGN_ROWS = 4

LAYOUTS = ("row", "col")
FORMATS = ("fp32", "ue8m0", "ue8m0_packed")
#: The C++ ops' element codes (``codegen/torch_ops.cpp``, ``ScaleLayout``).
ELEMENT_CODES = {"float32": 0, "int32": 1}


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclasses.dataclass(frozen=True)
class QuantTraits:
    """How a group's scale is made from its absmax: ``max(absmax / qmax, min_scale)``,
    then rounded up to a power of two where ``pow2`` (UE8M0: DeepGEMM's E8M0 mode)."""

    qmax: float = FP8_MAX
    min_scale: float = MIN_SCALE
    pow2: bool = False


@dataclasses.dataclass(frozen=True)
class ScaleLayout:
    """The geometry of one scale format: logical [M, C] with C = ceil(K/G / groups_per_word)."""

    layout: str
    format: str
    #: Storage dtype of one element: fp32 scales, or int32 words of four UE8M0 exponent bytes.
    element: str
    #: Groups per element: 4 for packed UE8M0 (byte i of a word is group 4c + i, padding bytes 0).
    groups_per_word: int
    #: Column-major: strides (1, ld), ld >= M; allocated with ld = round_up(M, row_align).
    column_major: bool
    row_align: int
    traits: QuantTraits

    @property
    def packed(self) -> bool:
        return self.groups_per_word > 1

    def columns(self, groups: int) -> int:
        return -(-groups // self.groups_per_word)

    def geometry(self, rows: int, groups: int) -> Tuple[Tuple[int, int], Tuple[int, int], int, str]:
        """(shape, strides, storage rows, element dtype) of the scales of ``rows`` tokens."""
        cols = self.columns(groups)
        if not self.column_major:
            return (rows, cols), (cols, 1), rows, self.element
        padded = round_up(rows, self.row_align)
        return (rows, cols), (1, padded), padded, self.element

    def groups_refusal(self, groups: int) -> Optional[str]:
        """Why the dynamic-K kernel cannot run rows of ``groups`` groups (whole words only), or None."""
        if groups % self.groups_per_word:
            return f"whole {self.element} words of {self.groups_per_word} groups"
        return None

    def strides_refusal(self, shape, strides) -> Optional[str]:
        """None when the kernels can write scales of logical ``shape`` [M, C] with ``strides``;
        else the strides they take.

        Row-major: contiguous. Column-major: (1, ld) with any ld >= M. The kernels read ld from
        the tensor, so TMA's round_up(M, 4) (``geometry``'s allocation, what DeepGEMM and
        cuBLAS read) and vLLM's unpadded (1, M) (what its fusion pass allocates when
        M % 4 != 0, and all torch 2.11's BlockWise1x128 ``scaled_mm`` takes) both work. With
        M = 0 nothing is written and any strides do. Strides are checked even where a
        dimension has size 1: the kernels' argument binder checks them.
        """
        rows, cols = shape
        if rows == 0:
            return None
        if not self.column_major:
            return None if tuple(strides) == (cols, 1) else f"row-major strides ({cols}, 1)"
        if strides[0] == 1 and strides[1] >= rows:
            return None
        examples = sorted({rows, round_up(rows, self.row_align)})
        return f"column-major strides (1, ld) with ld >= M={rows}, such as " + " or ".join(f"(1, {ld})" for ld in examples)

    def cxx_record(self) -> Tuple[int, int, bool, int]:
        """What ``register_variant`` in ``codegen/torch_ops.cpp`` takes: (element code,
        groups per element, column-major, row alignment)."""
        return ELEMENT_CODES[self.element], self.groups_per_word, self.column_major, self.row_align


def choice_error(argument: str, value, accepted) -> ValueError:
    return ValueError(f"{argument}={value!r} is not supported; accepted: {', '.join(map(repr, accepted))}")


def scale_layout(layout: str, format: str) -> ScaleLayout:
    """The record of (``layout``, ``format``); ValueError naming what is not supported."""
    if layout not in LAYOUTS:
        raise choice_error("layout", layout, LAYOUTS)
    if format not in FORMATS:
        raise choice_error("format", format, FORMATS)
    packed = format == "ue8m0_packed"
    if packed and layout != "col":
        raise ValueError(
            f"format='ue8m0_packed' needs layout='col' (got layout={layout!r}); "
            "packed scales exist only for the column-major TMA layout"
        )
    col = layout == "col"
    return ScaleLayout(
        layout=layout,
        format=format,
        element="int32" if packed else "float32",
        groups_per_word=4 if packed else 1,
        column_major=col,
        row_align=TMA_ALIGN_ROWS if col else 1,
        traits=QuantTraits(pow2=format != "fp32"),
    )
