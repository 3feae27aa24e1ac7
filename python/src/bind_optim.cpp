// attn.optim: SGD, AdamW and clip_grad_norm over one layer's parameters (the C++ nn::SGD,
// nn::AdamW and nn::clip_grad_norm), so that a Python training loop updates the parameters in
// place, in the layer's own dtype (bfloat16 included), without copying them out and back.
//
// An optimiser holds its layer (the Python object), so the parameters it points at live as long
// as it does; every call releases the GIL and locks the layer, as the layer's own calls do.
#include "bindings.hpp"
#include "module_wrapper.hpp"

#include "attn/core/error.hpp"
#include "attn/nn/optim.hpp"

#include <pybind11/stl.h>

#include <cmath>
#include <memory>
#include <string>
#include <utility>

namespace attn::python {
namespace {

struct PyOptimizer {
  virtual ~PyOptimizer() = default;
  py::object owner;  // the attn.Module whose parameters these are
  PyModule* layer = nullptr;
  std::unique_ptr<nn::Optimizer> opt;
  std::string name;  // "SGD", "AdamW" (messages)
};
// One C++ type per Python class (pybind11 registers each type once).
struct PySGD : PyOptimizer {};
struct PyAdamW : PyOptimizer {};

// The layer behind `module` (an attn.Module), kept alive by the returned object.
std::pair<py::object, PyModule*> layer_of(py::handle module, const char* op) {
  if (!py::isinstance<PyModule>(module))
    throw Error(op,
                fmt::format("the first argument must be an attn.Module (a layer), not {}",
                            py::str(py::type::of(module).attr("__name__")).cast<std::string>()));
  return {py::reinterpret_borrow<py::object>(module), &module.cast<PyModule&>()};
}

// A PyT holding an Opt(layer's parameters, options) over `module`'s layer.
template <typename PyT, typename Opt, typename Options>
std::unique_ptr<PyT> make_optimizer(py::handle module, const char* name, const Options& options) {
  auto [owner, layer] = layer_of(module, name);
  auto self = std::make_unique<PyT>();
  self->owner = owner;
  self->layer = layer;
  self->name = name;
  std::lock_guard lock(layer->mutex);
  self->opt = std::make_unique<Opt>(layer->module().named_parameters(), options);
  return self;
}

template <typename F>
auto locked(PyOptimizer& self, F&& f) {
  return without_gil([&] {
    std::lock_guard lock(self.layer->mutex);
    return f(*self.opt);
  });
}

// step() with the layer's threads (its Context, as its forward and backward use): AdamW updates
// parameters side by side, with the same bits on any thread count.
void step(PyOptimizer& self) {
  without_gil([&] {
    std::scoped_lock lock(self.layer->mutex, self.layer->ctx->mutex);
    self.opt->threads = self.layer->ctx->ctx.resolved_threads();
    self.opt->step();
  });
}

// Python's repr of a float: 0.001, 1e-08, 0.9.
std::string r(double x) {
  return py::repr(py::float_(x)).cast<std::string>();
}

}  // namespace

void bind_optim(py::module_& m) {
  py::class_<PyOptimizer>(m, "Optimizer", R"doc(
Base of attn.optim.SGD and attn.optim.AdamW: an optimiser over every parameter of one layer
(layer.named_parameters()), updating them in place in the layer's dtype.)doc")
      .def(
          "step", [](PyOptimizer& self) { step(self); },
          R"doc(
One update from the layer's current gradients (layer.grads). Parameters without a gradient yet
(a lazy layer before its first input) are skipped, as PyTorch skips .grad = None.)doc")
      .def(
          "zero_grad",
          [](PyOptimizer& self) { locked(self, [](nn::Optimizer& o) { o.zero_grad(); }); },
          "Sets every gradient of the layer to zero (layer.zero_grad()).")
      .def_property(
          "lr", [](PyOptimizer& self) { return self.opt->lr; },
          [](PyOptimizer& self, double lr) {
            check(std::isfinite(lr) && lr >= 0.0, self.name.c_str(),
                  "lr is {}, expected a finite number >= 0", lr);
            std::lock_guard lock(self.layer->mutex);
            self.opt->lr = lr;
          },
          "The learning rate of the next step (set it for a schedule).")
      .def_property_readonly(
          "layer", [](PyOptimizer& self) { return self.owner; }, "The layer it updates.")
      .def(
          "state_dict",
          [](PyOptimizer& self) {
            const nn::StateDict state =
                locked(self, [](nn::Optimizer& o) { return o.state_dict(); });
            py::dict out;
            for (const auto& [name, t] : state)
              out[py::str(name)] = to_numpy(t);
            return out;
          },
          R"doc(
Copies of the optimiser's state, {"<parameter>.<buffer>": array}: SGD's "momentum_buffer",
AdamW's "step", "exp_avg" and "exp_avg_sq" (created at a parameter's first step). The state
of a bfloat16 layer is bfloat16, as torch.optim keeps it: its arrays are float32 holding the
bf16 values exactly. Hyperparameters are not included.)doc")
      .def(
          "load_state_dict",
          [](PyOptimizer& self, const py::dict& state) {
            std::vector<Input> keep;  // what `dict` views, until loaded (copied)
            const nn::StateDict dict =
                state_dict_input(state, self.name + "::load_state_dict", keep);
            locked(self, [&](nn::Optimizer& o) { o.load_state_dict(dict); });
          },
          py::arg("state_dict"), R"doc(
Replaces the state by a copy of `state_dict` (as state_dict() returns it; arrays, lists or
torch tensors, converted to each parameter's dtype). Every name must be a buffer of one of the
layer's parameters, with its shape; nothing changes when anything is wrong (attn.Error).)doc")
      .def_property_readonly(
          "param_names",
          [](PyOptimizer& self) {
            py::list out;
            for (const auto& [name, p] : self.opt->parameters())
              out.append(name);
            return out;
          },
          "The names of the parameters it updates, in the layer's order.");

  py::class_<PySGD, PyOptimizer>(m, "SGD", R"doc(
SGD(layer, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False): torch.optim.SGD's
rule over every parameter of `layer`:
    g = grad + weight_decay * p
    momentum != 0:  buf = g at the first step, else momentum * buf + (1 - dampening) * g
                    g = g + momentum * buf if nesterov else buf
    p = p - lr * g
Each element is updated in double and rounded once to the layer's dtype.)doc")
      .def(py::init([](py::handle module, double lr, double momentum, double dampening,
                       double weight_decay, bool nesterov) {
             return make_optimizer<PySGD, nn::SGD>(
                 module, "SGD", nn::SGDOptions{lr, momentum, dampening, weight_decay, nesterov});
           }),
           py::arg("layer"), py::arg("lr"), py::arg("momentum") = 0.0, py::arg("dampening") = 0.0,
           py::arg("weight_decay") = 0.0, py::arg("nesterov") = false)
      .def("__repr__", [](PySGD& self) {
        const auto& o = static_cast<nn::SGD&>(*self.opt).options;
        return fmt::format(
            "attn.optim.SGD({}, lr={}, momentum={}, dampening={}, weight_decay={}, nesterov={})",
            self.layer->name(), r(self.opt->lr), r(o.momentum), r(o.dampening), r(o.weight_decay),
            o.nesterov ? "True" : "False");
      });

  py::class_<PyAdamW, PyOptimizer>(m, "AdamW", R"doc(
AdamW(layer, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2): torch.optim.AdamW's rule
(decoupled weight decay) over every parameter of `layer`:
    t = t + 1;  p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
Each element is updated in double and rounded once to the layer's dtype.)doc")
      .def(py::init([](py::handle module, double lr, std::pair<double, double> betas, double eps,
                       double weight_decay) {
             return make_optimizer<PyAdamW, nn::AdamW>(
                 module, "AdamW",
                 nn::AdamWOptions{lr, betas.first, betas.second, eps, weight_decay});
           }),
           py::arg("layer"), py::arg("lr") = 1e-3, py::arg("betas") = std::make_pair(0.9, 0.999),
           py::arg("eps") = 1e-8, py::arg("weight_decay") = 1e-2)
      .def("__repr__", [](PyAdamW& self) {
        const auto& o = static_cast<nn::AdamW&>(*self.opt).options;
        return fmt::format("attn.optim.AdamW({}, lr={}, betas=({}, {}), eps={}, weight_decay={})",
                           self.layer->name(), r(self.opt->lr), r(o.beta1), r(o.beta2), r(o.eps),
                           r(o.weight_decay));
      });

  m.def(
      "clip_grad_norm",
      [](py::handle module, double max_norm, double norm_type) {
        auto [owner, layer] = layer_of(module, "clip_grad_norm");
        return without_gil([&, layer = layer] {
          std::lock_guard lock(layer->mutex);
          return nn::clip_grad_norm(layer->module().named_parameters(), max_norm, norm_type);
        });
      },
      py::arg("layer"), py::arg("max_norm"), py::arg("norm_type") = 2.0, R"doc(
torch.nn.utils.clip_grad_norm_ over the layer's gradients: their global norm (all of them as one
vector; norm_type=float('inf') for the largest |g|); when it exceeds max_norm every gradient is
multiplied by max_norm / (norm + 1e-6). Returns the norm before clipping.)doc");
}

}  // namespace attn::python
