// Conv1d, RNN and GRU modules (see attn/nn/sequence.hpp): parameters with PyTorch's names and
// initialisation around the ops in ops/conv1d.cpp and ops/rnn.cpp.
//
// Vocabulary: B batch, n sequence length, k kernel size, I input size, H hidden size.
#include "attn/nn/sequence.hpp"

#include "attn/ops/conv1d.hpp"
#include "attn/ops/rnn.hpp"
#include "nn/internal.hpp"

#include <cmath>

namespace attn::nn {

namespace {

void check_float_dtype(const char* op, DType dtype) {
  check(dtype == DType::F32 || dtype == DType::F64, op, "dtype {} unsupported, expected F32 or F64",
        dtype_name(dtype));
}

// A parameter of `shape` drawn from U(-bound, bound) on its own stream (named as in the state
// dict), with a zero gradient.
void init_uniform(Parameter& p, const Shape& shape, DType dtype, double bound, uint64_t seed,
                  const char* name) {
  p.value = Tensor::empty(shape, dtype);
  Rng rng(seed, detail::name_stream(name));
  detail::fill_with(p.value, [&] { return rng.uniform(-bound, bound); });
  p.grad = Tensor::zeros(shape, dtype);
}

void check_dout(const char* op, const Tensor& dout, const Shape& expected, DType dtype) {
  check(dout.defined() && dout.shape() == expected && dout.dtype() == dtype, op,
        "dout has shape {} and dtype {}, expected {} and {}", shape_arg(dout),
        dout.defined() ? dtype_name(dout.dtype()) : "none", shape_arg(expected), dtype_name(dtype));
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Conv1d

Conv1d::Conv1d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, bool with_bias,
               DType dtype, uint64_t seed)
    : Module(dtype), has_bias_(with_bias) {
  const char* op = "Conv1d";
  check(in_channels > 0 && out_channels > 0, op,
        "in_channels ({}) and out_channels ({}) must be positive", in_channels, out_channels);
  check(kernel_size > 0 && kernel_size % 2 == 1, op,
        "kernel_size {} must be odd and positive ('same' padding (k-1)/2 on each side)",
        kernel_size);
  check_float_dtype(op, dtype);
  // Conv1d.reset_parameters: kaiming_uniform_(a=sqrt(5)) has bound
  // sqrt(6 / ((1 + a^2) fan_in)) = 1/sqrt(fan_in), and the bias uses 1/sqrt(fan_in) too.
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_channels * kernel_size));
  init_uniform(weight, {out_channels, in_channels, kernel_size}, dtype, bound, seed, "weight");
  if (with_bias) init_uniform(bias, {out_channels}, dtype, bound, seed, "bias");
}

std::vector<std::pair<std::string, Parameter*>> Conv1d::named_parameters() {
  if (has_bias_) return {{"weight", &weight}, {"bias", &bias}};
  return {{"weight", &weight}};
}

Tensor Conv1d::forward(Context& ctx, const Tensor& x) {
  detail::check_input("Conv1d", "x", x, 3, dtype_);
  x_ = x;
  int64_t flops = 0;
  Tensor y = conv1d(ctx, x, weight.value, has_bias_ ? bias.value : Tensor(), &flops);
  flops_ += flops;
  return y;
}

Tensor Conv1d::backward(Context& ctx, const Tensor& dy) {
  const char* op = "Conv1d::backward";
  check(x_.defined(), op, "called before forward");
  check_dout(op, dy, {x_.dim(0), x_.dim(1), out_channels()}, dtype_);
  Conv1dGrads g = conv1d_backward(ctx, dy, x_, weight.value, has_bias_);
  detail::accumulate(weight.grad, g.dW);
  if (has_bias_) detail::accumulate(bias.grad, g.db);
  return g.dx;
}

// ----------------------------------------------------------------------------------------------
// RNN

RNN::RNN(int64_t input_size, int64_t hidden_size, bool with_bias, DType dtype, uint64_t seed)
    : Module(dtype), has_bias_(with_bias) {
  const char* op = "RNN";
  check(input_size > 0 && hidden_size > 0, op,
        "input_size ({}) and hidden_size ({}) must be positive", input_size, hidden_size);
  check_float_dtype(op, dtype);
  // RNNBase.reset_parameters: every weight ~ U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)).
  const double bound = 1.0 / std::sqrt(static_cast<double>(hidden_size));
  init_uniform(weight_ih_l0, {hidden_size, input_size}, dtype, bound, seed, "weight_ih_l0");
  init_uniform(weight_hh_l0, {hidden_size, hidden_size}, dtype, bound, seed, "weight_hh_l0");
  if (with_bias) {
    init_uniform(bias_ih_l0, {hidden_size}, dtype, bound, seed, "bias_ih_l0");
    init_uniform(bias_hh_l0, {hidden_size}, dtype, bound, seed, "bias_hh_l0");
  }
}

std::vector<std::pair<std::string, Parameter*>> RNN::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out = {{"weight_ih_l0", &weight_ih_l0},
                                                         {"weight_hh_l0", &weight_hh_l0}};
  if (has_bias_) {
    out.emplace_back("bias_ih_l0", &bias_ih_l0);
    out.emplace_back("bias_hh_l0", &bias_hh_l0);
  }
  return out;
}

Tensor RNN::forward(Context& ctx, const Tensor& x, const Tensor& h0) {
  detail::check_input("RNN", "x", x, 3, dtype_);
  if (h0.defined()) detail::check_input("RNN", "h0", h0, 2, dtype_);
  RnnResult r =
      rnn_tanh(ctx, x, h0, weight_ih_l0.value, weight_hh_l0.value,
               has_bias_ ? bias_ih_l0.value : Tensor(), has_bias_ ? bias_hh_l0.value : Tensor());
  x_ = x;
  h0_ = h0;
  output_ = r.output;
  h_n_ = r.h_n;
  flops_ += r.flops;
  return r.output;
}

RNN::InputGrads RNN::backward(Context& ctx, const Tensor& dout, const Tensor& dh_n) {
  const char* op = "RNN::backward";
  check(output_.defined(), op, "called before forward");
  check_dout(op, dout, output_.shape(), dtype_);
  if (dh_n.defined()) check_dout(op, dh_n, h_n_.shape(), dtype_);
  RnnGrads g = rnn_tanh_backward(ctx, dout, dh_n, x_, h0_, weight_ih_l0.value, weight_hh_l0.value,
                                 output_, has_bias_);
  detail::accumulate(weight_ih_l0.grad, g.dW_ih);
  detail::accumulate(weight_hh_l0.grad, g.dW_hh);
  if (has_bias_) {
    detail::accumulate(bias_ih_l0.grad, g.db_ih);
    detail::accumulate(bias_hh_l0.grad, g.db_hh);
  }
  return {g.dx, g.dh0};
}

// ----------------------------------------------------------------------------------------------
// GRU

GRU::GRU(int64_t input_size, int64_t hidden_size, bool with_bias, DType dtype, uint64_t seed)
    : Module(dtype), has_bias_(with_bias) {
  const char* op = "GRU";
  check(input_size > 0 && hidden_size > 0, op,
        "input_size ({}) and hidden_size ({}) must be positive", input_size, hidden_size);
  check_float_dtype(op, dtype);
  // RNNBase.reset_parameters, as for the RNN: every weight ~ U(-1/sqrt(H), 1/sqrt(H)); the
  // three gates' rows (r, z, n) are stacked in each tensor.
  const double bound = 1.0 / std::sqrt(static_cast<double>(hidden_size));
  const int64_t rows = 3 * hidden_size;
  init_uniform(weight_ih_l0, {rows, input_size}, dtype, bound, seed, "weight_ih_l0");
  init_uniform(weight_hh_l0, {rows, hidden_size}, dtype, bound, seed, "weight_hh_l0");
  if (with_bias) {
    init_uniform(bias_ih_l0, {rows}, dtype, bound, seed, "bias_ih_l0");
    init_uniform(bias_hh_l0, {rows}, dtype, bound, seed, "bias_hh_l0");
  }
}

std::vector<std::pair<std::string, Parameter*>> GRU::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out = {{"weight_ih_l0", &weight_ih_l0},
                                                         {"weight_hh_l0", &weight_hh_l0}};
  if (has_bias_) {
    out.emplace_back("bias_ih_l0", &bias_ih_l0);
    out.emplace_back("bias_hh_l0", &bias_hh_l0);
  }
  return out;
}

Tensor GRU::forward(Context& ctx, const Tensor& x, const Tensor& h0) {
  detail::check_input("GRU", "x", x, 3, dtype_);
  if (h0.defined()) detail::check_input("GRU", "h0", h0, 2, dtype_);
  GruResult r =
      gru(ctx, x, h0, weight_ih_l0.value, weight_hh_l0.value,
          has_bias_ ? bias_ih_l0.value : Tensor(), has_bias_ ? bias_hh_l0.value : Tensor());
  x_ = x;
  h0_ = h0;
  output_ = r.output;
  h_n_ = r.h_n;
  flops_ += r.flops;
  return r.output;
}

GRU::InputGrads GRU::backward(Context& ctx, const Tensor& dout, const Tensor& dh_n) {
  const char* op = "GRU::backward";
  check(output_.defined(), op, "called before forward");
  check_dout(op, dout, output_.shape(), dtype_);
  if (dh_n.defined()) check_dout(op, dh_n, h_n_.shape(), dtype_);
  // The op recomputes the gates from the saved x, h0 and output with the parameters as they are
  // now: backward belongs before the optimizer step (as for every module here).
  GruGrads g = gru_backward(ctx, dout, dh_n, x_, h0_, weight_ih_l0.value, weight_hh_l0.value,
                            has_bias_ ? bias_ih_l0.value : Tensor(),
                            has_bias_ ? bias_hh_l0.value : Tensor(), output_);
  detail::accumulate(weight_ih_l0.grad, g.dW_ih);
  detail::accumulate(weight_hh_l0.grad, g.dW_hh);
  if (has_bias_) {
    detail::accumulate(bias_ih_l0.grad, g.db_ih);
    detail::accumulate(bias_hh_l0.grad, g.db_hh);
  }
  return {g.dx, g.dh0};
}

}  // namespace attn::nn
