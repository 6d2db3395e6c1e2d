"""CPU kernels: the tensor expression built for TVM's llvm target, compiled on first use.

This needs the TVM compiler (the [build] extra); without it ``available()`` is False and
the torch op falls back to the reference. A CPU kernel takes the same arguments as a
bundle's CUDA kernel (``tvm_rmsquant.launch``).
"""

from __future__ import annotations

import functools
import importlib.util

from . import launch
from .spec import VariantSpec


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
