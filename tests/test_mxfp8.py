"""The MXFP8 layout (``tiled``: cuBLAS's 128 x 4 tiles of E8M0 bytes, G = 32) on the CPU:
byte order against an independent implementation of the cuBLAS layout (``mx_tiles``),
both scale roundings against their definitions, zero padding, the spec's rules, and the
choice of a kernel for the ``cublas_mxfp8`` consumer. The llvm kernel's equivalence with
the reference is in ``test_expr_cpu``; the bundle's, on the GPU, in ``test_gpu_kernels``."""

import math

import mx_tiles
import pytest
import torch

from tvm_rmsquant import reference
from tvm_rmsquant.spec import VariantSpec

UP = VariantSpec("bf16", 192, 32, False, "tiled", "mxfp8")
OCP = VariantSpec("bf16", 192, 32, False, "tiled", "mxfp8_ocp")


def _bytes_of(scale: torch.Tensor) -> torch.Tensor:
    """fp32 powers of two (or NaN) -> their E8M0 bytes, by frexp, one at a time."""
    out = torch.empty(scale.shape, dtype=torch.uint8)
    for index, value in enumerate(scale.flatten().tolist()):
        out.view(-1)[index] = 0xFF if math.isnan(value) else math.frexp(value)[1] - 1 + 127
    return out


@pytest.mark.parametrize("rows", [1, 31, 127, 128, 129, 300])
@pytest.mark.parametrize("spec", [UP, OCP], ids=lambda spec: spec.format)
def test_scales_are_stored_byte_for_byte_in_cublas_tile_order(spec, rows):
    """K = 192 is 6 groups: the columns pad to 8, and M pads to whole 128-row tiles."""
    y = torch.randn(rows, spec.hidden, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16) * 3
    q, scales = reference.group_quant(y, spec)
    groups = spec.hidden // 32
    assert scales.dtype == torch.float8_e8m0fnu and scales.is_contiguous()
    assert tuple(scales.shape) == (-(-rows // 128) * 128, 8)
    per_group = reference.scales_fp32(scales, spec, spec.hidden, rows)
    expected = mx_tiles.swizzle(_bytes_of(per_group))
    assert torch.equal(scales.view(torch.uint8).flatten(), expected)
    # The padding is zero: only the M x 6 scales are nonzero bytes.
    written = {mx_tiles.offset(row, col, 8) for row in range(rows) for col in range(groups)}
    flat = scales.view(torch.uint8).flatten()
    assert all(int(flat[index]) == 0 for index in range(flat.numel()) if index not in written)


@pytest.mark.parametrize(
    "absmax, up, ocp",
    [
        (448.0, 1.0, 1.0),  # exactly qmax: scale 1 either way
        (449.0, 2.0, 1.0),  # just above: up rounds up; OCP keeps 2^(8 - 8) and saturates
        (1.0, 2.0**-8, 2.0**-8),
        (3.0, 2.0**-7, 2.0**-7),  # 3 / 448 -> 2^-7; floor(log2 3) - 8 = -7
        (511.0, 2.0, 1.0),
        (512.0, 2.0, 2.0),
        (0.0, 2.0**-17, 2.0**-17),  # the floor: 1 / (448 * 512) rounds up to 2^-17; 1/512 gives 2^(-9 - 8)
        (2.0**-20, 2.0**-17, 2.0**-17),
        (float("inf"), float("nan"), float("nan")),  # inf scale: E8M0 has no inf, 0xFF is NaN
        (float("nan"), float("nan"), float("nan")),
    ],
)
def test_both_roundings_follow_their_definitions(absmax, up, ocp):
    y = torch.zeros(1, 32)
    y[0, 5] = -absmax
    for spec, want in ((UP.with_hidden(32), up), (OCP.with_hidden(32), ocp)):
        _, scales = reference.group_quant(y, spec)
        got = reference.scales_fp32(scales, spec, 32, 1)[0, 0].item()
        assert (math.isnan(got) and math.isnan(want)) or got == want, (spec.format, absmax, got, want)


def test_ocp_saturates_where_rounding_up_does_not():
    y = torch.full((1, 32), 1.0)
    y[0, 0] = 480.0  # OCP scale 1 (floor(log2 480) = 8): 480 saturates to 448; up: scale 2, code 240
    q_up, _ = reference.group_quant(y, UP.with_hidden(32))
    q_ocp, _ = reference.group_quant(y, OCP.with_hidden(32))
    assert q_ocp.float()[0, 0].item() == 448.0 and q_up.float()[0, 0].item() == 240.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(group=128), "format='mxfp8' scales groups of 32 elements, not 128"),
        (dict(layout="col"), "format='mxfp8' needs layout='tiled'"),
    ],
)
def test_the_spec_refuses_what_mxfp8_is_not(kwargs, message):
    args = dict(dtype="bf16", hidden=4096, group=32, layout="tiled", format="mxfp8") | kwargs
    with pytest.raises(ValueError, match=message):
        VariantSpec(**args)


def test_names_round_trip():
    for spec in (UP, OCP, VariantSpec("fp16", None, 32, True, "tiled", "mxfp8_ocp", True)):
        assert VariantSpec.parse(spec.name) == spec


def test_select_serves_the_cublas_mxfp8_consumer_on_the_cpu():
    """The CPU path runs the llvm kernel where TVM is installed, the reference otherwise;
    either way its scales are the tiled layout."""
    from tvm_rmsquant import select

    bound = select(2048, torch.bfloat16, group_size=32, consumer="cublas_mxfp8", device="cpu")
    assert bound.spec == VariantSpec("bf16", 2048, 32, False, "tiled", "mxfp8")
    x, weight = torch.randn(5, 2048, dtype=torch.bfloat16), torch.randn(2048, dtype=torch.bfloat16)
    q, scales = bound(x, weight, 1e-6)
    want_q, want_scales, _ = reference.rms_norm_group_quant(x, weight, 1e-6, bound.spec)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8)) and scales.shape == (128, 64)
    with pytest.raises(ValueError, match="groups of 32 elements, not 128"):
        select(2048, torch.bfloat16, consumer="cublas_mxfp8", device="cpu")


def test_the_cpu_path_runs_tiled_scales_in_blocks_of_whole_tiles(monkeypatch):
    """A block of rows writes its own tiles: 300 rows in blocks of at most 100 run as 128 + 128 + 44."""
    from tvm_rmsquant import cpu, ops

    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 100 * 192)
    spec = UP.with_hidden(192)
    x, weight = torch.randn(300, 192, dtype=torch.bfloat16), torch.randn(192, dtype=torch.bfloat16)
    launches, inner = [], ops._reference_function(spec)

    def counted(*args):
        launches.append(args[0].shape[0])
        inner(*args)

    q, scales = torch.empty(300, 192, dtype=torch.float8_e4m3fn), reference.empty_scales(spec, 300, 192, "cpu")
    cpu.by_row_chunks(spec, counted)(x, weight, 1e-6, q, scales)
    assert launches == [128, 128, 44]
    want_q, want_scales, _ = reference.rms_norm_group_quant(x, weight, 1e-6, spec)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))
