// attn._attn: the extension module behind `import attn` (python/attn/__init__.py re-exports it).
#include "bindings.hpp"

#include "attn/core/error.hpp"

#ifndef ATTN_VERSION
#define ATTN_VERSION "unknown"
#endif

namespace py = pybind11;

PYBIND11_MODULE(_attn, m) {
  m.doc() = "attn: self-attention, multi-head attention and positional encoding (C++ core).";
  m.attr("__version__") = ATTN_VERSION;

  // attn::Error -> attn.Error, a ValueError subclass carrying attn's message unchanged and the
  // rejecting operation as .op ("masked_softmax", "MultiHeadAttention", ...).
  static py::exception<attn::Error> error(m, "Error", PyExc_ValueError);
  error.doc() =
      "A user mistake rejected by attn (bad shape, dtype or value); .op names the operation.";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const attn::Error& e) {
      py::object instance = py::handle(error.ptr())(e.what());
      instance.attr("op") = e.op();
      PyErr_SetObject(error.ptr(), instance.ptr());
    }
  });

  attn::python::bind_context(m);
  attn::python::bind_ops(m);
  attn::python::bind_nn(m);
  attn::python::bind_transformer(m);  // after bind_nn: its classes derive from attn.Module
  attn::python::bind_train(m);        // after bind_nn: Linear derives from attn.Module
  attn::python::bind_optim(m);        // re-exported as attn.optim (python/attn/optim.py)
  attn::python::bind_torch(m);        // behind attn.torch (python/attn/torch.py)
  attn::python::bind_decoder(m);      // after bind_nn: its classes derive from attn.Module
  attn::python::bind_distributed(m);  // behind attn.distributed (python/attn/distributed.py)
}
