// The CUDA implementation of the allocating torch ops (rms_norm_group_quant,
// fused_add_rms_norm_group_quant, add_rms_norm_group_quant, group_quant), in C++.
//
// Why C++: with a Python implementation, every dispatched call (a compiled graph's, an
// engine's direct torch.ops call) also ran a Python kernel frame, two Python allocations
// and a tvm-ffi crossing (docs/perf.md, host overhead). Here the torch dispatcher calls
// straight into this file, which allocates q and the scales with torch's caching allocator
// and calls the variant's entry point (codegen/row_views.cuh) through tvm-ffi's C API, on
// torch's current stream: one dispatcher entry per call.
//
// It is built against torch's stable ABI (TORCH_TARGET_VERSION), so one library runs on
// every torch from that version on, whichever torch built it. Python registers each
// variant's entry point and geometry once (register_variant, a tvm-ffi function of this
// library), at select() time; the ops find it by the variant name they are called with.
//
// Errors: a stable-ABI extension raises through pybind11's standard translations, so
// argument errors are std::invalid_argument (Python ValueError), dtype errors included.
#include <dlfcn.h>

#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include <cuda_runtime_api.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

namespace {

using torch::stable::Tensor;

// The scale layout record of tvm_rmsquant/scale_layout.py (ScaleLayout.cxx_record), as
// received: this file interprets it and keeps no layout facts of its own.
struct ScaleLayout {
  int64_t element;          // ELEMENTS' codes: 0 float32, 1 int32, 2 float8_e8m0fnu
  int64_t groups_per_word;  // groups per element (4 for packed UE8M0)
  bool column_major;        // strides (1, round_up(M, row_align))
  int64_t row_align;
  int64_t column_align;     // > 1: tiled, a zero-filled [round_up(M, row_align), round_up(C, column_align)]
};

// What a call needs to know of one variant: its entry point, and the scale geometry.
struct Variant {
  tvm::ffi::Function entry;
  int64_t group;
  ScaleLayout scale;
  bool norm;      // normalizes: takes a weight and eps (false: the standalone quant, x only)
  bool residual;  // takes a residual (x, residual, weight, ...)
  bool scale_ub;  // takes a one-element scale_ub tensor
  std::string capabilities;  // the compute capabilities the machine code runs on, as "9.0,10.0"
};

constexpr int kMaxDevices = 64;

std::mutex registry_mutex;
std::unordered_map<std::string, std::shared_ptr<const Variant>> registry;

int64_t register_variant(tvm::ffi::String name, tvm::ffi::Function entry, int64_t group, int64_t element,
                         int64_t groups_per_word, bool column_major, int64_t row_align, int64_t column_align, bool norm,
                         bool residual, bool scale_ub, tvm::ffi::String capabilities) {
  if (element < 0 || element > 2 || groups_per_word < 1 || row_align < 1 || column_align < 1) {
    throw std::invalid_argument("register_variant: " + std::string(name) + " has a scale layout this library cannot allocate");
  }
  auto variant = std::make_shared<const Variant>(Variant{std::move(entry), group,
                                                         ScaleLayout{element, groups_per_word, column_major, row_align, column_align},
                                                         norm, residual, scale_ub, std::string(capabilities)});
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry[std::string(name)] = std::move(variant);
  return int64_t(registry.size());
}

std::shared_ptr<const Variant> find_variant(const std::string& name) {
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto found = registry.find(name);
    if (found != registry.end()) return found->second;
  }
  throw std::invalid_argument("variant '" + name + "' has no CUDA kernel registered with tvm_rmsquant's C++ ops; " +
                              "tvm_rmsquant.select(...) or tvm_rmsquant.ops.use_bundle(bundle) registers a bundle's variants");
}

// Python's repr of a tuple of ints, as the Python path prints shapes and strides.
std::string tuple_repr(torch::stable::IntHeaderOnlyArrayRef values) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  out << (values.size() == 1 ? ",)" : ")");
  return out.str();
}

DLDataType dlpack_dtype(int32_t dtype) {
  static const struct {
    int32_t torch;
    DLDataType dlpack;
  } table[] = {
      {aoti_torch_dtype_bfloat16(), {kDLBfloat, 16, 1}}, {aoti_torch_dtype_float16(), {kDLFloat, 16, 1}},
      {aoti_torch_dtype_float32(), {kDLFloat, 32, 1}},   {aoti_torch_dtype_float64(), {kDLFloat, 64, 1}},
      {aoti_torch_dtype_float8_e4m3fn(), {kDLFloat8_e4m3fn, 8, 1}},
      {aoti_torch_dtype_int8(), {kDLInt, 8, 1}},         {aoti_torch_dtype_int16(), {kDLInt, 16, 1}},
      {aoti_torch_dtype_int32(), {kDLInt, 32, 1}},       {aoti_torch_dtype_int64(), {kDLInt, 64, 1}},
      {aoti_torch_dtype_uint8(), {kDLUInt, 8, 1}},       {aoti_torch_dtype_bool(), {kDLBool, 8, 1}},
  };
  for (const auto& row : table) {
    if (row.torch == dtype) return row.dlpack;
  }
  // A dtype no kernel takes: the entry point refuses it by code, naming the argument.
  return DLDataType{kDLOpaqueHandle, 0, 1};
}

// A torch tensor as the entry point takes it: a DLTensor whose shape and strides borrow
// the tensor's own arrays. ``compact`` holds a compact copy where its rows (or a 1-D
// weight) were strided.
struct Argument {
  DLTensor view;
  int32_t torch_dtype;
  std::optional<Tensor> compact;

  Argument(const Tensor& source, const char* name) { describe(source, name); }

  void describe(const Tensor& source, const char* name) {
    AtenTensorHandle handle = source.get();
    int64_t dim = 0;
    int32_t device_type = 0, device_index = 0;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(handle, &view.data));
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(handle, &dim));
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(handle, &view.shape));
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(handle, &view.strides));
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(handle, &torch_dtype));
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(handle, &device_type));
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(handle, &device_index));
    view.ndim = int32_t(dim);
    view.dtype = dlpack_dtype(torch_dtype);
    view.device = DLDevice{device_type == aoti_torch_device_type_cuda() ? kDLCUDA : kDLCPU, device_index};
    view.byte_offset = 0;
    if (dim == 0 || compact.has_value()) return;
    // Strided rows and a strided weight are copied compact here; a strided last dimension
    // of rows is refused (the Python path does the same).
    const bool last_contiguous = view.strides[dim - 1] == 1 || view.shape[dim - 1] <= 1;
    if (dim > 1 && !last_contiguous) {
      throw std::invalid_argument(std::string(name) + " must have a contiguous last dimension, got strides " +
                                  tuple_repr(source.strides()));
    }
    const bool rows_strided = dim == 2 && view.shape[0] > 1 && view.strides[0] != view.shape[1];
    if (rows_strided || !last_contiguous) {
      compact = torch::stable::contiguous(source);
      describe(*compact, name);
    }
  }
};

// An in-place target whose rows share memory (an expanded tensor) would take one write in
// several rows, and torch refuses the copy back only after the launch: refuse it first. A
// strided last dimension is left to describe(), which refuses it as the Python path does.
void refuse_overlapping_rows(const Tensor& tensor, const char* name) {
  const bool last_contiguous = tensor.dim() == 2 && (tensor.stride(1) == 1 || tensor.size(1) <= 1);
  if (last_contiguous && tensor.size(0) > 1 && tensor.stride(0) < tensor.size(1)) {
    throw std::invalid_argument(std::string(name) + " has shape " + tuple_repr(tensor.sizes()) + " and strides " +
                                tuple_repr(tensor.strides()) + ": its rows overlap (an expanded tensor?), so it cannot be " +
                                "updated in place; pass " + name + ".clone()");
  }
}

// torch's current CUDA stream, through the C shim of libtorch_cuda (already loaded by
// any process that holds a CUDA tensor; looked up, not linked, so one library serves
// torch builds with and without CUDA at load time).
void* current_stream(int32_t device_index) {
  using GetStream = int32_t (*)(int32_t, void**);
  static GetStream get_stream = [] {
    void* library = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    return library ? reinterpret_cast<GetStream>(dlsym(library, "aoti_torch_get_current_cuda_stream")) : nullptr;
  }();
  if (get_stream == nullptr) {
    throw std::runtime_error("tvm_rmsquant: this torch has no loaded libtorch_cuda.so exporting aoti_torch_get_current_cuda_stream");
  }
  void* stream = nullptr;
  if (get_stream(device_index, &stream) != 0) throw std::runtime_error("tvm_rmsquant: could not read torch's current CUDA stream");
  return stream;
}

// Refuse, once per device, a GPU that cannot run the variant's machine code.
void check_capability(const Variant& variant, int32_t device_index) {
  static int capability[kMaxDevices] = {};  // major * 10 + minor, 0: not read yet
  if (device_index < 0 || device_index >= kMaxDevices) throw std::invalid_argument("x is on an unsupported CUDA device index");
  int& known = capability[device_index];
  if (known == 0) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_index) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_index) != cudaSuccess) {
      throw std::runtime_error("tvm_rmsquant: could not read the compute capability of cuda:" + std::to_string(device_index));
    }
    known = major * 10 + minor;
  }
  const std::string device = std::to_string(known / 10) + "." + std::to_string(known % 10);
  if (("," + variant.capabilities + ",").find("," + device + ",") == std::string::npos) {
    throw std::invalid_argument("the bundle's kernels are built for compute capability " + variant.capabilities + ", cuda:" +
                                std::to_string(device_index) + " has " + device);
  }
}

// Re-raise the error the entry point set, as the std exception pybind11 maps to its kind.
[[noreturn]] void raise_ffi_error() {
  TVMFFIObjectHandle handle = nullptr;
  TVMFFIErrorMoveFromRaised(&handle);
  if (handle == nullptr) throw std::runtime_error("tvm_rmsquant: the kernel call failed without an error");
  const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(handle);
  const std::string kind(cell->kind.data, cell->kind.size);
  const std::string message(cell->message.data, cell->message.size);
  TVMFFIObjectDecRef(handle);
  if (kind == "ValueError" || kind == "TypeError") throw std::invalid_argument(message);
  if (kind == "IndexError") throw std::out_of_range(message);
  throw std::runtime_error(kind + ": " + message);
}

// A fresh [rows, cols] tensor from torch's caching allocator, and the DLTensor the entry
// point takes for it (shape and strides are the arrays it was allocated with).
struct Output {
  int64_t shape[2], strides[2];
  Tensor tensor;
  DLTensor view;

  Output(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride, int32_t dtype, DLDataType dlpack,
         int32_t device_index)
      : shape{rows, cols}, strides{row_stride, col_stride}, tensor(allocate(shape, strides, dtype, device_index)) {
    view = DLTensor{tensor.data_ptr(), DLDevice{kDLCUDA, device_index}, 2, dlpack, shape, strides, 0};
  }
  Output(const Output&) = delete;

  static Tensor allocate(const int64_t* shape, const int64_t* strides, int32_t dtype, int32_t device_index) {
    AtenTensorHandle handle = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(
        aoti_torch_empty_strided(2, shape, strides, dtype, aoti_torch_device_type_cuda(), device_index, &handle));
    return Tensor(handle);
  }
};

// torch's dtype code (c10::ScalarType) of float8_e8m0fnu: the stable ABI declares
// aoti_torch_dtype_float8_e8m0fnu() only from torch 2.12, and this library targets 2.10.
constexpr int32_t kFloat8E8m0fnu = 44;

// The scales of ``rows`` rows: reference.empty_scales's shape, strides and dtype.
void emplace_scales(std::optional<Output>& scales, const Variant& variant, int64_t rows, int64_t hidden, int32_t device_index) {
  const ScaleLayout& layout = variant.scale;
  const int64_t groups = hidden / variant.group;
  const int64_t cols = (groups + layout.groups_per_word - 1) / layout.groups_per_word;
  const int64_t padded = (rows + layout.row_align - 1) / layout.row_align * layout.row_align;
  static const int32_t dtypes[] = {aoti_torch_dtype_float32(), aoti_torch_dtype_int32(), kFloat8E8m0fnu};
  static const DLDataType dlpack[] = {{kDLFloat, 32, 1}, {kDLInt, 32, 1}, {kDLFloat8_e8m0fnu, 8, 1}};
  const int32_t dtype = dtypes[layout.element];
  if (layout.column_align > 1) {
    // Tiled: the kernels write only the rows and groups there are; the padding reads as zero.
    const int64_t width = (cols + layout.column_align - 1) / layout.column_align * layout.column_align;
    scales.emplace(padded, width, width, 1, dtype, dlpack[layout.element], device_index);
    torch::stable::zero_(scales->tensor);
  } else if (!layout.column_major) {
    scales.emplace(rows, cols, cols, 1, dtype, dlpack[layout.element], device_index);
  } else {
    scales.emplace(rows, cols, 1, padded, dtype, dlpack[layout.element], device_index);
  }
}

// One call: check what only this layer knows, allocate, launch on torch's stream. With
// ``new_residual`` the updated residual goes to a new tensor (returned third), else in place.
std::tuple<Tensor, Tensor, std::optional<Tensor>> launch(const std::string& name, const Tensor& x_in,
                                                         const std::optional<Tensor>& residual, const std::optional<Tensor>& weight_in,
                                                         const std::optional<Tensor>& scale_ub, double eps, bool new_residual) {
  const std::shared_ptr<const Variant> found = find_variant(name);
  const Variant& variant = *found;
  if (variant.norm != weight_in.has_value()) {
    throw std::invalid_argument("variant " + name +
                                (variant.norm ? " normalizes: call rms_norm_group_quant (group_quant takes a _nonorm variant)"
                                              : " is a standalone quant: call group_quant, which takes no weight"));
  }
  if (variant.residual != residual.has_value()) {
    throw std::invalid_argument("variant " + name +
                                (variant.residual ? " updates a residual: call fused_add_rms_norm_group_quant"
                                                  : " has no residual: use a _res variant"));
  }
  if (variant.scale_ub != scale_ub.has_value()) {
    throw std::invalid_argument("variant " + name + (variant.scale_ub ? " needs" : " takes no") + " scale_ub");
  }
  const Argument x(x_in, "x");
  if (x.view.ndim != 2) {
    throw std::invalid_argument("x must be 2-D [M, K] here, got shape " + tuple_repr(x_in.sizes()) + "; the Python API flattens [..., K]");
  }
  if (x.view.device.device_type != kDLCUDA) {
    throw std::invalid_argument("x is on the CPU while another argument is on CUDA; put every tensor on one device");
  }
  std::optional<Argument> weight;
  if (weight_in.has_value()) weight.emplace(*weight_in, "weight");
  const int32_t device_index = x.view.device.device_id;
  check_capability(variant, device_index);
  const int64_t rows = x.view.shape[0], hidden = x.view.shape[1];
  const Output q(rows, hidden, hidden, 1, aoti_torch_dtype_float8_e4m3fn(), DLDataType{kDLFloat8_e4m3fn, 8, 1}, device_index);
  std::optional<Output> scales, residual_out;
  emplace_scales(scales, variant, rows, hidden, device_index);
  if (new_residual) residual_out.emplace(rows, hidden, hidden, 1, x.torch_dtype, x.view.dtype, device_index);

  // Arguments in the entry point's order (tvm_rmsquant/launch.py, ``parameters``): x, [residual],
  // [weight], [scale_ub], [eps], q, scales, [residual_out]; weight and eps where the variant
  // normalizes. The residual is read, then written, by the same thread, so in place
  // works; strided residual rows go through their compact copy, written back after.
  std::optional<Argument> source, cap;
  if (residual.has_value() && !new_residual) refuse_overlapping_rows(*residual, "residual");
  if (residual.has_value()) source.emplace(*residual, "residual");
  if (scale_ub.has_value()) cap.emplace(*scale_ub, "scale_ub");
  int32_t count = 0;
  TVMFFIAny args[8];
  auto push = [&](const DLTensor* tensor) {
    args[count].type_index = kTVMFFIDLTensorPtr;
    args[count].zero_padding = 0;
    args[count++].v_ptr = const_cast<DLTensor*>(tensor);
  };
  push(&x.view);
  if (source) push(&source->view);
  if (weight) push(&weight->view);
  if (cap) push(&cap->view);
  if (weight) {
    args[count].type_index = kTVMFFIFloat;
    args[count].zero_padding = 0;
    args[count++].v_float64 = eps;
  }
  push(&q.view);
  push(&scales->view);
  if (source) push(residual_out ? &residual_out->view : &source->view);

  TVMFFIStreamHandle previous = nullptr;
  if (TVMFFIEnvSetStream(kDLCUDA, device_index, current_stream(device_index), &previous) != 0) raise_ffi_error();
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  const int status = TVMFFIFunctionCall(const_cast<tvm::ffi::FunctionObj*>(variant.entry.get()), args, count, &result);
  TVMFFIEnvSetStream(kDLCUDA, device_index, previous, nullptr);
  if (status != 0) raise_ffi_error();
  if (source && !residual_out && source->compact) {
    Tensor destination = *residual;
    torch::stable::copy_(destination, *source->compact);
  }
  return {q.tensor, scales->tensor, residual_out ? std::optional<Tensor>(residual_out->tensor) : std::nullopt};
}

std::tuple<Tensor, Tensor> rms_norm_group_quant(Tensor x, Tensor weight, double eps, std::string variant,
                                                std::optional<Tensor> scale_ub) {
  auto [q, scales, unused] = launch(variant, x, std::nullopt, weight, scale_ub, eps, false);
  return {q, scales};
}

std::tuple<Tensor, Tensor> fused_add_rms_norm_group_quant(Tensor x, Tensor residual, Tensor weight, double eps,
                                                          std::string variant, std::optional<Tensor> scale_ub) {
  auto [q, scales, unused] = launch(variant, x, residual, weight, scale_ub, eps, false);
  return {q, scales};
}

std::tuple<Tensor, Tensor, Tensor> add_rms_norm_group_quant(Tensor x, Tensor residual, Tensor weight, double eps,
                                                            std::string variant, std::optional<Tensor> scale_ub) {
  auto [q, scales, residual_out] = launch(variant, x, residual, weight, scale_ub, eps, true);
  return {q, scales, *residual_out};
}

std::tuple<Tensor, Tensor> group_quant(Tensor x, std::string variant, std::optional<Tensor> scale_ub) {
  auto [q, scales, unused] = launch(variant, x, std::nullopt, std::nullopt, scale_ub, 0.0, false);
  return {q, scales};
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(register_variant, register_variant);

STABLE_TORCH_LIBRARY_IMPL(tvm_rmsquant, CUDA, m) {
  m.impl("rms_norm_group_quant", TORCH_BOX(&rms_norm_group_quant));
  m.impl("fused_add_rms_norm_group_quant", TORCH_BOX(&fused_add_rms_norm_group_quant));
  m.impl("add_rms_norm_group_quant", TORCH_BOX(&add_rms_norm_group_quant));
  m.impl("group_quant", TORCH_BOX(&group_quant));
}
