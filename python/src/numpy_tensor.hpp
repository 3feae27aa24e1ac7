// NumPy <-> attn::Tensor without copies where the layout allows, and the binding-wide helpers
// (dtype and policy parsing, the shared Context, running C++ with the GIL released).
//
// In: an array whose dtype attn computes in (float32/float64 for data; int32/int64/float32/
// float64 for valid_lens), native byte order, aligned, with non-negative byte strides that are
// multiples of the item size, becomes a Tensor::wrap view of the array's own memory (element
// strides = byte strides / item size). Anything else (lists, torch tensors, other dtypes,
// reversed or byte-misaligned views) is converted once by NumPy into a fresh C-contiguous array.
// The py::array kept in Input owns that memory: it must outlive every Tensor viewing it.
//
// Out: to_numpy(t) returns an array over the Tensor's own buffer; a py::capsule holding a copy of
// the Tensor (shared ownership of its storage) is the array's base, so the memory lives exactly
// as long as the last array viewing it. No copy, except for Tensors that do not own their memory
// (views of someone else's buffer) and BF16 (NumPy has no bfloat16), which are copied.
//
// bfloat16: NumPy has no such dtype, so bf16 data arrives as torch.bfloat16 tensors. For the ops
// with bf16 kernels (InputKind::kFloatBF16) such a tensor becomes a BF16 Tensor::wrap view of the
// tensor's own memory (through tensor.view(torch.int16).numpy(), which shares it; any strides
// torch allows), and to_torch returns BF16 results as torch.bfloat16 tensors over attn's buffer.
// Layers and load_state_dict take them too (converting to their dtype); the functions without
// bf16 kernels (InputKind::kFloat) reject them with an Error. torch is never imported here: a
// torch tensor can only exist once the caller imported torch.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"
#include "attn/ops/masked_softmax.hpp"

#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

// attn::Shape (sizes or strides, stored inline) crosses into Python as a list of ints, as the
// std::vector<int64_t> it replaced did.
#include <pybind11/stl.h>
namespace pybind11::detail {
template <>
struct type_caster<attn::Shape> : list_caster<attn::Shape, int64_t> {};
}  // namespace pybind11::detail

namespace attn::python {

namespace py = pybind11;

// A Tensor view of a NumPy array and the array that owns the memory it views.
struct Input {
  py::object array;  // None when the argument was None
  Tensor tensor;     // undefined when the argument was None
  bool copied = false;
  bool from_torch = false;  // the argument was a torch tensor (any dtype)
};

enum class InputKind : uint8_t {
  kFloat,      // data: float32/float64 kept, other real numbers converted to float32
  kFloatBF16,  // as kFloat, and torch.bfloat16 viewed as BF16 (ops with bf16 kernels; layers
               // and load_state_dict, which convert to their dtype)
  kLens,       // valid_lens: int32/int64/float32/float64 kept, other integers to int64
  kIds,        // token ids: int32/int64 kept, other integers to int64; floats are an error
};

// Converts `obj` for argument `name` of operation `op`; errors are attn::Error(op, ...).
// `allow_none`: None gives an undefined Tensor instead of an error.
Input to_tensor(py::handle obj, const char* op, const char* name, InputKind kind,
                bool allow_none = false);

// An owning, contiguous copy of `obj` converted to `dtype` (load_state_dict: the module must not
// keep views of caller memory, and PyTorch's load_state_dict copies too). Accepts arrays, lists
// and torch tensors (detached first; torch.bfloat16 included).
Tensor to_owned_tensor(py::handle obj, DType dtype, const char* op, const std::string& name);

// The array over t's memory (see the file comment). Undefined -> None. `writeable = false`
// marks the array read-only (module state such as gradients, which backward accumulates into).
py::object to_numpy(const Tensor& t, bool writeable = true);

// The result as a torch tensor over t's memory (no copy, as to_numpy; torch.from_numpy shares
// the array's buffer): BF16 becomes torch.bfloat16, other dtypes their torch equivalent.
// Undefined -> None. Only call it when the caller passed torch tensors (torch is imported then).
py::object to_torch(const Tensor& t);

// Results of a call: torch tensors when the call computed in bfloat16 (`compute`) and one of its
// data arguments was a torch tensor, NumPy arrays otherwise (BF16 widened to float32).
struct OutputMode {
  bool torch = false;
  OutputMode(DType compute, std::initializer_list<const Input*> inputs);
  py::object operator()(const Tensor& t) const { return torch ? to_torch(t) : to_numpy(t); }
};

// Python's spelling of an attn dtype, for messages: "float32", "float64", "bfloat16", ...
const char* python_dtype_name(DType t);

// "float32"/np.float32/np.dtype(...)/None (-> F32) to F32 or F64. "bfloat16" (or
// torch.bfloat16) gives BF16 when `allow_bf16`, else an Error saying which ops run in bfloat16;
// anything else is an Error.
DType parse_float_dtype(py::handle obj, const char* op, bool allow_bf16 = false);
// The dtype= keyword of the functions with bf16 kernels: None (compute in the inputs' dtype) or
// what parse_float_dtype(obj, op, true) accepts.
std::optional<DType> parse_compute_dtype(py::handle obj, const char* op);
// Errors unless all of `inputs` (defined Tensors, argument `names`) share one dtype; the message
// names the first one that differs, both dtypes, and the dtype= way out.
void check_same_dtype(const char* op,
                      std::initializer_list<std::pair<const char*, const Input*>> inputs);
// "uniform" (d2l) / "zero" (PyTorch SDPA) for rows with no valid key.
MaskedRowPolicy parse_masked_rows(const std::string& name, const char* op);
const char* masked_rows_name(MaskedRowPolicy policy);

// A Context shared by everything that runs with it. Calls release the GIL and then hold `mutex`
// while computing, so two Python threads never race on its dropout-offset counter.
struct SharedContext {
  Context ctx;
  std::mutex mutex;
};
using ContextPtr = std::shared_ptr<SharedContext>;

// The context free functions use when given ctx=None (attn.default_context in Python).
ContextPtr default_context();

// Runs f() with the GIL released; the caller must not touch Python objects inside f. Exceptions
// (attn::Error included) propagate after the GIL is taken back.
template <typename F>
auto without_gil(F&& f) -> decltype(f()) {
  py::gil_scoped_release release;
  return f();
}

}  // namespace attn::python
