// attn's free functions for Python: the d2l names (masked_softmax, sinusoidal_encoding) and the
// functional attention, plus attn.Context. Every function converts its arrays (no copy where the
// layout allows: numpy_tensor.hpp), then computes with the GIL released.
#include "bindings.hpp"

#include "attn/core/memory.hpp"
#include "attn/ops/attention.hpp"
#include "attn/ops/linear.hpp"
#include "attn/ops/masked_softmax.hpp"
#include "attn/ops/positional.hpp"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace attn::python {

namespace {

ContextPtr context_or_default(const ContextPtr& ctx) {
  return ctx ? ctx : default_context();
}

// Runs f(ctx) with the GIL released and the context locked (dropout offsets are drawn from it).
template <typename F>
auto run_with(const ContextPtr& shared, F&& f) {
  return without_gil([&] {
    std::lock_guard lock(shared->mutex);
    return f(shared->ctx);
  });
}

MaskOptions mask_options(const Input& lens, bool causal, const std::string& masked_rows,
                         const char* op) {
  MaskOptions mask;
  mask.valid_lens = lens.tensor;
  mask.causal = causal;
  mask.masked_rows = parse_masked_rows(masked_rows, op);
  return mask;
}

}  // namespace

void bind_context(py::module_& m) {
  py::class_<SharedContext, ContextPtr>(m, "Context", R"doc(
Execution state passed to computations: thread count, seed of the dropout stream and the
stream offset the next dropout site takes, and the backend.

    ctx = attn.Context(seed=42, threads=1, backend="auto")
    attn.scaled_dot_product_attention(q, k, v, dropout=0.1, ctx=ctx)

Modules own one each (module.context); free functions use attn.default_context unless given
ctx=. Results do not depend on the thread count (static partitioning). autocast_bf16=True is
bf16 mixed precision, as `attn train --precision bf16` trains.)doc")
      .def(py::init([](uint64_t seed, int threads, const std::string& backend, bool autocast) {
             auto c = std::make_shared<SharedContext>();
             c->ctx.seed = seed;
             c->ctx.threads = threads;
             c->ctx.backend = parse_backend(backend);
             c->ctx.autocast_bf16 = autocast;
             return c;
           }),
           py::arg("seed") = 0, py::arg("threads") = 0, py::arg("backend") = "auto",
           py::arg("autocast_bf16") = false)
      .def_property(
          "seed", [](SharedContext& c) { return c.ctx.seed; },
          [](SharedContext& c, uint64_t seed) {
            std::lock_guard lock(c.mutex);
            c.ctx.seed = seed;
          },
          "Seed of the dropout stream (and of parameter initialisation for new modules).")
      .def_property(
          "threads", [](SharedContext& c) { return c.ctx.threads; },
          [](SharedContext& c, int threads) {
            check(threads >= 0, "Context", "threads is {}, expected >= 0 (0: all cores)", threads);
            std::lock_guard lock(c.mutex);
            c.ctx.threads = threads;
          },
          "Threads for parallel regions; 0 means all hardware threads.")
      .def_property(
          "backend", [](SharedContext& c) { return std::string(backend_name(c.ctx.backend)); },
          [](SharedContext& c, const std::string& name) {
            Backend b = parse_backend(name);
            std::lock_guard lock(c.mutex);
            c.ctx.backend = b;
          },
          "'auto' (fastest available), 'reference' (plain loops, the oracle) or 'cpu'.")
      .def_property(
          "autocast_bf16", [](SharedContext& c) { return c.ctx.autocast_bf16; },
          [](SharedContext& c, bool on) {
            std::lock_guard lock(c.mutex);
            c.ctx.autocast_bf16 = on;
          },
          R"doc(
bf16 mixed precision (PyTorch's torch.autocast("cpu", dtype=torch.bfloat16)): float32 modules
run their linear layers and attention cores in bfloat16 (inputs and weights rounded to bf16,
float32 sums, one rounding), while parameters, gradients, LayerNorm, softmax statistics and the
loss stay float32; a weight's gradient is the bf16 product widened to float32. Modules of other
dtypes and backend='reference' ignore it. Set it on a module's context (module.context) to
train that module in mixed precision; what a forward ran under, its backward must too.)doc")
      .def_property(
          "dropout_offset", [](SharedContext& c) { return c.ctx.dropout_offset(); },
          [](SharedContext& c, uint64_t offset) {
            std::lock_guard lock(c.mutex);
            c.ctx.set_dropout_offset(offset);
          },
          "Stream offset the next dropout site takes (each site and call takes a fresh one).")
      .def_property(
          "dropout_first_sample", [](SharedContext& c) { return c.ctx.dropout_first_sample; },
          [](SharedContext& c, uint64_t first) {
            std::lock_guard lock(c.mutex);
            c.ctx.dropout_first_sample = first;
          },
          R"doc(
Global index of the first sample (row of the batch) the next calls compute: element i of a
dropout mask is drawn at stream index dropout_first_sample * (elements per sample) + i. 0 in one
process. In data-parallel training, rank r computing rows [lo, hi) of the global batch sets it
to lo (attn.distributed.DistributedDataParallel.shard does), so a sample's dropout masks do not
depend on which rank holds it: N ranks train the model 1 rank trains.)doc")
      .def("__repr__", [](SharedContext& c) {
        return "Context(seed=" + std::to_string(c.ctx.seed) +
               ", threads=" + std::to_string(c.ctx.threads) + ", backend='" +
               backend_name(c.ctx.backend) + "'" +
               (c.ctx.autocast_bf16 ? ", autocast_bf16=True" : "") + ")";
      });
  m.attr("default_context") = default_context();

  // The block cache behind tensors (attn/core/memory.hpp).
  m.def(
      "memory_cache_stats",
      [] {
        const MemoryCacheStats s = memory_cache_stats();
        py::dict d;
        d["limit_bytes"] = s.limit_bytes;
        d["cached_bytes"] = s.cached_bytes;
        d["cached_blocks"] = s.cached_blocks;
        d["hits"] = s.hits;
        d["misses"] = s.misses;
        return d;
      },
      R"doc(The block cache behind attn's arrays: freed blocks of 128 KiB or more are kept (up to
limit_bytes) for later results of about the same size, so that each step's temporaries are not
page-faulted in again. Returns {limit_bytes, cached_bytes, cached_blocks, hits, misses}.)doc");
  m.def(
      "release_cached_memory", [] { release_cached_memory(); },
      "Frees every block the cache holds (arrays alive are not affected).");
  m.def(
      "set_memory_cache_limit",
      [](int64_t bytes) {
        check(bytes >= 0, "set_memory_cache_limit", "limit is {} bytes, expected >= 0 (0: off)",
              bytes);
        set_memory_cache_limit(static_cast<size_t>(bytes));
      },
      py::arg("bytes"),
      "Most bytes the cache may hold (default ATTN_MEMORY_CACHE_MIB MiB, else 1 GiB); 0 turns it "
      "off and frees what it holds.");
}

void bind_ops(py::module_& m) {
  m.def(
      "masked_softmax",
      [](py::handle X, py::handle valid_lens, bool causal, const std::string& masked_rows,
         ContextPtr ctx) {
        const char* op = "masked_softmax";
        Input x = to_tensor(X, op, "X", InputKind::kFloat);
        Input lens = to_tensor(valid_lens, op, "valid_lens", InputKind::kLens, true);
        MaskOptions mask = mask_options(lens, causal, masked_rows, op);
        Tensor y = run_with(context_or_default(ctx),
                            [&](Context& c) { return masked_softmax(c, x.tensor, mask); });
        return to_numpy(y);
      },
      py::arg("X"), py::arg("valid_lens") = py::none(), py::kw_only(), py::arg("causal") = false,
      py::arg("masked_rows") = "uniform", py::arg("ctx") = py::none(), R"doc(
Softmax over the last axis with d2l's valid_lens masking.

X: (B, T, S) float32/float64. valid_lens: None, (B,) or (B, T), integer or float (key s of row
(b, t) is kept iff s < len; 2.5 keeps 0, 1, 2). Masked keys get exactly 0. A row with no kept key
is uniform 1/S (masked_rows='uniform', d2l) or all zeros (masked_rows='zero', PyTorch SDPA).
causal=True also masks keys s > t. Unlike d2l, X is not modified. Returns (B, T, S).)doc");

  m.def(
      "masked_softmax_backward",
      [](py::handle dY, py::handle Y, py::handle valid_lens, bool causal,
         const std::string& masked_rows, ContextPtr ctx) {
        const char* op = "masked_softmax_backward";
        Input dy = to_tensor(dY, op, "dY", InputKind::kFloat);
        Input y = to_tensor(Y, op, "Y", InputKind::kFloat);
        Input lens = to_tensor(valid_lens, op, "valid_lens", InputKind::kLens, true);
        MaskOptions mask = mask_options(lens, causal, masked_rows, op);
        Tensor dx = run_with(context_or_default(ctx), [&](Context& c) {
          return masked_softmax_backward(c, dy.tensor, y.tensor, mask);
        });
        return to_numpy(dx);
      },
      py::arg("dY"), py::arg("Y"), py::arg("valid_lens") = py::none(), py::kw_only(),
      py::arg("causal") = false, py::arg("masked_rows") = "uniform", py::arg("ctx") = py::none(),
      R"doc(
Gradient of masked_softmax: dX = mask * Y * (dY - sum_s(dY * Y)), Y the forward's output.
Masked positions and rows with no kept key get zero gradient.)doc");

  m.def(
      "scaled_dot_product_attention",
      [](py::handle queries, py::handle keys, py::handle values, py::handle valid_lens, bool causal,
         double dropout, std::optional<double> scale, bool need_weights,
         const std::string& masked_rows, py::handle dtype, ContextPtr ctx) -> py::object {
        const char* op = "scaled_dot_product_attention";
        const std::optional<DType> compute = parse_compute_dtype(dtype, op);
        Input q = to_tensor(queries, op, "queries", InputKind::kFloatBF16);
        Input k = to_tensor(keys, op, "keys", InputKind::kFloatBF16);
        Input v = to_tensor(values, op, "values", InputKind::kFloatBF16);
        Input lens = to_tensor(valid_lens, op, "valid_lens", InputKind::kLens, true);
        if (!compute) check_same_dtype(op, {{"queries", &q}, {"keys", &k}, {"values", &v}});
        AttentionOptions opts;
        opts.mask = mask_options(lens, causal, masked_rows, op);
        opts.dropout = dropout;
        opts.training = dropout > 0;  // functional form: dropout acts whenever p > 0 (as SDPA)
        opts.need_weights = need_weights;
        opts.scale = scale;
        AttentionResult r = run_with(context_or_default(ctx), [&](Context& c) {
          if (!compute) return scaled_dot_product_attention(c, q.tensor, k.tensor, v.tensor, opts);
          // dtype=: a converted copy of each input whose dtype differs (to BF16: round to
          // nearest even, attn/core/dtype.hpp; a float64 input through float32).
          return scaled_dot_product_attention(c, q.tensor.to(*compute), k.tensor.to(*compute),
                                              v.tensor.to(*compute), opts);
        });
        const OutputMode out(r.output.dtype(), {&q, &k, &v});
        if (need_weights) return py::make_tuple(out(r.output), out(r.weights));
        return out(r.output);
      },
      py::arg("queries"), py::arg("keys"), py::arg("values"), py::arg("valid_lens") = py::none(),
      py::arg("causal") = false, py::arg("dropout") = 0.0, py::kw_only(),
      py::arg("scale") = py::none(), py::arg("need_weights") = false,
      py::arg("masked_rows") = "uniform", py::arg("dtype") = py::none(),
      py::arg("ctx") = py::none(), R"doc(
out = dropout(masked_softmax(queries keys^T * scale, valid_lens)) values   (d2l DotProductAttention)

queries (B, T, D), keys (B, S, D), values (B, S, Dv), float32 or float64, any strides, or
torch.bfloat16 tensors (viewed without a copy). valid_lens None, (B,) or (B, T); causal: query t
sees keys 0..t; scale defaults to 1/sqrt(D). dropout acts whenever > 0 (like PyTorch's
functional SDPA), drawn from ctx's dropout stream. Returns out (B, T, Dv), or (out, weights) with
need_weights=True; weights (B, T, S) are the pre-dropout softmax, as d2l stores them.

dtype: None computes in the inputs' dtype (all three alike, else attn.Error). 'bfloat16' (or
torch.bfloat16) rounds float inputs to bfloat16 (nearest even) and runs the bfloat16 kernels;
'float32'/'float64' convert to that. bfloat16 results: torch.bfloat16 tensors when an input was a
torch tensor (weights then a float32 torch tensor), else float32 NumPy arrays holding the
bfloat16 values exactly (out); the weights are float32 either way.)doc");

  m.def(
      "sinusoidal_encoding",
      [](int64_t num_steps, int64_t num_hiddens, py::handle dtype, std::optional<bool> exact) {
        const char* op = "sinusoidal_encoding";
        DType t = parse_float_dtype(dtype, op);
        std::optional<SinusoidalMode> mode;
        if (exact) mode = *exact ? SinusoidalMode::kExact : SinusoidalMode::kMatchD2l;
        Tensor P =
            without_gil([&] { return sinusoidal_encoding(num_steps, num_hiddens, t, mode); });
        return to_numpy(P);
      },
      py::arg("num_steps"), py::arg("num_hiddens"), py::arg("dtype") = py::none(), py::kw_only(),
      py::arg("exact") = py::none(), R"doc(
The sinusoidal position matrix P (num_steps, num_hiddens) of d2l's PositionalEncoding:
P[i, 2j] = sin(i / 10000^(2j/d)), P[i, 2j+1] = cos(i / 10000^(2j/d)). Odd widths and any length
work. float32 follows d2l's float32 op chain (within ~1 ulp of PyTorch) unless exact=True;
float64 (and exact=True) computes angles in double.)doc");

  m.def(
      "linear",
      [](py::handle x, py::handle weight, py::handle bias, py::handle dtype, ContextPtr ctx) {
        const char* op = "linear";
        const std::optional<DType> compute = parse_compute_dtype(dtype, op);
        Input xi = to_tensor(x, op, "x", InputKind::kFloatBF16);
        Input w = to_tensor(weight, op, "weight", InputKind::kFloatBF16);
        Input b = to_tensor(bias, op, "bias", InputKind::kFloatBF16, true);
        if (!compute && b.tensor.defined())
          check_same_dtype(op, {{"x", &xi}, {"weight", &w}, {"bias", &b}});
        else if (!compute)
          check_same_dtype(op, {{"x", &xi}, {"weight", &w}});
        Tensor y = run_with(context_or_default(ctx), [&](Context& c) {
          if (!compute) return linear(c, xi.tensor, w.tensor, b.tensor);
          // dtype=: a converted copy of each input whose dtype differs (to BF16: round to
          // nearest even, attn/core/dtype.hpp; a float64 input through float32).
          const Tensor bc = b.tensor.defined() ? b.tensor.to(*compute) : Tensor();
          return linear(c, xi.tensor.to(*compute), w.tensor.to(*compute), bc);
        });
        return OutputMode(y.dtype(), {&xi, &w, &b})(y);
      },
      py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::kw_only(),
      py::arg("dtype") = py::none(), py::arg("ctx") = py::none(), R"doc(
y = x weight^T + bias, weight (out, in) as in PyTorch: (..., in) -> (..., out).

x, weight, bias: float32 or float64, or torch.bfloat16 tensors (viewed without a copy).
dtype: None computes in the inputs' dtype (all alike, else attn.Error); 'bfloat16' (or
torch.bfloat16) rounds float inputs to bfloat16 (nearest even) and runs the bfloat16 GEMM (f32
accumulation, one rounding per output, as PyTorch's bf16 F.linear); 'float32'/'float64' convert
to that. bfloat16 results: a torch.bfloat16 tensor when an input was a torch tensor, else a
float32 NumPy array holding the bfloat16 values exactly.)doc");

  m.def(
      "_input_view",
      [](py::handle array, bool lens) {
        Input in = to_tensor(array, "_input_view", "array",
                             lens ? InputKind::kLens : InputKind::kFloatBF16);
        py::dict info;
        info["data"] = reinterpret_cast<uintptr_t>(in.tensor.raw_data());
        info["strides"] = py::cast(in.tensor.strides());
        info["dtype"] = std::string(dtype_name(in.tensor.dtype()));
        info["copied"] = in.copied;
        info["from_torch"] = in.from_torch;
        return info;
      },
      py::arg("array"), py::arg("lens") = false,
      "Testing aid: how an argument reaches C++ (data address, element strides, dtype, and "
      "copied:\n"
      "whether it was not a NumPy array usable as is, nor a torch.bfloat16 tensor).");

  m.def(
      "dropout",
      [](py::handle x, double p, uint64_t seed, uint64_t offset) {
        Input xi = to_tensor(x, "dropout", "x", InputKind::kFloat);
        Tensor y = without_gil([&] { return dropout(xi.tensor, p, seed, offset); });
        return to_numpy(y);
      },
      py::arg("x"), py::arg("p"), py::kw_only(), py::arg("seed") = 0, py::arg("offset") = 0,
      R"doc(
Inverted dropout of x from the Philox dropout stream keyed by (seed, offset): element i
(row-major) is kept iff its uniform u_i >= p, then scaled by 1/(1-p). The same (seed, offset)
always draws the same mask, in C++, Python and CUDA alike.)doc");
}

}  // namespace attn::python
