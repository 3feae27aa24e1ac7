// d2l's Transformer decoder and encoder-decoder for Python (11.7): TransformerDecoder with d2l's
// constructor arguments and state-dict names, its KV-cache decoding (init_state, step), and
// EncoderDecoder with greedy and beam search.
#include "bindings.hpp"
#include "module_wrapper.hpp"

#include "attn/model/generation.hpp"
#include "attn/nn/decoder.hpp"

#include <pybind11/stl.h>

#include <string>

namespace attn::python {

namespace {

struct PyTransformerDecoder : PyModule {
  nn::TransformerDecoder m;
  int64_t ffn_num_hiddens;
  double dropout;
  bool use_bias;
  PyTransformerDecoder(int64_t V, int64_t E, int64_t F, int64_t H, int64_t blocks, double p,
                       bool bias, const nn::TransformerDecoderOptions& options)
      : m(V, E, F, H, blocks, p, bias, options), ffn_num_hiddens(F), dropout(p), use_bias(bias) {}
  nn::Module& module() override { return m; }
  const char* name() const override { return "TransformerDecoder"; }
  std::string repr() override {
    return "TransformerDecoder(vocab_size=" + std::to_string(m.vocab_size()) +
           ", num_hiddens=" + std::to_string(m.num_hiddens()) +
           ", ffn_num_hiddens=" + std::to_string(ffn_num_hiddens) +
           ", num_heads=" + std::to_string(m.num_heads()) +
           ", num_blks=" + std::to_string(m.num_blks()) + ", dropout=" + fmt_double(dropout) +
           ", use_bias=" + (use_bias ? "True" : "False") + ")";
  }
};

struct PyEncoderDecoder : PyModule {
  nn::EncoderDecoder m;
  explicit PyEncoderDecoder(const nn::Seq2SeqConfig& c) : m(c) {}
  nn::Module& module() override { return m; }
  const char* name() const override { return "EncoderDecoder"; }
  std::string repr() override {
    const nn::Seq2SeqConfig& c = m.config();
    return "EncoderDecoder(src_vocab_size=" + std::to_string(c.src_vocab_size) +
           ", tgt_vocab_size=" + std::to_string(c.tgt_vocab_size) +
           ", num_hiddens=" + std::to_string(c.num_hiddens) +
           ", ffn_num_hiddens=" + std::to_string(c.ffn_num_hiddens) +
           ", num_heads=" + std::to_string(c.num_heads) +
           ", num_enc_blks=" + std::to_string(c.num_enc_blks) +
           ", num_dec_blks=" + std::to_string(c.num_dec_blks) +
           ", dropout=" + fmt_double(c.dropout) + ", use_bias=" + (c.use_bias ? "True" : "False") +
           ")";
  }
};

// The cache of one decoding run (it owns copies: no caller array is kept).
struct PyDecoderState {
  nn::DecoderState state;
};

py::dict generation_dict(const model::Generation& g) {
  py::dict out;
  out["tokens"] = g.tokens;
  out["ended"] = g.ended;
  out["scores"] = g.scores;
  out["steps"] = g.steps;
  return out;
}

}  // namespace

void bind_decoder(py::module_& m) {
  py::class_<PyDecoderState>(m, "DecoderState", R"doc(
The key/value cache of TransformerDecoder.step: per block the projected self-attention keys and
values of the decoded positions and the projected encoder outputs. .length is the number of
positions decoded; reorder(rows) makes row i continue row rows[i] (beam search).)doc")
      .def_property_readonly("length", [](const PyDecoderState& s) { return s.state.length; })
      .def_property_readonly("batch", [](const PyDecoderState& s) { return s.state.batch; })
      .def_property_readonly(
          "cache_dtype",
          [](const PyDecoderState& s) {
            return s.state.blocks.empty()
                       ? std::string()
                       : std::string(python_dtype_name(s.state.blocks[0].keys.dtype()));
          },
          "dtype of the cached keys and values ('float32', 'float64' or 'bfloat16').")
      .def(
          "reorder",
          [](PyDecoderState& s, const std::vector<int64_t>& rows) { s.state.reorder(rows); },
          py::arg("rows"));

  py::class_<PyTransformerDecoder, PyModule> dec(m, "TransformerDecoder", R"doc(
d2l's TransformerDecoder(vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout,
use_bias=False): token ids (B, T) and enc_outputs (B, S, num_hiddens) -> logits (B, T, vocab_size)
through X = pos_encoding(embedding(ids) * sqrt(num_hiddens)), num_blks post-norm blocks (causal
self-attention, encoder-decoder attention over enc_outputs with enc_valid_lens, FFN) and a dense
layer. Unlike d2l the self-attention is causal in eval mode too, and step() adds the positional
encoding of the step's position (d2l adds row 0). State dict: embedding.weight,
blks.block{i}.attention{1,2}.W_{q,k,v,o}.weight, blks.block{i}.addnorm{1,2,3}.ln.*,
blks.block{i}.ffn.dense{1,2}.*, dense.weight, dense.bias.)doc");
  dec.def(py::init([](int64_t vocab_size, int64_t num_hiddens, int64_t ffn_num_hiddens,
                      int64_t num_heads, int64_t num_blks, double dropout, bool use_bias,
                      int64_t max_len, py::handle dtype, uint64_t seed, int threads,
                      const std::string& backend, ContextPtr ctx) {
            ContextPtr c = make_context(ctx, seed, threads, backend);
            nn::TransformerDecoderOptions options;
            options.max_len = max_len;
            options.dtype = parse_float_dtype(dtype, "TransformerDecoder");
            options.seed = c->ctx.seed;
            auto self = std::make_unique<PyTransformerDecoder>(vocab_size, num_hiddens,
                                                               ffn_num_hiddens, num_heads, num_blks,
                                                               dropout, use_bias, options);
            self->ctx = c;
            return self;
          }),
          py::arg("vocab_size"), py::arg("num_hiddens"), py::arg("ffn_num_hiddens"),
          py::arg("num_heads"), py::arg("num_blks"), py::arg("dropout"),
          py::arg("use_bias") = false, py::kw_only(), py::arg("max_len") = 1000,
          py::arg("dtype") = py::none(), py::arg("seed") = 0, py::arg("threads") = 0,
          py::arg("backend") = "auto", py::arg("ctx") = py::none(), kCommonDoc);
  auto dec_forward = [](PyTransformerDecoder& self, py::handle X, py::handle enc_outputs,
                        py::handle enc_valid_lens) {
    const char* op = "TransformerDecoder";
    Input ids = to_tensor(X, op, "X", InputKind::kIds);
    Input enc = module_input(enc_outputs, op, "enc_outputs", self.m.dtype());
    Input lens = lens_input(enc_valid_lens, op);
    Tensor out = run_locked(self, {ids.array, enc.array, lens.array}, [&](Context& c) {
      return self.m.forward(c, ids.tensor, enc.tensor, lens.tensor);
    });
    return to_numpy(out);
  };
  const char* dec_doc =
      "Token ids X (B, T), enc_outputs (B, S, num_hiddens), enc_valid_lens None or (B,) -> "
      "logits (B, T, vocab_size).";
  dec.def("forward", dec_forward, py::arg("X"), py::arg("enc_outputs"),
          py::arg("enc_valid_lens") = py::none(), dec_doc)
      .def("__call__", dec_forward, py::arg("X"), py::arg("enc_outputs"),
           py::arg("enc_valid_lens") = py::none(), dec_doc)
      .def(
          "backward",
          [](PyTransformerDecoder& self, py::handle grad_output) {
            Input d =
                module_input(grad_output, "TransformerDecoder", "grad_output", self.m.dtype());
            Tensor denc =
                run_locked(self, {}, [&](Context& c) { return self.m.backward(c, d.tensor); });
            return to_numpy(denc);
          },
          py::arg("grad_output"),
          "Gradient of enc_outputs (summed over the blocks); adds parameter gradients into "
          ".grads.")
      .def(
          "init_state",
          [](PyTransformerDecoder& self, py::handle enc_outputs, py::handle enc_valid_lens,
             int64_t capacity, py::handle cache_dtype) {
            const char* op = "TransformerDecoder.init_state";
            Input enc = module_input(enc_outputs, op, "enc_outputs", self.m.dtype());
            Input lens = lens_input(enc_valid_lens, op);
            const DType cache = parse_float_dtype(cache_dtype, op, /*allow_bf16=*/true);
            PyDecoderState s;
            s.state = run_locked(self, {}, [&](Context& c) {
              return self.m.init_state(c, enc.tensor, lens.tensor, capacity, cache);
            });
            return s;
          },
          py::arg("enc_outputs"), py::arg("enc_valid_lens") = py::none(), py::arg("capacity") = 64,
          py::arg("cache_dtype") = py::none(),
          "d2l's init_state: projects enc_outputs (B, S, num_hiddens) once per block and returns "
          "an empty DecoderState. cache_dtype: the cached keys' and values' dtype, None (the "
          "decoder's) or 'bfloat16' for a float32 decoder (half the memory and the bytes each "
          "step reads; the projections are rounded to bfloat16, attention accumulates in "
          "float32).")
      .def(
          "step",
          [](PyTransformerDecoder& self, py::handle X, PyDecoderState& s) {
            Input ids = to_tensor(X, "TransformerDecoder.step", "X", InputKind::kIds);
            Tensor out = run_locked(
                self, {}, [&](Context& c) { return self.m.step(c, ids.tensor, s.state); });
            return to_numpy(out);
          },
          py::arg("X"), py::arg("state"),
          "Decodes token ids X (B, T_new) at positions state.length .. state.length + T_new - 1 "
          "with the cache (eval computation) -> logits (B, T_new, vocab_size).")
      .def_property(
          "need_weights", [](PyTransformerDecoder& s) { return s.m.need_weights; },
          [](PyTransformerDecoder& s, bool on) {
            std::lock_guard lock(s.mutex);
            s.m.need_weights = on;
          },
          "Keep both attentions' weights on the next forward (attention_weights).")
      .def_property_readonly(
          "attention_weights",
          [](PyTransformerDecoder& self) {
            std::lock_guard lock(self.mutex);
            py::list self_w, cross_w;
            for (int64_t i = 0; i < self.m.num_blks(); ++i) {
              self_w.append(to_numpy(self.m.self_attention_weights(i), /*writeable=*/false));
              cross_w.append(to_numpy(self.m.cross_attention_weights(i), /*writeable=*/false));
            }
            py::list out;
            out.append(self_w);
            out.append(cross_w);
            return out;
          },
          "d2l's decoder.attention_weights: [self per block, cross per block], (B * num_heads, "
          "T, T|S) pre-dropout, None unless need_weights was set for the last forward.")
      .def_property_readonly("num_blks", [](PyTransformerDecoder& s) { return s.m.num_blks(); });

  py::class_<PyEncoderDecoder, PyModule> ed(m, "EncoderDecoder", R"doc(
d2l's EncoderDecoder(TransformerEncoder, TransformerDecoder) with one width:
forward(enc_X, dec_X, enc_valid_lens) = decoder(dec_X, encoder(enc_X, enc_valid_lens),
enc_valid_lens) -> logits (B, T, tgt_vocab_size). State dict: encoder.*, decoder.*.
greedy_search / beam_search generate with the decoder's key/value cache.)doc");
  ed.def(py::init([](int64_t src_vocab_size, int64_t tgt_vocab_size, int64_t num_hiddens,
                     int64_t ffn_num_hiddens, int64_t num_heads, int64_t num_enc_blks,
                     int64_t num_dec_blks, double dropout, bool use_bias, int64_t max_len,
                     py::handle dtype, uint64_t seed, int threads, const std::string& backend,
                     ContextPtr ctx) {
           ContextPtr c = make_context(ctx, seed, threads, backend);
           nn::Seq2SeqConfig config;
           config.src_vocab_size = src_vocab_size;
           config.tgt_vocab_size = tgt_vocab_size;
           config.num_hiddens = num_hiddens;
           config.ffn_num_hiddens = ffn_num_hiddens;
           config.num_heads = num_heads;
           config.num_enc_blks = num_enc_blks;
           config.num_dec_blks = num_dec_blks;
           config.dropout = dropout;
           config.use_bias = use_bias;
           config.max_len = max_len;
           config.dtype = parse_float_dtype(dtype, "EncoderDecoder");
           config.seed = c->ctx.seed;
           auto self = std::make_unique<PyEncoderDecoder>(config);
           self->ctx = c;
           return self;
         }),
         py::arg("src_vocab_size"), py::arg("tgt_vocab_size"), py::arg("num_hiddens"),
         py::arg("ffn_num_hiddens"), py::arg("num_heads"), py::arg("num_enc_blks"),
         py::arg("num_dec_blks"), py::arg("dropout"), py::arg("use_bias") = false, py::kw_only(),
         py::arg("max_len") = 1000, py::arg("dtype") = py::none(), py::arg("seed") = 0,
         py::arg("threads") = 0, py::arg("backend") = "auto", py::arg("ctx") = py::none(),
         kCommonDoc);
  auto ed_forward = [](PyEncoderDecoder& self, py::handle enc_X, py::handle dec_X,
                       py::handle enc_valid_lens) {
    const char* op = "EncoderDecoder";
    Input src = to_tensor(enc_X, op, "enc_X", InputKind::kIds);
    Input tgt = to_tensor(dec_X, op, "dec_X", InputKind::kIds);
    Input lens = lens_input(enc_valid_lens, op);
    Tensor out = run_locked(self, {src.array, tgt.array, lens.array}, [&](Context& c) {
      return self.m.forward(c, src.tensor, tgt.tensor, lens.tensor);
    });
    return to_numpy(out);
  };
  const char* ed_doc =
      "Source ids enc_X (B, S), target ids dec_X (B, T) (<bos> + the target shifted), "
      "enc_valid_lens None or (B,) -> logits (B, T, tgt_vocab_size).";
  auto search = [](PyEncoderDecoder& self, py::handle src_ids, py::handle src_valid_lens,
                   const model::GenerationOptions& o, bool beam) {
    const char* op = beam ? "beam_search" : "greedy_search";
    Input src = to_tensor(src_ids, op, "src", InputKind::kIds);
    Input lens = lens_input(src_valid_lens, op);
    model::Generation g = run_locked(self, {}, [&](Context& c) {
      return beam ? model::beam_search(c, self.m, src.tensor, lens.tensor, o)
                  : model::greedy_search(c, self.m, src.tensor, lens.tensor, o);
    });
    return generation_dict(g);
  };
  ed.def("forward", ed_forward, py::arg("enc_X"), py::arg("dec_X"),
         py::arg("enc_valid_lens") = py::none(), ed_doc)
      .def("__call__", ed_forward, py::arg("enc_X"), py::arg("dec_X"),
           py::arg("enc_valid_lens") = py::none(), ed_doc)
      .def(
          "backward",
          [](PyEncoderDecoder& self, py::handle grad_output) {
            Input d = module_input(grad_output, "EncoderDecoder", "grad_output", self.m.dtype());
            run_locked(self, {}, [&](Context& c) {
              self.m.backward(c, d.tensor);
              return 0;
            });
          },
          py::arg("grad_output"), "Adds every parameter gradient into .grads; returns None.")
      .def(
          "greedy_search",
          [search](PyEncoderDecoder& self, py::handle src, py::handle src_valid_lens, int64_t bos,
                   int64_t eos, int64_t max_len, bool use_cache, py::handle cache_dtype) {
            model::GenerationOptions o;
            o.bos = bos;
            o.eos = eos;
            o.max_len = max_len;
            o.use_cache = use_cache;
            o.cache_dtype = parse_float_dtype(cache_dtype, "greedy_search", /*allow_bf16=*/true);
            return search(self, src, src_valid_lens, o, false);
          },
          py::arg("src"), py::arg("src_valid_lens") = py::none(), py::kw_only(), py::arg("bos"),
          py::arg("eos"), py::arg("max_len") = 32, py::arg("use_cache") = true,
          py::arg("cache_dtype") = py::none(),
          "Greedy decoding of source ids (B, S) (eval mode; stops each sequence at eos) -> dict "
          "tokens (per source, without bos/eos), ended, scores (sum of log-probabilities), "
          "steps. cache_dtype (use_cache): None (the model's dtype) or 'bfloat16' for a float32 "
          "model, as TransformerDecoder.init_state.")
      .def(
          "beam_search",
          [search](PyEncoderDecoder& self, py::handle src, py::handle src_valid_lens, int64_t bos,
                   int64_t eos, int64_t max_len, int64_t beam_size, double length_penalty,
                   bool use_cache, py::handle cache_dtype) {
            model::GenerationOptions o;
            o.bos = bos;
            o.eos = eos;
            o.max_len = max_len;
            o.beam_size = beam_size;
            o.length_penalty = length_penalty;
            o.use_cache = use_cache;
            o.cache_dtype = parse_float_dtype(cache_dtype, "beam_search", /*allow_bf16=*/true);
            return search(self, src, src_valid_lens, o, true);
          },
          py::arg("src"), py::arg("src_valid_lens") = py::none(), py::kw_only(), py::arg("bos"),
          py::arg("eos"), py::arg("max_len") = 32, py::arg("beam_size") = 4,
          py::arg("length_penalty") = 0.75, py::arg("use_cache") = true,
          py::arg("cache_dtype") = py::none(),
          "Beam search (d2l 10.8: score log P / L^length_penalty) -> dict tokens, ended, scores, "
          "steps, as greedy_search (cache_dtype too).");
}

}  // namespace attn::python
