"""Scale layouts: the one home of the scale tensor's geometry and of the quant traits.

A variant's (layout, format) pair names one ``ScaleLayout`` record in ``RECORDS``: the
element dtype, how a group's scale is stored in it, how many groups share one element,
row- or column-major, the row alignment of the storage, the cuBLAS tile order where there
is one, and the ``QuantTraits`` that say how a group's scale is computed. The tensor
expression, the schedule rules, the reference, the Python and C++ allocators and the
argument checks all read these records; the C++ ops receive ``cxx_record()`` instead of
flags of their own. Imports neither torch nor TVM.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple

#: The largest float8_e4m3fn value.
FP8_MAX = 448.0
#: The smallest scale: keeps an all-zero group finite (q = 0) and matches vLLM's floor.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
#: Column-major scale rows are padded to this many for TMA's 16-byte alignment (4 fp32).
TMA_ALIGN_ROWS = 4
#: cuBLAS's block-scaled GEMMs read scales in tiles of 128 rows x 4 columns, 512 bytes each,
#: rows padded to 128 and columns to 4 with zeros; inside a tile, row r and column c sit at
#: byte (r % 32) * 16 + (r // 32) * 4 + c (the cuBLAS documentation's "1D block scaling
#: factors layout"; torch's SWIZZLE_32_4_4).
TILE_ROWS, TILE_COLUMNS, TILE_STRIP = 128, 4, 32
#: MX block scaling (OCP Microscaling Formats v1.0) scales groups of 32 elements.
MX_GROUP = 32

#: Storage dtypes of a scale element (torch and TVM share these names), their codes in the
#: C++ ops (``codegen/torch_ops.cpp``, ``ScaleLayout``) and their bytes.
ELEMENTS = {"float32": (0, 4), "int32": (1, 4), "float8_e8m0fnu": (2, 1)}
#: How a group's scale is computed from its absmax a (``QuantTraits.rounding``):
#: ``exact``  max(a / qmax, min_scale);
#: ``up``     that, rounded up to a power of two (DeepGEMM's UE8M0 rule: no code saturates);
#: ``ocp``    2^(floor(log2(max(a, qmax * min_scale))) - emax), the OCP MX rule (the largest
#:            codes of a group saturate to qmax).
ROUNDINGS = ("exact", "up", "ocp")


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclasses.dataclass(frozen=True)
class QuantTraits:
    """How a group's scale is made from its absmax (``ROUNDINGS``)."""

    qmax: float = FP8_MAX
    min_scale: float = MIN_SCALE
    rounding: str = "exact"

    @property
    def pow2(self) -> bool:
        """Every scale is a power of two (or inf, or NaN): dividing by it is exact."""
        return self.rounding != "exact"

    @property
    def emax(self) -> int:
        """The exponent of the largest power of two <= qmax: 8 for float8_e4m3fn (448)."""
        return math.floor(math.log2(self.qmax))


@dataclasses.dataclass(frozen=True)
class ScaleLayout:
    """The geometry of one scale format: logical [M, C] with C = ceil(K/G / groups_per_word),
    stored as ``geometry`` says."""

    layout: str
    format: str
    #: Storage dtype of one element (``ELEMENTS``).
    element: str
    #: "value": the fp32 scale itself; "exponent": its biased E8M0 exponent byte(s), 0xFF for NaN.
    encoding: str
    #: Groups per element: 4 for packed UE8M0 (byte i of a word is group 4c + i, padding bytes 0).
    groups_per_word: int
    #: Column-major: strides (1, ld), ld >= M; allocated with ld = round_up(M, row_align).
    column_major: bool
    #: The storage holds round_up(M, row_align) rows (col: TMA's 4; tiled: 128).
    row_align: int
    #: Stored in cuBLAS's 128 x 4 tiles (``TILE_ROWS``): a zero-filled [round_up(M, 128),
    #: round_up(C, 4)] tensor whose bytes are in tile order, not row order.
    tiled: bool
    #: The one group size the format is defined for (None: any).
    group: Optional[int]
    traits: QuantTraits

    @property
    def packed(self) -> bool:
        return self.groups_per_word > 1

    @property
    def encoded(self) -> bool:
        """The stored element is not the fp32 scale: the kernels write it from the scale."""
        return self.encoding == "exponent"

    @property
    def element_bytes(self) -> int:
        return ELEMENTS[self.element][1]

    def columns(self, groups: int) -> int:
        return -(-groups // self.groups_per_word)

    def geometry(self, rows: int, groups: int) -> Tuple[Tuple[int, int], Tuple[int, int], int, str]:
        """(shape, strides, storage rows, element dtype) of the scales of ``rows`` tokens."""
        cols = self.columns(groups)
        if self.tiled:
            padded = round_up(rows, self.row_align)
            width = round_up(cols, TILE_COLUMNS)
            return (padded, width), (width, 1), padded, self.element
        if not self.column_major:
            return (rows, cols), (cols, 1), rows, self.element
        padded = round_up(rows, self.row_align)
        return (rows, cols), (1, padded), padded, self.element

    def tile_coordinates(self, row, column):
        """Where scale (row, column) sits in the tiled storage viewed as [M/128, C/4, 32, 4, 4]
        (C the storage's columns, a multiple of 4). Plain arithmetic: it takes ints, torch
        index tensors and TVM expressions alike. Its flat offset is
        ((row // 128) * (C / 4) + column // 4) * 512 + (row % 32) * 16 + (row % 128 // 32) * 4 + column % 4."""
        return (
            row // TILE_ROWS,
            column // TILE_COLUMNS,
            row % TILE_STRIP,
            row % TILE_ROWS // TILE_STRIP,
            column % TILE_COLUMNS,
        )

    def groups_refusal(self, groups: int) -> Optional[str]:
        """Why the dynamic-K kernel cannot run rows of ``groups`` groups (whole words only), or None."""
        if groups % self.groups_per_word:
            return f"whole {self.element} words of {self.groups_per_word} groups"
        return None

    def group_refusal(self, group: int) -> Optional[str]:
        """Why this format cannot scale groups of ``group`` elements, or None."""
        if self.group is not None and group != self.group:
            return f"format={self.format!r} scales groups of {self.group} elements, not {group}"
        return None

    def strides_refusal(self, shape, strides) -> Optional[str]:
        """None when the kernels can write scales of logical ``shape`` [M, C] with ``strides``;
        else the strides they take.

        Row-major (and tiled): contiguous. Column-major: (1, ld) with any ld >= M. The kernels
        read ld from the tensor, so TMA's round_up(M, 4) (``geometry``'s allocation, what
        DeepGEMM reads) and vLLM's unpadded (1, M) (what its fusion pass allocates when M % 4 != 0,
        and the only strides torch 2.11's BlockWise1x128 ``scaled_mm`` accepts) both work.
        With M = 0 nothing is written and any strides do. Strides are checked even where a
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

    def cxx_record(self) -> Tuple[int, int, bool, int, int]:
        """What ``register_variant`` in ``codegen/torch_ops.cpp`` takes: (element code, groups
        per element, column-major, row alignment, column alignment: > 1 only where tiled)."""
        return ELEMENTS[self.element][0], self.groups_per_word, self.column_major, self.row_align, TILE_COLUMNS if self.tiled else 1


#: Column-major layouts and the rows their storage is aligned to: ``col`` TMA-padded (DeepGEMM),
#: ``col_dense`` exactly M (torch's BlockWise1x128 ``scaled_mm`` wants strides (1, M) and
#: refuses (1, round_up(M, 4)) when M % 4 != 0; cuBLAS then runs only M % 4 == 0, so odd M
#: is padded by the consumer: ``integrations.transformers.block_fp8_mm``).
COLUMN_MAJOR_ROW_ALIGN = {"col": TMA_ALIGN_ROWS, "col_dense": 1}


def _record(layout: str, format: str, element: str = "float32", encoding: str = "value", groups_per_word: int = 1,
            tiled: bool = False, group: Optional[int] = None, rounding: str = "exact") -> ScaleLayout:
    col = layout in COLUMN_MAJOR_ROW_ALIGN
    row_align = COLUMN_MAJOR_ROW_ALIGN[layout] if col else TILE_ROWS if tiled else 1
    return ScaleLayout(layout, format, element, encoding, groups_per_word, column_major=col,
                       row_align=row_align, tiled=tiled, group=group, traits=QuantTraits(rounding=rounding))


#: Every (layout, format) pair there is, and its record.
RECORDS: Dict[Tuple[str, str], ScaleLayout] = {
    (record.layout, record.format): record
    for record in (
        _record("row", "fp32"),
        _record("row", "ue8m0", rounding="up"),
        _record("col", "fp32"),
        _record("col", "ue8m0", rounding="up"),
        # DeepGEMM's sm100 layout: four exponent bytes per int32, column-major, TMA-padded.
        _record("col", "ue8m0_packed", element="int32", encoding="exponent", groups_per_word=4, rounding="up"),
        # cuBLAS BlockWise1x128 through torch's scaled_mm: column-major, exactly M rows.
        _record("col_dense", "fp32"),
        _record("col_dense", "ue8m0", rounding="up"),
        # MXFP8 activations as cuBLAS's block-scaled GEMMs (torch's BlockWise1x32) read them.
        _record("tiled", "mxfp8", element="float8_e8m0fnu", encoding="exponent", tiled=True, group=MX_GROUP, rounding="up"),
        _record("tiled", "mxfp8_ocp", element="float8_e8m0fnu", encoding="exponent", tiled=True, group=MX_GROUP, rounding="ocp"),
    )
}
LAYOUTS = tuple(dict.fromkeys(layout for layout, _ in RECORDS))
FORMATS = tuple(dict.fromkeys(format for _, format in RECORDS))


def choice_error(argument: str, value, accepted) -> ValueError:
    return ValueError(f"{argument}={value!r} is not supported; accepted: {', '.join(map(repr, accepted))}")


def scale_layout(layout: str, format: str) -> ScaleLayout:
    """The record of (``layout``, ``format``); ValueError naming what is not supported."""
    if layout not in LAYOUTS:
        raise choice_error("layout", layout, LAYOUTS)
    if format not in FORMATS:
        raise choice_error("format", format, FORMATS)
    record = RECORDS.get((layout, format))
    if record is None:
        layouts = [name for name, fmt in RECORDS if fmt == format]
        raise ValueError(
            f"format={format!r} needs layout={' or '.join(map(repr, layouts))} (got layout={layout!r}); "
            f"the pairs are {', '.join(f'{name}:{fmt}' for name, fmt in RECORDS)}"
        )
    return record
