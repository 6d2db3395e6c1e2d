"""The allocating ops' CUDA implementation in C++ (a bundle's ``torch_ops.so``).

With it, an eager CUDA call of ``rms_norm_group_quant``, ``fused_add_rms_norm_group_quant``,
``add_rms_norm_group_quant`` or ``group_quant`` is one torch dispatcher entry: C++ allocates q and the
scales and launches the variant's kernel on torch's current stream
(``codegen/torch_ops.cpp``). Without it (a CPU-only torch, a torch older than the
library's stable-ABI target, a library that fails to load), those ops run their Python
implementation, which makes the same kernel call through tvm-ffi.

One library is loaded per process: the first bundle's. Its ops serve every bundle, since
``tvm_rmsquant.serving`` registers with it each variant whose serving bundle changed
(``activate``): the C++ registry mirrors that one record.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Sequence

import torch

from .loader import Bundle, BundleError
from .target import targets
from .spec import VariantSpec

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_register = None  # the loaded library's register_variant


def _version(text: str):
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2])


def unavailable(bundle: Bundle) -> Optional[str]:
    """Why this torch cannot run the bundle's torch ops library; None when it can."""
    entry = bundle.torch_ops
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if _version(torch.__version__) < _version(entry["torch_stable_target"]):
        return f"torch {torch.__version__} predates the library's stable-ABI target {entry['torch_stable_target']}"
    return None


def _load(bundle: Bundle):
    global _register
    if _register is None:
        import tvm_ffi

        path = str(bundle.verified_path(bundle.torch_ops["library"]))
        try:
            torch.ops.load_library(path)
            _register = tvm_ffi.load_module(path)["register_variant"]
        except (OSError, RuntimeError) as error:
            raise BundleError(f"{path} did not load into torch {torch.__version__}: {error}") from None
    return _register


def registration(bundle: Bundle, name: str, capabilities: str) -> tuple:
    """``register_variant``'s arguments for variant ``name`` of ``bundle`` (``codegen/torch_ops.cpp``
    takes them in this order): name, entry point, group, the scale layout record, then
    norm, residual, scale_ub and the compute capabilities the code runs on ("9.0,10.0")."""
    spec = VariantSpec.parse(name)
    return (name, bundle.function(name), spec.group, *spec.scale.cxx_record(), spec.norm, spec.residual, spec.scale_ub, capabilities)


def activate(bundle: Bundle, names: Sequence[str]) -> Optional[str]:
    """Route ``names`` (variants of ``bundle``) through the C++ ops; None when they run
    there, else why not (logged)."""
    reason = unavailable(bundle)
    if reason is None:
        try:
            with _lock:
                register = _load(bundle)
                capabilities = ",".join(f"{target.capability[0]}.{target.capability[1]}" for target in targets(bundle.target_archs))
                for name in names:
                    register(*registration(bundle, name, capabilities))
        except BundleError as error:
            reason = str(error)
    if reason is not None:
        logger.warning("tvm_rmsquant: CUDA ops run their Python implementation (%s)", reason)
    return reason
