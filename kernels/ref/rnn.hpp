// Reference recurrent layers (internal): the Elman RNN with tanh and the GRU, forward and
// backward through time.
//
// Glossary: B batch, N sequence length (time steps), I input size, H hidden size.
#pragma once

#include <cstdint>

namespace attn::ref {

// x (B, N, I), h0 (B, H) or null (zeros), W_ih (H, I), W_hh (H, H), b_ih, b_hh (H) or both null
//   -> out (B, N, H), out[b,t] = h_t:
//   h_t = tanh(x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh),   h_{-1} = h0
// (torch.nn.RNN with nonlinearity='tanh', batch_first=True, one layer). The recurrent product
// runs at every step, t = 0 included, so the kernel performs B*N*H*(I + H) multiply-accumulates,
// the number it returns. T is float, double or PathTracer (kernels/ref/path_tracer.hpp).
template <typename T>
int64_t rnn_tanh_forward(const T* x, const T* h0, const T* W_ih, const T* W_hh, const T* b_ih,
                         const T* b_hh, T* out, int64_t B, int64_t N, int64_t I, int64_t H);

// dout (B, N, H) (gradient of every h_t), dh_n (B, H) or null (gradient of the final state)
//   -> dx (B, N, I), dh0 (B, H), dW_ih (H, I), dW_hh (H, H), db_ih, db_hh (H) (skipped when
//   null); all overwritten. `out` is the forward's output (the h_t it saved).
template <typename T>
void rnn_tanh_backward(const T* dout, const T* dh_n, const T* x, const T* h0, const T* W_ih,
                       const T* W_hh, const T* out, T* dx, T* dh0, T* dW_ih, T* dW_hh, T* db_ih,
                       T* db_hh, int64_t B, int64_t N, int64_t I, int64_t H);

// GRU (torch.nn.GRU, batch_first=True, one layer), gates stacked in PyTorch's order (r, z, n):
// rows [0, H) of W_ih, W_hh, b_ih, b_hh belong to r, [H, 2H) to z, [2H, 3H) to n.
//   x (B, N, I), h0 (B, H) or null (zeros), W_ih (3H, I), W_hh (3H, H), b_ih, b_hh (3H) or both
//   null -> out (B, N, H), out[b,t] = h_t, with h = h_{t-1} (h_{-1} = h0):
//   r = sigmoid(W_ir x_t + b_ir + W_hr h + b_hr)
//   z = sigmoid(W_iz x_t + b_iz + W_hz h + b_hz)
//   n = tanh(W_in x_t + b_in + r * (W_hn h + b_hn))
//   h_t = (1 - z) * n + z * h
// The step reads h_{t-1} as stored in `out` (rounded to T), so the backward can recompute the
// gates exactly. Returns the multiply-accumulates of the products, B*N*3H*(I + H).
template <typename T>
int64_t gru_forward(const T* x, const T* h0, const T* W_ih, const T* W_hh, const T* b_ih,
                    const T* b_hh, T* out, int64_t B, int64_t N, int64_t I, int64_t H);

// dout (B, N, H) (gradient of every h_t), dh_n (B, H) or null (gradient of the final state)
//   -> dx (B, N, I), dh0 (B, H), dW_ih (3H, I), dW_hh (3H, H), db_ih, db_hh (3H) (skipped when
//   null); all overwritten. `out` is the forward's output; the gates are recomputed from it.
template <typename T>
void gru_backward(const T* dout, const T* dh_n, const T* x, const T* h0, const T* W_ih,
                  const T* W_hh, const T* b_ih, const T* b_hh, const T* out, T* dx, T* dh0,
                  T* dW_ih, T* dW_hh, T* db_ih, T* db_hh, int64_t B, int64_t N, int64_t I,
                  int64_t H);

}  // namespace attn::ref
