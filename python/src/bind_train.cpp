// The pieces a Python training loop needs around the attention layers: attn.Linear (an output
// head, torch.nn.Linear / LazyLinear) and the softmax cross-entropy loss with its gradient
// (torch.nn.functional.cross_entropy, plus d2l's valid_lens masking).
#include "bindings.hpp"
#include "module_wrapper.hpp"

#include "attn/core/error.hpp"
#include "attn/nn/module.hpp"
#include "attn/ops/loss.hpp"

#include <memory>
#include <string>

namespace attn::python {
namespace {

struct PyLinear : PyModule {
  nn::Linear m;
  int64_t out_features;
  bool bias;
  PyLinear(int64_t in, int64_t out, bool with_bias, DType dtype, uint64_t seed)
      : m(out, in, with_bias, dtype, seed), out_features(out), bias(with_bias) {}
  nn::Module& module() override { return m; }
  const char* name() const override { return "Linear"; }
  std::string repr() override {
    const int64_t in = m.in_features();
    return "Linear(in_features=" + (in > 0 ? std::to_string(in) : std::string("None")) +
           ", out_features=" + std::to_string(out_features) +
           ", bias=" + (bias ? "True" : "False") + ")";
  }
};

// The converted arguments of cross_entropy(_backward); the Inputs own what the tensors view.
struct LossArgs {
  Input logits, targets, lens;
  CrossEntropyOptions opts;
};

LossArgs loss_args(const char* op, py::handle logits, py::handle targets, py::handle valid_lens,
                   int64_t ignore_index, const std::string& reduction) {
  check(reduction == "mean" || reduction == "sum", op,
        "reduction '{}' unsupported, expected 'mean' or 'sum'", reduction);
  LossArgs a;
  a.logits = to_tensor(logits, op, "logits", InputKind::kFloat);
  a.targets = to_tensor(targets, op, "targets", InputKind::kIds);
  a.lens = lens_input(valid_lens, op);
  a.opts.ignore_index = ignore_index;
  a.opts.valid_lens = a.lens.tensor;
  a.opts.reduction = reduction == "sum" ? Reduction::kSum : Reduction::kMean;
  return a;
}

// f(context) on `ctx` (the default one when None), under its lock, without the GIL.
template <typename F>
auto on_context(ContextPtr ctx, F&& f) {
  if (!ctx) ctx = default_context();
  return without_gil([&] {
    std::lock_guard lock(ctx->mutex);
    return f(ctx->ctx);
  });
}

}  // namespace

void bind_train(py::module_& m) {
  py::class_<PyLinear, PyModule> lin(m, "Linear", R"doc(
Linear(in_features, out_features, bias=True): y = x W^T + b over the last axis, as
torch.nn.Linear; in_features=None takes the width from the first input (torch.nn.LazyLinear,
d2l's choice). weight (out_features, in_features) and bias are initialised as PyTorch does
(uniform in +-1/sqrt(in_features)); state dict names "weight", "bias". float32 or float64.)doc");
  lin.def(py::init([](py::object in_features, int64_t out_features, bool bias, py::handle dtype,
                      uint64_t seed, int threads, const std::string& backend, ContextPtr ctx) {
            const int64_t in = in_features.is_none() ? 0 : in_features.cast<int64_t>();
            check(in_features.is_none() || in > 0, "Linear",
                  "in_features must be positive or None (lazy), got {}", in);
            ContextPtr c = make_context(ctx, seed, threads, backend);
            auto self = std::make_unique<PyLinear>(in, out_features, bias,
                                                   parse_float_dtype(dtype, "Linear"), c->ctx.seed);
            self->ctx = c;
            return self;
          }),
          py::arg("in_features"), py::arg("out_features"), py::arg("bias") = true,
          ATTN_COMMON_KWARGS, kCommonDoc);
  auto forward = [](PyLinear& self, py::handle X) {
    Input x = module_input(X, "Linear", "X", self.m.dtype());
    // The layer keeps a view of x for backward: the binding keeps the array alive until then.
    Tensor y = run_locked(self, {x.array}, [&](Context& c) { return self.m.forward(c, x.tensor); });
    return to_numpy(y);
  };
  lin.def("forward", forward, py::arg("X"), "X (..., in_features) -> (..., out_features).")
      .def("__call__", forward, py::arg("X"), "X (..., in_features) -> (..., out_features).")
      .def(
          "backward",
          [](PyLinear& self, py::handle grad_output) {
            Input d = module_input(grad_output, "Linear", "grad_output", self.m.dtype());
            Tensor dx =
                run_locked(self, {}, [&](Context& c) { return self.m.backward(c, d.tensor); });
            return to_numpy(dx);
          },
          py::arg("grad_output"), "Gradient of the last forward's X; adds dW (and db) into .grads.")
      .def_property_readonly("in_features",
                             [](PyLinear& self) -> py::object {
                               std::lock_guard lock(self.mutex);
                               const int64_t in = self.m.in_features();
                               return in > 0 ? py::int_(in) : py::object(py::none());
                             })
      .def_property_readonly("out_features", [](PyLinear& self) { return self.out_features; });

  m.def(
      "cross_entropy",
      [](py::handle logits, py::handle targets, py::handle valid_lens, int64_t ignore_index,
         const std::string& reduction, ContextPtr ctx) {
        const LossArgs a =
            loss_args("cross_entropy", logits, targets, valid_lens, ignore_index, reduction);
        return on_context(ctx, [&](Context& c) {
          return softmax_cross_entropy(c, a.logits.tensor, a.targets.tensor, a.opts).loss;
        });
      },
      py::arg("logits"), py::arg("targets"), py::arg("valid_lens") = py::none(), py::kw_only(),
      py::arg("ignore_index") = -100, py::arg("reduction") = "mean", py::arg("ctx") = py::none(),
      R"doc(
Softmax cross-entropy of logits (..., C) against integer targets (...), as a float:
torch.nn.functional.cross_entropy(logits.reshape(-1, C), targets.reshape(-1),
ignore_index=ignore_index, reduction=reduction). valid_lens (B,) for logits (B, T, C) also
leaves out positions t >= valid_lens[b] (d2l's masked loss). 'mean' over no kept position is
NaN, as in PyTorch.)doc");
  m.def(
      "cross_entropy_backward",
      [](py::handle logits, py::handle targets, py::handle valid_lens, int64_t ignore_index,
         const std::string& reduction, double grad_loss, ContextPtr ctx) {
        const LossArgs a = loss_args("cross_entropy_backward", logits, targets, valid_lens,
                                     ignore_index, reduction);
        Tensor dx = on_context(ctx, [&](Context& c) {
          return softmax_cross_entropy_backward(c, a.logits.tensor, a.targets.tensor, a.opts,
                                                grad_loss);
        });
        return to_numpy(dx);
      },
      py::arg("logits"), py::arg("targets"), py::arg("valid_lens") = py::none(), py::kw_only(),
      py::arg("ignore_index") = -100, py::arg("reduction") = "mean", py::arg("grad_loss") = 1.0,
      py::arg("ctx") = py::none(), R"doc(
Gradient of cross_entropy(...) * grad_loss with respect to logits, shaped and typed as logits:
(softmax(logits) - onehot(targets)) * grad_loss / n_kept ('mean') for kept positions, 0
elsewhere.)doc");
  m.def(
      "cross_entropy_with_grad",
      [](py::handle logits, py::handle targets, py::handle valid_lens, int64_t ignore_index,
         const std::string& reduction, double grad_loss, ContextPtr ctx) {
        const LossArgs a = loss_args("cross_entropy_with_grad", logits, targets, valid_lens,
                                     ignore_index, reduction);
        CrossEntropyWithGrad r = on_context(ctx, [&](Context& c) {
          return softmax_cross_entropy_with_grad(c, a.logits.tensor, a.targets.tensor, a.opts,
                                                 grad_loss);
        });
        return py::make_tuple(r.result.loss, to_numpy(r.dlogits));
      },
      py::arg("logits"), py::arg("targets"), py::arg("valid_lens") = py::none(), py::kw_only(),
      py::arg("ignore_index") = -100, py::arg("reduction") = "mean", py::arg("grad_loss") = 1.0,
      py::arg("ctx") = py::none(), R"doc(
(loss, grad) of a training step in one pass over the logits: cross_entropy(...) and
cross_entropy_backward(..., grad_loss=grad_loss), the same values bit for bit, each row's
log-sum-exp taken once instead of twice.)doc");
}

}  // namespace attn::python
