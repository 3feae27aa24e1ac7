// What the layer bindings share (bind_nn.cpp, bind_transformer.cpp): the wrapper every Python
// layer object holds, and running a layer with the GIL released.
//
// Lifetimes: a forward keeps views of its input arrays (the backward reads them), so each wrapper
// holds those arrays until the next forward. Concurrency: calls release the GIL and then lock the
// layer (and its Context), so two Python threads may share a layer without racing.
#pragma once

#include "numpy_tensor.hpp"

#include "attn/nn/module.hpp"

#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace attn::python {

// What every wrapped layer has: the module, its Context, its lock and the arrays its saved
// forward state views.
struct PyModule {
  virtual ~PyModule() = default;
  virtual nn::Module& module() = 0;
  virtual std::string repr() = 0;
  virtual const char* name() const = 0;  // the class name, used in messages

  ContextPtr ctx;
  std::mutex mutex;
  std::vector<py::object> keep_alive;
};

// Runs f(ctx) with the GIL released and the module and its context locked. `inputs` are the
// arrays the module may keep views of: they replace the previous ones on success and join them
// on failure (a failed forward may have saved some of them already).
template <typename F>
auto run_locked(PyModule& self, std::vector<py::object> inputs, F&& f) {
  try {
    auto result = without_gil([&] {
      std::scoped_lock lock(self.mutex, self.ctx->mutex);
      return f(self.ctx->ctx);
    });
    if (!inputs.empty()) self.keep_alive = std::move(inputs);
    return result;
  } catch (...) {
    for (auto& a : inputs)
      self.keep_alive.push_back(std::move(a));
    throw;
  }
}

// An input converted to the module's dtype (a copy only when the dtype differs: NumPy's default
// float64 feeding a float32 module, say). Errors name the module.
Input module_input(py::handle obj, const char* op, const char* name, DType dtype,
                   bool allow_none = false);
// {name: array} (NumPy arrays, torch tensors incl. bfloat16, lists) as Tensors for a
// load_state_dict of operation `op`; `keep` receives the arrays the Tensors view, which must
// outlive them (the loaders copy).
nn::StateDict state_dict_input(const py::dict& state, const std::string& op,
                               std::vector<Input>& keep);
// valid_lens: None, or integer/float lengths.
Input lens_input(py::handle obj, const char* op);
// `ctx` when given, else a new Context from the other arguments.
ContextPtr make_context(ContextPtr ctx, uint64_t seed, int threads, const std::string& backend);
// "0.5" for 0.5 (reprs).
std::string fmt_double(double x);

// The keyword arguments every constructor takes after d2l's positional ones.
#define ATTN_COMMON_KWARGS                                                                   \
  py::kw_only(), py::arg("dtype") = py::none(), py::arg("seed") = 0, py::arg("threads") = 0, \
                 py::arg("backend") = "auto", py::arg("ctx") = py::none()

inline constexpr const char* kCommonDoc = R"doc(
Keyword arguments of every layer: dtype (float32 default, or float64; also 'bfloat16' for
DotProductAttention and MultiHeadAttention), seed (parameter initialisation and the dropout
stream), threads (0: all cores), backend ('auto', 'reference', 'cpu'), ctx (an attn.Context to
share instead of a new one; seed/threads/backend then ignored).
Inputs of another float dtype are converted to the layer's dtype (a copy).)doc";

}  // namespace attn::python
