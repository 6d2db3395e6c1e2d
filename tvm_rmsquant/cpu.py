"""CPU kernels: the tensor expression built for TVM's llvm target, compiled on first use.

This needs the TVM compiler (the [build] extra); without it ``available()`` is False and
the torch op falls back to the reference. A CPU kernel takes the same arguments as a
bundle's CUDA kernel (``tvm_rmsquant.launch``).
"""

from __future__ import annotations

import functools
import importlib.util

from . import launch, reference
from .scale_layout import round_up
from .spec import VariantSpec

#: Elements per CPU launch. The llvm build is the unscheduled tensor expression, whose
#: stages materialize fp32 [M, K] buffers (the reference's temporaries are the same), so one
#: launch over M·K >= 2**31 bf16 elements wanted tens of GiB and was killed for memory.
#: 2**24 elements caps each such buffer at 64 MiB.
CHUNK_ELEMENTS = 1 << 24


def available() -> bool:
    return importlib.util.find_spec("tvm") is not None and importlib.util.find_spec("tvm.s_tir") is not None


@functools.lru_cache(maxsize=None)
def function(spec: VariantSpec):
    """The llvm build of ``spec``'s tensor expression (dynamic M; static or dynamic K)."""
    from .codegen.lower import cpu_function

    grouped = cpu_function(spec)

    def call(*args):
        if args[0].shape[0]:
            grouped(*launch.group_views(spec, args))

    return call


def by_row_chunks(spec: VariantSpec, function):
    """``function`` (kernel calling convention) run over blocks of rows of at most
    ``CHUNK_ELEMENTS`` elements; each block's scales go through a compact buffer of the
    layout, copied into the caller's rows."""
    kinds = [kind for _, kind in launch.parameters(spec)]
    scales_at = [name for name, _ in launch.parameters(spec)].index("scales")

    def call(*args):
        rows, hidden = args[0].shape
        step = max(1, CHUNK_ELEMENTS // max(hidden, 1))
        if spec.scale.tiled:  # a block of rows owns whole tiles of the scales' storage
            step = round_up(step, spec.scale.row_align)
        if rows <= step:
            return function(*args)
        scales = args[scales_at]
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            part = [arg[start:stop] if kind == launch.ROWS else arg for arg, kind in zip(args, kinds)]
            part[scales_at] = reference.empty_scales(spec, stop - start, hidden, scales.device)
            function(*part)
            scales[start : start + part[scales_at].shape[0]].copy_(part[scales_at])

    return call
