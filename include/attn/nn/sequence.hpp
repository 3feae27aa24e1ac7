// Sequence layers of the chapter's CNN / RNN / self-attention comparison, forward and backward:
// Conv1d (kernel k, 'same' padding), RNN (Elman, tanh) and GRU. All map (B, n, d_in) to
// (B, n, d_out) like self-attention does, and count the FLOPs their forward performs.
//
// Vocabulary: B batch, n sequence length, d_in / d_out widths, k kernel size, H hidden size.
#pragma once

#include "attn/nn/module.hpp"

#include <cstdint>

namespace attn::nn {

// torch.nn.Conv1d(in_channels, out_channels, kernel_size, padding=(k-1)/2, bias) applied to a
// (B, n, d_in) sequence (PyTorch's own layout is (B, d_in, n); see attn/ops/conv1d.hpp).
// State dict: weight (out, in, k), bias (out). Initialisation as PyTorch: weight and bias
// ~ U(-1/sqrt(in*k), 1/sqrt(in*k)) (kaiming_uniform with a = sqrt(5) gives that bound).
class Conv1d : public Module {
 public:
  Conv1d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, bool with_bias = true,
         DType dtype = DType::F32, uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;

  Tensor forward(Context& ctx, const Tensor& x);    // (B, n, in) -> (B, n, out)
  Tensor backward(Context& ctx, const Tensor& dy);  // returns dx; accumulates dW, db

  int64_t in_channels() const { return weight.value.dim(1); }
  int64_t out_channels() const { return weight.value.dim(0); }
  int64_t kernel_size() const { return weight.value.dim(2); }
  bool has_bias() const { return has_bias_; }
  // FLOPs the forward calls performed since construction or reset_flops() (2 per
  // multiply-accumulate, as the kernel counted them).
  int64_t flops() const { return flops_; }
  void reset_flops() { flops_ = 0; }

  Parameter weight, bias;

 private:
  bool has_bias_;
  int64_t flops_ = 0;
  Tensor x_;  // saved input
};

// torch.nn.RNN(input_size, hidden_size, num_layers=1, nonlinearity='tanh', bias,
// batch_first=True): h_t = tanh(x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh).
// State dict: weight_ih_l0 (H, I), weight_hh_l0 (H, H), bias_ih_l0 (H), bias_hh_l0 (H).
// Initialisation as PyTorch: every parameter ~ U(-1/sqrt(H), 1/sqrt(H)).
class RNN : public Module {
 public:
  RNN(int64_t input_size, int64_t hidden_size, bool with_bias = true, DType dtype = DType::F32,
      uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;

  // x (B, n, I), h0 (B, H) or undefined (zeros) -> output (B, n, H); h_n() is the final state.
  Tensor forward(Context& ctx, const Tensor& x, const Tensor& h0 = {});
  const Tensor& h_n() const { return h_n_; }

  struct InputGrads {
    Tensor dx;   // (B, n, I)
    Tensor dh0;  // (B, H)
  };
  // dout (B, n, H); dh_n (B, H) or undefined. Accumulates the parameter gradients.
  InputGrads backward(Context& ctx, const Tensor& dout, const Tensor& dh_n = {});

  int64_t input_size() const { return weight_ih_l0.value.dim(1); }
  int64_t hidden_size() const { return weight_ih_l0.value.dim(0); }
  bool has_bias() const { return has_bias_; }
  int64_t flops() const { return flops_; }  // as Conv1d::flops
  void reset_flops() { flops_ = 0; }

  Parameter weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0;

 private:
  bool has_bias_;
  int64_t flops_ = 0;
  Tensor x_, h0_, output_, h_n_;  // saved by the forward
};

// torch.nn.GRU(input_size, hidden_size, num_layers=1, bias, batch_first=True), gates in PyTorch's
// order (r, z, n); equations in attn/ops/rnn.hpp.
// State dict: weight_ih_l0 (3H, I), weight_hh_l0 (3H, H), bias_ih_l0 (3H), bias_hh_l0 (3H), rows
// r | z | n as PyTorch stacks them. Initialisation as PyTorch: every parameter
// ~ U(-1/sqrt(H), 1/sqrt(H)).
class GRU : public Module {
 public:
  GRU(int64_t input_size, int64_t hidden_size, bool with_bias = true, DType dtype = DType::F32,
      uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;

  // x (B, n, I), h0 (B, H) or undefined (zeros) -> output (B, n, H); h_n() is the final state.
  Tensor forward(Context& ctx, const Tensor& x, const Tensor& h0 = {});
  const Tensor& h_n() const { return h_n_; }

  using InputGrads = RNN::InputGrads;  // dx (B, n, I), dh0 (B, H)
  // dout (B, n, H); dh_n (B, H) or undefined. Accumulates the parameter gradients.
  InputGrads backward(Context& ctx, const Tensor& dout, const Tensor& dh_n = {});

  int64_t input_size() const { return weight_ih_l0.value.dim(1); }
  int64_t hidden_size() const { return weight_hh_l0.value.dim(1); }
  bool has_bias() const { return has_bias_; }
  int64_t flops() const { return flops_; }  // as Conv1d::flops
  void reset_flops() { flops_ = 0; }

  Parameter weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0;

 private:
  bool has_bias_;
  int64_t flops_ = 0;
  Tensor x_, h0_, output_, h_n_;  // saved by the forward
};

}  // namespace attn::nn
