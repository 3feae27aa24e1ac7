// The fused CUDA attention (kernels/cuda/flash_attention.cu) against the reference
// (kernels/ref/attention, double): forward, backward and the decode step, float32 and bf16, over
// d2l's masks (1-D and 2-D valid_lens lowered to kept-key counts), causal, dropout (the same
// Philox stream, so the reference drops the same weights), both masked-row policies, head dims
// past a warp, T != S, and heads read in place from a (batch, T, heads * D) projection. bf16
// cases with D = Dv in {32, 64, 128} run the tensor-core forward (flash_mma.cu), the others the
// SIMT kernel; ATTN_CUDA_SIMT_ATTENTION=1 sends all of them to the SIMT kernel.
// Every case prints its largest errors; a failure names the case. Skips without a GPU.
#include "cuda_testing.hpp"
#include "kernels/cuda/kernels.hpp"
#include "kernels/ref/attention.hpp"

#include "attn/core/rng.hpp"

#include <fmt/format.h>

#include <cstdlib>

namespace attn::cuda {
namespace {

using namespace testing;

enum class Mask { kNone, kLens1d, kLens2d };

struct Case {
  int64_t batch = 2, heads = 1, T = 8, S = 8, D = 16, Dv = 16;
  Mask mask = Mask::kNone;
  bool causal = false;
  float dropout = 0.0f;
  kernels::MaskedRows policy = kernels::MaskedRows::kUniform;
  bool bf16 = false;
  bool in_place_heads = false;  // q, k, v, out as (batch, T, heads * D) projections
  std::string name() const {
    return fmt::format("b{} h{} T{} S{} D{} Dv{} mask{} causal{} p{} {} {}{}", batch, heads, T, S,
                       D, Dv, static_cast<int>(mask), causal, dropout,
                       policy == kernels::MaskedRows::kZero ? "zero-rows" : "uniform-rows",
                       bf16 ? "bf16" : "f32", in_place_heads ? " strided" : "");
  }
};

std::vector<Case> cases() {
  std::vector<Case> v;
  for (int64_t D : {8, 32, 40, 64, 128})
    for (Mask m : {Mask::kNone, Mask::kLens1d, Mask::kLens2d})
      for (bool causal : {false, true}) {
        Case c;
        c.D = c.Dv = D;
        c.T = D == 64 ? 33 : 17;
        c.S = D == 64 ? 70 : 17;
        c.heads = 2;
        c.mask = m;
        c.causal = causal;
        v.push_back(c);
      }
  Case c;
  c.dropout = 0.3f;
  c.T = 40;
  c.S = 50;
  c.mask = Mask::kLens2d;
  v.push_back(c);
  c.causal = true;
  v.push_back(c);
  c.policy = kernels::MaskedRows::kZero;
  v.push_back(c);
  c = Case{};
  c.D = 32;
  c.Dv = 48;
  c.T = 5;
  c.S = 100;
  v.push_back(c);
  c = Case{};
  c.batch = 3;
  c.heads = 4;
  c.D = c.Dv = 32;
  c.T = c.S = 128;  // d2l's training shape, reduced batch
  c.mask = Mask::kLens1d;
  c.dropout = 0.1f;
  c.in_place_heads = true;
  v.push_back(c);
  c = Case{};  // the bf16 tensor-core forward's features: dropout, heads in place, padding rows
  c.batch = 2;
  c.heads = 2;
  c.D = c.Dv = 64;
  c.T = 100;
  c.S = 130;
  c.mask = Mask::kLens2d;
  c.causal = true;
  c.dropout = 0.2f;
  c.in_place_heads = true;
  v.push_back(c);
  c.D = c.Dv = 128;
  c.causal = false;
  c.mask = Mask::kLens1d;
  c.policy = kernels::MaskedRows::kZero;
  v.push_back(c);
  c = Case{};
  c.D = c.Dv = 256;
  c.T = 20;
  c.S = 33;
  v.push_back(c);
  // ATTN_CUDA_SMALL (scripts/gpu-check.sh's compute-sanitizer run): a spread of 6 cases.
  if (std::getenv("ATTN_CUDA_SMALL") != nullptr) {
    std::vector<Case> few;
    for (size_t i = 0; i < v.size(); i += 6)
      few.push_back(v[i]);
    v = few;
  }
  const size_t n = v.size();
  for (size_t i = 0; i < n; ++i) {  // every case in bf16 too
    Case b = v[i];
    b.bf16 = true;
    v.push_back(b);
  }
  return v;
}

struct Problem {
  Case c;
  int64_t Bh;
  std::vector<double> q, k, v, dout;  // (Bh, T|S, D|Dv), rounded to the case's precision
  std::vector<int32_t> kept;          // (Bh, T): the mask lowered, without causal
  std::vector<int32_t> ref_kept;      // with causal folded in (the reference has no flag)
};

Problem make(const Case& c, uint64_t seed) {
  Problem p;
  p.c = c;
  p.Bh = c.batch * c.heads;
  Rng rng(seed);
  auto fill = [&](std::vector<double>& x, int64_t n) {
    x.resize(static_cast<size_t>(n));
    for (auto& e : x) {
      e = rng.uniform(-1, 1);
      e = c.bf16 ? bf16_widen(bf16_round(static_cast<float>(e))) : static_cast<float>(e);
    }
  };
  fill(p.q, p.Bh * c.T * c.D);
  fill(p.k, p.Bh * c.S * c.D);
  fill(p.v, p.Bh * c.S * c.Dv);
  fill(p.dout, p.Bh * c.T * c.Dv);
  std::vector<int64_t> lens1(c.batch);
  for (auto& l : lens1)
    l = static_cast<int64_t>(rng.below(static_cast<uint64_t>(c.S + 1)));
  if (c.mask == Mask::kLens1d && c.batch > 1) lens1[0] = 0;  // a fully masked batch
  p.kept.resize(static_cast<size_t>(p.Bh * c.T));
  p.ref_kept.resize(p.kept.size());
  for (int64_t b = 0; b < p.Bh; ++b)
    for (int64_t t = 0; t < c.T; ++t) {
      int64_t len = c.S;
      if (c.mask == Mask::kLens1d) len = lens1[b / c.heads];
      if (c.mask == Mask::kLens2d)
        len = static_cast<int64_t>(rng.below(static_cast<uint64_t>(c.S + 1)));
      p.kept[b * c.T + t] = static_cast<int32_t>(len);
      p.ref_kept[b * c.T + t] =
          static_cast<int32_t>(c.causal ? std::min<int64_t>(len, t + 1) : len);
    }
  return p;
}

// (Bh, L, W) contiguous -> (batch, L, heads * W), head h at columns [h*W, (h+1)*W).
std::vector<double> interleave(const std::vector<double>& x, const Case& c, int64_t L, int64_t W) {
  std::vector<double> r(x.size());
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t w = 0; w < W; ++w)
          r[((b * L + l) * c.heads + h) * W + w] = x[(((b * c.heads + h) * L) + l) * W + w];
  return r;
}
std::vector<double> deinterleave(const std::vector<double>& x, const Case& c, int64_t L,
                                 int64_t W) {
  std::vector<double> r(x.size());
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t w = 0; w < W; ++w)
          r[(((b * c.heads + h) * L) + l) * W + w] = x[((b * L + l) * c.heads + h) * W + w];
  return r;
}

template <class E>
kernels::StridedView<E> view(const Tensor& t, const Case& c, int64_t L, int64_t W) {
  kernels::StridedView<E> v;
  v.data = ptr<E>(t);
  if (c.in_place_heads) {
    v.sb = L * c.heads * W;
    v.st = c.heads * W;
    v.sh = W;
  } else {
    v.sb = L * W;
    v.st = W;
  }
  return v;
}

template <class E>
Tensor upload_as(const std::vector<double>& x, const Case& c, int64_t L, int64_t W) {
  const std::vector<double> laid = c.in_place_heads ? interleave(x, c, L, W) : x;
  if constexpr (std::is_same_v<E, float>)
    return upload(to_f32(laid));
  else
    return upload(to_bf16(laid));
}
template <class E>
std::vector<double> download_as(const Tensor& t, const Case& c, int64_t L, int64_t W, size_t n) {
  std::vector<double> x = widen(download<E>(t, n));
  return c.in_place_heads ? deinterleave(x, c, L, W) : x;
}

template <class E>
void run_case(const Case& c, bool decode) {
  SCOPED_TRACE(c.name());
  const Problem p = make(c, 1234);
  const int64_t Bh = p.Bh;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  // The oracle on the same problem: ref_kept holds each row's kept-key limit (causal folded in).
  ref::AttentionCall<double> rc;
  rc.problem.B = Bh, rc.problem.T = c.T, rc.problem.S = c.S, rc.problem.D = c.D;
  rc.problem.Dv = c.Dv;
  rc.problem.kept_keys = p.ref_kept.data();
  rc.problem.masked_rows = c.policy;
  rc.problem.dropout = static_cast<float>(c.dropout);
  rc.problem.seed = 77;
  rc.problem.offset = 5;
  rc.scale = scale;
  rc.dropout = c.dropout;
  std::vector<double> out_ref(Bh * c.T * c.Dv), lse_ref(Bh * c.T);
  rc.q = p.q.data(), rc.k = p.k.data(), rc.v = p.v.data();
  rc.out = out_ref.data(), rc.lse = lse_ref.data();
  ref::sdpa_forward<double>(rc);

  Tensor q = upload_as<E>(p.q, c, c.T, c.D), k = upload_as<E>(p.k, c, c.S, c.D),
         v = upload_as<E>(p.v, c, c.S, c.Dv), dout = upload_as<E>(p.dout, c, c.T, c.Dv);
  const size_t n_out = static_cast<size_t>(Bh * c.T * c.Dv);
  Tensor out =
      empty({static_cast<int64_t>(n_out)}, std::is_same_v<E, float> ? DType::F32 : DType::BF16);
  Tensor lse = empty({Bh * c.T}, DType::F32);
  Tensor kept = upload(p.kept);
  kernels::AttentionArgs<E> a;
  a.B = Bh;
  a.T = c.T;
  a.S = c.S;
  a.D = c.D;
  a.Dv = c.Dv;
  a.heads = c.in_place_heads ? c.heads : 1;
  a.kept_keys = c.mask == Mask::kNone ? nullptr : ptr<int32_t>(kept);
  a.causal = c.causal;
  a.masked_rows = c.policy;
  a.scale = static_cast<float>(scale);
  a.dropout = c.dropout;
  a.seed = rc.problem.seed;
  a.offset = rc.problem.offset;
  // Half of the dropout cases read part of the offset on the device, as a captured training step
  // does (AttentionProblem::dropout_offset_device): base 3 + offset 2 is the reference's 5.
  Tensor offset_base = upload(std::vector<uint64_t>{3});
  if (c.dropout > 0.0f && c.D >= 64) {
    a.offset = rc.problem.offset - 3;
    a.dropout_offset_device = ptr<const uint64_t>(offset_base);
  }
  a.q = view<const E>(q, c, c.T, c.D);
  a.k = view<const E>(k, c, c.S, c.D);
  a.v = view<const E>(v, c, c.S, c.Dv);
  a.out = view<E>(out, c, c.T, c.Dv);
  a.lse = ptr<float>(lse);
  if (decode)
    flash_attention_decode(a, nullptr);
  else
    flash_attention_forward(a, nullptr);
  synchronize(nullptr);
  const bool bf16 = !std::is_same_v<E, float>;
  const double rtol = bf16 ? 2e-2 : 1e-5, atol = bf16 ? 1e-2 : 1e-5;
  const std::string tag = (decode ? "decode " : "fwd ") + c.name();
  expect_close(tag + " out", download_as<E>(out, c, c.T, c.Dv, n_out), out_ref, rtol, atol);
  std::vector<double> lse_got = widen(download<float>(lse, static_cast<size_t>(Bh * c.T)));
  for (size_t i = 0; i < lse_got.size(); ++i)  // -inf rows: compare as 0 (both must be -inf)
    if (std::isinf(lse_ref[i]) || std::isinf(lse_got[i])) {
      EXPECT_EQ(std::isinf(lse_ref[i]), std::isinf(lse_got[i])) << tag << " lse row " << i;
      lse_ref[i] = lse_got[i] = 0;
    }
  expect_close(tag + " lse", lse_got, lse_ref, 1e-5, bf16 ? 1e-3 : 1e-5);
  if (decode) return;

  std::vector<double> dq_ref(p.q.size()), dk_ref(p.k.size()), dv_ref(p.v.size());
  rc.dout = p.dout.data();
  rc.dq = dq_ref.data(), rc.dk = dk_ref.data(), rc.dv = dv_ref.data();
  ref::sdpa_backward<double>(rc);
  const DType dt = bf16 ? DType::BF16 : DType::F32;
  Tensor dq = empty({static_cast<int64_t>(p.q.size())}, dt),
         dk = empty({static_cast<int64_t>(p.k.size())}, dt),
         dv = empty({static_cast<int64_t>(p.v.size())}, dt), delta = empty({Bh * c.T}, DType::F32);
  kernels::AttentionGradArgs<E> g;
  g.dout = view<const E>(dout, c, c.T, c.Dv);
  g.dq = view<E>(dq, c, c.T, c.D);
  g.dk = view<E>(dk, c, c.S, c.D);
  g.dv = view<E>(dv, c, c.S, c.Dv);
  flash_attention_backward(a, g, ptr<float>(delta), nullptr);
  synchronize(nullptr);
  // bf16 gradients: the forward's output was rounded, so delta = rowsum(dO * O) carries bf16
  // error into every dS; a norm-relative 5e-2 holds for these sizes.
  const double grtol = bf16 ? 5e-2 : 1e-4, gatol = bf16 ? 2e-2 : 1e-5;
  expect_close("bwd " + c.name() + " dq", download_as<E>(dq, c, c.T, c.D, p.q.size()), dq_ref,
               grtol, gatol);
  expect_close("bwd " + c.name() + " dk", download_as<E>(dk, c, c.S, c.D, p.k.size()), dk_ref,
               grtol, gatol);
  expect_close("bwd " + c.name() + " dv", download_as<E>(dv, c, c.S, c.Dv, p.v.size()), dv_ref,
               grtol, gatol);
}

TEST(CudaFlashAttention, ForwardAndBackwardMatchTheReference) {
  ATTN_SKIP_WITHOUT_GPU();
  std::printf("device: %s\n", device_description().c_str());
  for (const Case& c : cases()) {
    if (c.bf16)
      run_case<uint16_t>(c, false);
    else
      run_case<float>(c, false);
  }
}

TEST(CudaFlashAttention, DecodeStepMatchesTheReference) {
  ATTN_SKIP_WITHOUT_GPU();
  // Keys in chunks of 1024 (kDecodeChunk): one chunk, a chunk and a key, several; head dims of
  // one to four outputs a lane.
  for (bool bf16 : {false, true})
    for (int64_t T : {1, 2})
      for (int64_t S : {1, 31, 257, 1024, 1025, 2000, 4100})
        for (Mask m : {Mask::kNone, Mask::kLens1d}) {
          Case c;
          c.batch = 3;
          c.heads = 2;
          c.T = T;
          c.S = S;
          c.D = c.Dv = S == 1025 ? 32 : (S == 4100 ? 128 : 64);
          c.mask = m;
          c.bf16 = bf16;
          c.dropout = S == 257 || S == 4100 ? 0.2f : 0.0f;
          if (S == 1025 && m == Mask::kLens1d) c.policy = kernels::MaskedRows::kZero;
          if (bf16)
            run_case<uint16_t>(c, true);
          else
            run_case<float>(c, true);
        }
}

TEST(CudaFlashAttention, RejectsWhatItDoesNotSupport) {
  ATTN_SKIP_WITHOUT_GPU();
  kernels::AttentionArgs<float> a;
  a.B = 1;
  a.T = a.S = 4;
  a.D = a.Dv = 300;
  EXPECT_THROW(flash_attention_forward(a, nullptr), Error);
}

}  // namespace
}  // namespace attn::cuda
