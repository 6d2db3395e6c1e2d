// The public entry point of each kernel: it takes the tensors as torch holds them
// (rows [M, K], weight [K]) and calls the TVM-generated wrapper, which takes them as
// [M, K/G, G] and [K/G, G], with in-place views: no Python-side reshapes per call.
// Where the tuning database gave small M its own kernels, a variant's entry point picks
// the kernel by M here. Its checks name the argument, the value received and what is
// accepted, at no Python cost per call. It launches on the tensors' device (the generated
// wrapper uses the current one) and returns before launching when M == 0 (the generated
// wrapper would launch an empty grid that writes through NULL).
#include <cfloat>
#include <cmath>
#include <sstream>
#include <string>

namespace tvm_rmsquant {

enum ArgKind : int { kAsIs = 0, kRows = 1, kWeight = 2, kEps = 3 };
using PackedFunction = int32_t (*)(void*, void*, int32_t, void*);
constexpr int kMaxArgs = 8;

// One kernel of a variant: it runs M <= max_rows (max_rows < 0: every M).
struct Kernel {
  int64_t max_rows;
  PackedFunction grouped;
};

// What one variant accepts and which kernels run it; generated per variant.
struct Contract {
  const char* name;
  int32_t arity;
  const char* const* arg_names;
  const int* kinds;
  const bool* input_dtype;  // per argument: must have the input dtype (x, r, weight, residual_out)
  DLDataType dtype;         // the input dtype
  DLDataType weight_dtype;  // the norm weight's: the input dtype, or float32 (a mixed-dtype variant)
  int64_t group;
  int64_t hidden;           // -1: dynamic K
  int64_t hidden_multiple;  // dynamic K must be a multiple of this
  const Kernel* kernels;    // by max_rows ascending, the last for every M
};

static std::string dtype_name(DLDataType dtype) {
  if (dtype.lanes == 1) {
    if (dtype.code == kDLBfloat && dtype.bits == 16) return "bfloat16";
    if (dtype.code == kDLFloat && dtype.bits == 16) return "float16";
    if (dtype.code == kDLFloat && dtype.bits == 32) return "float32";
    if (dtype.code == kDLFloat8_e4m3fn && dtype.bits == 8) return "float8_e4m3fn";
    if (dtype.code == kDLInt) return "int" + std::to_string(dtype.bits);
    if (dtype.code == kDLUInt) return "uint" + std::to_string(dtype.bits);
    if (dtype.code == kDLFloat) return "float" + std::to_string(dtype.bits);
  }
  std::ostringstream out;
  out << "(DLPack code " << int(dtype.code) << ", " << int(dtype.bits) << " bits, " << dtype.lanes << " lanes)";
  return out.str();
}

static std::string shape_text(const DLTensor* tensor) {
  std::ostringstream out;
  out << "[";
  for (int i = 0; i < tensor->ndim; ++i) out << (i ? ", " : "") << tensor->shape[i];
  out << "]";
  return out.str();
}

static const DLTensor* tensor_arg(const TVMFFIAny& arg) {
  if (arg.type_index == kTVMFFITensor) return TVMFFITensorGetDLTensorPtr(arg.v_obj);
  if (arg.type_index == kTVMFFIDLTensorPtr) return static_cast<const DLTensor*>(arg.v_ptr);
  return nullptr;
}

// "(x, weight, eps)": the first ``count`` argument names.
static std::string signature(const Contract& contract, int32_t count) {
  std::string text = "(";
  for (int32_t i = 0; i < count; ++i) text += (i ? ", " : "") + std::string(contract.arg_names[i]);
  return text + ")";
}

// eps as the kernels add it, in fp32: a positive finite double can still be 0 or inf there
// (1e-50, 1e39), and the contract is checked in the precision it is used.
static inline float eps_as_fp32(double eps) {
  return std::isfinite(eps) && std::fabs(eps) > FLT_MAX ? std::copysign(INFINITY, float(eps > 0 ? 1 : -1)) : float(eps);
}

static bool same_dtype(DLDataType a, DLDataType b) { return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes; }

static int32_t call_with_group_views(const Contract& contract, const void* args, int32_t num_args, void* result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  const char* name = contract.name;
  if (num_args != contract.arity) {
    TVM_FFI_THROW(TypeError) << name << " takes " << contract.arity << " arguments, got " << num_args << ": "
                             << signature(contract, contract.arity);
  }
  const TVMFFIAny* given = static_cast<const TVMFFIAny*>(args);
  TVMFFIAny forwarded[kMaxArgs];
  DLTensor views[kMaxArgs];
  int64_t shapes[kMaxArgs][3];
  int64_t strides[kMaxArgs][3];
  const DLTensor* first = nullptr;  // x: every row tensor must match it
  for (int32_t i = 0; i < contract.arity; ++i) {
    forwarded[i] = given[i];
    const DLTensor* tensor = tensor_arg(given[i]);
    const char* arg = contract.arg_names[i];
    if (contract.kinds[i] == kEps) {
      const bool number = given[i].type_index == kTVMFFIFloat || given[i].type_index == kTVMFFIInt;
      const double eps = given[i].type_index == kTVMFFIInt ? double(given[i].v_int64) : given[i].v_float64;
      const float eps_fp32 = eps_as_fp32(eps);
      if (!number || !(eps_fp32 > 0.0f) || !std::isfinite(eps_fp32)) {
        std::ostringstream value;
        if (number) value << "=" << eps << " (" << eps_fp32 << " in fp32)";
        TVM_FFI_THROW(ValueError) << name << ": " << arg << value.str() << " must be positive and finite in fp32, such as 1e-6";
      }
      forwarded[i].type_index = kTVMFFIFloat;
      forwarded[i].v_float64 = eps;
      continue;
    }
    if (contract.kinds[i] == kAsIs) {
      if (tensor != nullptr && first != nullptr &&
          (tensor->device.device_type != first->device.device_type || tensor->device.device_id != first->device.device_id)) {
        TVM_FFI_THROW(ValueError) << name << ": " << arg << " is on device (" << tensor->device.device_type << ", "
                                  << tensor->device.device_id << "), x on (" << first->device.device_type << ", "
                                  << first->device.device_id << "); put every tensor on one device";
      }
      continue;
    }
    if (tensor == nullptr) {
      TVM_FFI_THROW(TypeError) << name << ": " << arg << " must be a tensor";
    }
    const int ndim = contract.kinds[i] == kRows ? 2 : 1;
    if (tensor->ndim != ndim) {
      TVM_FFI_THROW(ValueError) << name << ": " << arg << " must be " << ndim << "-D, got " << tensor->ndim
                                << "-D of shape " << shape_text(tensor);
    }
    const DLDataType expected = contract.kinds[i] == kWeight ? contract.weight_dtype : contract.dtype;
    if (contract.input_dtype[i] && !same_dtype(tensor->dtype, expected)) {
      TVM_FFI_THROW(TypeError) << name << ": " << arg << ".dtype is " << dtype_name(tensor->dtype) << "; this variant takes "
                               << dtype_name(expected);
    }
    const int64_t hidden = tensor->shape[ndim - 1];
    if (first == nullptr) {
      first = tensor;
      if (hidden % contract.group != 0) {
        TVM_FFI_THROW(ValueError) << name << ": " << arg << ".shape[-1]=" << hidden << " is not a multiple of the group size "
                                  << contract.group;
      }
      if (contract.hidden >= 0 && hidden != contract.hidden) {
        TVM_FFI_THROW(ValueError) << name << ": " << arg << ".shape[-1]=" << hidden << "; this variant is built for "
                                  << contract.hidden << " (use its dynamic-K variant, or build one for " << hidden << ")";
      }
      if (contract.hidden < 0 && hidden % contract.hidden_multiple != 0) {
        TVM_FFI_THROW(ValueError) << name << ": " << arg << ".shape[-1]=" << hidden << "; this variant needs a multiple of "
                                  << contract.hidden_multiple;
      }
    } else {
      const bool same_shape = hidden == first->shape[1] && (ndim == 1 || tensor->shape[0] == first->shape[0]);
      if (!same_shape) {
        TVM_FFI_THROW(ValueError) << name << ": " << arg << " has shape " << shape_text(tensor) << "; with x of shape "
                                  << shape_text(first) << " it must be "
                                  << (ndim == 1 ? "[" + std::to_string(first->shape[1]) + "]" : shape_text(first));
      }
      if (tensor->device.device_type != first->device.device_type || tensor->device.device_id != first->device.device_id) {
        TVM_FFI_THROW(ValueError) << name << ": " << arg << " is on device (" << tensor->device.device_type << ", "
                                  << tensor->device.device_id << "), x on (" << first->device.device_type << ", "
                                  << first->device.device_id << "); put every tensor on one device";
      }
    }
    const bool last_contiguous = tensor->strides == nullptr || tensor->strides[ndim - 1] == 1 || hidden == 1;
    const bool rows_contiguous =
        ndim == 1 || tensor->strides == nullptr || tensor->shape[0] <= 1 || tensor->strides[0] == hidden;
    if (!last_contiguous || !rows_contiguous) {
      TVM_FFI_THROW(ValueError) << name << ": " << arg << " must be contiguous, got shape " << shape_text(tensor);
    }
    views[i] = *tensor;
    views[i].ndim = ndim + 1;
    views[i].shape = shapes[i];
    views[i].strides = strides[i];
    int64_t* shape = shapes[i];
    int64_t* stride = strides[i];
    if (ndim == 2) {
      *shape++ = tensor->shape[0];
      *stride++ = hidden;
    }
    shape[0] = hidden / contract.group;
    shape[1] = contract.group;
    stride[0] = contract.group;
    stride[1] = 1;
    forwarded[i].type_index = kTVMFFIDLTensorPtr;
    forwarded[i].zero_padding = 0;
    forwarded[i].v_ptr = &views[i];
  }
  if (first->device.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << name << ": x is on DLPack device type " << first->device.device_type
                              << "; this is a CUDA kernel (CPU tensors run through the torch op's CPU path)";
  }
  const int64_t rows = first->shape[0];
  if (rows == 0) return 0;
  const Kernel* kernel = contract.kernels;
  while (kernel->max_rows >= 0 && rows > kernel->max_rows) ++kernel;
  tvm::ffi::CUDADeviceGuard guard(first->device.device_id);
  if (kernel->grouped(nullptr, forwarded, contract.arity, result) != 0) return -1;
  TVM_FFI_SAFE_CALL_END();
}

}  // namespace tvm_rmsquant
