// d2l's Transformer encoder for Python (11.7): TransformerEncoderBlock and TransformerEncoder,
// with d2l's constructor arguments and state-dict names (blks.block0.attention.W_q.weight, ...).
#include "bindings.hpp"
#include "module_wrapper.hpp"

#include "attn/nn/transformer.hpp"

#include <pybind11/stl.h>

#include <string>

namespace attn::python {

namespace {

struct PyTransformerEncoderBlock : PyModule {
  nn::TransformerEncoderBlock m;
  int64_t num_hiddens, ffn_num_hiddens, num_heads;
  double dropout;
  bool use_bias;
  PyTransformerEncoderBlock(int64_t E, int64_t F, int64_t H, double p, bool bias, DType dtype,
                            uint64_t seed)
      : m(E, F, H, p, bias, dtype, seed),
        num_hiddens(E),
        ffn_num_hiddens(F),
        num_heads(H),
        dropout(p),
        use_bias(bias) {}
  nn::Module& module() override { return m; }
  const char* name() const override { return "TransformerEncoderBlock"; }
  std::string repr() override {
    return "TransformerEncoderBlock(num_hiddens=" + std::to_string(num_hiddens) +
           ", ffn_num_hiddens=" + std::to_string(ffn_num_hiddens) +
           ", num_heads=" + std::to_string(num_heads) + ", dropout=" + fmt_double(dropout) +
           ", use_bias=" + (use_bias ? "True" : "False") + ")";
  }
};

struct PyTransformerEncoder : PyModule {
  nn::TransformerEncoder m;
  int64_t vocab_size, ffn_num_hiddens, num_heads;
  double dropout;
  bool use_bias;
  PyTransformerEncoder(int64_t V, int64_t E, int64_t F, int64_t H, int64_t blocks, double p,
                       bool bias, const nn::TransformerEncoderOptions& options)
      : m(V, E, F, H, blocks, p, bias, options),
        vocab_size(V),
        ffn_num_hiddens(F),
        num_heads(H),
        dropout(p),
        use_bias(bias) {}
  nn::Module& module() override { return m; }
  const char* name() const override { return "TransformerEncoder"; }
  std::string repr() override {
    return "TransformerEncoder(vocab_size=" + std::to_string(vocab_size) +
           ", num_hiddens=" + std::to_string(m.num_hiddens()) +
           ", ffn_num_hiddens=" + std::to_string(ffn_num_hiddens) +
           ", num_heads=" + std::to_string(num_heads) +
           ", num_blks=" + std::to_string(m.num_blks()) + ", dropout=" + fmt_double(dropout) +
           ", use_bias=" + (use_bias ? "True" : "False") + ", positional='" +
           nn::positional_kind_name(m.positional()) + "')";
  }
};

}  // namespace

void bind_transformer(py::module_& m) {
  py::class_<PyTransformerEncoderBlock, PyModule> block(m, "TransformerEncoderBlock", R"doc(
d2l's TransformerEncoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias=False):
Y = addnorm1(X, attention(X, X, X, valid_lens)); out = addnorm2(Y, ffn(Y)), post-norm.
State dict: attention.W_{q,k,v,o}.weight, addnorm1.ln.{weight,bias}, ffn.dense{1,2}.{weight,bias},
addnorm2.ln.{weight,bias}.)doc");
  block.def(py::init([](int64_t num_hiddens, int64_t ffn_num_hiddens, int64_t num_heads,
                        double dropout, bool use_bias, py::handle dtype, uint64_t seed, int threads,
                        const std::string& backend, ContextPtr ctx) {
              ContextPtr c = make_context(ctx, seed, threads, backend);
              auto self = std::make_unique<PyTransformerEncoderBlock>(
                  num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias,
                  parse_float_dtype(dtype, "TransformerEncoderBlock"), c->ctx.seed);
              self->ctx = c;
              return self;
            }),
            py::arg("num_hiddens"), py::arg("ffn_num_hiddens"), py::arg("num_heads"),
            py::arg("dropout"), py::arg("use_bias") = false, ATTN_COMMON_KWARGS, kCommonDoc);
  auto block_forward = [](PyTransformerEncoderBlock& self, py::handle X, py::handle valid_lens) {
    const char* op = "TransformerEncoderBlock";
    Input x = module_input(X, op, "X", self.m.dtype());
    Input lens = lens_input(valid_lens, op);
    Tensor out = run_locked(self, {x.array, lens.array},
                            [&](Context& c) { return self.m.forward(c, x.tensor, lens.tensor); });
    return to_numpy(out);
  };
  const char* block_doc =
      "X (B, T, num_hiddens), valid_lens None, (B,) or (B, T) -> (B, T, num_hiddens).";
  block.def("forward", block_forward, py::arg("X"), py::arg("valid_lens") = py::none(), block_doc)
      .def("__call__", block_forward, py::arg("X"), py::arg("valid_lens") = py::none(), block_doc)
      .def(
          "backward",
          [](PyTransformerEncoderBlock& self, py::handle grad_output) {
            Input d =
                module_input(grad_output, "TransformerEncoderBlock", "grad_output", self.m.dtype());
            Tensor dx =
                run_locked(self, {}, [&](Context& c) { return self.m.backward(c, d.tensor); });
            return to_numpy(dx);
          },
          py::arg("grad_output"),
          "Gradient of X (its three uses as queries, keys and values summed); adds parameter "
          "gradients into .grads.")
      .def_property_readonly(
          "attention_weights",
          [](PyTransformerEncoderBlock& self) {
            std::lock_guard lock(self.mutex);
            return to_numpy(self.m.attention.attention_weights(), /*writeable=*/false);
          },
          "The block's (B * num_heads, T, T) pre-dropout weights of the last forward.");

  py::class_<PyTransformerEncoder, PyModule> enc(m, "TransformerEncoder", R"doc(
d2l's TransformerEncoder(vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout,
use_bias=False): token ids (B, T) -> (B, T, num_hiddens) through
X = pos_encoding(embedding(ids) * sqrt(num_hiddens)) and num_blks post-norm blocks.
State dict: embedding.weight, blks.block{i}.(...) as d2l's. positional= chooses the position
signal: 'sinusoidal' (d2l, default), 'learned', 'rotary', 'alibi' or 'none'.)doc");
  enc.def(py::init([](int64_t vocab_size, int64_t num_hiddens, int64_t ffn_num_hiddens,
                      int64_t num_heads, int64_t num_blks, double dropout, bool use_bias,
                      const std::string& positional, int64_t max_len, py::handle dtype,
                      uint64_t seed, int threads, const std::string& backend, ContextPtr ctx) {
            ContextPtr c = make_context(ctx, seed, threads, backend);
            nn::TransformerEncoderOptions options;
            options.positional = nn::parse_positional_kind(positional);
            options.max_len = max_len;
            options.dtype = parse_float_dtype(dtype, "TransformerEncoder");
            options.seed = c->ctx.seed;
            auto self = std::make_unique<PyTransformerEncoder>(vocab_size, num_hiddens,
                                                               ffn_num_hiddens, num_heads, num_blks,
                                                               dropout, use_bias, options);
            self->ctx = c;
            return self;
          }),
          py::arg("vocab_size"), py::arg("num_hiddens"), py::arg("ffn_num_hiddens"),
          py::arg("num_heads"), py::arg("num_blks"), py::arg("dropout"),
          py::arg("use_bias") = false, py::kw_only(), py::arg("positional") = "sinusoidal",
          py::arg("max_len") = 1000, py::arg("dtype") = py::none(), py::arg("seed") = 0,
          py::arg("threads") = 0, py::arg("backend") = "auto", py::arg("ctx") = py::none(),
          kCommonDoc);
  auto enc_forward = [](PyTransformerEncoder& self, py::handle X, py::handle valid_lens) {
    const char* op = "TransformerEncoder";
    Input ids = to_tensor(X, op, "X", InputKind::kIds);
    Input lens = lens_input(valid_lens, op);
    Tensor out = run_locked(self, {ids.array, lens.array},
                            [&](Context& c) { return self.m.forward(c, ids.tensor, lens.tensor); });
    return to_numpy(out);
  };
  const char* enc_doc =
      "Token ids X (B, T) (integers in [0, vocab_size)), valid_lens None, (B,) or (B, T) -> (B, T, "
      "num_hiddens).";
  enc.def("forward", enc_forward, py::arg("X"), py::arg("valid_lens") = py::none(), enc_doc)
      .def("__call__", enc_forward, py::arg("X"), py::arg("valid_lens") = py::none(), enc_doc)
      .def(
          "backward",
          [](PyTransformerEncoder& self, py::handle grad_output) {
            Input d =
                module_input(grad_output, "TransformerEncoder", "grad_output", self.m.dtype());
            run_locked(self, {}, [&](Context& c) {
              self.m.backward(c, d.tensor);
              return 0;
            });
          },
          py::arg("grad_output"),
          "Adds every parameter gradient into .grads (token ids have none); returns None.")
      .def_property_readonly(
          "attention_weights",
          [](PyTransformerEncoder& self) {
            std::lock_guard lock(self.mutex);
            py::list out;
            for (int64_t i = 0; i < self.m.num_blks(); ++i)
              out.append(to_numpy(self.m.attention_weights(i), /*writeable=*/false));
            return out;
          },
          "d2l's encoder.attention_weights: per block, (B * num_heads, T, T) pre-dropout.")
      .def_property_readonly("num_hiddens",
                             [](PyTransformerEncoder& s) { return s.m.num_hiddens(); })
      .def_property_readonly("num_blks", [](PyTransformerEncoder& s) { return s.m.num_blks(); });
}

}  // namespace attn::python
