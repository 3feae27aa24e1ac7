// attn's layers for Python, shaped like d2l's PyTorch modules: construct with d2l's arguments,
// call to run forward, .train()/.eval(), .state_dict()/.load_state_dict() with d2l and PyTorch
// names, .attention_weights; plus what autograd would do in PyTorch, made explicit:
// .backward(grad_output) returns the input gradients and accumulates parameter gradients, which
// .grads shows.
//
// Lifetimes and locking: module_wrapper.hpp.
#include "bindings.hpp"
#include "module_wrapper.hpp"

#include "attn/nn/attention.hpp"
#include "attn/nn/positional.hpp"

#include <pybind11/stl.h>

#include <string>
#include <vector>

namespace attn::python {

// An input converted to the module's dtype (a copy only when the dtype differs: NumPy's default
// float64 feeding a float32 module, say). Errors name the module.
// torch.bfloat16 inputs are accepted by every layer: viewed as is by a bfloat16 layer, widened
// (exactly) for a float32/float64 one; float inputs to a bfloat16 layer are rounded to nearest
// even.
Input module_input(py::handle obj, const char* op, const char* name, DType dtype, bool allow_none) {
  Input in = to_tensor(obj, op, name, InputKind::kFloatBF16, allow_none);
  if (!in.tensor.defined() || in.tensor.dtype() == dtype) return in;
  Tensor converted = in.tensor.to(dtype);  // owning, contiguous
  // So the returned Input still owns what it views. A BF16 copy owns itself (and the layer's
  // saved Tensors share its storage); to_numpy would widen it into an unrelated array.
  in.array = dtype == DType::BF16 ? py::none() : to_numpy(converted);
  in.tensor = converted;
  in.copied = true;
  return in;
}

nn::StateDict state_dict_input(const py::dict& state, const std::string& op,
                               std::vector<Input>& keep) {
  nn::StateDict dict;
  for (auto [key, value] : state) {
    std::string name = py::str(key).cast<std::string>();
    // bf16 checkpoints (torch.bfloat16 tensors) load too: the library converts each entry to
    // its parameter's dtype.
    keep.push_back(to_tensor(value, op.c_str(), name.c_str(), InputKind::kFloatBF16));
    dict.emplace(std::move(name), keep.back().tensor);
  }
  return dict;
}

Input lens_input(py::handle obj, const char* op) {
  return to_tensor(obj, op, "valid_lens", InputKind::kLens, true);
}

ContextPtr make_context(ContextPtr ctx, uint64_t seed, int threads, const std::string& backend) {
  if (ctx) return ctx;
  auto c = std::make_shared<SharedContext>();
  c->ctx.seed = seed;
  c->ctx.threads = threads;
  c->ctx.backend = parse_backend(backend);
  return c;
}

std::string fmt_double(double x) {
  std::string s = std::to_string(x);
  s.erase(s.find_last_not_of('0') + 1);
  if (!s.empty() && s.back() == '.') s += '0';
  return s;
}

namespace {

py::tuple input_grads(const nn::AttentionInputGrads& g, const OutputMode& out) {
  return py::make_tuple(out(g.dqueries), out(g.dkeys), out(g.dvalues));
}

// ---------------------------------------------------------------------------------------------
// The layers

struct PyDotProductAttention : PyModule {
  nn::DotProductAttention m;
  PyDotProductAttention(double dropout, DType dtype) : m(dropout, dtype) {}
  nn::Module& module() override { return m; }
  const char* name() const override { return "DotProductAttention"; }
  std::string repr() override {
    return "DotProductAttention(dropout=" + fmt_double(m.dropout) + ")";
  }
};

struct PyAdditiveAttention : PyModule {
  nn::AdditiveAttention m;
  int64_t num_hiddens;
  PyAdditiveAttention(int64_t h, double dropout, DType dtype, uint64_t seed)
      : m(h, dropout, dtype, seed), num_hiddens(h) {}
  nn::Module& module() override { return m; }
  const char* name() const override { return "AdditiveAttention"; }
  std::string repr() override {
    return "AdditiveAttention(num_hiddens=" + std::to_string(num_hiddens) +
           ", dropout=" + fmt_double(m.dropout) + ")";
  }
};

struct PyMultiHeadAttention : PyModule {
  nn::MultiHeadAttention m;
  bool bias;
  PyMultiHeadAttention(int64_t E, int64_t H, double dropout, bool b, DType dtype, uint64_t seed)
      : m(E, H, dropout, b, dtype, seed), bias(b) {}
  nn::Module& module() override { return m; }
  const char* name() const override { return "MultiHeadAttention"; }
  std::string repr() override {
    return "MultiHeadAttention(num_hiddens=" + std::to_string(m.num_hiddens()) +
           ", num_heads=" + std::to_string(m.num_heads()) +
           ", dropout=" + fmt_double(m.attention.dropout) + ", bias=" + (bias ? "True" : "False") +
           ")";
  }
};

struct PyPositionalEncoding : PyModule {
  nn::PositionalEncoding m;
  int64_t num_hiddens, max_len;
  PyPositionalEncoding(int64_t E, double dropout, int64_t len, DType dtype)
      : m(E, dropout, len, dtype), num_hiddens(E), max_len(len) {}
  nn::Module& module() override { return m; }
  const char* name() const override { return "PositionalEncoding"; }
  std::string repr() override {
    return "PositionalEncoding(num_hiddens=" + std::to_string(num_hiddens) +
           ", dropout=" + fmt_double(m.dropout) + ", max_len=" + std::to_string(max_len) + ")";
  }
};

struct PyLearnedPositionalEmbedding : PyModule {
  nn::LearnedPositionalEmbedding m;
  int64_t max_len, num_hiddens;
  PyLearnedPositionalEmbedding(int64_t len, int64_t E, double dropout, DType dtype, uint64_t seed)
      : m(len, E, dropout, dtype, seed), max_len(len), num_hiddens(E) {}
  nn::Module& module() override { return m; }
  const char* name() const override { return "LearnedPositionalEmbedding"; }
  std::string repr() override {
    return "LearnedPositionalEmbedding(max_len=" + std::to_string(max_len) +
           ", num_hiddens=" + std::to_string(num_hiddens) + ", dropout=" + fmt_double(m.dropout) +
           ")";
  }
};

void bind_module_base(py::module_& m) {
  py::class_<PyModule>(m, "Module", R"doc(
Base of attn's layers: parameters, train/eval, state dicts and gradients, like torch.nn.Module.
Layers start in training mode, as PyTorch's do.)doc")
      .def(
          "train",
          [](PyModule& self, bool mode) -> PyModule& {
            std::lock_guard lock(self.mutex);
            self.module().train(mode);
            return self;
          },
          py::arg("mode") = true, py::return_value_policy::reference_internal,
          "Training mode (dropout active) or not; returns self.")
      .def(
          "eval",
          [](PyModule& self) -> PyModule& {
            std::lock_guard lock(self.mutex);
            self.module().eval();
            return self;
          },
          py::return_value_policy::reference_internal,
          "Evaluation mode (no dropout); returns self.")
      .def_property_readonly("training", [](PyModule& self) { return self.module().training(); })
      .def(
          "state_dict",
          [](PyModule& self) {
            std::lock_guard lock(self.mutex);
            nn::StateDict values = self.module().state_dict();
            py::dict out;  // in registration order, as PyTorch lists them
            for (auto& [name, p] : self.module().named_parameters()) {
              auto it = values.find(name);
              if (it != values.end()) out[py::str(name)] = to_numpy(it->second);
            }
            return out;
          },
          R"doc(
Copies of the parameters, {name: array}, with d2l's names ("W_q.weight", ...). Lazy projections
that have seen no input yet are absent. A bfloat16 layer's entries are float32 arrays holding
the bf16 values exactly (torch.from_numpy(a).bfloat16() and load_state_dict restore them
exactly).)doc")
      .def(
          "load_state_dict",
          [](PyModule& self, const py::dict& state, bool strict) {
            std::vector<Input> keep;  // what `dict` views, until loaded (copied)
            const nn::StateDict dict =
                state_dict_input(state, std::string(self.name()) + "::load_state_dict", keep);
            std::lock_guard lock(self.mutex);
            self.module().load_state_dict(dict, strict);
          },
          py::arg("state_dict"), py::arg("strict") = true, R"doc(
Loads parameters from {name: array} (NumPy arrays, torch tensors or nested lists), copying them
and converting them to the layer's dtype (to bfloat16: rounded to nearest even).
d2l names, and for MultiHeadAttention also torch.nn.MultiheadAttention's (in_proj_weight,
in_proj_bias, out_proj.weight, ...). strict: missing or unexpected names are errors. Nothing
changes when anything is wrong (attn.Error).)doc")
      .def(
          "named_parameters",
          [](PyModule& self) {
            std::lock_guard lock(self.mutex);
            py::list out;
            for (auto& [name, p] : self.module().named_parameters()) {
              if (!p->value.defined()) continue;
              // NumPy cannot view bfloat16 memory as numbers: a bf16 layer's values come as
              // float32 copies, read-only so that an in-place update fails instead of changing
              // a copy the layer never sees.
              const bool live = p->value.dtype() != DType::BF16;
              out.append(py::make_tuple(name, to_numpy(p->value, /*writeable=*/live)));
            }
            return out;
          },
          R"doc(
[(name, array)] of live, writeable views of the parameters (no copies): an in-place update such
as `w -= lr * g` changes the layer. load_state_dict overwrites them in place, so views stay valid.
A bfloat16 layer's parameters come as read-only float32 copies holding the bf16 values (NumPy
has no bfloat16); update those through load_state_dict.)doc")
      .def_property_readonly(
          "grads",
          [](PyModule& self) {
            std::lock_guard lock(self.mutex);
            py::dict out;
            for (auto& [name, p] : self.module().named_parameters())
              if (p->grad.defined()) out[py::str(name)] = to_numpy(p->grad, /*writeable=*/false);
            return out;
          },
          R"doc(
{name: array} of parameter gradients, read-only live views: every backward() ADDS to them (as
PyTorch accumulates .grad) until zero_grad(). Copy an entry to keep a snapshot. A bfloat16
layer's gradients are read-only float32 snapshots holding the bf16 values (not live).)doc")
      .def(
          "zero_grad",
          [](PyModule& self) {
            std::lock_guard lock(self.mutex);
            self.module().zero_grad();
          },
          "Sets every parameter gradient to zero.")
      .def_property_readonly("num_parameters",
                             [](PyModule& self) {
                               std::lock_guard lock(self.mutex);
                               return self.module().num_parameters();
                             })
      .def_property_readonly(
          "dtype",
          [](PyModule& self) {
            const DType t = self.module().dtype();
            // NumPy has no bfloat16: the name, as dtype= takes it.
            if (t == DType::BF16) return py::object(py::str("bfloat16"));
            return py::object(py::dtype(t == DType::F64 ? "float64" : "float32"));
          },
          "np.float32/np.float64 dtype, or the string 'bfloat16' (DotProductAttention and "
          "MultiHeadAttention).")
      .def_property(
          "context", [](PyModule& self) { return self.ctx; },
          [](PyModule& self, ContextPtr ctx) {
            check(ctx != nullptr, "Module", "context must be an attn.Context, not None");
            std::lock_guard lock(self.mutex);
            self.ctx = std::move(ctx);
          },
          "The attn.Context this layer runs with (seed, threads, backend, dropout offset).")
      .def_property(
          "seed", [](PyModule& self) { return self.ctx->ctx.seed; },
          [](PyModule& self, uint64_t seed) {
            std::lock_guard lock(self.ctx->mutex);
            self.ctx->ctx.seed = seed;
          },
          "Seed of this layer's dropout stream (context.seed).")
      .def("__repr__", [](PyModule& self) { return self.repr(); });
}

// forward/__call__ and backward of the three attention layers, which share signatures.
template <typename W, typename Class>
void bind_attention_calls(Class& cls, const char* op) {
  auto forward = [op](W& self, py::handle queries, py::handle keys, py::handle values,
                      py::handle valid_lens) {
    const DType dt = self.m.dtype();
    // Self-attention (one object for queries, keys and values) converts once, so the layer
    // still sees one tensor three times (MultiHeadAttention then projects with one stacked
    // GEMM) when the array is not in its dtype (float32 arrays into a bfloat16 layer, say).
    Input q = module_input(queries, op, "queries", dt);
    Input k = keys.is(queries) ? q : module_input(keys, op, "keys", dt);
    Input v = values.is(queries) ? q : values.is(keys) ? k : module_input(values, op, "values", dt);
    Input lens = lens_input(valid_lens, op);
    Tensor out = run_locked(self, {q.array, k.array, v.array, lens.array}, [&](Context& c) {
      return self.m.forward(c, q.tensor, k.tensor, v.tensor, lens.tensor);
    });
    return OutputMode(dt, {&q, &k, &v})(out);
  };
  const char* forward_doc = R"doc(
Runs forward: queries (B, T, Dq), keys (B, S, Dk), values (B, S, Dv); valid_lens None, (B,) or
(B, T), integer or float. Returns (B, T, Dv) (DotProduct/Additive) or (B, T, num_hiddens)
(MultiHeadAttention). The layer keeps the input arrays for backward: do not modify them (or the
returned output) in place before calling backward.)doc";
  cls.def("forward", forward, py::arg("queries"), py::arg("keys"), py::arg("values"),
          py::arg("valid_lens") = py::none(), forward_doc)
      .def("__call__", forward, py::arg("queries"), py::arg("keys"), py::arg("values"),
           py::arg("valid_lens") = py::none(), forward_doc)
      .def(
          "backward",
          [op](W& self, py::handle grad_output) {
            Input dout = module_input(grad_output, op, "grad_output", self.m.dtype());
            nn::AttentionInputGrads g =
                run_locked(self, {}, [&](Context& c) { return self.m.backward(c, dout.tensor); });
            return input_grads(g, OutputMode(self.m.dtype(), {&dout}));
          },
          py::arg("grad_output"), R"doc(
Backward of the last forward: returns (d_queries, d_keys, d_values) and adds the parameter
gradients into .grads. For self-attention (the same array as queries, keys and values) the
gradient of that array is the sum of the three.)doc")
      .def_property_readonly(
          "attention_weights",
          [](W& self) {
            std::lock_guard lock(self.mutex);
            return to_numpy(self.m.attention_weights(), /*writeable=*/false);
          },
          R"doc(
The last forward's attention weights, pre-dropout as d2l stores them (read-only, no copy):
(B, T, S), or (B * num_heads, T, S) for MultiHeadAttention (row b * num_heads + h). None before
the first forward.)doc");
}

}  // namespace

void bind_nn(py::module_& m) {
  bind_module_base(m);

  py::class_<PyDotProductAttention, PyModule> dot(m, "DotProductAttention", R"doc(
d2l's DotProductAttention(dropout): softmax(q k^T / sqrt(D)) v with valid_lens masking and
dropout on the weights; no parameters.

dtype='bfloat16' (or torch.bfloat16) computes in bfloat16: torch.bfloat16 inputs are used as they
are (no copy), float inputs are rounded to bfloat16 (nearest even). Output and backward's
gradients are torch.bfloat16 tensors when the call's arrays were torch tensors, else float32
NumPy arrays holding the bfloat16 values; attention_weights are float32. need_weights=False runs
the fused bfloat16 kernel (with weights kept, the exact reference runs and rounds).)doc");
  dot.def(py::init([](double dropout, bool causal, const std::string& masked_rows, py::handle dtype,
                      uint64_t seed, int threads, const std::string& backend, ContextPtr ctx) {
            const char* op = "DotProductAttention";
            auto self = std::make_unique<PyDotProductAttention>(
                dropout, parse_float_dtype(dtype, op, /*allow_bf16=*/true));
            self->m.causal = causal;
            self->m.masked_rows = parse_masked_rows(masked_rows, op);
            self->ctx = make_context(ctx, seed, threads, backend);
            return self;
          }),
          py::arg("dropout"), py::arg("causal") = false, py::arg("masked_rows") = "uniform",
          ATTN_COMMON_KWARGS, kCommonDoc)
      .def_property(
          "causal", [](PyDotProductAttention& s) { return s.m.causal; },
          [](PyDotProductAttention& s, bool on) {
            std::lock_guard lock(s.mutex);
            s.m.causal = on;
          },
          "Query t sees keys 0..t only (combined with valid_lens).")
      .def_property(
          "need_weights", [](PyDotProductAttention& s) { return s.m.need_weights; },
          [](PyDotProductAttention& s, bool on) {
            std::lock_guard lock(s.mutex);
            s.m.need_weights = on;
          },
          "Keep attention_weights (d2l does); False saves the (B, T, S) matrix on long inputs.")
      .def_property(
          "dropout", [](PyDotProductAttention& s) { return s.m.dropout; },
          [](PyDotProductAttention& s, double p) {
            std::lock_guard lock(s.mutex);
            s.m.dropout = p;
          });
  bind_attention_calls<PyDotProductAttention>(dot, "DotProductAttention");

  py::class_<PyAdditiveAttention, PyModule> add(m, "AdditiveAttention", R"doc(
d2l's AdditiveAttention(num_hiddens, dropout): score = w_v . tanh(W_q q + W_k k), no scaling.
W_q and W_k are lazy (their input widths come from the first call or a state dict).
State dict: W_k.weight, W_q.weight, w_v.weight.)doc");
  add.def(py::init([](int64_t num_hiddens, double dropout, py::handle dtype, uint64_t seed,
                      int threads, const std::string& backend, ContextPtr ctx) {
            ContextPtr c = make_context(ctx, seed, threads, backend);
            auto self = std::make_unique<PyAdditiveAttention>(
                num_hiddens, dropout, parse_float_dtype(dtype, "AdditiveAttention"), c->ctx.seed);
            self->ctx = c;
            return self;
          }),
          py::arg("num_hiddens"), py::arg("dropout"), ATTN_COMMON_KWARGS, kCommonDoc)
      .def_property(
          "dropout", [](PyAdditiveAttention& s) { return s.m.dropout; },
          [](PyAdditiveAttention& s, double p) {
            std::lock_guard lock(s.mutex);
            s.m.dropout = p;
          });
  bind_attention_calls<PyAdditiveAttention>(add, "AdditiveAttention");

  py::class_<PyMultiHeadAttention, PyModule> mha(m, "MultiHeadAttention", R"doc(
d2l's MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False): lazy projections W_q,
W_k, W_v, W_o; head h owns features [h*D, (h+1)*D), D = num_hiddens / num_heads.
load_state_dict also takes torch.nn.MultiheadAttention(num_hiddens, num_heads, bias=...,
batch_first=True)'s state dict; d2l and torch then agree except on rows with no valid key
(d2l: uniform weights; torch: NaN).

dtype='bfloat16' (or torch.bfloat16) is PyTorch's module after .to(torch.bfloat16): bfloat16
parameters (the float32 init rounded), projections on the bfloat16 GEMM (f32 accumulation, one
rounding per output), attention on the bfloat16 kernels. torch.bfloat16 inputs are used as they
are, float inputs rounded to bfloat16; output and backward's gradients are torch.bfloat16 tensors
when the call's arrays were torch tensors, else float32 NumPy arrays holding the bfloat16 values.
attention_weights are float32; state_dict(), grads and named_parameters() give float32 copies
holding the bfloat16 values; load_state_dict takes float or torch.bfloat16 tensors (rounded).)doc");
  mha.def(py::init([](int64_t num_hiddens, int64_t num_heads, double dropout, bool bias,
                      bool causal, const std::string& masked_rows, py::handle dtype, uint64_t seed,
                      int threads, const std::string& backend, ContextPtr ctx) {
            const char* op = "MultiHeadAttention";
            ContextPtr c = make_context(ctx, seed, threads, backend);
            auto self = std::make_unique<PyMultiHeadAttention>(
                num_hiddens, num_heads, dropout, bias,
                parse_float_dtype(dtype, op, /*allow_bf16=*/true), c->ctx.seed);
            self->m.attention.causal = causal;
            self->m.attention.masked_rows = parse_masked_rows(masked_rows, op);
            self->ctx = c;
            return self;
          }),
          py::arg("num_hiddens"), py::arg("num_heads"), py::arg("dropout"), py::arg("bias") = false,
          py::arg("causal") = false, py::arg("masked_rows") = "uniform", ATTN_COMMON_KWARGS,
          kCommonDoc)
      .def_property_readonly("num_hiddens",
                             [](PyMultiHeadAttention& s) { return s.m.num_hiddens(); })
      .def_property_readonly("num_heads", [](PyMultiHeadAttention& s) { return s.m.num_heads(); })
      .def_property(
          "causal", [](PyMultiHeadAttention& s) { return s.m.attention.causal; },
          [](PyMultiHeadAttention& s, bool on) {
            std::lock_guard lock(s.mutex);
            s.m.attention.causal = on;
          })
      .def_property(
          "need_weights", [](PyMultiHeadAttention& s) { return s.m.attention.need_weights; },
          [](PyMultiHeadAttention& s, bool on) {
            std::lock_guard lock(s.mutex);
            s.m.attention.need_weights = on;
          },
          "Keep attention_weights (d2l does); False saves the (B*H, T, S) matrix on long inputs.")
      .def_property(
          "dropout", [](PyMultiHeadAttention& s) { return s.m.attention.dropout; },
          [](PyMultiHeadAttention& s, double p) {
            std::lock_guard lock(s.mutex);
            s.m.attention.dropout = p;
          });
  bind_attention_calls<PyMultiHeadAttention>(mha, "MultiHeadAttention");

  py::class_<PyPositionalEncoding, PyModule> pe(m, "PositionalEncoding", R"doc(
d2l's PositionalEncoding(num_hiddens, dropout, max_len=1000): out = dropout(X + P[:T]) for X
(B, T, num_hiddens). Unlike d2l, odd widths work and max_len is only a cache size.)doc");
  pe.def(py::init([](int64_t num_hiddens, double dropout, int64_t max_len, py::handle dtype,
                     uint64_t seed, int threads, const std::string& backend, ContextPtr ctx) {
           auto self = std::make_unique<PyPositionalEncoding>(
               num_hiddens, dropout, max_len, parse_float_dtype(dtype, "PositionalEncoding"));
           self->ctx = make_context(ctx, seed, threads, backend);
           return self;
         }),
         py::arg("num_hiddens"), py::arg("dropout"), py::arg("max_len") = 1000, ATTN_COMMON_KWARGS,
         kCommonDoc);
  auto pe_forward = [](PyPositionalEncoding& self, py::handle X) {
    Input x = module_input(X, "PositionalEncoding", "X", self.m.dtype());
    Tensor out = run_locked(self, {}, [&](Context& c) { return self.m.forward(c, x.tensor); });
    return to_numpy(out);
  };
  pe.def("forward", pe_forward, py::arg("X"), "X (B, T, num_hiddens) -> dropout(X + P[:T]).")
      .def("__call__", pe_forward, py::arg("X"), "X (B, T, num_hiddens) -> dropout(X + P[:T]).")
      .def(
          "backward",
          [](PyPositionalEncoding& self, py::handle grad_output) {
            Input d =
                module_input(grad_output, "PositionalEncoding", "grad_output", self.m.dtype());
            Tensor dx =
                run_locked(self, {}, [&](Context& c) { return self.m.backward(c, d.tensor); });
            return to_numpy(dx);
          },
          py::arg("grad_output"), "Gradient of X (the dropout mask of the last forward applied).")
      .def_property_readonly(
          "P",
          [](PyPositionalEncoding& self) {
            std::lock_guard lock(self.mutex);
            const Tensor& P = self.m.P(self.max_len);
            return to_numpy(
                P.slice(0, 0, self.max_len).reshape({1, self.max_len, self.num_hiddens}),
                /*writeable=*/false);
          },
          "d2l's P: (1, max_len, num_hiddens), read-only.")
      .def_property(
          "dropout", [](PyPositionalEncoding& s) { return s.m.dropout; },
          [](PyPositionalEncoding& s, double p) {
            std::lock_guard lock(s.mutex);
            s.m.dropout = p;
          });

  py::class_<PyLearnedPositionalEmbedding, PyModule> lpe(m, "LearnedPositionalEmbedding", R"doc(
Learned absolute positions (BERT/GPT style): out = dropout(X + weight[:T]), weight (max_len,
num_hiddens) initialised N(0, 1) like nn.Embedding; state dict name "weight".)doc");
  lpe.def(py::init([](int64_t max_len, int64_t num_hiddens, double dropout, py::handle dtype,
                      uint64_t seed, int threads, const std::string& backend, ContextPtr ctx) {
            ContextPtr c = make_context(ctx, seed, threads, backend);
            auto self = std::make_unique<PyLearnedPositionalEmbedding>(
                max_len, num_hiddens, dropout,
                parse_float_dtype(dtype, "LearnedPositionalEmbedding"), c->ctx.seed);
            self->ctx = c;
            return self;
          }),
          py::arg("max_len"), py::arg("num_hiddens"), py::arg("dropout") = 0.0, ATTN_COMMON_KWARGS,
          kCommonDoc);
  auto lpe_forward = [](PyLearnedPositionalEmbedding& self, py::handle X) {
    Input x = module_input(X, "LearnedPositionalEmbedding", "X", self.m.dtype());
    Tensor out = run_locked(self, {}, [&](Context& c) { return self.m.forward(c, x.tensor); });
    return to_numpy(out);
  };
  lpe.def("forward", lpe_forward, py::arg("X"))
      .def("__call__", lpe_forward, py::arg("X"))
      .def(
          "backward",
          [](PyLearnedPositionalEmbedding& self, py::handle grad_output) {
            Input d = module_input(grad_output, "LearnedPositionalEmbedding", "grad_output",
                                   self.m.dtype());
            Tensor dx =
                run_locked(self, {}, [&](Context& c) { return self.m.backward(c, d.tensor); });
            return to_numpy(dx);
          },
          py::arg("grad_output"), "Gradient of X; adds the table's gradient into .grads.");
}

}  // namespace attn::python
