"""tvm-rmsquant: fused RMSNorm (+ residual add) + per-token-group FP8 quantization.

The runtime (this package's import path) needs torch, numpy and apache-tvm-ffi only;
the TVM compiler is needed only to build kernels (``tvm_rmsquant.codegen``).
"""

__version__ = "0.1.0"

from .spec import VariantSpec  # noqa: E402

__all__ = ["VariantSpec", "__version__"]
