// The CUDA kernels' entry points (internal to the library): raw device pointers and the plain
// argument structs of the CPU kernels, launched on an opaque stream (a cudaStream_t; null is the
// default stream). No CUDA header, so the tests and the ops layer compile with the C++ compiler.
// All pointers are device pointers unless said otherwise; every call is asynchronous.
//
// Glossary: B rows of (batch, head) pairs, T queries, S keys, D head dim, Dv value width,
// R rows of a row-wise op, E its width, N tokens, V vocabulary (classes), n elements.
#pragma once

#include "kernels/attention_problem.hpp"
#include "kernels/cuda/device_math.hpp"

#include <cstddef>
#include <cstdint>

namespace attn::cuda {

using StreamHandle = void*;

// ---- Fused attention (flash_attention.cu) -------------------------------------------------------
// The problem of kernels/attention_problem.hpp, exactly: strided views, kept-key counts (a device
// array of B*T int32, as ops/mask.hpp lowers d2l's 1-D and 2-D valid_lens), causal, masked-row
// policy, the dropout stream (the same masks as the CPU, bit for bit), the dropout window. Not
// supported here (an Error says so): `weights` and `dropout_keep` (the CUDA backward draws the
// stream again). Head dims D, Dv <= 256. E is float or bf16 (uint16_t); arithmetic in float.
void flash_attention_forward(const kernels::AttentionArgs<float>& a, StreamHandle stream);
void flash_attention_forward(const kernels::AttentionArgs<uint16_t>& a, StreamHandle stream);
// The backward of the forward `a` (whose out and lse it reads); `delta` is B*T floats of scratch
// (rowsum(dout * out)). dq, dk, dv are overwritten. Deterministic: no atomics.
void flash_attention_backward(const kernels::AttentionArgs<float>& a,
                              const kernels::AttentionGradArgs<float>& g, float* delta,
                              StreamHandle stream);
void flash_attention_backward(const kernels::AttentionArgs<uint16_t>& a,
                              const kernels::AttentionGradArgs<uint16_t>& g, float* delta,
                              StreamHandle stream);
// Decode step for generation: the forward for few queries (T of 1 to a few) against a long key
// cache, the keys of a row split over the warps of a block. Same contract as the forward.
void flash_attention_decode(const kernels::AttentionArgs<float>& a, StreamHandle stream);
void flash_attention_decode(const kernels::AttentionArgs<uint16_t>& a, StreamHandle stream);

// ---- GEMM through cuBLASLt (gemm.cpp) -----------------------------------------------------------
enum class GemmType : uint8_t { kF32, kBF16 };  // bf16 in and out, float accumulation
// Row-major C (M, N) = alpha * op(A) op(B) + beta * C (+ bias[n] when bias is non-null, float for
// kF32 and bf16 for kBF16), op(A) (M, K) and op(B) (K, N); trans_a means A is stored (K, M),
// trans_b means B is stored (N, K) (a Linear weight (out, in): y = x W^T is trans_b).
// Leading dimensions are the row strides of the stored matrices.
struct GemmArgs {
  GemmType type = GemmType::kF32;
  int64_t M = 0, N = 0, K = 0;
  bool trans_a = false, trans_b = false;
  const void* A = nullptr;
  const void* B = nullptr;
  void* C = nullptr;
  const void* bias = nullptr;
  int64_t lda = 0, ldb = 0, ldc = 0;
  float alpha = 1.0f, beta = 0.0f;
  // A batch of `batch` independent products, matrix i of each operand `stride_*` elements after
  // matrix i - 1 (cuBLASLt's strided batch); no bias with a batch.
  int64_t batch = 1, stride_a = 0, stride_b = 0, stride_c = 0;
};
void gemm(const GemmArgs& g, StreamHandle stream);

// ---- Row and elementwise ops (ops.cu); float32 unless a bf16 overload exists
// ---------------------- Inverted dropout of n elements with the dropout stream: element i draws
// index index_base + i.
void dropout_forward(const float* x, float* y, int64_t n, float p, uint64_t seed, uint64_t offset,
                     uint64_t index_base, StreamHandle stream);
// dx = dy * Z (the same Z as the forward of the same stream).
void dropout_backward(const float* dy, float* dx, int64_t n, float p, uint64_t seed,
                      uint64_t offset, uint64_t index_base, StreamHandle stream);

// out (N, E) = weight[ids[n]] (ids int64, checked on the host by the ops layer to lie in [0, V)).
void embedding_forward(const int64_t* ids, const float* weight, float* out, int64_t N, int64_t E,
                       StreamHandle stream);
// dweight (V, E) += dout rows scattered by ids (atomic adds; zero dweight first for a fresh sum).
void embedding_backward(const float* dout, const int64_t* ids, float* dweight, int64_t N, int64_t E,
                        StreamHandle stream);
// P (positions, dim), d2l's sinusoidal layout, angles in double (ref::sinusoidal_exact).
void sinusoidal_encoding(float* P, int64_t positions, int64_t dim, StreamHandle stream);
// y (B, T, E) = x * x_scale + P[t] (d2l's encoder: X * sqrt(E) + P, then dropout separately).
void add_positional(const float* x, const float* P, float* y, int64_t B, int64_t T, int64_t E,
                    float x_scale, StreamHandle stream);

// LayerNorm over the last dim: x (R, E) -> y, mean (R), rstd (R); gamma/beta (E) or null.
// With `residual` non-null it is AddNorm: LayerNorm(x + residual), and `sum` (R, E) receives
// x + residual for the backward (null: not kept).
void layer_norm_forward(const float* x, const float* residual, float* sum, const float* gamma,
                        const float* beta, float* y, float* mean, float* rstd, int64_t R, int64_t E,
                        float eps, StreamHandle stream);
// dx (R, E) from dy; dgamma/dbeta (E) overwritten when non-null (a second pass over the rows:
// deterministic, no atomics). For AddNorm dx is the gradient of both summands.
void layer_norm_backward(const float* dy, const float* x, const float* gamma, const float* mean,
                         const float* rstd, float* dx, float* dgamma, float* dbeta, int64_t R,
                         int64_t E, StreamHandle stream);
// The parameter gradients alone (dgamma, dbeta overwritten, either may be null). With `scratch`
// (2 * kLayerNormChunks * E floats) chunks of rows are summed side by side and then in chunk
// order (many blocks, for long R); null: one pass per 32 columns. Deterministic either way.
constexpr int64_t kLayerNormChunks = 64;
void layer_norm_param_grads(const float* dy, const float* x, const float* mean, const float* rstd,
                            float* dgamma, float* dbeta, int64_t R, int64_t E, float* scratch,
                            StreamHandle stream);

// Masked softmax over rows of S (ref::masked_softmax_forward): kept (R) kept-key counts or null.
void masked_softmax_forward(const float* x, float* y, const int32_t* kept,
                            kernels::MaskedRows policy, int64_t R, int64_t S, StreamHandle stream);
void masked_softmax_backward(const float* dy, const float* y, float* dx, const int32_t* kept,
                             int64_t R, int64_t S, StreamHandle stream);

// Cross-entropy per row: loss[r] = logsumexp(logits[r]) - logits[r][target[r]] (0 where keep is
// given and keep[r] == 0); dlogits = scale * (softmax - onehot) on kept rows, 0 elsewhere.
void cross_entropy_forward(const float* logits, const int64_t* targets, const uint8_t* keep,
                           float* loss, int64_t N, int64_t V, StreamHandle stream);
void cross_entropy_backward(const float* logits, const int64_t* targets, const uint8_t* keep,
                            float* dlogits, int64_t N, int64_t V, float scale, StreamHandle stream);
// The same with the scale read on the device (*scale, e.g. loss_mean's 1 / n_kept), so that a
// captured graph replays with each batch's scale.
void cross_entropy_backward(const float* logits, const int64_t* targets, const uint8_t* keep,
                            float* dlogits, int64_t N, int64_t V, const float* scale,
                            StreamHandle stream);

// ---- The training step's other kernels (train_ops.cu) -----------------------------------------
// y = relu(x) (NaN stays NaN, as torch.relu); dx = dy where x > 0, else 0 (torch's gradient at 0).
void relu_forward(const float* x, float* y, int64_t n, StreamHandle stream);
void relu_backward(const float* dy, const float* x, float* dx, int64_t n, StreamHandle stream);
// y = x * Z * scale with Z the dropout stream's element index_base + i at stream offset
// *offset_base + offset, *offset_base read on the device (a graph replays with each step's
// offset). Forward and backward alike (the backward multiplies dy by the same Z).
void dropout_at(const float* x, float* y, int64_t n, float p, uint64_t seed,
                const uint64_t* offset_base, uint64_t offset, uint64_t index_base, float scale,
                StreamHandle stream);
// The classification head's pooling: pooled (B, E) = mean of X (B, T, E) over t < counts[b]
// (summed in double; 0 for counts[b] = 0), and its backward dX = dpooled[b] / counts[b] there, 0
// elsewhere.
void masked_mean_forward(const float* X, const int32_t* counts, float* pooled, int64_t B, int64_t T,
                         int64_t E, StreamHandle stream);
void masked_mean_backward(const float* dpooled, const int32_t* counts, float* dX, int64_t B,
                          int64_t T, int64_t E, StreamHandle stream);
// Attention's weights as a row op over (R, S) scores (the batched-GEMM attention of the training
// step): y = masked softmax (masked_softmax_forward's contract) and yd = y * Z, Z the dropout
// stream's element r * S + s at offset *offset_base + offset (for p = 0 yd is not written); the
// backward takes dyd (the gradient of yd) and y: dx = y * (dyd Z - sum_s dyd Z y) on kept keys.
void softmax_dropout_forward(const float* x, float* y, float* yd, const int32_t* kept,
                             kernels::MaskedRows policy, int64_t R, int64_t S, float p,
                             uint64_t seed, const uint64_t* offset_base, uint64_t offset,
                             StreamHandle stream);
void softmax_dropout_backward(const float* dyd, const float* y, float* dx, const int32_t* kept,
                              int64_t R, int64_t S, float p, uint64_t seed,
                              const uint64_t* offset_base, uint64_t offset, StreamHandle stream);
// The heads of `parts` stacked projections: x (B, T, parts * H * D) -> heads (parts, B * H, T, D)
// contiguous (to_heads), and back (from_heads), for attention as batched GEMMs.
void to_heads(const float* x, float* heads, int64_t B, int64_t T, int64_t H, int64_t D,
              int64_t parts, StreamHandle stream);
void from_heads(const float* heads, float* x, int64_t B, int64_t T, int64_t H, int64_t D,
                int64_t parts, StreamHandle stream);
// The mean loss of the kept rows (keep null: all): *mean = sum / n_kept in double (NaN when none
// is kept, as PyTorch's 0/0), *scale = 1 / n_kept as float (0 when none).
void loss_mean(const float* loss, const uint8_t* keep, int64_t N, double* mean, float* scale,
               StreamHandle stream);

// ---- AdamW (optim.cu) ---------------------------------------------------------------------------
// One step over n float parameters, bit for bit the CPU's (nn/optim.cpp) for the same inputs.
struct AdamWStep {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  int64_t step = 1;  // t, counted from 1
};
void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s,
                  StreamHandle stream);
// The per-step scalars of that update (host arithmetic), and the update reading them from device
// memory `u`, so that a captured graph replays with each step's bias corrections. With `skip_if`
// non-null nothing changes when *skip_if is not finite (a training step's loss).
AdamWElement adamw_element(const AdamWStep& s);
void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWElement* u,
                  const double* skip_if, StreamHandle stream);
// Sum of squares of n floats into *out (device, double), for gradient clipping by global norm;
// `scratch` holds kSumSquaresScratch doubles. A fixed order: the same bits on every run.
constexpr int64_t kSumSquaresScratch = 128;
void sum_squares(const float* x, int64_t n, double* out, double* scratch, StreamHandle stream);
// torch's clip_grad_norm_ on n gradients given their *sum_squares: coef = max_norm / (sqrt(sum)
// + 1e-6), multiplied into every gradient (in double, rounded once) when below 1; *norm =
// sqrt(sum). max_norm = infinity never clips.
void clip_by_norm(float* g, int64_t n, const double* sum_squares, double max_norm, double* norm,
                  StreamHandle stream);

}  // namespace attn::cuda
