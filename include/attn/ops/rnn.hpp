// Recurrent layers, forward and backward through time: the Elman RNN with tanh (the RNN of the
// chapter's CNN / RNN / self-attention comparison) and the GRU.
//
// rnn_tanh:
//   x (B, n, I), h0 (B, H) or undefined (zeros), W_ih (H, I), W_hh (H, H), b_ih, b_hh (H) or both
//   undefined
//   h_t = tanh(x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh),   t = 0..n-1,  h_{-1} = h0
//   output (B, n, H) holds h_0..h_{n-1}; h_n (B, H) is the last of them.
//
// PyTorch: nn.RNN(I, H, nonlinearity='tanh', batch_first=True) with its weight_ih_l0 = W_ih,
// weight_hh_l0 = W_hh, bias_ih_l0 = b_ih, bias_hh_l0 = b_hh (same layouts).
// Cost: B*n*H*(I + H) multiply-accumulates, 2 FLOPs each, in n dependent steps.
#pragma once

#include "attn/core/context.hpp"
#include "attn/core/tensor.hpp"

#include <cstdint>

namespace attn {

struct RnnResult {
  Tensor output;      // (B, n, H): h_t for every t
  Tensor h_n;         // (B, H): the final state (a copy of output[:, n-1])
  int64_t flops = 0;  // FLOPs the kernel performed (2 per multiply-accumulate)
};

RnnResult rnn_tanh(Context& ctx, const Tensor& x, const Tensor& h0, const Tensor& W_ih,
                   const Tensor& W_hh, const Tensor& b_ih = {}, const Tensor& b_hh = {});

struct RnnGrads {
  Tensor dx;            // (B, n, I)
  Tensor dh0;           // (B, H)
  Tensor dW_ih, dW_hh;  // (H, I), (H, H)
  Tensor db_ih, db_hh;  // (H), undefined when the forward had no bias
};
// Backward through time. dout (B, n, H) is the gradient of `output`; dh_n (B, H) or undefined
// that of the final state (PyTorch returns both; their gradients add). `output` is the forward's.
RnnGrads rnn_tanh_backward(Context& ctx, const Tensor& dout, const Tensor& dh_n, const Tensor& x,
                           const Tensor& h0, const Tensor& W_ih, const Tensor& W_hh,
                           const Tensor& output, bool has_bias);

// GRU, torch.nn.GRU's equations and gate order (r, z, n): rows [0, H) of W_ih, W_hh, b_ih, b_hh
// are r's, [H, 2H) z's, [2H, 3H) n's.
//
//   x (B, n, I), h0 (B, H) or undefined (zeros), W_ih (3H, I), W_hh (3H, H), b_ih, b_hh (3H) or
//   both undefined; with h = h_{t-1} (h_{-1} = h0):
//   r = sigmoid(x_t W_ir^T + b_ir + h W_hr^T + b_hr)
//   z = sigmoid(x_t W_iz^T + b_iz + h W_hz^T + b_hz)
//   n = tanh(x_t W_in^T + b_in + r * (h W_hn^T + b_hn))
//   h_t = (1 - z) * n + z * h
//   output (B, n, H) holds h_0..h_{n-1}; h_n (B, H) is the last of them (h0 or zeros for n = 0).
//
// PyTorch: nn.GRU(I, H, batch_first=True) with weight_ih_l0 = W_ih, weight_hh_l0 = W_hh,
// bias_ih_l0 = b_ih, bias_hh_l0 = b_hh (same layouts). Cost: B*n*3H*(I + H) multiply-accumulates
// (the count in `flops`, 2 FLOPs each), in n dependent steps; the gates' elementwise work is not
// counted.
using GruResult = RnnResult;
GruResult gru(Context& ctx, const Tensor& x, const Tensor& h0, const Tensor& W_ih,
              const Tensor& W_hh, const Tensor& b_ih = {}, const Tensor& b_hh = {});

struct GruGrads {
  Tensor dx;            // (B, n, I)
  Tensor dh0;           // (B, H)
  Tensor dW_ih, dW_hh;  // (3H, I), (3H, H)
  Tensor db_ih, db_hh;  // (3H), undefined when the forward had no bias (they differ: b_hn is
                        // scaled by r)
};
// Backward through time. dout (B, n, H) is the gradient of `output`, dh_n (B, H) or undefined
// that of the final state (their gradients add). x, h0, the weights and biases are the forward's
// and `output` its result: the gates are recomputed from them, step by step.
GruGrads gru_backward(Context& ctx, const Tensor& dout, const Tensor& dh_n, const Tensor& x,
                      const Tensor& h0, const Tensor& W_ih, const Tensor& W_hh, const Tensor& b_ih,
                      const Tensor& b_hh, const Tensor& output);

}  // namespace attn
