#include "numpy_tensor.hpp"

#include "attn/core/error.hpp"

#include <string>
#include <vector>

namespace attn::python {

namespace {

// NumPy's spelling of an attn dtype (BF16 has none: callers convert first).
const char* numpy_name(DType t) {
  switch (t) {
    case DType::F32:
      return "float32";
    case DType::F64:
      return "float64";
    case DType::F16:
      return "float16";
    case DType::I32:
      return "int32";
    case DType::I64:
      return "int64";
    case DType::BF16:
      break;
  }
  return nullptr;
}

// The entry points with bfloat16 kernels, for the messages that point there.
constexpr const char* kBf16EntryPoints =
    "scaled_dot_product_attention, linear, DotProductAttention and MultiHeadAttention";

std::string dtype_str(const py::dtype& dt) {
  return dt.attr("name").cast<std::string>();
}

// The attn dtype an array of `dt` is used as without conversion, if any.
// (BF16 arrives only as a torch.bfloat16 tensor: to_tensor handles it before this.)
std::optional<DType> usable_dtype(const py::dtype& dt, InputKind kind) {
  const char k = dt.kind();
  const auto size = dt.itemsize();
  if (kind == InputKind::kIds && k == 'f') return std::nullopt;  // token ids are integers
  if (k == 'f' && size == 4) return DType::F32;
  if (k == 'f' && size == 8) return DType::F64;
  const bool integers_ok = kind != InputKind::kFloat;
  if (integers_ok && k == 'i' && size == 4) return DType::I32;
  if (integers_ok && k == 'i' && size == 8) return DType::I64;
  return std::nullopt;
}

// The dtype other real arrays are converted to: data to float32 (float64 for wider floats),
// integer lengths and token ids to int64; none for floating token ids.
const char* conversion_target(const py::dtype& dt, InputKind kind) {
  const char k = dt.kind();
  const bool integer = k == 'b' || k == 'i' || k == 'u';
  switch (kind) {
    case InputKind::kFloat:
    case InputKind::kFloatBF16:
      if (k == 'f') return dt.itemsize() > 8 ? "float64" : "float32";
      return integer ? "float32" : nullptr;
    case InputKind::kLens:
      if (k == 'f') return "float64";
      return integer ? "int64" : nullptr;
    case InputKind::kIds:
      return integer ? "int64" : nullptr;
  }
  return nullptr;
}

}  // namespace

Input to_tensor(py::handle obj, const char* op, const char* name, InputKind kind, bool allow_none) {
  Input in;
  in.array = py::none();
  if (obj.is_none()) {
    check(allow_none, op, "{} is None, expected an array", name);
    return in;
  }
  py::object src = py::reinterpret_borrow<py::object>(obj);
  // torch tensors: np.asarray refuses ones that require grad, so detach (a view, no copy).
  in.from_torch =
      !py::isinstance<py::array>(src) && py::hasattr(src, "detach") && py::hasattr(src, "cpu");
  bool bf16 = false;
  if (in.from_torch) {
    src = src.attr("detach")().attr("cpu")();
    bf16 = py::hasattr(src, "dtype") &&
           py::str(src.attr("dtype")).cast<std::string>() == "torch.bfloat16";
  }
  if (bf16) {
    check(kind == InputKind::kFloatBF16, op,
          "{} is a torch.bfloat16 tensor, expected float32 or float64: {} has no bfloat16 kernel "
          "(bfloat16 runs in {})",
          name, op, kBf16EntryPoints);
    // Same item size, so the int16 view keeps every stride; .numpy() shares the memory and its
    // array keeps the tensor alive.
    src = src.attr("view")(py::module_::import("torch").attr("int16")).attr("numpy")();
  }
  py::array arr = py::array::ensure(src);
  // Lists, scalars and other array-likes became a new array (torch tensors are shared, but
  // count as converted too: attn views NumPy's array, not the tensor object), except bf16
  // tensors, whose memory attn views as is.
  in.copied = !py::isinstance<py::array>(obj) && !bf16;
  check(static_cast<bool>(arr), op, "{} of type {} cannot be converted to an array", name,
        py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>());

  py::dtype dt = arr.dtype();
  std::optional<DType> dtype = bf16 ? std::optional<DType>(DType::BF16) : usable_dtype(dt, kind);
  bool view_ok = dtype.has_value() && dt.attr("isnative").cast<bool>() &&
                 (arr.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_) != 0;
  const auto itemsize = static_cast<int64_t>(dt.itemsize());
  for (py::ssize_t i = 0; view_ok && i < arr.ndim(); ++i) {
    // Strides of dimensions of size 0 or 1 never move the pointer, so they do not matter.
    if (arr.shape(i) > 1) view_ok = arr.strides(i) >= 0 && arr.strides(i) % itemsize == 0;
  }
  // torch's int16 view of a CPU tensor is always native, aligned and non-negatively strided.
  check(view_ok || !bf16, op, "{}: this torch.bfloat16 tensor's memory cannot be viewed", name);
  if (!view_ok) {
    const char* target = dtype ? numpy_name(*dtype) : conversion_target(dt, kind);
    check(target != nullptr, op, "{} has dtype {}, expected {}", name, dtype_str(dt),
          kind == InputKind::kLens        ? "integer or floating lengths"
          : kind == InputKind::kIds       ? "integer token ids"
          : kind == InputKind::kFloatBF16 ? "float32 or float64 (or a torch.bfloat16 tensor)"
                                          : "float32 or float64");
    arr = py::module_::import("numpy").attr("ascontiguousarray")(arr, py::dtype(target));
    dt = arr.dtype();
    dtype = usable_dtype(dt, kind);
    in.copied = true;
  }

  const int ndim = static_cast<int>(arr.ndim());
  Shape shape(ndim);
  for (int i = 0; i < ndim; ++i)
    shape[i] = arr.shape(i);
  // Element strides; size-0/1 dimensions get their contiguous stride so that a C-contiguous
  // array is also contiguous to attn (NumPy leaves arbitrary strides there).
  Strides strides = contiguous_strides(shape);
  for (int i = 0; i < ndim; ++i) {
    if (arr.shape(i) > 1) strides[i] = arr.strides(i) / static_cast<py::ssize_t>(dt.itemsize());
  }
  in.tensor = Tensor::wrap(const_cast<void*>(arr.data()), shape, *dtype, std::move(strides));
  in.array = std::move(arr);
  return in;
}

Tensor to_owned_tensor(py::handle obj, DType dtype, const char* op, const std::string& name) {
  Input in = to_tensor(obj, op, name.c_str(), InputKind::kFloatBF16);
  Tensor out = Tensor::empty(in.tensor.shape(), dtype);
  out.copy_from(in.tensor);
  return out;
}

namespace {

// An array over t's own memory (t owns it), of NumPy dtype `np_dtype` (same item size).
py::array array_over(const Tensor& t, const char* np_dtype) {
  const auto itemsize = static_cast<py::ssize_t>(dtype_size(t.dtype()));
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
  std::vector<py::ssize_t> strides(shape.size());
  for (size_t i = 0; i < shape.size(); ++i)
    strides[i] = t.strides()[i] * itemsize;
  // The capsule owns a Tensor sharing the storage; NumPy drops it with the last view.
  auto* keep = new Tensor(t);
  py::capsule owner(keep, [](void* p) { delete static_cast<Tensor*>(p); });
  return py::array(py::dtype(np_dtype), std::move(shape), std::move(strides), t.raw_data(), owner);
}

}  // namespace

py::object to_numpy(const Tensor& tensor, bool writeable) {
  if (!tensor.defined()) return py::none();
  Tensor t = tensor;
  if (!t.owns_memory()) t = t.clone();  // a view of memory nobody here keeps alive
  if (t.dtype() == DType::BF16) t = t.to(DType::F32);
  py::array array = array_over(t, numpy_name(t.dtype()));
  if (!writeable) array.attr("setflags")(py::arg("write") = false);
  return array;
}

py::object to_torch(const Tensor& tensor) {
  if (!tensor.defined()) return py::none();
  py::module_ torch = py::module_::import("torch");
  Tensor t = tensor;
  if (!t.owns_memory()) t = t.clone();
  if (t.dtype() != DType::BF16)
    return torch.attr("from_numpy")(array_over(t, numpy_name(t.dtype())));
  // The bits as int16, reinterpreted by torch (same item size: strides unchanged).
  return torch.attr("from_numpy")(array_over(t, "int16")).attr("view")(torch.attr("bfloat16"));
}

OutputMode::OutputMode(DType compute, std::initializer_list<const Input*> inputs) {
  if (compute != DType::BF16) return;
  for (const Input* in : inputs)
    torch = torch || in->from_torch;
}

const char* python_dtype_name(DType t) {
  return t == DType::BF16 ? "bfloat16" : numpy_name(t);
}

void check_same_dtype(const char* op,
                      std::initializer_list<std::pair<const char*, const Input*>> inputs) {
  const auto* first = inputs.begin();
  for (const auto& [name, in] : inputs) {
    const DType a = first->second->tensor.dtype(), b = in->tensor.dtype();
    const bool bf16 = a == DType::BF16 || b == DType::BF16;
    check(a == b, op,
          "{} has dtype {} but {} has dtype {}, expected one dtype for all of them (dtype='{}' "
          "converts them{})",
          name, python_dtype_name(b), first->first, python_dtype_name(a),
          bf16 ? "bfloat16" : "float64", bf16 ? ", rounding floats to nearest even" : "");
  }
}

DType parse_float_dtype(py::handle obj, const char* op, bool allow_bf16) {
  if (obj.is_none()) return DType::F32;
  const std::string text = py::str(obj).cast<std::string>();
  if (text == "torch.float32") return DType::F32;  // accept PyTorch's dtype objects too
  if (text == "torch.float64") return DType::F64;
  if (text == "bfloat16" || text == "torch.bfloat16") {
    check(allow_bf16, op,
          "dtype bfloat16 is not supported by {}, expected float32 or float64 (bfloat16 runs in "
          "{})",
          op, kBf16EntryPoints);
    return DType::BF16;
  }
  const char* expected = allow_bf16 ? "float32, float64 or bfloat16" : "float32 or float64";
  py::dtype dt;
  try {
    dt = py::dtype::from_args(py::reinterpret_borrow<py::object>(obj));
  } catch (const py::error_already_set&) {
    throw Error(op, "dtype " + text + " is not a NumPy dtype, expected " + expected);
  }
  std::optional<DType> t = usable_dtype(dt, InputKind::kFloat);
  check(t.has_value(), op, "dtype {} is not supported, expected {}", dtype_str(dt), expected);
  return *t;
}

std::optional<DType> parse_compute_dtype(py::handle obj, const char* op) {
  if (obj.is_none()) return std::nullopt;
  return parse_float_dtype(obj, op, /*allow_bf16=*/true);
}

MaskedRowPolicy parse_masked_rows(const std::string& name, const char* op) {
  if (name == "uniform") return MaskedRowPolicy::kUniform;
  if (name == "zero") return MaskedRowPolicy::kZero;
  throw Error(op, "masked_rows is '" + name + "', expected 'uniform' (d2l) or 'zero' (PyTorch)");
}

const char* masked_rows_name(MaskedRowPolicy policy) {
  return policy == MaskedRowPolicy::kZero ? "zero" : "uniform";
}

ContextPtr default_context() {
  static ContextPtr ctx = std::make_shared<SharedContext>();
  return ctx;
}

}  // namespace attn::python
