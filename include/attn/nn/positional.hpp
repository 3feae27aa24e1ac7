// Positional encodings as modules.
#pragma once

#include "attn/nn/module.hpp"
#include "attn/ops/positional.hpp"

namespace attn::nn {

// d2l PositionalEncoding(num_hiddens, dropout, max_len=1000): out = dropout(X + P[:T]).
//   X (B, T, E) -> (B, T, E). P is sinusoidal_encoding(max_len, E) computed once (max_len is a
//   cache size: longer inputs extend the cache; odd E works). No parameters, empty state dict.
class PositionalEncoding : public Module {
 public:
  PositionalEncoding(int64_t num_hiddens, double dropout, int64_t max_len = 1000,
                     DType dtype = DType::F32);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override { return {}; }
  Tensor forward(Context& ctx, const Tensor& X);
  Tensor backward(Context& ctx, const Tensor& dout);  // dX
  // forward(X * factor) and backward(dout) * factor, the scaling in double and rounded once as
  // nn's scaled(): d2l's encoder and decoder input, pos_encoding(embedding(X) * sqrt(E)). On
  // the float32 CPU path each is one pass (scale, add and dropout per chunk, with the separate
  // ops' bits) instead of three.
  Tensor forward_scaled(Context& ctx, const Tensor& X, double factor);
  Tensor backward_scaled(Context& ctx, const Tensor& dout, double factor);
  // The cached (len, E) encoding, grown to at least `len` rows.
  const Tensor& P(int64_t len);

  double dropout;

 private:
  int64_t num_hiddens_;
  Tensor P_;
  uint64_t dropout_offset_ = 0;
  bool dropped_ = false;
};

// Learned absolute positions (BERT/GPT style): out = dropout(X + W[:T]), W (max_len, E) a
// parameter initialised N(0, 1) like nn.Embedding; state dict name "weight". Unlike sinusoids it
// cannot represent positions >= max_len (Error).
class LearnedPositionalEmbedding : public Module {
 public:
  LearnedPositionalEmbedding(int64_t max_len, int64_t num_hiddens, double dropout = 0.0,
                             DType dtype = DType::F32, uint64_t seed = 0);
  std::vector<std::pair<std::string, Parameter*>> named_parameters() override;
  Tensor forward(Context& ctx, const Tensor& X);
  Tensor backward(Context& ctx, const Tensor& dout);  // dX; accumulates weight.grad

  Parameter weight;
  double dropout;

 private:
  int64_t T_ = 0;
  uint64_t dropout_offset_ = 0;
  bool dropped_ = false;
};

}  // namespace attn::nn
