// Positional encodings as modules: d2l's sinusoidal PositionalEncoding and a learned absolute
// position table, forward and backward.
//
// Vocabulary: B batch, T positions (sequence length), E = num_hiddens.
#include "attn/nn/positional.hpp"

#include "attn/ops/attention.hpp"
#include "attn/ops/dropout.hpp"
#include "kernels/cpu/encoder_ops.hpp"
#include "kernels/cpu/parallel_for.hpp"
#include "nn/internal.hpp"
#include "nn/transformer_internal.hpp"

#include <algorithm>

namespace attn::nn {

namespace {

// out[b, t, e] = X[b, t, e] + P[t, e] for t < T: the position table broadcast over the batch.
// Batch rows on up to `threads` OpenMP threads (elementwise: the same sums for any count), and
// a unit-stride inner loop (it vectorises) when X and P have unit feature stride.
template <typename T>
void add_positions_typed(const Tensor& X, const Tensor& P, Tensor& out, int threads) {
  const int64_t B = X.dim(0), L = X.dim(1), E = X.dim(2);
  const int64_t x0 = X.stride(0), x1 = X.stride(1), x2 = X.stride(2);
  const int64_t p0 = P.stride(0), p1 = P.stride(1);
  const T* x = X.data<T>();
  const T* p = P.data<T>();
  T* o = out.data<T>();
  const bool unit = x2 == 1 && p1 == 1;
  cpu::parallel_for(B, B * L * E >= (int64_t{1} << 16) ? threads : 1, [&](int64_t b) {
    for (int64_t t = 0; t < L; ++t) {
      T* orow = o + (b * L + t) * E;
      if (unit) {
        const T* xr = x + b * x0 + t * x1;
        const T* pr = p + t * p0;
#pragma omp simd
        for (int64_t e = 0; e < E; ++e)
          orow[e] = xr[e] + pr[e];
      } else {
        for (int64_t e = 0; e < E; ++e)
          orow[e] = x[b * x0 + t * x1 + e * x2] + p[t * p0 + e * p1];
      }
    }
  });
}

// The adjoint of the broadcast: G[t, e] += sum over b of dY[b, t, e] (dY contiguous (B, T, E)).
template <typename T>
void accumulate_positions(const Tensor& dY, Tensor& G) {
  const int64_t B = dY.dim(0), L = dY.dim(1), E = dY.dim(2);
  const T* d = dY.data<T>();
  T* g = G.data<T>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L * E; ++i)
      g[i] += d[b * L * E + i];
}

Tensor add_positions(const Tensor& X, const Tensor& P, int threads) {
  Tensor out = Tensor::empty(X.shape(), X.dtype());
  if (X.dtype() == DType::F32)
    add_positions_typed<float>(X, P, out, threads);
  else
    add_positions_typed<double>(X, P, out, threads);
  return out;
}

void check_module_args(const char* op, int64_t num_hiddens, double p, DType dtype) {
  check(num_hiddens > 0, op, "num_hiddens must be positive, got {}", num_hiddens);
  check(p >= 0.0 && p <= 1.0, op, "dropout probability {} is outside [0, 1]", p);
  check(dtype == DType::F32 || dtype == DType::F64, op, "dtype {} unsupported, expected F32 or F64",
        dtype_name(dtype));
}

void check_sequence(const char* op, const Tensor& X, int64_t num_hiddens, DType dtype) {
  detail::check_input(op, "X", X, 3, dtype);
  check(X.dim(2) == num_hiddens, op, "X has shape {}, expected (B, T, {})", shape_arg(X.shape()),
        num_hiddens);
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// PositionalEncoding: out = dropout(X + P[:T]),  P[i, 2j] = sin(i / 10000^(2j/E)),
//                                               P[i, 2j+1] = cos(i / 10000^(2j/E))

PositionalEncoding::PositionalEncoding(int64_t num_hiddens, double dropout_p, int64_t max_len,
                                       DType dtype)
    : Module(dtype), dropout(dropout_p), num_hiddens_(num_hiddens) {
  check_module_args("PositionalEncoding", num_hiddens, dropout_p, dtype);
  check(max_len >= 0, "PositionalEncoding", "max_len must be >= 0, got {}", max_len);
  // d2l computes P for max_len positions up front; here max_len is only the initial cache size.
  if (max_len > 0) P_ = sinusoidal_encoding(max_len, num_hiddens, dtype);
}

const Tensor& PositionalEncoding::P(int64_t len) {
  if (!P_.defined() || P_.dim(0) < len) {
    // Grow geometrically so that slowly increasing lengths recompute O(log) times. Each row is a
    // pure function of its position, so a regrown table agrees with the old one on old rows.
    const int64_t old = P_.defined() ? P_.dim(0) : 0;
    P_ = sinusoidal_encoding(std::max(len, 2 * old), num_hiddens_, dtype_);
  }
  return P_;
}

Tensor PositionalEncoding::forward(Context& ctx, const Tensor& X) {
  const char* op = "PositionalEncoding";
  check_sequence(op, X, num_hiddens_, dtype_);
  check(dropout >= 0.0 && dropout <= 1.0, op, "dropout probability {} is outside [0, 1]", dropout);
  // X = X + P[:, :T, :]
  Tensor Y = add_positions(X, P(X.dim(1)), ctx.resolved_threads());
  // return dropout(X): a fresh stream offset per call, like every other dropout site.
  dropped_ = training_ && dropout > 0.0;
  if (dropped_) {
    dropout_offset_ = ctx.next_dropout_offset();
    Y = attn::dropout(ctx, Y, dropout, ctx.seed, dropout_offset_);
  }
  return Y;
}

Tensor PositionalEncoding::backward(Context& ctx, const Tensor& dout) {
  // forward: out = dropout(X + P), P constant, so dX = dropout_backward(dout) (same mask).
  check(dout.defined() && dout.ndim() == 3 && dout.dim(2) == num_hiddens_ && dout.dtype() == dtype_,
        "PositionalEncoding::backward", "dout has shape {}, expected (B, T, {}) of {}",
        shape_arg(dout.shape()), num_hiddens_, dtype_name(dtype_));
  if (dropped_) return dropout_backward(ctx, dout, dropout, ctx.seed, dropout_offset_);
  return dout.clone();
}

namespace {

// The one-pass float32 CPU path of forward_scaled / backward_scaled (p = 1 keeps the separate
// ops: dropout_f32's everything-dropped case).
bool fused_input_stage(const Context& ctx, DType dtype, double p) {
  return ctx.backend != Backend::kReference && dtype == DType::F32 && p < 1.0;
}

// The dropout stream index of element 0 of t (B, T, E), as attn::dropout takes it: the sample
// axis is the outermost (a data-parallel shard's first sample, Context::dropout_first_sample).
uint64_t sample_index_base(const Context& ctx, const Tensor& t) {
  return ctx.dropout_index_base(t.dim(0) > 0 ? static_cast<uint64_t>(t.dim(1) * t.dim(2)) : 0);
}

}  // namespace

Tensor PositionalEncoding::forward_scaled(Context& ctx, const Tensor& X, double factor) {
  const char* op = "PositionalEncoding";
  check_sequence(op, X, num_hiddens_, dtype_);
  check(dropout >= 0.0 && dropout <= 1.0, op, "dropout probability {} is outside [0, 1]", dropout);
  const int threads = ctx.resolved_threads();
  if (!fused_input_stage(ctx, dtype_, dropout))
    return forward(ctx, detail::scaled(X, factor, threads));
  const int64_t B = X.dim(0), T = X.dim(1), E = X.dim(2);
  const Tensor Xc = X.contiguous();
  const Tensor& table = P(T);
  // As forward: a fresh stream offset per call when dropping.
  dropped_ = training_ && dropout > 0.0;
  if (dropped_) dropout_offset_ = ctx.next_dropout_offset();
  Tensor Y = Tensor::empty(X.shape(), DType::F32);
  cpu::scale_add_positions_dropout_f32(
      Xc.data<float>(), factor, table.data<float>(), table.stride(0), Y.data<float>(), B, T, E,
      dropped_ ? dropout : 0.0, ctx.seed, dropout_offset_, sample_index_base(ctx, X), threads);
  return Y;
}

Tensor PositionalEncoding::backward_scaled(Context& ctx, const Tensor& dout, double factor) {
  const int threads = ctx.resolved_threads();
  // A dout the one-pass path does not take (or a malformed one: backward names the problem)
  // goes through the separate ops.
  if (!fused_input_stage(ctx, dtype_, dropout) || !dout.defined() || dout.ndim() != 3 ||
      dout.dim(2) != num_hiddens_ || dout.dtype() != DType::F32)
    return detail::scaled(backward(ctx, dout), factor, threads);
  const Tensor dc = dout.contiguous();
  Tensor dX = Tensor::empty(dout.shape(), DType::F32);
  cpu::dropout_scale_f32(dc.data<float>(), factor, dX.data<float>(), dout.numel(),
                         dropped_ ? dropout : 0.0, ctx.seed, dropout_offset_,
                         sample_index_base(ctx, dout), threads);
  return dX;
}

// ----------------------------------------------------------------------------------------------
// LearnedPositionalEmbedding: out = dropout(X + W[:T]), W (max_len, E) a parameter

LearnedPositionalEmbedding::LearnedPositionalEmbedding(int64_t max_len, int64_t num_hiddens,
                                                       double dropout_p, DType dtype, uint64_t seed)
    : Module(dtype), dropout(dropout_p) {
  check_module_args("LearnedPositionalEmbedding", num_hiddens, dropout_p, dtype);
  check(max_len > 0, "LearnedPositionalEmbedding", "max_len must be positive, got {}", max_len);
  // nn.Embedding's init: N(0, 1), from this parameter's own stream.
  weight.value = Tensor::empty({max_len, num_hiddens}, dtype);
  Rng rng(seed, detail::name_stream("weight"));
  detail::fill_with(weight.value, [&] { return rng.normal(); });
  weight.grad = Tensor::zeros({max_len, num_hiddens}, dtype);
}

std::vector<std::pair<std::string, Parameter*>> LearnedPositionalEmbedding::named_parameters() {
  return {{"weight", &weight}};
}

Tensor LearnedPositionalEmbedding::forward(Context& ctx, const Tensor& X) {
  const char* op = "LearnedPositionalEmbedding";
  const int64_t max_len = weight.value.dim(0), E = weight.value.dim(1);
  check_sequence(op, X, E, dtype_);
  check(X.dim(1) <= max_len, op,
        "X has shape {}: {} positions, but the table holds max_len = {} (a learned table cannot "
        "extrapolate; use PositionalEncoding or a larger max_len)",
        shape_arg(X.shape()), X.dim(1), max_len);
  check(dropout >= 0.0 && dropout <= 1.0, op, "dropout probability {} is outside [0, 1]", dropout);
  T_ = X.dim(1);
  Tensor Y = add_positions(X, weight.value, ctx.resolved_threads());
  dropped_ = training_ && dropout > 0.0;
  if (dropped_) {
    dropout_offset_ = ctx.next_dropout_offset();
    Y = attn::dropout(ctx, Y, dropout, ctx.seed, dropout_offset_);
  }
  return Y;
}

Tensor LearnedPositionalEmbedding::backward(Context& ctx, const Tensor& dout) {
  const char* op = "LearnedPositionalEmbedding::backward";
  const int64_t E = weight.value.dim(1);
  check(dout.defined() && dout.ndim() == 3 && dout.dim(1) == T_ && dout.dim(2) == E &&
            dout.dtype() == dtype_,
        op, "dout has shape {}, expected (B, {}, {}) of {}", shape_arg(dout.shape()), T_, E,
        dtype_name(dtype_));
  // forward: Y = X + W[:T]; out = dropout(Y). So dY = dropout_backward(dout), dX = dY and
  // W.grad[t] += sum over b of dY[b, t].
  Tensor dX =
      dropped_ ? dropout_backward(ctx, dout, dropout, ctx.seed, dropout_offset_) : dout.clone();
  dX = dX.contiguous();
  if (dtype_ == DType::F32)
    accumulate_positions<float>(dX, weight.grad);
  else
    accumulate_positions<double>(dX, weight.grad);
  return dX;
}

}  // namespace attn::nn
