// Per-thread arithmetic of the CUDA kernels, written once as host-and-device functions so that
// the CPU tests (tests/cuda/test_cuda_host.cpp) check every formula against the CPU paths without
// a GPU: bf16 rounding, the dropout stream's index and decision, the online-softmax state and its
// merge, LayerNorm's row statistics, AdamW's element update. No CUDA header: g++ compiles this
// file as plain C++ (ATTN_HOST_DEVICE is empty there).
//
// Glossary: B rows of (batch, head) pairs, T queries, S keys, D head dim.
#pragma once

#include "attn/core/rng.hpp"  // Philox 4x32-10 and the dropout stream, already host-and-device

#include <cmath>
#include <cstdint>
#include <cstring>

namespace attn::cuda {

ATTN_HOST_DEVICE inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// bfloat16 <-> float, bit for bit attn::float_to_bf16 / bf16_to_float (attn/core/dtype.hpp):
// round to nearest even, NaN kept a quiet NaN. The CUDA intrinsic __float2bfloat16_rn agrees on
// numbers but not on NaN payloads, so the kernels use this one.
ATTN_HOST_DEVICE inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
ATTN_HOST_DEVICE inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

ATTN_HOST_DEVICE inline uint16_t bf16_round(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
ATTN_HOST_DEVICE inline float bf16_widen(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

// Loads and stores of a kernel's element type E (float, or bf16 held as uint16_t) in float.
ATTN_HOST_DEVICE inline float load_f(const float* p) {
  return *p;
}
ATTN_HOST_DEVICE inline float load_f(const uint16_t* p) {
  return bf16_widen(*p);
}
ATTN_HOST_DEVICE inline void store_f(float* p, float v) {
  *p = v;
}
ATTN_HOST_DEVICE inline void store_f(uint16_t* p, float v) {
  *p = bf16_round(v);
}

// The dropout stream index of attention weight (b, t, s): kernels::AttentionProblem::dropout_index
// (the host original) rewritten on plain fields so that device code can call it.
struct DropoutIndexer {
  uint64_t base = 0;
  int64_t T = 0, S = 0;                        // this call's problem
  int64_t rows = 0, cols = 0, t0 = 0, s0 = 0;  // dropout window; rows == 0: the whole problem

  ATTN_HOST_DEVICE uint64_t operator()(int64_t b, int64_t t, int64_t s) const {
    if (rows == 0) return base + static_cast<uint64_t>((b * T + t) * S + s);
    return base + static_cast<uint64_t>((b * rows + t0 + t) * cols + s0 + s);
  }
};

// The inverted-dropout multiplier Z of stream element i: 0 or 1 / (1 - p).
ATTN_HOST_DEVICE inline float dropout_factor(uint64_t seed, uint64_t offset, uint64_t i, float p) {
  if (p <= 0.0f) return 1.0f;
  return dropout_keep(seed, offset, i, p) ? 1.0f / (1.0f - p) : 0.0f;
}

// Keys [0, limit) are kept by row (b, t) (AttentionProblem::row_limit on plain fields).
ATTN_HOST_DEVICE inline int64_t row_limit(const int32_t* kept_keys, bool causal, int64_t b,
                                          int64_t t, int64_t T, int64_t S) {
  int64_t lim = kept_keys ? kept_keys[b * T + t] : S;
  if (causal && lim > t + 1) lim = t + 1;
  if (lim < 0) lim = 0;
  if (lim > S) lim = S;
  return lim;
}

// Online softmax (Milakov & Gimelshein 2018): the running max m and the sum l of exp(x - m)
// over the scores seen so far. Two states over disjoint key sets merge exactly: this is how the
// decode kernel combines its warps' key slices and how ring attention combines key blocks.
struct SoftmaxState {
  float m = -INFINITY;
  float l = 0.0f;

  // The factor that rescales values accumulated under max `m_old` to the max `m_new`.
  ATTN_HOST_DEVICE static float rescale(float m_old, float m_new) {
    return m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
  }
  ATTN_HOST_DEVICE void add(float x) {
    if (x == -INFINITY) return;
    const float m_new = x > m ? x : m;
    l = l * rescale(m, m_new) + expf(x - m_new);
    m = m_new;
  }
  // Merged state, and the factors (*wa, *wb) by which each side's accumulated outputs are scaled
  // before they are added: out = wa * out_a + wb * out_b (both still unnormalised).
  ATTN_HOST_DEVICE static SoftmaxState merge(SoftmaxState a, SoftmaxState b, float* wa, float* wb) {
    SoftmaxState r;
    r.m = a.m > b.m ? a.m : b.m;
    if (r.m == -INFINITY) {
      *wa = *wb = 0.0f;
      return r;
    }
    *wa = rescale(a.m, r.m);
    *wb = rescale(b.m, r.m);
    r.l = a.l * *wa + b.l * *wb;
    return r;
  }
  // log sum exp of everything added; -inf when nothing was.
  ATTN_HOST_DEVICE float lse() const { return l > 0.0f ? m + logf(l) : -INFINITY; }
};

// LayerNorm row statistics by Welford's update and Chan et al.'s parallel combine: each thread
// folds its strided share of the row, then the shares combine pairwise (a warp shuffle tree). The
// result is the mean and the biased variance, as the reference's two passes compute them.
struct WelfordState {
  float mean = 0.0f, m2 = 0.0f, count = 0.0f;

  ATTN_HOST_DEVICE void add(float x) {
    count += 1.0f;
    const float delta = x - mean;
    mean += delta / count;
    m2 += delta * (x - mean);
  }
  ATTN_HOST_DEVICE static WelfordState combine(WelfordState a, WelfordState b) {
    if (a.count == 0.0f) return b;
    if (b.count == 0.0f) return a;
    WelfordState r;
    r.count = a.count + b.count;
    const float delta = b.mean - a.mean;
    const float fb = b.count / r.count;
    r.mean = a.mean + delta * fb;
    r.m2 = a.m2 + b.m2 + delta * delta * a.count * fb;
    return r;
  }
  ATTN_HOST_DEVICE float variance() const { return count > 0.0f ? m2 / count : 0.0f; }
};

// AdamW's element update, the formula of nn/optim.cpp (AdamW::step, adamw_update_f32) in the same
// double operations, so that a CUDA step computes the same float bits as the CPU when compiled
// without FMA contraction (kernels/cuda/optim.cu is built with --fmad=false).
struct AdamWElement {
  double lr, beta1, beta2, eps, weight_decay;
  double step_size;              // lr / (1 - beta1^t)
  double bias_correction2_sqrt;  // sqrt(1 - beta2^t)

  ATTN_HOST_DEVICE void operator()(float* w, float g_in, float* m, float* v) const {
    const double g = g_in;
    const double wj = static_cast<float>(*w * (1.0 - lr * weight_decay));
    *m = static_cast<float>(beta1 * *m + (1.0 - beta1) * g);
    *v = static_cast<float>(beta2 * *v + (1.0 - beta2) * g * g);
    const double denom = sqrt(static_cast<double>(*v)) / bias_correction2_sqrt + eps;
    *w = static_cast<float>(wj - step_size * *m / denom);
  }
};

}  // namespace attn::cuda
