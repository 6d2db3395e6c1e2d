"""tvm-rmsquant: fused RMSNorm (+ residual add) + per-token-group FP8 quantization.

The runtime (this package's import path) needs torch, numpy and apache-tvm-ffi only;
the TVM compiler is needed only to build kernels (``tvm_rmsquant.codegen``).

The public names load on first use (PEP 562), so that importing ``tvm_rmsquant.codegen``
or ``tvm_rmsquant.schedules`` (the build's lowering workers) imports neither torch nor
the ops: 1.4 s of torch import per worker otherwise. Any public name, or
``import tvm_rmsquant.ops``, registers ``torch.ops.tvm_rmsquant.*``.
"""

import importlib

__version__ = "0.1.0"

#: Public name -> the module that owns it.
_PUBLIC = {
    "VariantSpec": "spec",
    "Bundle": "loader",
    "BundleError": "loader",
    "open_bundle": "loader",
    "ops": None,
    "rms_norm_group_quant": "api",
    "group_quant": "api",
    "BoundKernel": "dispatch",
    "select": "dispatch",
}


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'tvm_rmsquant' has no attribute {name!r}")
    importlib.import_module(f"{__name__}.ops")  # every public name comes with the ops registered
    owner = _PUBLIC[name]
    value = importlib.import_module(f"{__name__}.{owner or name}")
    if owner is not None:
        value = getattr(value, name)
    globals()[name] = value
    return value


def vllm_post_pass(graph) -> None:
    """vLLM's post-grad pass (``tvm_rmsquant.vllm``), under the one name vLLM 0.33 resolves:
    a top-level attribute of a package, named in ``CompilationConfig.inductor_passes``.
    Imported on first call, so that the runtime needs no vLLM."""
    from .vllm import post_pass

    post_pass(graph)


__all__ = sorted(_PUBLIC) + ["vllm_post_pass", "__version__"]
