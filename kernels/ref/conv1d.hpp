// Reference 1-D convolution over a sequence (internal), forward and backward.
//
// Glossary: B batch, N sequence length, Ci / Co in / out channels, K kernel size (odd),
// P = (K - 1) / 2 the 'same' zero padding on each side.
#pragma once

#include <cstdint>

namespace attn::ref {

// x (B, N, Ci), W (Co, Ci, K) (PyTorch's Conv1d layout), b (Co) or null -> y (B, N, Co):
//   y[b,t,o] = b[o] + sum_{j<K} sum_{i<Ci} W[o,i,j] x[b, t+j-P, i],   x = 0 outside [0, N)
// (cross-correlation, as torch.nn.Conv1d). The padded taps are multiplied like any other (the
// zero-padded sequence is the data, as im2col-based convolutions do), so the kernel performs
// exactly B*N*Co*K*Ci multiply-accumulates, the number it returns.
// T is float, double or PathTracer (kernels/ref/path_tracer.hpp).
template <typename T>
int64_t conv1d_forward(const T* x, const T* W, const T* b, T* y, int64_t B, int64_t N, int64_t Ci,
                       int64_t Co, int64_t K);

// dy (B, N, Co) -> dx (B, N, Ci), dW (Co, Ci, K), db (Co) (skipped when null); all overwritten.
template <typename T>
void conv1d_backward(const T* dy, const T* x, const T* W, T* dx, T* dW, T* db, int64_t B, int64_t N,
                     int64_t Ci, int64_t Co, int64_t K);

}  // namespace attn::ref
