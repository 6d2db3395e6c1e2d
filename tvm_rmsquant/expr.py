"""The fused op as a TVM tensor expression: the math, written once.

Row tensors are viewed as [M, K/G, G] (x, r, q, the residual output; weight as
[K/G, G]), so every index a schedule produces is affine in its thread layout and
thread-local buffers compact to exactly what one thread holds.

Stages, by block name (schedules find them by these names and never restate the math):

    h          fp32(x) [+ fp32(r)]                    the unrounded sum the norm uses
    residual   dtype(h)                                the updated residual (residual variants)
    sumsq      sum_k h^2
    rms        1 / sqrt(sumsq / K + eps)
    y          fp32(dtype(fp32(dtype(h * rms)) * fp32(w)))
               an fp32 weight with 16-bit x (weight_dtype): fp32(dtype(h * rms * w)), one rounding;
               the standalone quant (norm=False): y = h = fp32(x), no sumsq, rms, weight or eps
    absmax     max over each group of bits(|y|)        NaN-propagating, see below
    scale      max(min(a, ub) / 448, 1 / (448 * 512)), rounded up to 2^n for UE8M0; NaN if ub <= 0
               (or the OCP MX rule: the record's ``QuantTraits.rounding``)
    ratio      y / scale, correctly rounded (``quotient``)
    q          float8_e4m3fn(clamp(ratio, -448, 448))
    scales     the scale write: ``scale`` itself, or its E8M0 bytes (packed four to a word, or
               one per byte in cuBLAS's tiles: ``_with_tiled_storage``)

The group absmax is reduced on the IEEE bit pattern of |y| as int32: for non-negative
floats it orders like the value, and a NaN orders above every number, so NaN reaches
the scale instead of being dropped by a float ``max`` (CUDA's ``fmaxf`` drops it).
Clamps and mins are ``select``s for the same reason.

This module imports the TVM compiler; the runtime path never imports it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List

import tvm
from tvm import te, tirx

from .scale_layout import TILE_COLUMNS, TILE_ROWS, TILE_STRIP
from .spec import VariantSpec

F32 = "float32"
FLT_MAX = 3.4028234663852886e38  # not inf, not NaN: |e| <= FLT_MAX is "e is finite"
#: Scalar symbol that binds the TMA-padded row count from the col-layout tensor's stride.
PADDED_ROWS = "m_pad"


@dataclasses.dataclass
class FusedExpr:
    """The TE tensors of one spec, and the kernel's argument order."""

    spec: VariantSpec
    rows: tirx.Var
    groups: object  # int, or tirx.Var for the dynamic-K variant
    tensors: Dict[str, te.Tensor]
    eps: tirx.Var
    args: List[object]


def _f32(value: float):
    return tirx.const(value, F32)


def _let(name: str, value, body):
    """Bind ``value`` once so that ``body(var)`` does not repeat the expression."""
    var = tirx.Var(name, value.ty)
    return tirx.Let(var, value, body(var))


def _clamp(value, low, high):
    """NaN-propagating clamp (a plain min/max drops NaN on CUDA)."""
    return tirx.Select(value > high, high, tirx.Select(value < low, low, value))


def _u32(value: int):
    return tirx.const(value, "uint32")


def _fma(a, b, c):
    """a * b + c with one rounding (``tirx.fma`` is not fused on llvm; ``fmaf`` is, on both targets)."""
    return tirx.call_pure_extern(F32, "fmaf", a, b, c)


def quotient(y, s, bounded: bool = False, power_of_two: bool = False):
    """RN(y / s) from one reciprocal per group instead of one IEEE division per element.

    ``r = RN(1 / s)`` is the same for a group's elements, so the compiler computes it once.
    Markstein's theorem: with r correctly rounded and ``q0 = RN(y r)`` within an ulp of y / s,
    the remainder ``e = y - q0 s`` is exact in one fma and ``RN(q0 + e r) = RN(y / s)``.
    The remainder is computed as ``-(q0 s - y)``, which is the same number but keeps y's sign
    through zeros (y = -0 gives -0); it uses s capped at FLT_MAX, so that s = inf (an inf in
    the group) gives e = y and the answer y * 0 = +-0 instead of NaN.

    ``bounded``: |y| <= 448 s for finite y, as for every element of a group whose scale has
    no cap (s >= absmax / 448), so y r cannot overflow and the remainder is finite unless y
    is inf or NaN, where s is too and the answer NaN either way: no per-element check.
    Otherwise (any y and s), a non-finite remainder means q0 = +-inf already is the answer.

    ``power_of_two``: s is 2^n, inf or NaN (UE8M0 scales), so r is exact and so is
    ``y r = y / s``: one multiply.

    For |y| < 2^-100 the remainder may underflow and the last bit differ, but |y / s| < 2^-82
    is an fp8 zero of y's sign either way (s >= 1 / (448 * 512)).
    """
    if power_of_two:
        return _let("r", _f32(1.0) / s, lambda r: y * r)
    finite_s = tirx.Select(s > _f32(FLT_MAX), _f32(FLT_MAX), s)

    def correct(r):
        def refine(q0):
            remainder = -_fma(q0, finite_s, -y)
            if bounded:
                return _fma(remainder, r, q0)
            return _let("e", remainder, lambda e: tirx.Select(tirx.abs(e) <= _f32(FLT_MAX), _fma(e, r, q0), q0))

        return _let("q0", y * r, refine)

    return _let("r", _f32(1.0) / s, correct)


def e4m3fn_bits(value):
    """float32 -> float8_e4m3fn code, round-to-nearest-even, in integer arithmetic.

    ``value`` is already clamped to [-448, 448] or NaN. Used where the target's own fp8
    cast is not exact (TVM's llvm legalization truncates subnormals and wraps NaN).
    """

    def from_magnitude(bits, magnitude):
        sign = (bits >> _u32(24)) & _u32(0x80)
        # Normal e4m3 (>= 2^-6): drop 20 mantissa bits with round-half-even, rebias 127 -> 7.
        lsb = (magnitude >> _u32(20)) & _u32(1)
        normal = ((magnitude + _u32(0x7FFFF) + lsb) >> _u32(20)) - _u32(120 << 3)
        # Subnormal e4m3 (< 2^-6): |v| / 2^-9 rounded half-even; 8 is the first normal code.
        subnormal = tirx.nearbyint(tirx.reinterpret(F32, magnitude) * _f32(512.0)).astype("uint32")
        code = tirx.Select(
            magnitude > _u32(0x7F800000),
            _u32(0x7F),
            tirx.Select(magnitude >= _u32(0x3C800000), normal, subnormal),
        )
        return tirx.reinterpret("float8_e4m3fn", (code | sign).astype("uint8"))

    return _let(
        "bits",
        tirx.reinterpret("uint32", value),
        lambda bits: _let("magnitude", bits & _u32(0x7FFFFFFF), lambda magnitude: from_magnitude(bits, magnitude)),
    )


def bf16_round_bits(value):
    """fp32(bfloat16(value)), round-to-nearest-even, in integer arithmetic; NaN stays NaN.

    TVM's llvm bf16 legalization folds the cast pair fp32(bf16(v)) away; this cannot be folded.
    """
    bits = tirx.reinterpret("uint32", value)
    lsb = (bits >> tirx.const(16, "uint32")) & tirx.const(1, "uint32")
    rounded = (bits + tirx.const(0x7FFF, "uint32") + lsb) & tirx.const(0xFFFF0000, "uint32")
    return tirx.Select(tirx.isnan(value), value, tirx.reinterpret(F32, rounded))


def round_up_pow2(scale):
    """Round a positive fp32 up to a power of two on its bits; NaN stays NaN."""
    bits = tirx.reinterpret("uint32", scale)
    exponent = (bits >> tirx.const(23, "uint32")) & tirx.const(0xFF, "uint32")
    exponent = exponent + tirx.Select(
        (bits & tirx.const(0x7FFFFF, "uint32")) != tirx.const(0, "uint32"),
        tirx.const(1, "uint32"),
        tirx.const(0, "uint32"),
    )
    exponent = tirx.min(exponent, tirx.const(255, "uint32"))
    rounded = tirx.reinterpret(F32, exponent << tirx.const(23, "uint32"))
    return tirx.Select(tirx.isnan(scale), scale, rounded)


def ocp_scale(amax, traits):
    """The OCP MX scale of a non-negative absmax (``scale_layout.ROUNDINGS``), on its bits:
    2^(floor(log2(max(a, qmax * min_scale))) - emax); NaN for an inf or NaN absmax."""
    least = _f32(traits.qmax * traits.min_scale)
    floored = tirx.Select(amax < least, least, amax)  # NaN is not < anything: it stays NaN
    bits = tirx.reinterpret("uint32", floored)
    exponent = (bits >> _u32(23)) & _u32(0xFF)
    scale = tirx.reinterpret(F32, (exponent - _u32(traits.emax)) << _u32(23))
    return tirx.Select(exponent == _u32(0xFF), tirx.reinterpret(F32, _u32(0x7FC00000)), scale)


def build(spec: VariantSpec, portable_casts: bool = False) -> FusedExpr:
    """Build the TE graph of ``spec``.

    ``portable_casts`` writes the narrowing casts (bf16 rounding, fp8) in integer
    arithmetic, for targets whose own casts are not exact (TVM's llvm). Both forms
    compute the same bits; CUDA keeps the native casts, which are cheaper.
    """
    dtype = spec.tvm_dtype
    group = spec.group
    # 64-bit rows: offsets such as m * K pass 2^31 for M * K >= 2^31 elements.
    rows = te.var("m", "int64")
    layout = spec.scale
    per_word = layout.groups_per_word
    if spec.hidden is not None:
        groups = spec.hidden // group
        words = layout.columns(groups)
    elif layout.packed:
        # Whole packed words only, so that no group loop needs a bounds predicate;
        # ``words`` binds from the packed scales' shape.
        words = te.var("words", "int64")
        groups = words * per_word
    else:
        groups = te.var("groups", "int64")
        words = groups
    hidden = groups * group
    eps = te.var("eps", F32)

    shape = (rows, groups, group)
    x = te.placeholder(shape, dtype, name="x")
    r = te.placeholder(shape, dtype, name="r") if spec.residual else None
    ub = te.placeholder((1,), F32, name="scale_ub") if spec.scale_ub else None

    if r is None:
        h = te.compute(shape, lambda m, g, j: x[m, g, j].astype(F32), name="h")
    else:
        h = te.compute(shape, lambda m, g, j: x[m, g, j].astype(F32) + r[m, g, j].astype(F32), name="h")
    residual = te.compute(shape, lambda m, g, j: h[m, g, j].astype(dtype), name="residual") if r is not None else None

    if spec.norm:
        weight = te.placeholder((groups, group), spec.weight_tvm_dtype, name="weight")
        y, norm_tensors = _normalized(h, weight, eps, rows, groups, group, hidden, dtype, portable_casts)
    else:
        # The standalone quant: the groups of x itself (y = h = fp32(x), an exact widening).
        weight, norm_tensors = None, {}
        y = te.compute(shape, lambda m, g, j: h[m, g, j], name="y")

    lane_axis = te.reduce_axis((0, group), name="jr")
    absmax = te.compute(
        (rows, groups),
        lambda m, g: te.max(tirx.reinterpret("int32", tirx.abs(y[m, g, lane_axis])), axis=lane_axis),
        name="absmax",
    )

    traits = layout.traits
    qmax = _f32(traits.qmax)

    def group_scale(m, g):
        amax = tirx.reinterpret(F32, absmax[m, g])
        if ub is not None:
            # A cap that is not > 0 (or NaN) cannot give a valid scale: NaN, as in the reference.
            capped = _let("amax", amax, lambda a: tirx.Select(a > ub[0], ub[0], a))
            amax = tirx.Select(ub[0] > _f32(0.0), capped, tirx.reinterpret(F32, _u32(0x7FC00000)))
        if traits.rounding == "ocp":
            return _let("a", amax, lambda a: ocp_scale(a, traits))
        floor = _f32(traits.min_scale)
        floored = _let("s", amax / qmax, lambda s: tirx.Select(s < floor, floor, s))
        return _let("s", floored, round_up_pow2) if traits.rounding == "up" else floored

    scale = te.compute((rows, groups), group_scale, name="scale")

    ratio = te.compute(
        shape, lambda m, g, j: quotient(y[m, g, j], scale[m, g], bounded=ub is None, power_of_two=traits.pow2), name="ratio"
    )

    def quantize(m, g, j):
        if portable_casts:
            return _let("c", _let("v", ratio(m, g, j), lambda v: _clamp(v, _f32(-traits.qmax), qmax)), e4m3fn_bits)
        # CUDA's float -> e4m3 conversion is saturating (cvt.rn.satfinite): it is the clamp.
        return ratio[m, g, j].astype(spec.out_dtype)

    q = te.compute(shape, quantize, name="q")

    if layout.encoded:

        def encode(m, j):
            """The element of scales[m, j]: the E8M0 exponent bytes of its groups, little-endian."""
            word = tirx.const(0, "uint32")
            for byte in range(per_word):
                g = j * per_word + byte
                # Groups past the last are padding bytes: 0. if_then_else never reads them.
                bits = tirx.if_then_else(g < groups, tirx.reinterpret("uint32", scale[m, g]), _u32(0)) if per_word > 1 else tirx.reinterpret("uint32", scale[m, g])
                word = word | (((bits >> _u32(23)) & _u32(0xFF)) << _u32(8 * byte))
            if layout.element_bytes == 4:
                return tirx.reinterpret(layout.element, word)
            return tirx.reinterpret(layout.element, word.astype("uint8"))

        scales = te.compute((rows, words), encode, name="scales")
    else:
        scales = scale

    tensors = {"x": x, "h": h, "y": y, "absmax": absmax, "scale": scale, "ratio": ratio, "q": q, "scales": scales, **norm_tensors}
    if r is not None:
        tensors.update(r=r, residual=residual)
    if ub is not None:
        tensors["scale_ub"] = ub

    args = [x] + ([r] if r is not None else []) + ([weight] if weight is not None else [])
    args += ([ub] if ub is not None else []) + ([eps] if spec.norm else []) + [q, scales]
    if residual is not None:
        args.append(residual)
    return FusedExpr(spec=spec, rows=rows, groups=groups, tensors=tensors, eps=eps, args=args)


def _normalized(h, weight, eps, rows, groups, group, hidden, dtype, portable_casts):
    """y, the RMSNorm of h times the weight rounded as the contract says, and the stages
    that make it (``sumsq``, ``rms``, ``weight``)."""
    shape = (rows, groups, group)
    g_axis = te.reduce_axis((0, groups), name="gr")
    j_axis = te.reduce_axis((0, group), name="jr")
    sumsq = te.compute(
        (rows,), lambda m: te.sum(h[m, g_axis, j_axis] * h[m, g_axis, j_axis], axis=[g_axis, j_axis]), name="sumsq"
    )
    rms = te.compute(
        (rows,), lambda m: _f32(1.0) / tirx.sqrt(sumsq[m] / tirx.Cast(F32, hidden) + eps), name="rms"
    )

    def round_to_dtype(value):
        if portable_casts and dtype == "bfloat16":
            return bf16_round_bits(value)
        return value.astype(dtype).astype(F32)

    def normalize(m, g, j):
        if weight.dtype != dtype:
            # An fp32 weight with 16-bit activations: the multiply in fp32, one rounding (vLLM's rule).
            return round_to_dtype(h[m, g, j] * rms[m] * weight[g, j])
        if portable_casts or dtype == F32:
            normed = round_to_dtype(h[m, g, j] * rms[m])
            return round_to_dtype(normed * weight[g, j].astype(F32))
        # A product of two 16-bit floats is exact in fp32, so rounding it to dtype is the
        # 16-bit multiply itself (one HMUL on CUDA instead of two conversions and an FMUL).
        return ((h[m, g, j] * rms[m]).astype(dtype) * weight[g, j]).astype(F32)

    y = te.compute(shape, normalize, name="y")
    return y, {"weight": weight, "sumsq": sumsq, "rms": rms}


def _with_padded_col_strides(func: tirx.PrimFunc, param: str) -> tirx.PrimFunc:
    """Declare ``param`` with strides (1, m_pad), m_pad bound from the tensor at call time.

    ``te.create_prim_func`` cannot declare a strided output, so the parameter is replaced by a
    strided buffer (``tvm_ffi.structural_map``). This used to print the function as TVMScript,
    add the strides to the text and parse it back: 0.084 s per function, 24 s of CPU for the
    290 column-layout kernels of the default build, against 0.001 s here. The result is the
    function that round trip gave, so kernel digests (hence tuning records) and the CUDA stay
    the same: the default build's eight libraries came out byte for byte as before. That takes
    the parser's three normalizations: a variable of the body named like a parameter or a shape
    variable (the loops over the rows ``m``, a let-bound ``r`` beside the residual ``r``) and a
    let-bound variable whose value binds one of the same name (the two ``s`` of the rounded-up
    scale) get the printer's ``_1``; an int64 block iterator's domain starts at an int64 0.
    """
    import tvm_ffi

    (old,) = [buffer for buffer in func.params if buffer.name == param]
    int64 = lambda value: tirx.IntImm("int64", value)  # a strided parameter binds only if its shape and strides are int64, like the rows
    shape = [dim if isinstance(dim, tirx.Var) else int64(int(dim)) for dim in old.ty.shape]
    strided = tirx.decl_buffer(shape, old.ty.dtype, old.name, strides=[int64(1), tirx.Var(PADDED_ROWS, "int64")], elem_offset=old.ty.elem_offset,
                               scope=old.ty.storage_scope, data_alignment=old.ty.data_alignment, offset_factor=old.ty.offset_factor, layout=None)
    outer = list(func.params) + [dim for buffer in func.params if isinstance(buffer.ty, tirx.BufferType) for dim in buffer.ty.shape if isinstance(dim, tirx.Var)]
    taken = {var.name for var in outer}
    renamed: Dict[tirx.Var, tirx.Var] = {}

    def rename(var: tirx.Var) -> None:
        if var.name in taken and var not in renamed and not any(var.same_as(other) for other in outer):
            renamed[var] = tirx.Var(f"{var.name}_1", var.ty)

    def rename_shadowing(let: tirx.Let) -> None:
        inner = set()
        tvm_ffi.structural_walk(let.value, [(tirx.Let, lambda nested: inner.add(nested.var.name))], order="pre")
        if let.var.name in inner and let.var not in renamed:
            renamed[let.var] = tirx.Var(f"{let.var.name}_1", let.var.ty)

    def int64_domain(iterator: tirx.IterVar) -> tirx.IterVar:
        start = iterator.dom.min
        if str(iterator.var.ty) != "int64" or str(start.ty) != "int32":
            return iterator
        return tirx.IterVar(tvm.ir.Range.from_min_extent(int64(int(start)), iterator.dom.extent), iterator.var, iterator.iter_type, iterator.thread_tag)

    tvm_ffi.structural_walk(func.body, [(tirx.Var, rename), (tirx.Let, rename_shadowing)], order="pre")
    replace = {old: strided, **renamed}
    return tvm_ffi.structural_map(func, [(tirx.IterVar, int64_domain), (tirx.Var, lambda var: replace.get(var, var))], order="pre")


def _with_tiled_storage(func: tirx.PrimFunc, fused: FusedExpr) -> tirx.PrimFunc:
    """Store the scales in the record's tile order: the parameter is the [round_up(M, 128),
    round_up(C, 4)] tensor a caller holds, written through a 5-D view of the same memory at
    ``tile_coordinates``.

    ``te.create_prim_func`` cannot declare that, and ``transform_layout`` needs one index
    dtype for the whole buffer (int64 columns then break the rules' int32 splits), so the
    function is printed, the parameter given the caller's 2-D shape (the argument binder
    checks it), the view declared on its data, each write moved to its tile coordinates,
    and the text parsed back.
    """
    layout, name = fused.spec.scale, fused.tensors["scales"].op.name
    source = func.script()
    head = f"{name}: T.Buffer("
    start = source.find(head)
    if start < 0 or source.find(head, start + 1) >= 0:
        raise RuntimeError(f"could not find parameter {name!r} to give its tiled storage")
    depth, end = 0, start + len(head) - 1
    for end in range(end, len(source)):
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        if depth == 0:
            break
    columns = fused.tensors["scales"].shape[1]
    static = isinstance(columns, tirx.IntImm)
    columns_text = f"T.int64({columns})" if static else columns.name
    row_tiles = f"({fused.rows.name} + T.int64({TILE_ROWS - 1})) // T.int64({TILE_ROWS})"
    column_tiles = f"({columns_text} + T.int64({TILE_COLUMNS - 1})) // T.int64({TILE_COLUMNS})"
    inner = ", ".join(f"T.int64({extent})" for extent in (TILE_STRIP, TILE_ROWS // TILE_STRIP, TILE_COLUMNS))
    dtype = f'"{layout.element}"'
    declared = f"{head}({row_tiles} * T.int64({TILE_ROWS}), {column_tiles} * T.int64({TILE_COLUMNS})), {dtype})"
    view = f"    {name}_tiles = T.decl_buffer(({row_tiles}, {column_tiles}, {inner}), {dtype}, data={name}.data)\n"

    def tiled(match: "re.Match") -> str:
        row, column = (part.strip() for part in match.group(1).split(","))
        coordinates = layout.tile_coordinates(tirx.Var(row, "int64"), tirx.Var(column, "int32" if static else "int64").astype("int64"))
        return f"{name}_tiles[{', '.join(str(coordinate) for coordinate in coordinates)}]"

    body, count = re.subn(rf"\b{name}\[(\w+, \w+)\]", tiled, source[end + 1 :])
    if count != 2:  # T.writes and the store of the one block that writes the scales
        raise RuntimeError(f"expected the one write of {name!r} (T.writes and the store), found {count} accesses")
    first = body.index("\n", body.index("T.func_attr(")) + 1
    return tvm.script.from_source(source[:start] + declared + body[:first] + view + body[first:])


def prim_func(spec: VariantSpec, portable_casts: bool = False) -> tirx.PrimFunc:
    """The unscheduled PrimFunc of ``spec`` named ``main``, with its scale layout declared."""
    fused = build(spec, portable_casts)
    func = te.create_prim_func(fused.args)
    if spec.residual:
        # r and the residual output may be one tensor (in-place update): no restrict.
        func = func.with_attr("tirx.noalias", False)
    if spec.scale.column_major:
        func = _with_padded_col_strides(func, fused.tensors["scales"].op.name)
    if spec.scale.tiled:
        func = _with_tiled_storage(func, fused)
    return func
