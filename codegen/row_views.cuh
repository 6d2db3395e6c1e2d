// The public entry point of each kernel: it takes the tensors as torch holds them
// (rows [M, K], weight [K]) and calls the TVM-generated wrapper, which takes them as
// [M, K/G, G] and [K/G, G], with in-place views: no Python-side reshapes per call.
// It also launches on the tensors' device (the generated wrapper uses the current one)
// and returns before launching when M == 0 (the generated wrapper would launch an
// empty grid that writes through NULL).
namespace tvm_rmsquant {

enum ArgKind : int { kPassThrough = 0, kRows = 1, kWeight = 2 };
using PackedFunction = int32_t (*)(void*, void*, int32_t, void*);
constexpr int kMaxArgs = 8;

static const DLTensor* tensor_arg(const TVMFFIAny& arg) {
  if (arg.type_index == kTVMFFITensor) return TVMFFITensorGetDLTensorPtr(arg.v_obj);
  if (arg.type_index == kTVMFFIDLTensorPtr) return static_cast<const DLTensor*>(arg.v_ptr);
  return nullptr;
}

static int32_t call_with_group_views(PackedFunction grouped, const char* name, const char* const* arg_names,
                                     const int* kinds, int32_t arity, int64_t group, void* args,
                                     int32_t num_args, void* result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  if (num_args != arity) {
    TVM_FFI_THROW(TypeError) << name << " takes " << arity << " arguments, got " << num_args;
  }
  const TVMFFIAny* given = static_cast<const TVMFFIAny*>(args);
  TVMFFIAny forwarded[kMaxArgs];
  DLTensor views[kMaxArgs];
  int64_t shapes[kMaxArgs][3];
  int64_t strides[kMaxArgs][3];
  int64_t rows = -1;
  int device_id = 0;
  for (int32_t i = 0; i < arity; ++i) {
    forwarded[i] = given[i];
    if (kinds[i] == kPassThrough) continue;
    const DLTensor* tensor = tensor_arg(given[i]);
    if (tensor == nullptr) {
      TVM_FFI_THROW(TypeError) << name << ": " << arg_names[i] << " must be a tensor";
    }
    const int ndim = kinds[i] == kRows ? 2 : 1;
    if (tensor->ndim != ndim) {
      TVM_FFI_THROW(ValueError) << name << ": " << arg_names[i] << " must be " << ndim << "-D, got "
                                << tensor->ndim << "-D";
    }
    const int64_t hidden = tensor->shape[ndim - 1];
    if (hidden % group != 0) {
      TVM_FFI_THROW(ValueError) << name << ": " << arg_names[i] << ".shape[-1]=" << hidden
                                << " is not a multiple of the group size " << group;
    }
    const bool last_contiguous = tensor->strides == nullptr || tensor->strides[ndim - 1] == 1 || hidden == 1;
    const bool rows_contiguous = ndim == 1 || tensor->strides == nullptr || tensor->shape[0] <= 1 ||
                                 tensor->strides[0] == hidden;
    if (!last_contiguous || !rows_contiguous) {
      TVM_FFI_THROW(ValueError) << name << ": " << arg_names[i] << " must be contiguous";
    }
    views[i] = *tensor;
    views[i].ndim = ndim + 1;
    views[i].shape = shapes[i];
    views[i].strides = strides[i];
    int64_t* shape = shapes[i];
    int64_t* stride = strides[i];
    if (kinds[i] == kRows) {
      rows = tensor->shape[0];
      device_id = tensor->device.device_id;
      *shape++ = rows;
      *stride++ = hidden;
    }
    shape[0] = hidden / group;
    shape[1] = group;
    stride[0] = group;
    stride[1] = 1;
    forwarded[i].type_index = kTVMFFIDLTensorPtr;
    forwarded[i].zero_padding = 0;
    forwarded[i].v_ptr = &views[i];
  }
  if (rows == 0) return 0;
  tvm::ffi::CUDADeviceGuard guard(device_id);
  if (grouped(nullptr, forwarded, arity, result) != 0) return -1;
  TVM_FFI_SAFE_CALL_END();
}

}  // namespace tvm_rmsquant
