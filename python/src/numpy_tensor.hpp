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
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"
#include "attn/ops/masked_softmax.hpp"

#include <memory>
#include <mutex>
#include <optional>
#include <utility>

namespace attn::python {

namespace py = pybind11;

// A Tensor view of a NumPy array and the array that owns the memory it views.
struct Input {
  py::object array;  // None when the argument was None
  Tensor tensor;     // undefined when the argument was None
  bool copied = false;
};

enum class InputKind : uint8_t {
  kFloat,  // data: float32/float64 kept, other real numbers converted to float32
  kLens,   // valid_lens: int32/int64/float32/float64 kept, other integers to int64
  kIds,    // token ids: int32/int64 kept, other integers to int64; floats are an error
};

// Converts `obj` for argument `name` of operation `op`; errors are attn::Error(op, ...).
// `allow_none`: None gives an undefined Tensor instead of an error.
Input to_tensor(py::handle obj, const char* op, const char* name, InputKind kind,
                bool allow_none = false);

// An owning, contiguous copy of `obj` converted to `dtype` (load_state_dict: the module must not
// keep views of caller memory, and PyTorch's load_state_dict copies too). Accepts arrays, lists
// and torch tensors (detached first).
Tensor to_owned_tensor(py::handle obj, DType dtype, const char* op, const std::string& name);

// The array over t's memory (see the file comment). Undefined -> None. `writeable = false`
// marks the array read-only (module state such as gradients, which backward accumulates into).
py::object to_numpy(const Tensor& t, bool writeable = true);

// "float32"/np.float32/np.dtype(...)/None (-> F32) to F32 or F64; anything else is an Error.
DType parse_float_dtype(py::handle obj, const char* op);
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
