// A one-function tvm-ffi binding of FlashInfer's fused add + RMSNorm + 1x128 FP8 block quant, the
// kernel a user would pick instead of ours: the benchmark's `flashinfer` peer (tvm_rmsquant/bench.py).
// scripts/build_flashinfer_peer.py compiles it against the headers of the pinned FlashInfer wheel,
// downloaded at build time; nothing of FlashInfer's is committed.
//
// flashinfer_fused_add_rmsnorm_fp8_block_quant(output fp8 [M, K], block_scale f32 [K/128, round_up(M, 4)],
//     normed_out [M, K], input [M, K], residual [M, K] (updated in place), weight [K], eps, enable_pdl)
// on the tvm-ffi environment stream of input's device (torch's current stream when called from torch).
#include <cstdint>
#include <string>

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "flashinfer/norm.cuh"

namespace {

using tvm::ffi::TensorView;

bool is_dtype(const TensorView& tensor, uint8_t code, uint8_t bits) {
  return tensor.dtype().code == code && tensor.dtype().bits == bits && tensor.dtype().lanes == 1;
}

void require(bool condition, const std::string& message) {
  if (!condition) TVM_FFI_THROW(ValueError) << "flashinfer peer: " << message;
}

template <typename T>
void launch(TensorView output, TensorView block_scale, TensorView normed_out, TensorView input, TensorView residual,
            TensorView weight, double eps, bool enable_pdl, cudaStream_t stream) {
  const uint32_t rows = static_cast<uint32_t>(input.size(0)), hidden = static_cast<uint32_t>(input.size(1));
  cudaError_t status = flashinfer::norm::FusedAddRMSNormFP8BlockQuant<T, __nv_fp8_e4m3>(
      static_cast<T*>(input.data_ptr()), static_cast<T*>(residual.data_ptr()), static_cast<T*>(weight.data_ptr()),
      static_cast<__nv_fp8_e4m3*>(output.data_ptr()), static_cast<float*>(block_scale.data_ptr()),
      static_cast<T*>(normed_out.data_ptr()), rows, hidden, static_cast<uint32_t>(input.stride(0)),
      static_cast<uint32_t>(residual.stride(0)), static_cast<uint32_t>(output.stride(0)),
      static_cast<uint32_t>(normed_out.stride(0)), static_cast<uint32_t>(block_scale.stride(0)), static_cast<float>(eps),
      enable_pdl, stream);
  require(status == cudaSuccess, std::string("the kernel launch failed: ") + cudaGetErrorString(status));
}

void fused_add_rmsnorm_fp8_block_quant(TensorView output, TensorView block_scale, TensorView normed_out, TensorView input,
                                       TensorView residual, TensorView weight, double eps, bool enable_pdl) {
  require(input.ndim() == 2 && residual.ndim() == 2 && output.ndim() == 2 && normed_out.ndim() == 2 && weight.ndim() == 1 &&
              block_scale.ndim() == 2,
          "input, residual, output, normed_out and block_scale are 2-D, weight 1-D");
  const int64_t rows = input.size(0), hidden = input.size(1);
  for (const TensorView* tensor : {&residual, &output, &normed_out}) {
    require(tensor->size(0) == rows && tensor->size(1) == hidden, "residual, output and normed_out must be [M, K] like input");
  }
  require(weight.size(0) == hidden, "weight must be [K]");
  require(block_scale.size(0) == hidden / 128 && block_scale.size(1) == (rows + 3) / 4 * 4 && block_scale.stride(1) == 1,
          "block_scale must be a contiguous [K/128, round_up(M, 4)] float32 tensor");
  require(is_dtype(block_scale, kDLFloat, 32) && is_dtype(output, kDLFloat8_e4m3fn, 8), "block_scale float32, output float8_e4m3fn");
  for (const TensorView* tensor : {&input, &residual, &output, &normed_out, &weight}) {
    require(tensor->stride(tensor->ndim() - 1) == 1, "every tensor needs a contiguous last dimension");
  }
  const DLDevice device = input.device();
  require(device.device_type == kDLCUDA, "input must be on a CUDA device");
  cudaStream_t stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(device.device_type, device.device_id));
  if (is_dtype(input, kDLBfloat, 16)) {
    require(is_dtype(residual, kDLBfloat, 16) && is_dtype(weight, kDLBfloat, 16) && is_dtype(normed_out, kDLBfloat, 16),
            "residual, weight and normed_out must have input's dtype");
    launch<__nv_bfloat16>(output, block_scale, normed_out, input, residual, weight, eps, enable_pdl, stream);
  } else if (is_dtype(input, kDLFloat, 16)) {
    require(is_dtype(residual, kDLFloat, 16) && is_dtype(weight, kDLFloat, 16) && is_dtype(normed_out, kDLFloat, 16),
            "residual, weight and normed_out must have input's dtype");
    launch<half>(output, block_scale, normed_out, input, residual, weight, eps, enable_pdl, stream);
  } else {
    require(false, "input must be bfloat16 or float16");
  }
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(flashinfer_fused_add_rmsnorm_fp8_block_quant, fused_add_rmsnorm_fp8_block_quant);
