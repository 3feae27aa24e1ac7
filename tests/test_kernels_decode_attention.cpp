// The decode kernel (kernels/cpu/decode_attention) against the reference SDPA (kernels/ref): a
// sweep of queries per row (1..8), cache lengths (1..~300 across the 128-key chunk boundaries and
// one long cache), head widths (odd ones for the scalar tails), batch x heads with head strides
// into a (B, capacity, H*D) cache, per-row lengths (ragged, zero), both masked-row policies, a
// bfloat16 cache, every SIMD target; and bitwise equality for 1, 2 and 3 threads. Cache positions
// past S hold NaN: the kernel must never read them.
#include "attn/core/context.hpp"
#include "attn/core/dtype.hpp"
#include "attn/core/error.hpp"
#include "attn/core/tensor.hpp"
#include "kernels/cpu/decode_attention.hpp"
#include "kernels/cpu/flash_attention.hpp"
#include "kernels/cpu/parallel.hpp"
#include "kernels/ref/attention.hpp"
#include "ops/attention_decode.hpp"
#include "ops/attention_kernel.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace attn {
namespace {

// Every kernel forks as far as a test asks, whatever the size (kernels/cpu/parallel.hpp), so that
// the thread-count comparisons below run the parallel paths on these small shapes too.
const bool kForkAtAnySize = (attn::cpu::set_min_flops_per_thread(0), true);

struct Case {
  int64_t batch = 1, heads = 1, T = 1, S = 1, D = 16, Dv = 16;
  enum Lens { kNone, kRagged, kWithZero, kPerQuery } lens = kNone;
  bool causal = false;
  kernels::MaskedRows policy = kernels::MaskedRows::kUniform;
  bool bf16 = false;
  int64_t simd_targets = 0;  // AttentionProblem::simd_targets: 0, or one target bit to force

  std::string name() const {
    return "batch" + std::to_string(batch) + "_H" + std::to_string(heads) + "_T" +
           std::to_string(T) + "_S" + std::to_string(S) + "_D" + std::to_string(D) + "_Dv" +
           std::to_string(Dv) + "_lens" + std::to_string(int(lens)) + (causal ? "_causal" : "") +
           (policy == kernels::MaskedRows::kZero ? "_zero" : "") + (bf16 ? "_bf16" : "");
  }
};

// Tensors of one case, laid out as the decoder's: q (batch, T, H*D) with a spare column, the
// cache (batch, capacity, H*D) with NaN past S, output (batch, T, H*Dv) with guard values.
struct Data {
  Case c;
  int64_t cap = 0, qw = 0;
  std::vector<float> q, k32, v32, out;
  std::vector<uint16_t> k16, v16;
  std::vector<int32_t> kept;  // (batch*H, T)

  explicit Data(const Case& cs) : c(cs) {
    std::mt19937 gen(static_cast<uint32_t>(cs.S * 131 + cs.D * 7 + cs.T));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int64_t H = c.heads;
    cap = c.S + 3, qw = H * c.D + 1;
    q.resize(static_cast<size_t>(c.batch * c.T * qw));
    for (float& x : q)
      x = nd(gen);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    auto fill_cache = [&](std::vector<float>& f, std::vector<uint16_t>& h, int64_t width) {
      f.assign(static_cast<size_t>(c.batch * cap * width), nan);
      h.assign(f.size(), float_to_bf16(nan));
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t s = 0; s < c.S; ++s)
          for (int64_t i = 0; i < width; ++i) {
            const size_t at = static_cast<size_t>((b * cap + s) * width + i);
            h[at] = float_to_bf16(nd(gen));
            f[at] = c.bf16 ? bf16_to_float(h[at]) : nd(gen);
          }
    };
    fill_cache(k32, k16, H * c.D);
    fill_cache(v32, v16, H * c.Dv);
    out.assign(static_cast<size_t>(c.batch * c.T * H * c.Dv), 12345.0f);
    if (c.lens != Case::kNone) {
      std::uniform_int_distribution<int32_t> len(0, static_cast<int32_t>(c.S));
      kept.resize(static_cast<size_t>(c.batch * H * c.T));
      for (int64_t b = 0; b < c.batch; ++b) {
        // Per batch row (d2l's valid_lens, the same for its heads), or per query.
        const int32_t row = c.lens == Case::kWithZero && b == 0 ? 0 : len(gen);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t t = 0; t < c.T; ++t)
            kept[static_cast<size_t>((b * H + h) * c.T + t)] =
                c.lens == Case::kPerQuery
                    ? std::min<int32_t>(static_cast<int32_t>(c.S), row + static_cast<int32_t>(t))
                    : row;
      }
    }
  }

  template <class KV>
  cpu::DecodeArgs<KV> args(const std::vector<KV>& k, const std::vector<KV>& v, float* lse,
                           int threads) {
    cpu::DecodeArgs<KV> a;
    const int64_t H = c.heads;
    a.B = c.batch * H, a.T = c.T, a.S = c.S, a.D = c.D, a.Dv = c.Dv, a.heads = H;
    a.kept_keys = kept.empty() ? nullptr : kept.data();
    a.causal = c.causal;
    a.masked_rows = c.policy;
    a.scale = 1.0f / std::sqrt(static_cast<float>(c.D));
    a.threads = threads;
    a.simd_targets = c.simd_targets;
    a.q = {q.data(), c.T * qw, c.D, qw, 1};
    a.k = {k.data(), cap * H * c.D, c.D, H * c.D, 1};
    a.v = {v.data(), cap * H * c.Dv, c.Dv, H * c.Dv, 1};
    a.out = {out.data(), c.T * H * c.Dv, c.Dv, H * c.Dv, 1};
    a.lse = lse;
    return a;
  }

  // Runs the kernel; returns out and lse concatenated.
  std::vector<float> run(int threads) {
    std::vector<float> lse(static_cast<size_t>(c.batch * c.heads * c.T), 777.0f);
    if (c.bf16)
      cpu::decode_attention(args(k16, v16, lse.data(), threads));
    else
      cpu::decode_attention(args(k32, v32, lse.data(), threads));
    std::vector<float> all = out;
    all.insert(all.end(), lse.begin(), lse.end());
    return all;
  }

  // The reference in double on per-(batch, head) copies; same layout as run().
  std::vector<double> reference() const {
    const int64_t H = c.heads, BH = c.batch * H;
    std::vector<double> rq(static_cast<size_t>(BH * c.T * c.D)),
        rk(static_cast<size_t>(BH * c.S * c.D)), rv(static_cast<size_t>(BH * c.S * c.Dv)),
        ro(static_cast<size_t>(BH * c.T * c.Dv)), rl(static_cast<size_t>(BH * c.T));
    std::vector<int32_t> rkept(static_cast<size_t>(BH * c.T));
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t bh = b * H + h;
        for (int64_t t = 0; t < c.T; ++t) {
          for (int64_t i = 0; i < c.D; ++i)
            rq[static_cast<size_t>((bh * c.T + t) * c.D + i)] =
                q[static_cast<size_t>((b * c.T + t) * qw + h * c.D + i)];
          int64_t lim = kept.empty() ? c.S : kept[static_cast<size_t>(bh * c.T + t)];
          if (c.causal) lim = std::min(lim, t + 1);
          rkept[static_cast<size_t>(bh * c.T + t)] = lim;
        }
        for (int64_t s = 0; s < c.S; ++s) {
          for (int64_t i = 0; i < c.D; ++i)
            rk[static_cast<size_t>((bh * c.S + s) * c.D + i)] =
                k32[static_cast<size_t>((b * cap + s) * H * c.D + h * c.D + i)];
          for (int64_t i = 0; i < c.Dv; ++i)
            rv[static_cast<size_t>((bh * c.S + s) * c.Dv + i)] =
                v32[static_cast<size_t>((b * cap + s) * H * c.Dv + h * c.Dv + i)];
        }
      }
    // The oracle on the kernel's own problem (kept keys with causal folded in, contiguous rows).
    ref::AttentionCall<double> rc;
    rc.problem.B = BH, rc.problem.T = c.T, rc.problem.S = c.S, rc.problem.D = c.D;
    rc.problem.Dv = c.Dv;
    rc.problem.kept_keys = rkept.data();
    rc.problem.masked_rows = c.policy;
    rc.scale = 1.0 / std::sqrt(double(c.D));
    rc.q = rq.data(), rc.k = rk.data(), rc.v = rv.data(), rc.out = ro.data(), rc.lse = rl.data();
    ref::sdpa_forward(rc);
    // Back to the kernel's (batch, T, H*Dv) output layout, then lse (B*H, T).
    std::vector<double> all(static_cast<size_t>(c.batch * c.T * H * c.Dv));
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < c.T; ++t)
          for (int64_t i = 0; i < c.Dv; ++i)
            all[static_cast<size_t>((b * c.T + t) * H * c.Dv + h * c.Dv + i)] =
                ro[static_cast<size_t>(((b * H + h) * c.T + t) * c.Dv + i)];
    all.insert(all.end(), rl.begin(), rl.end());
    return all;
  }
};

void check_case(const Case& c, std::initializer_list<int> thread_counts = {2}) {
  SCOPED_TRACE(c.name());
  Data data(c);
  const std::vector<double> want = data.reference();
  const std::vector<float> got = data.run(1);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i])) {  // lse of a masked row
      ASSERT_EQ(got[i], static_cast<float>(want[i])) << "at " << i;
      continue;
    }
    ASSERT_NEAR(got[i], want[i], 2e-5 * (1.0 + std::abs(want[i]))) << "at " << i;
  }
  // Split-K merges in a fixed order: any thread count gives the same bits.
  for (int threads : thread_counts) {
    const std::vector<float> again = data.run(threads);
    ASSERT_EQ(std::memcmp(got.data(), again.data(), got.size() * sizeof(float)), 0)
        << threads << " threads";
  }
}

TEST(DecodeAttention, SweepAgainstReference) {
  int n = 0;
  for (int64_t T = 1; T <= 8; ++T)
    for (int64_t S : {1, 7, 127, 129, 300})
      for (int64_t D : {16, 17, 100}) {
        Case c;
        c.T = T, c.S = S, c.D = D, c.Dv = (n % 3 == 0) ? D + 3 : D;
        c.batch = 1 + n % 3, c.heads = 1 + (n / 3) % 3;
        c.lens = static_cast<Case::Lens>(n % 4);
        c.causal = n % 11 == 5;
        c.policy = n % 2 ? kernels::MaskedRows::kZero : kernels::MaskedRows::kUniform;
        c.bf16 = n % 5 == 1;
        check_case(c);
        if (HasFatalFailure()) return;
        ++n;
      }
}

TEST(DecodeAttention, LongCacheSplitAcrossThreads) {
  for (bool bf16 : {false, true})
    for (int64_t T : {1, 4}) {
      Case c;
      c.batch = 2, c.heads = 2, c.T = T, c.S = 5000, c.D = 128, c.Dv = 128;
      c.lens = T == 1 ? Case::kNone : Case::kPerQuery;
      c.bf16 = bf16;
      check_case(c, {2, 3});
    }
}

TEST(DecodeAttention, HeadWidthsAndMaskedRows) {
  for (int64_t D = 1; D <= 40; D += 3)
    for (auto policy : {kernels::MaskedRows::kUniform, kernels::MaskedRows::kZero}) {
      Case c;
      c.batch = 2, c.heads = 2, c.T = 3, c.S = 37, c.D = D, c.Dv = 41 - D;
      c.lens = Case::kWithZero, c.policy = policy;
      check_case(c);
    }
}

TEST(DecodeAttention, EverySimdTarget) {
  for (int64_t target : cpu::flash_attention_targets()) {
    SCOPED_TRACE(cpu::flash_attention_target_name(target));
    for (bool bf16 : {false, true}) {
      Case c;
      c.batch = 2, c.heads = 3, c.T = 5, c.S = 290, c.D = 33, c.Dv = 24;
      c.lens = Case::kPerQuery, c.bf16 = bf16, c.simd_targets = target;
      check_case(c);
    }
  }
}

// Context::kernel_targets reaches the decode kernel through the op (the one builder of the
// kernel arguments, ops/attention_kernel.hpp; the decode path once built its own and dropped the
// field): the op's output at each target is bitwise the kernel's at that target.
TEST(DecodeAttention, OpHonorsContextKernelTargets) {
  Case c;
  c.batch = 2, c.heads = 3, c.T = 2, c.S = 150, c.D = 33, c.Dv = 24;
  Data data(c);
  const int64_t H = c.heads;
  const Tensor q =
      Tensor::wrap(data.q.data(), {c.batch, c.T, H * c.D}, DType::F32, {c.T * data.qw, data.qw, 1});
  const Tensor k = Tensor::wrap(data.k32.data(), {c.batch, c.S, H * c.D}, DType::F32,
                                {data.cap * H * c.D, H * c.D, 1});
  const Tensor v = Tensor::wrap(data.v32.data(), {c.batch, c.S, H * c.Dv}, DType::F32,
                                {data.cap * H * c.Dv, H * c.Dv, 1});
  std::vector<std::vector<float>> by_target;
  for (int64_t target : cpu::flash_attention_targets()) {
    SCOPED_TRACE(cpu::flash_attention_target_name(target));
    Context ctx;
    ctx.kernel_targets = target;
    const AttentionResult r = detail::multi_head_decode_attention(ctx, q, k, v, H, {});
    Case ck = c;
    ck.simd_targets = target;
    Data direct(ck);
    const std::vector<float> want = direct.run(ctx.resolved_threads());
    // The kernel's out then lse, as Data::run returns them.
    std::vector<float> got(r.output.data<float>(), r.output.data<float>() + r.output.numel());
    got.insert(got.end(), r.logsumexp.data<float>(),
               r.logsumexp.data<float>() + r.logsumexp.numel());
    ASSERT_EQ(got.size(), want.size());
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
    by_target.push_back(got);
    // Every entry's problem comes from the one builder, which copies the Context's switches.
    const kernels::AttentionProblem p =
        detail::attention_problem(ctx, {1, 1, 1, 1, 1, 1}, {}, AttentionOptions{}, 0);
    EXPECT_EQ(p.simd_targets, target);
  }
  // The check above can only fail if the targets differ in some bit, which they do here (their
  // reductions have different widths); say so if a change ever makes them agree.
  bool differ = false;
  for (size_t i = 1; i < by_target.size(); ++i)
    differ |= std::memcmp(by_target[i].data(), by_target[0].data(),
                          by_target[0].size() * sizeof(float)) != 0;
  if (!differ) GTEST_SKIP() << "every target gives the same bits: the test cannot tell them apart";
}

// A bfloat16 cache of the benchmark's head width (D = 64: whole vectors on every target) on every
// target, every T, and head counts 1 and 3 with V widths 32 and 48.
TEST(DecodeAttention, Bf16CacheEveryTargetAndQueryCount) {
  for (int64_t target : cpu::flash_attention_targets()) {
    SCOPED_TRACE(cpu::flash_attention_target_name(target));
    for (int64_t T = 1; T <= 8; ++T)
      for (int64_t heads : {1, 3}) {
        Case c;
        c.batch = 2, c.heads = heads, c.T = T, c.S = 150, c.D = 64, c.Dv = T % 2 ? 32 : 48;
        c.lens = T % 3 ? Case::kPerQuery : Case::kRagged, c.bf16 = true, c.simd_targets = target;
        check_case(c);
        if (HasFatalFailure()) return;
      }
  }
}

// The AVX-512 bfloat16 paths (QDotKBf16Pairs: D a multiple of 32, keys in transposed groups of 16;
// WeightedSumVBf16: Dv a multiple of 32 or 64) against the reference on the best target (AVX-512
// where the CPU has it; elsewhere the generic paths on the same shapes): groups cut by the cache
// length and the kept-key limits (S = 1, 15, 16, 17, 100, 130, 257), D = 32, 64, 96, 128 beside
// Dv = 64, 96, D and a generic 40, every T, 1-3 heads.
TEST(DecodeAttention, Bf16PairPathsAcrossGroupBoundaries) {
  int n = 0;
  for (int64_t T = 1; T <= 8; ++T)
    for (int64_t S : {1, 15, 16, 17, 100, 130, 257})
      for (int64_t D : {32, 64, 96, 128}) {
        if ((T + S + D / 32) % 3 != 0) continue;  // a third of the grid
        Case c;
        c.batch = 1 + n % 2, c.heads = 1 + n % 3, c.T = T, c.S = S, c.D = D;
        c.Dv = n % 4 == 0 ? 64 : n % 4 == 1 ? 96 : n % 4 == 2 ? D : 40;
        c.lens = static_cast<Case::Lens>(n % 4);
        c.causal = n % 7 == 3;
        c.policy = n % 2 ? kernels::MaskedRows::kZero : kernels::MaskedRows::kUniform;
        c.bf16 = true;
        check_case(c);
        if (HasFatalFailure()) return;
        ++n;
      }
}

TEST(DecodeAttention, RejectsWhatItDoesNotServe) {
  Case c;
  c.T = 2, c.S = 5;
  Data data(c);
  auto a = data.args(data.k32, data.v32, nullptr, 1);
  a.T = 9;
  EXPECT_THROW(cpu::decode_attention(a), Error);
  a.T = 2, a.dropout = 0.1f;
  EXPECT_THROW(cpu::decode_attention(a), Error);
  a.dropout = 0.0f, a.k.sd = 2;
  EXPECT_THROW(cpu::decode_attention(a), Error);
}

}  // namespace
}  // namespace attn
