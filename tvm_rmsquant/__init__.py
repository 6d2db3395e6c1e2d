"""tvm-rmsquant: fused RMSNorm (+ residual add) + per-token-group FP8 quantization.

The runtime (this package's import path) needs torch, numpy and apache-tvm-ffi only;
the TVM compiler is needed only to build kernels (``tvm_rmsquant.codegen``).
"""

__version__ = "0.1.0"

from .spec import VariantSpec  # noqa: E402
from .loader import Bundle, BundleError, open_bundle  # noqa: E402
from . import ops  # noqa: E402  (registers torch.ops.tvm_rmsquant.*)
from .api import rms_norm_group_quant  # noqa: E402
from .dispatch import BoundKernel, select  # noqa: E402


def vllm_post_pass(graph) -> None:
    """vLLM's post-grad pass (``tvm_rmsquant.vllm``), under the one name vLLM 0.33 resolves:
    a top-level attribute of a package, named in ``CompilationConfig.inductor_passes``.
    Imported on first call, so that the runtime needs no vLLM."""
    from .vllm import post_pass

    post_pass(graph)

__all__ = ["Bundle", "BoundKernel", "BundleError", "VariantSpec", "open_bundle", "ops", "rms_norm_group_quant", "select", "vllm_post_pass", "__version__"]
