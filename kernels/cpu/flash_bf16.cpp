// Fused CPU attention with bfloat16 inputs (contract in flash_bf16.hpp).
//
// Native forward (AVX512-BF16, chosen at run time). The fp32 kernel's layout (flash_attention.cpp:
// a block of queries along the vector lanes, key tiles, online softmax in log2 units) with both
// products done by vdpbf16ps, which multiplies the two bf16 of each 32-bit lane of two vectors
// and adds both products to the fp32 lane of the accumulator: one instruction is 32 multiplies.
// So every operand is laid out as *pairs* along the reduction axis:
//
//   X^T = K Q^T  (keys x queries)   reduction over d: Q^T packed per block as qt2[d/2][t] =
//                                   (q[t][2i], q[t][2i+1]); K as a broadcast 32-bit pair
//                                   (k[s][2i], k[s][2i+1]) from a copy packed once per call,
//                                   kt2[b][i][s], so that the 8 keys of a micro-tile are adjacent.
//   O^T += V^T P^T (Dv x queries)   reduction over s: P^T rounded to bf16 as pt2[s/2][t] =
//                                   (P[2j][t], P[2j+1][t]) (vcvtne2ps2bf16 + one vpermw per two key
//                                   rows); V as a broadcast pair (v[2j][e], v[2j+1][e]) from a
//                                   copy packed once per call, vt2[b][j][e].
//
// Scores come out of the dot products in fp32 and are multiplied by c = scale log2 e on the
// store (q is not pre-scaled: that would round q * c to bf16 again), where the micro-kernel also
// keeps the tile's column maximum. The softmax is fp32: the weights use a degree-3 exp2 (relative
// error 7.5e-5, far below the 2^-8 of the bf16 rounding that follows), the per-tile rescale an
// accurate one; the denominator l sums the fp32 weights, the numerator uses the bf16-rounded
// (dropped-out) weights. Everything else (masks, masked rows, NaN rules, threads) follows the
// fp32 kernel. Measured against it and the history of each choice: docs/notes/bf16-kernel.md.
//
// Native backward (AVX512-BF16): FlashAttention-2 Algorithm 2 with the same pairs (layout at the
// top of flash_bf16_backward-inl.h): all five products on vdpbf16ps, P Z and dS
// rounded to bf16 once for the products that consume them, dQ, dK, dV accumulated in fp32 and
// rounded once.
//
// Measured speed against the fp32 kernel and where the time goes: docs/kernels-cpu.md.
// Code: this file holds the fallback through the fp32 kernel and the entry points; the native
// kernels are in three parts it includes inside its AVX-512 target region (one translation unit,
// so the compiler sees what it saw when they were one file): flash_bf16_shared-inl.h (exp2,
// pair rounding, Philox, packing), flash_bf16_forward-inl.h (ForwardBlock, ForwardNative) and
// flash_bf16_backward-inl.h (BackwardItem, BackwardNative). Steps are named as in the fp32
// kernel (flash_attention.cpp: ForwardBlock, BackwardItem, ...). The work items, their schedule,
// the dQ merge and the masked rows are the flash driver's (flash_driver.hpp), shared with fp32.
#include "kernels/cpu/flash_bf16.hpp"

#include "kernels/cpu/dropout_simd.hpp"
#include "kernels/cpu/flash_attention.hpp"
#include "kernels/cpu/flash_driver.hpp"
#include "kernels/cpu/row_prefetch.hpp"
#include "kernels/cpu/scratch.hpp"
#include "kernels/cpu/transpose16.hpp"

#include "attn/core/dtype.hpp"
#include "attn/core/rng.hpp"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

// The shared SIMD Philox (kernels/cpu/philox-inl.h) compiled for each Highway target; the native
// kernels below call its AVX3 instance on raw registers (Philox16, flash_bf16_shared-inl.h).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/philox-inl.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "kernels/cpu/philox-inl.h"

#if !(HWY_TARGETS & HWY_AVX3) && HWY_STATIC_TARGET != HWY_AVX3
#error "flash_bf16.cpp needs Highway's AVX3 target (the native kernels' Philox)"
#endif

namespace attn::cpu {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

bool CpuHasBf16() {
  // Highway's AVX3 target (its extensions below AVX-512 come with every AVX-512 CPU, but the
  // target region below is compiled for them) plus AVX512-BF16.
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
                          __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("aes") &&
                          __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

// Keys [0, limit) are kept for row (b, t) (length mask and causal mask both keep a prefix).
int64_t RowLimit(const FlashBf16Params& p, int64_t b, int64_t t) {
  return p.row_limit(b, t);
}

// Dropout multipliers of elements i0 + k, k < n (kernels/cpu/dropout_simd.hpp).
void DropoutMultipliers(const FlashBf16Params& p, uint64_t i0, int64_t n, float* z) {
  cpu::dropout_multipliers(p.dropout, p.seed, p.offset, i0, n, z);
}

// Offset of batch row b in a tensor with batch stride sb and head stride sh (heads > 1: b is
// (batch, head) = (b / heads, b % heads); kernels/attention_problem.hpp).
inline int64_t HeadOffset(int64_t heads, int64_t b, int64_t sb, int64_t sh) {
  return heads == 1 ? b * sb : b / heads * sb + b % heads * sh;
}

// ---------------------------------------------------------------------------------------------
// Fallback: through the fp32 kernels

// One conversion of the fallback: a strided (B, N, C) bf16 view and a contiguous (B, N, C) fp32
// array, widened (bf16 -> fp32) or rounded (fp32 -> bf16) row by row.
struct Conversion {
  uint16_t* bf16;  // the view's data (read only when widening)
  int64_t sb, sh, st, sd;
  float* fp32;
  int64_t N, C;
};

template <class U>  // uint16_t or const uint16_t
Conversion Convert(const kernels::StridedView<U> v, int64_t N, int64_t C, float* fp32) {
  return {const_cast<uint16_t*>(v.data), v.sb, v.sh, v.st, v.sd, fp32, N, C};
}

// The conversions in one parallel region, each's rows dealt to the threads in chunks of 64 (the
// conversions are independent, so no barrier between them): elementwise, so the result does not
// depend on the split. Rows with unit stride along C go through the vectorised converters of
// attn/core/dtype.hpp (the same bits as the scalar ones). On CPUs without AVX512-BF16 the fallback
// ran 12 regions of these a layer and step, each ending at a barrier; memory-bound, a static
// split left a thread idle 15-18% of each (bench/omp_trace.py, Zen 3, 2 threads).
// kWiden: bf16 view -> fp32 array; else fp32 array -> bf16 view (rounded to nearest even).
template <bool kWiden>
void ConvertAll(std::initializer_list<Conversion> parts, int64_t B, int64_t heads, int threads) {
#pragma omp parallel num_threads(std::max(1, threads))
  for (const Conversion& c : parts) {
#pragma omp for schedule(dynamic, 64) nowait
    for (int64_t bn = 0; bn < B * c.N; ++bn) {
      uint16_t* h = c.bf16 + HeadOffset(heads, bn / c.N, c.sb, c.sh) + bn % c.N * c.st;
      float* f = c.fp32 + bn * c.C;
      if (c.sd == 1) {
        if constexpr (kWiden)
          bf16_to_floats(h, f, c.C);
        else
          floats_to_bf16(f, h, c.C);
        continue;
      }
      for (int64_t j = 0; j < c.C; ++j) {
        if constexpr (kWiden)
          f[j] = bf16_to_float(h[j * c.sd]);
        else
          h[j * c.sd] = float_to_bf16(f[j]);
      }
    }
  }
}

void Widen(std::initializer_list<Conversion> parts, int64_t B, int64_t heads, int threads) {
  ConvertAll<true>(parts, B, heads, threads);
}

void Round(std::initializer_list<Conversion> parts, int64_t B, int64_t heads, int threads) {
  ConvertAll<false>(parts, B, heads, threads);
}

// A contiguous (B, N, C) view of `data`.
template <class E>
kernels::StridedView<E> ContiguousView(E* data, int64_t N, int64_t C) {
  return {data, N * C, 0, C, 1};
}

// fp32 copies of q, k, v and out (converted from p.out.data with `with_out`, for the backward;
// otherwise only room for the fp32 kernel's output), then `extra` more floats for the caller,
// all in one scratch block (every part is written before it is read: conversions, or the fp32
// kernels' outputs, which overwrite), and the fp32 kernel's parameters on them.
struct Fp32Copies {
  Scratch<float> arena;
  float *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr, *extra = nullptr;
  FlashParams f;
};

void Fp32Params(const FlashBf16Params& p, bool with_out, size_t extra, Fp32Copies& c) {
  const int64_t B = p.B, T = p.T, S = p.S, D = p.D, Dv = p.Dv;
  const int th = p.threads;
  const auto n = [](int64_t a, int64_t b, int64_t e) { return static_cast<size_t>(a * b * e); };
  const size_t nq = n(B, T, D), nk = n(B, S, D), nv = n(B, S, Dv), no = n(B, T, Dv);
  c.arena = Scratch<float>("flash_attention_bf16", nq + nk + nv + no + extra);
  c.q = c.arena.get();
  c.k = c.q + nq, c.v = c.k + nk, c.out = c.v + nv, c.extra = c.out + no;
  if (with_out)
    Widen({Convert(p.q, T, D, c.q), Convert(p.k, S, D, c.k), Convert(p.v, S, Dv, c.v),
           Convert(p.out, T, Dv, c.out)},
          B, p.heads, th);
  else
    Widen({Convert(p.q, T, D, c.q), Convert(p.k, S, D, c.k), Convert(p.v, S, Dv, c.v)}, B, p.heads,
          th);
  FlashParams& f = c.f;
  static_cast<kernels::AttentionProblem&>(f) = p;  // the same problem, on contiguous copies
  f.heads = 1;
  f.q = ContiguousView<const float>(c.q, T, D);
  f.k = ContiguousView<const float>(c.k, S, D);
  f.v = ContiguousView<const float>(c.v, S, Dv);
  f.out = ContiguousView(c.out, T, Dv);
  f.lse = p.lse;
  f.weights = p.weights, f.w_sb = p.w_sb, f.w_st = p.w_st;
}

void ForwardFallback(const FlashBf16Params& p) {
  Fp32Copies c;
  Fp32Params(p, /*with_out=*/false, /*extra=*/0, c);
  flash_attention_forward(c.f);
  Round({Convert(p.out, p.T, p.Dv, c.out)}, p.B, p.heads, p.threads);
}

// ---------------------------------------------------------------------------------------------
// Native forward (AVX512-BF16). Everything from here to the pop_options is compiled for
// AVX-512 + BF16 and reached only when CpuHasBf16().

// The target is Highway's AVX3 (HWY_TARGET_STR_AVX3 in hwy/ops/set_macros-inl.h) plus
// AVX512-BF16, so that the shared Philox (philox-inl.h, compiled for AVX3) inlines here.
#if defined(__clang__)  // the fuzz build
#pragma clang attribute push(                                                               \
    __attribute__((target("sse2,ssse3,sse4.1,sse4.2,pclmul,aes,avx,avx2,bmi,bmi2,fma,f16c," \
                          "avx512f,avx512vl,avx512dq,avx512bw,avx512bf16"))),               \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("sse2,ssse3,sse4.1,sse4.2,pclmul,aes,avx,avx2,bmi,bmi2,fma,f16c", \
                   "avx512f,avx512vl,avx512dq,avx512bw,avx512bf16")
// GCC 12's avx512fintrin.h builds _mm512_max_ps and friends on `__m512 __Y = __Y;`
// (_mm512_undefined_ps), which -Wmaybe-uninitialized reports once inlined here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "kernels/cpu/flash_bf16_shared-inl.h"

#include "kernels/cpu/flash_bf16_forward-inl.h"

#include "kernels/cpu/flash_bf16_backward-inl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

}  // namespace

bool flash_bf16_native() {
  return CpuHasBf16();
}

bool flash_bf16_keeps_dropout(const FlashBf16Params& p) {
  return CpuHasBf16() && !p.force_bf16_fallback && p.weights == nullptr && p.dropout > 0.0f &&
         p.T > 0 && p.S > 0 && p.dropout_rows_aligned(0);
}

int64_t dropout_keep_words(const FlashBf16Params& p) {
  return p.B * ((p.T + kL - 1) / kL) * p.S;
}

void flash_attention_forward_bf16(const FlashBf16Params& p) {
  if (p.B == 0 || p.T == 0) return;
  // The weights need a second Q K^T pass with the final row statistics, which only the fp32
  // kernel has; a caller that asks for a (B, T, S) matrix is not after the last 2x anyway.
  if (!CpuHasBf16() || p.force_bf16_fallback || p.weights != nullptr) {
    ForwardFallback(p);
    return;
  }
  ForwardNative(p);
}

void flash_attention_backward_bf16(const FlashBf16Params& p, const FlashBf16Grads& g) {
  if (p.B == 0) return;
  if (CpuHasBf16() && !p.force_bf16_fallback && p.T > 0 && p.S > 0) {
    BackwardNative(p, g);
    return;
  }
  const int64_t B = p.B, T = p.T, S = p.S, D = p.D, Dv = p.Dv;
  // The arena after q, k, v, out: dout (B, T, Dv), dq (B, T, D), dk (B, S, D), dv (B, S, Dv).
  Fp32Copies c;
  Fp32Params(p, /*with_out=*/true, static_cast<size_t>(B * (T * Dv + T * D + S * D + S * Dv)), c);
  c.f.weights = nullptr;
  float* dout = c.extra;
  float* dq = dout + B * T * Dv;
  float* dk = dq + B * T * D;
  float* dv = dk + B * S * D;
  Widen({Convert(g.dout, T, Dv, dout)}, B, p.heads, p.threads);
  FlashGrads fg;
  fg.dout = ContiguousView<const float>(dout, T, Dv);
  fg.dq = ContiguousView(dq, T, D);
  fg.dk = ContiguousView(dk, S, D);
  fg.dv = ContiguousView(dv, S, Dv);
  flash_attention_backward(c.f, fg);
  Round({Convert(g.dq, T, D, dq), Convert(g.dk, S, D, dk), Convert(g.dv, S, Dv, dv)}, B, p.heads,
        p.threads);
}

}  // namespace attn::cpu
