// The one attention test harness. Kernel level: strided views inside sentinel-filled buffers
// (misaligned and non-unit strides, out-of-bounds writes detected), the case struct with its
// printable name, the valid lengths of a case and the per-row key limits that the ops layer would
// pass, the kernel arguments of a case (KernelProblem: the tests' one builder of
// kernels/attention_problem.hpp's structs) and the oracle on them (oracle(): kernels/ref on the
// same problem description). The case table that runs every case on every implementation is
// test_attention_cases.cpp; kernel-specific tests are test_kernels_flash_cpu.cpp (float32),
// test_kernels_flash_bf16.cpp (bfloat16) and test_kernels_decode_attention.cpp. Op and module level
// (test_nn_mha_heads.cpp): the same cases and lengths as Tensors, d2l's head split and merge,
// bitwise Tensor equality.
#pragma once

#include "kernels/attention_problem.hpp"
#include "kernels/ref/attention.hpp"

#include "attn/core/dtype.hpp"
#include "attn/core/rng.hpp"
#include "attn/core/tensor.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace attn::testing {

// float elements are themselves; bf16 elements are uint16_t bit patterns.
template <class E>
constexpr E kHarnessSentinel = std::is_same_v<E, float> ? E(-12345.0f) : E(0x7fc1);

// A (B, N, C) tensor of element type E at `off` in `buf` with element strides; every other slot
// of buf holds the sentinel (for float -12345, for bf16 a NaN payload never produced by
// rounding). Layouts: 0 contiguous; 1 the middle head of a (B, N, 3C+5) activation at an odd
// offset (misaligned rows); 2 a feature stride of 2 (non-unit last stride).
template <class E>
struct HarnessView {
  int64_t B = 0, N = 0, C = 0, off = 0, sb = 0, sn = 0, sc = 1;
  std::vector<E> buf;
  E* ptr() { return buf.data() + off; }
  const E* ptr() const { return buf.data() + off; }
  E& raw(int64_t b, int64_t n, int64_t c) { return buf[off + b * sb + n * sn + c * sc]; }
  E raw(int64_t b, int64_t n, int64_t c) const { return buf[off + b * sb + n * sn + c * sc]; }
  // float: the element itself (assignable); bf16: its value as a double.
  decltype(auto) at(int64_t b, int64_t n, int64_t c) {
    if constexpr (std::is_same_v<E, float>) {
      return raw(b, n, c);
    } else {
      return static_cast<double>(bf16_to_float(raw(b, n, c)));
    }
  }
  auto at(int64_t b, int64_t n, int64_t c) const {
    if constexpr (std::is_same_v<E, float>) {
      return raw(b, n, c);
    } else {
      return static_cast<double>(bf16_to_float(raw(b, n, c)));
    }
  }
  // The kernels' view of it (no head stride: one head per batch row), as an output or an input.
  kernels::StridedView<E> kernel_view() { return {ptr(), sb, 0, sn, sc}; }
  kernels::StridedView<const E> input_view() const { return {ptr(), sb, 0, sn, sc}; }
};

// Fills with uniform [-range, range) from Rng(seed, 99) when `fill`, else zeros.
template <class E>
HarnessView<E> make_harness_view(int64_t B, int64_t N, int64_t C, int layout, uint64_t seed,
                                 bool fill, double range = 1.0) {
  HarnessView<E> v;
  v.B = B, v.N = N, v.C = C;
  if (layout == 0) {
    v.sc = 1, v.sn = C, v.sb = N * C, v.off = 0;
  } else if (layout == 1) {
    const int64_t E3 = 3 * C + 5;
    v.sc = 1, v.sn = E3, v.sb = N * E3, v.off = C + 1;
  } else {
    v.sc = 2, v.sn = 2 * C + 1, v.sb = N * (2 * C + 1), v.off = 3;
  }
  v.buf.assign(static_cast<size_t>(v.off + B * v.sb + 8), kHarnessSentinel<E>);
  Rng rng(seed, 99);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        const float x = fill ? float(rng.uniform(-range, range)) : 0.0f;
        if constexpr (std::is_same_v<E, float>)
          v.raw(b, n, c) = x;
        else
          v.raw(b, n, c) = float_to_bf16(x);
      }
  return v;
}

// Number of buffer slots outside the tensor that no longer hold the sentinel (out-of-bounds
// writes).
template <class E>
int64_t guard_damage(const HarnessView<E>& v) {
  std::vector<char> is_elem(v.buf.size(), 0);
  for (int64_t b = 0; b < v.B; ++b)
    for (int64_t n = 0; n < v.N; ++n)
      for (int64_t c = 0; c < v.C; ++c)
        is_elem[v.off + b * v.sb + n * v.sn + c * v.sc] = 1;
  int64_t bad = 0;
  for (size_t i = 0; i < v.buf.size(); ++i)
    bad += !is_elem[i] && v.buf[i] != kHarnessSentinel<E>;
  return bad;
}

enum class Lens { kNone, k1D, k2D };

// One case of a kernel sweep; the name is what GoogleTest prints. H: heads of a (B, T, H*D)
// multi-head case (op and module tests; the kernel tests have one head per batch row).
struct KernelCase {
  int64_t B, T, S, D, Dv;
  Lens lens;
  bool causal;
  bool zero_rows;
  float dropout;
  int layout;
  int64_t H = 1;
  std::string name() const {
    static const char* kLens[] = {"none", "lens1d", "lens2d"};
    return "B" + std::to_string(B) + (H != 1 ? "_H" + std::to_string(H) : "") + "_T" +
           std::to_string(T) + "_S" + std::to_string(S) + "_D" + std::to_string(D) + "_Dv" +
           std::to_string(Dv) + "_" + kLens[int(lens)] + (causal ? "_causal" : "") +
           (zero_rows ? "_zero" : "_uniform") + "_p" + std::to_string(int(dropout * 100)) +
           "_layout" + std::to_string(layout);
  }
  kernels::MaskedRows masked_rows() const {
    return zero_rows ? kernels::MaskedRows::kZero : kernels::MaskedRows::kUniform;
  }
};

// d2l's valid_lens of a case, as a caller passes them: (B) for 1-D lengths, (B*T) row-major for
// 2-D ones, in [0, S + 2] (past S too), including 0 (a fully masked row: batch 0 with 1-D
// lengths, query 1 with 2-D ones). Empty without lengths.
inline std::vector<int64_t> case_valid_lens(const KernelCase& c) {
  std::vector<int64_t> lens;
  if (c.lens == Lens::kNone) return lens;
  Rng rng(7, 1);
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t len_b = b == 0 ? 0 : int64_t(rng.below(c.S + 3));
    if (c.lens == Lens::k1D) lens.push_back(len_b);
    for (int64_t t = 0; c.lens == Lens::k2D && t < c.T; ++t) {
      const int64_t len = int64_t(rng.below(c.S + 3));
      lens.push_back(t == 1 ? 0 : len);
    }
  }
  return lens;
}

// The same as a Tensor ((B) or (B, T) int64), undefined without lengths.
inline Tensor case_valid_lens_tensor(const KernelCase& c) {
  const std::vector<int64_t> lens = case_valid_lens(c);
  if (lens.empty()) return {};
  return Tensor::from_vector(lens, c.lens == Lens::k1D ? Shape{c.B} : Shape{c.B, c.T});
}

// Kept-key counts per (b, t) row as the ops layer passes them: the valid lengths clamped to
// [0, S]; 1-D lengths repeat over the rows of a batch. Empty without lengths.
inline std::vector<int32_t> case_key_limits(const KernelCase& c) {
  std::vector<int32_t> limit;
  const std::vector<int64_t> lens = case_valid_lens(c);
  if (lens.empty()) return limit;
  limit.resize(c.B * c.T);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < c.T; ++t) {
      const int64_t len = c.lens == Lens::k1D ? lens[b] : lens[b * c.T + t];
      limit[b * c.T + t] = int32_t(std::clamp<int64_t>(len, 0, c.S));
    }
  return limit;
}

// Keys [0, limit) kept by row (b, t): the lengths and the causal mask.
inline int64_t case_row_limit(const KernelCase& c, const std::vector<int32_t>& limit, int64_t b,
                              int64_t t) {
  int64_t lim = limit.empty() ? c.S : limit[b * c.T + t];
  if (c.causal) lim = std::min(lim, t + 1);
  return std::clamp<int64_t>(lim, 0, c.S);
}

// The kernel arguments of a case (the tests' one builder): q, k, v, dout filled (seeds 1..4, in
// [-qk_range, qk_range) for q and k), out, dq, dk, dv (and the float32 weights, unit stride along
// S, after with_weights()) in sentinel-filled buffers, the layouts rotated over the tensors, key
// limits from the case, scale 1/sqrt(D), dropout stream (seed 1234, offset 5), one thread. p and g
// point into this object: do not copy it after changing them (build it in place).
template <class E>
struct KernelProblem {
  KernelCase cs;
  HarnessView<E> q, k, v, out, dout, dq, dk, dv;
  HarnessView<float> weights;
  std::vector<float> lse;
  std::vector<int32_t> key_limit;
  kernels::AttentionArgs<E> p;
  kernels::AttentionGradArgs<E> g;

  explicit KernelProblem(const KernelCase& c, double qk_range = 1.0) : cs(c) {
    const int L = c.layout;
    q = make_harness_view<E>(c.B, c.T, c.D, L, 1, true, qk_range);
    k = make_harness_view<E>(c.B, c.S, c.D, (L + 1) % 3, 2, true, qk_range);
    v = make_harness_view<E>(c.B, c.S, c.Dv, (L + 2) % 3, 3, true);
    dout = make_harness_view<E>(c.B, c.T, c.Dv, L, 4, true);
    out = make_harness_view<E>(c.B, c.T, c.Dv, L, 0, false);
    dq = make_harness_view<E>(c.B, c.T, c.D, (L + 1) % 3, 0, false);
    dk = make_harness_view<E>(c.B, c.S, c.D, L, 0, false);
    dv = make_harness_view<E>(c.B, c.S, c.Dv, (L + 1) % 3, 0, false);
    lse.assign(c.B * c.T, 0.0f);
    key_limit = case_key_limits(c);
    p.B = c.B, p.T = c.T, p.S = c.S, p.D = c.D, p.Dv = c.Dv;
    p.q = q.input_view();
    p.k = k.input_view();
    p.v = v.input_view();
    p.out = out.kernel_view();
    p.lse = lse.data();
    p.kept_keys = key_limit.empty() ? nullptr : key_limit.data();
    p.causal = c.causal;
    p.masked_rows = c.masked_rows();
    p.scale = float(1.0 / std::sqrt(double(c.D)));
    p.dropout = c.dropout;
    p.seed = 1234;
    p.offset = 5;
    p.threads = 1;
    g.dout = dout.input_view();
    g.dq = dq.kernel_view();
    g.dk = dk.kernel_view();
    g.dv = dv.kernel_view();
  }
  // Asks the forward for the weights too (float32 kernel), into a fresh sentinel-filled view.
  void with_weights() {
    weights = make_harness_view<float>(cs.B, cs.T, cs.S, cs.layout % 2, 0, false);
    p.weights = weights.ptr(), p.w_sb = weights.sb, p.w_st = weights.sn;
  }
};

// A view's elements as a contiguous (B, N, C) double array.
template <class E>
std::vector<double> contiguous_values(const HarnessView<E>& v) {
  std::vector<double> x(static_cast<size_t>(v.B * v.N * v.C));
  for (int64_t b = 0; b < v.B; ++b)
    for (int64_t n = 0; n < v.N; ++n)
      for (int64_t c = 0; c < v.C; ++c)
        x[(b * v.N + n) * v.C + c] = static_cast<double>(v.at(b, n, c));
  return x;
}

// What the oracle gives for a problem: contiguous (B, T, Dv), (B, T), (B, T, S) weights and the
// gradients (B, T, D), (B, S, D), (B, S, Dv).
struct Expected {
  std::vector<double> out, lse, weights, dq, dk, dv;
};

// The oracle (kernels/ref/attention.hpp) on the problem's own description and input values, in
// double: scale and dropout p as the kernels take them (float, widened).
template <class E>
Expected oracle(const KernelProblem<E>& pr, bool backward) {
  const KernelCase& c = pr.cs;
  const std::vector<double> q = contiguous_values(pr.q), k = contiguous_values(pr.k),
                            v = contiguous_values(pr.v), dout = contiguous_values(pr.dout);
  Expected r;
  r.out.assign(c.B * c.T * c.Dv, 0.0);
  r.lse.assign(c.B * c.T, 0.0);
  r.weights.assign(c.B * c.T * c.S, 0.0);
  ref::AttentionCall<double> call;
  call.problem = pr.p;  // the AttentionProblem part: shapes, mask, dropout stream
  call.scale = pr.p.scale;
  call.dropout = pr.p.dropout;
  call.q = q.data(), call.k = k.data(), call.v = v.data();
  call.out = r.out.data(), call.lse = r.lse.data(), call.weights = r.weights.data();
  ref::sdpa_forward(call);
  if (backward) {
    r.dq.assign(c.B * c.T * c.D, 0.0);
    r.dk.assign(c.B * c.S * c.D, 0.0);
    r.dv.assign(c.B * c.S * c.Dv, 0.0);
    call.dout = dout.data();
    call.dq = r.dq.data(), call.dk = r.dk.data(), call.dv = r.dv.data();
    ref::sdpa_backward(call);
  }
  return r;
}

inline double max_abs(const std::vector<double>& x) {
  double m = 1e-30;
  for (double e : x)
    m = std::max(m, std::abs(e));
  return m;
}

// ---------------------------------------------------------------------------------------------
// Op and module level

// Same shape, dtype and bytes.
inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ac = a.contiguous(), bc = b.contiguous();
  return std::memcmp(ac.raw_data(), bc.raw_data(), ac.nbytes()) == 0;
}

// (B, L, H*W) -> (B*H, L, W) contiguous: d2l's transpose_qkv.
inline Tensor split_heads(const Tensor& x, int64_t H) {
  const int64_t B = x.dim(0), L = x.dim(1), W = x.dim(2) / H;
  return x.contiguous()
      .reshape({B, L, H, W})
      .permute({0, 2, 1, 3})
      .contiguous()
      .reshape({B * H, L, W});
}
// (B*H, L, W) -> (B, L, H*W) contiguous: d2l's transpose_output.
inline Tensor merge_heads(const Tensor& y, int64_t H) {
  const int64_t B = y.dim(0) / H, L = y.dim(1), W = y.dim(2);
  return y.reshape({B, H, L, W}).permute({0, 2, 1, 3}).contiguous().reshape({B, L, H * W});
}

}  // namespace attn::testing
