// The CUDA GEMM (cuBLASLt) and row/elementwise ops against the CPU references: every comparison
// prints its shape and largest error. Skips visibly without a GPU.
#include "cuda_testing.hpp"
#include "kernels/cuda/kernels.hpp"
#include "kernels/ref/dropout.hpp"
#include "kernels/ref/embedding.hpp"
#include "kernels/ref/layer_norm.hpp"
#include "kernels/ref/loss.hpp"
#include "kernels/ref/masked_softmax.hpp"
#include "kernels/ref/positional.hpp"

#include "attn/core/rng.hpp"
#include "attn/cuda/graph.hpp"
#include "attn/nn/optim.hpp"

#include <fmt/format.h>

namespace attn::cuda {
namespace {

using namespace testing;

std::vector<double> random(size_t n, uint64_t seed, double lo = -1, double hi = 1) {
  Rng rng(seed);
  std::vector<double> v(n);
  for (auto& x : v)
    x = static_cast<float>(rng.uniform(lo, hi));
  return v;
}

TEST(CudaGemm, Fp32AndBf16MatchTheHostProduct) {
  ATTN_SKIP_WITHOUT_GPU();
  for (bool bf16 : {false, true})
    for (auto [M, N, K] : {std::array<int64_t, 3>{1, 1, 1},
                           {7, 5, 3},
                           {64, 64, 64},
                           {128, 384, 128},
                           {4096, 128, 256},
                           {33, 1000, 130}})
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (int with_bias = 0; with_bias < 2; ++with_bias) {
            const int64_t lda = ta ? M : K, ldb = tb ? K : N;
            std::vector<double> A = random(static_cast<size_t>(M * K), 1),
                                B = random(static_cast<size_t>(K * N), 2),
                                bias = random(static_cast<size_t>(N), 3);
            if (bf16)
              for (auto* x : {&A, &B, &bias})
                for (auto& e : *x)
                  e = bf16_widen(bf16_round(static_cast<float>(e)));
            std::vector<double> want(static_cast<size_t>(M * N));
            for (int64_t m = 0; m < M; ++m)
              for (int64_t n = 0; n < N; ++n) {
                double acc = with_bias ? bias[n] : 0.0;
                for (int64_t k = 0; k < K; ++k)
                  acc += (ta ? A[k * lda + m] : A[m * lda + k]) *
                         (tb ? B[n * ldb + k] : B[k * ldb + n]);
                want[m * N + n] = acc;
              }
            Tensor a = bf16 ? upload(to_bf16(A)) : upload(to_f32(A));
            Tensor b = bf16 ? upload(to_bf16(B)) : upload(to_f32(B));
            Tensor bs = bf16 ? upload(to_bf16(bias)) : upload(to_f32(bias));
            Tensor c = empty({M * N}, bf16 ? DType::BF16 : DType::F32);
            GemmArgs g;
            g.type = bf16 ? GemmType::kBF16 : GemmType::kF32;
            g.M = M;
            g.N = N;
            g.K = K;
            g.trans_a = ta;
            g.trans_b = tb;
            g.A = a.raw_data();
            g.B = b.raw_data();
            g.C = c.raw_data();
            g.bias = with_bias ? bs.raw_data() : nullptr;
            g.lda = lda;
            g.ldb = ldb;
            g.ldc = N;
            gemm(g, nullptr);
            const std::vector<double> got = bf16 ? widen(download<uint16_t>(c, want.size()))
                                                 : widen(download<float>(c, want.size()));
            // fp32 without TF32: K-term sums in float; bf16: the output's rounding dominates.
            expect_close(fmt::format("gemm {} M{} N{} K{} ta{} tb{} bias{}", bf16 ? "bf16" : "f32",
                                     M, N, K, ta, tb, with_bias),
                         got, want, bf16 ? 1e-2 : 1e-5, bf16 ? 1e-2 : 1e-5 * std::sqrt(double(K)));
          }
}

// Strided batches (the training step's attention as GEMMs): matrix i of each operand `stride`
// elements after matrix i - 1, with padding between matrices, every transpose combination.
TEST(CudaGemm, StridedBatchesMatchTheHostProducts) {
  ATTN_SKIP_WITHOUT_GPU();
  const int64_t batch = 5, M = 19, N = 23, K = 11;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      const int64_t lda = ta ? M : K, ldb = tb ? K : N;
      const int64_t sa = M * K + 3, sb = K * N + 5, sc = M * N + 7;
      const std::vector<double> A = random(static_cast<size_t>(batch * sa), 4),
                                B = random(static_cast<size_t>(batch * sb), 5);
      std::vector<double> want(static_cast<size_t>(batch * sc), 0.0);
      for (int64_t i = 0; i < batch; ++i)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            double acc = 0;
            for (int64_t k = 0; k < K; ++k)
              acc += (ta ? A[i * sa + k * lda + m] : A[i * sa + m * lda + k]) *
                     (tb ? B[i * sb + n * ldb + k] : B[i * sb + k * ldb + n]);
            want[i * sc + m * N + n] = 0.5 * acc;
          }
      Tensor a = upload(to_f32(A)), b = upload(to_f32(B));
      Tensor c = upload(std::vector<float>(want.size(), 0.0f));
      GemmArgs g;
      g.M = M;
      g.N = N;
      g.K = K;
      g.trans_a = ta;
      g.trans_b = tb;
      g.A = a.raw_data();
      g.B = b.raw_data();
      g.C = c.raw_data();
      g.lda = lda;
      g.ldb = ldb;
      g.ldc = N;
      g.alpha = 0.5f;
      g.batch = batch;
      g.stride_a = sa;
      g.stride_b = sb;
      g.stride_c = sc;
      gemm(g, nullptr);
      // The padding between C's matrices stays 0 (the want vector's zeros there).
      expect_close(fmt::format("batched gemm x{} M{} N{} K{} ta{} tb{}", batch, M, N, K, ta, tb),
                   widen(download<float>(c, want.size())), want, 1e-5, 1e-5);
    }
}

TEST(CudaOps, DropoutDrawsTheCpuMaskBitForBit) {
  ATTN_SKIP_WITHOUT_GPU();
  for (int64_t n : {1, 3, 4, 1000, 100003}) {
    std::vector<float> x = to_f32(random(static_cast<size_t>(n), 4));
    ref::DropoutSpec spec;
    spec.active = true;
    spec.p = 0.1;
    spec.seed = 99;
    spec.offset = 7;
    spec.index_base = 12;
    std::vector<float> want(x.size());
    ref::dropout_forward<float>(x.data(), want.data(), n, spec);
    Tensor dx = upload(x), dy = empty({n}, DType::F32);
    dropout_forward(ptr<float>(dx), ptr<float>(dy), n, 0.1f, 99, 7, 12, nullptr);
    const std::vector<float> got = download<float>(dy, x.size());
    int64_t mismatches = 0;
    for (int64_t i = 0; i < n; ++i)
      mismatches += (got[i] == 0.0f) != (want[i] == 0.0f);
    std::printf("  dropout n%-8lld mask mismatches %lld\n", static_cast<long long>(n),
                static_cast<long long>(mismatches));
    EXPECT_EQ(mismatches, 0) << "n " << n;
    expect_close(fmt::format("dropout n{}", n), widen(got), widen(want), 1e-6, 0);
  }
}

TEST(CudaOps, EmbeddingAndPositionalEncoding) {
  ATTN_SKIP_WITHOUT_GPU();
  const int64_t V = 50, E = 33, N = 200;
  std::vector<float> w = to_f32(random(static_cast<size_t>(V * E), 5)),
                     dout = to_f32(random(static_cast<size_t>(N * E), 6));
  std::vector<int64_t> ids(N);
  Rng rng(8);
  for (auto& i : ids)
    i = static_cast<int64_t>(rng.below(V));
  std::vector<float> want(N * E), dw_want(V * E);
  ref::embedding_forward<int64_t, float>(ids.data(), w.data(), want.data(), N, E);
  ref::embedding_backward<int64_t, float>(dout.data(), ids.data(), dw_want.data(), N, V, E);
  Tensor dw = upload(w), did = upload(ids), dout_d = upload(dout), out = empty({N * E}, DType::F32);
  Tensor dwg = zeros({V * E}, DType::F32);
  embedding_forward(ptr<int64_t>(did), ptr<float>(dw), ptr<float>(out), N, E, nullptr);
  embedding_backward(ptr<float>(dout_d), ptr<int64_t>(did), ptr<float>(dwg), N, E, nullptr);
  expect_close("embedding forward", widen(download<float>(out, want.size())), widen(want), 0, 0);
  expect_close("embedding backward", widen(download<float>(dwg, dw_want.size())), widen(dw_want),
               1e-6, 1e-6);
  for (auto [P, D] : {std::array<int64_t, 2>{128, 32}, {1000, 129}}) {
    std::vector<float> pe(P * D);
    ref::sinusoidal_exact<float>(pe.data(), P, D);
    Tensor pd = empty({P * D}, DType::F32);
    sinusoidal_encoding(ptr<float>(pd), P, D, nullptr);
    expect_close(fmt::format("sinusoidal P{} D{}", P, D), widen(download<float>(pd, pe.size())),
                 widen(pe), 0, 1e-6);
  }
}

TEST(CudaOps, LayerNormAndAddNormForwardBackward) {
  ATTN_SKIP_WITHOUT_GPU();
  for (auto [R, E] : {std::array<int64_t, 2>{1, 1}, {7, 33}, {4096, 128}, {3, 1000}, {20001, 40}})
    for (bool add : {false, true}) {
      const size_t n = static_cast<size_t>(R * E);
      std::vector<double> x = random(n, 9, -2, 3), res = random(n, 10), dy = random(n, 11),
                          gamma = random(static_cast<size_t>(E), 12),
                          beta = random(static_cast<size_t>(E), 13);
      std::vector<double> sum = x;
      if (add)
        for (size_t i = 0; i < n; ++i)
          sum[i] = static_cast<float>(x[i] + res[i]);
      std::vector<double> y(n), mean(R), rstd(R), dx(n), dg(E), db(E);
      ref::layer_norm_forward<double>(sum.data(), gamma.data(), beta.data(), y.data(), mean.data(),
                                      rstd.data(), R, E, 1e-5);
      ref::layer_norm_backward<double>(dy.data(), sum.data(), gamma.data(), mean.data(),
                                       rstd.data(), dx.data(), dg.data(), db.data(), R, E);
      Tensor dx_d = upload(to_f32(x)), res_d = upload(to_f32(res)), g_d = upload(to_f32(gamma)),
             b_d = upload(to_f32(beta)), dy_d = upload(to_f32(dy));
      Tensor y_d = empty({R * E}, DType::F32), s_d = empty({R * E}, DType::F32),
             m_d = empty({R}, DType::F32), r_d = empty({R}, DType::F32),
             gx = empty({R * E}, DType::F32), gg = empty({E}, DType::F32),
             gb = empty({E}, DType::F32);
      layer_norm_forward(ptr<float>(dx_d), add ? ptr<float>(res_d) : nullptr,
                         add ? ptr<float>(s_d) : nullptr, ptr<float>(g_d), ptr<float>(b_d),
                         ptr<float>(y_d), ptr<float>(m_d), ptr<float>(r_d), R, E, 1e-5f, nullptr);
      const float* xin = add ? ptr<float>(s_d) : ptr<float>(dx_d);
      layer_norm_backward(ptr<float>(dy_d), xin, ptr<float>(g_d), ptr<float>(m_d), ptr<float>(r_d),
                          ptr<float>(gx), ptr<float>(gg), ptr<float>(gb), R, E, nullptr);
      const std::string tag = fmt::format("{} R{} E{}", add ? "add_norm" : "layer_norm", R, E);
      expect_close(tag + " y", widen(download<float>(y_d, n)), y, 1e-5, 1e-5);
      expect_close(tag + " dx", widen(download<float>(gx, n)), dx, 1e-4, 1e-5);
      expect_close(tag + " dgamma", widen(download<float>(gg, E)), dg, 1e-4, 1e-5);
      expect_close(tag + " dbeta", widen(download<float>(gb, E)), db, 1e-4, 1e-5);
      // The chunked parameter sums (the training step's): rows in chunks side by side.
      Tensor scratch = empty({2 * kLayerNormChunks * E}, DType::F32);
      layer_norm_param_grads(ptr<float>(dy_d), xin, ptr<float>(m_d), ptr<float>(r_d),
                             ptr<float>(gg), ptr<float>(gb), R, E, ptr<float>(scratch), nullptr);
      expect_close(tag + " dgamma (chunked)", widen(download<float>(gg, E)), dg, 1e-4, 1e-5);
      expect_close(tag + " dbeta (chunked)", widen(download<float>(gb, E)), db, 1e-4, 1e-5);
    }
}

TEST(CudaOps, MaskedSoftmaxForwardBackward) {
  ATTN_SKIP_WITHOUT_GPU();
  for (auto policy : {kernels::MaskedRows::kUniform, kernels::MaskedRows::kZero})
    for (auto [R, S] : {std::array<int64_t, 2>{5, 1}, {64, 17}, {512, 128}, {3, 3000}}) {
      const size_t n = static_cast<size_t>(R * S);
      std::vector<double> x = random(n, 14, -5, 5), dy = random(n, 15);
      std::vector<int32_t> kept(R);
      Rng rng(16);
      for (auto& k : kept)
        k = static_cast<int32_t>(rng.below(static_cast<uint64_t>(S + 1)));
      kept[0] = 0;
      std::vector<double> y(n), dx(n);
      ref::masked_softmax_forward<double>(x.data(), y.data(), kept.data(), policy, R, S);
      ref::masked_softmax_backward<double>(dy.data(), y.data(), dx.data(), kept.data(), R, S);
      Tensor xd = upload(to_f32(x)), dyd = upload(to_f32(dy)), kd = upload(kept),
             yd = empty({R * S}, DType::F32), dxd = empty({R * S}, DType::F32);
      masked_softmax_forward(ptr<float>(xd), ptr<float>(yd), ptr<int32_t>(kd), policy, R, S,
                             nullptr);
      masked_softmax_backward(ptr<float>(dyd), ptr<float>(yd), ptr<float>(dxd), ptr<int32_t>(kd), R,
                              S, nullptr);
      const std::string tag = fmt::format("masked_softmax R{} S{} policy{}", R, S, int(policy));
      expect_close(tag + " y", widen(download<float>(yd, n)), y, 1e-5, 1e-6);
      expect_close(tag + " dx", widen(download<float>(dxd, n)), dx, 1e-4, 1e-6);
      // The fused softmax + dropout rows (the training step's): y as above, y * Z with the
      // dropout stream's element r * S + s at the offset read on the device, and the backward of
      // dy = dyd * Z through the same y.
      const float p = 0.3f;
      const uint64_t seed = 21, offset = 4;
      std::vector<double> yz(n), dyz(n), dxz(n);
      for (size_t i = 0; i < n; ++i) {
        const double z = dropout_factor(seed, 2 + offset, i, p);
        yz[i] = static_cast<float>(y[i]) * z;
        dyz[i] = static_cast<float>(dy[i]) * z;
      }
      ref::masked_softmax_backward<double>(dyz.data(), y.data(), dxz.data(), kept.data(), R, S);
      Tensor base = upload(std::vector<uint64_t>{2}), pd = empty({R * S}, DType::F32);
      softmax_dropout_forward(ptr<float>(xd), ptr<float>(yd), ptr<float>(pd), ptr<int32_t>(kd),
                              policy, R, S, p, seed, ptr<const uint64_t>(base), offset, nullptr);
      softmax_dropout_backward(ptr<float>(dyd), ptr<float>(yd), ptr<float>(dxd), ptr<int32_t>(kd),
                               R, S, p, seed, ptr<const uint64_t>(base), offset, nullptr);
      expect_close(tag + " fused y", widen(download<float>(yd, n)), y, 1e-5, 1e-6);
      expect_close(tag + " fused y*Z", widen(download<float>(pd, n)), yz, 1e-5, 1e-6);
      expect_close(tag + " fused dx", widen(download<float>(dxd, n)), dxz, 1e-4, 1e-6);
    }
}

TEST(CudaOps, CrossEntropyForwardBackward) {
  ATTN_SKIP_WITHOUT_GPU();
  for (auto [N, V] : {std::array<int64_t, 2>{1, 2}, {4096, 2}, {100, 10000}}) {
    std::vector<double> logits = random(static_cast<size_t>(N * V), 17, -4, 4);
    std::vector<int64_t> targets(N);
    std::vector<uint8_t> keep(N);
    Rng rng(18);
    for (int64_t i = 0; i < N; ++i) {
      targets[i] = static_cast<int64_t>(rng.below(V));
      keep[i] = rng.below(5) != 0;
    }
    double total = ref::cross_entropy_forward<int64_t, double>(logits.data(), targets.data(),
                                                               keep.data(), N, V);
    std::vector<double> dl(N * V);
    ref::cross_entropy_backward<int64_t, double>(logits.data(), targets.data(), keep.data(),
                                                 dl.data(), N, V, 0.5);
    Tensor ld = upload(to_f32(logits)), td = upload(targets), kd = upload(keep),
           loss = empty({N}, DType::F32), dld = empty({N * V}, DType::F32);
    cross_entropy_forward(ptr<float>(ld), ptr<int64_t>(td), ptr<uint8_t>(kd), ptr<float>(loss), N,
                          V, nullptr);
    cross_entropy_backward(ptr<float>(ld), ptr<int64_t>(td), ptr<uint8_t>(kd), ptr<float>(dld), N,
                           V, 0.5f, nullptr);
    double got = 0;
    for (float l : download<float>(loss, N))
      got += l;
    const std::string tag = fmt::format("cross_entropy N{} V{}", N, V);
    expect_close(tag + " loss sum", {got}, {total}, 1e-5, 1e-5);
    expect_close(tag + " dlogits", widen(download<float>(dld, dl.size())), dl, 1e-5, 1e-7);
  }
}

TEST(CudaOps, AdamWIsTheCpuStepBitForBit) {
  ATTN_SKIP_WITHOUT_GPU();
  const int64_t n = 100003;
  std::vector<double> w0 = random(n, 19);
  nn::Parameter p;
  p.value = Tensor::from_vector(w0, {n});
  p.grad = Tensor::zeros({n});
  nn::AdamWOptions o;
  nn::AdamW cpu({{"w", &p}}, o);
  Tensor w = upload(to_f32(w0)), m = zeros({n}, DType::F32), v = zeros({n}, DType::F32);
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> g = to_f32(random(n, 20 + step, -0.1, 0.1));
    std::memcpy(p.grad.raw_data(), g.data(), g.size() * 4);
    cpu.step();
    Tensor gd = upload(g);
    AdamWStep s;
    s.lr = o.lr;
    s.beta1 = o.beta1;
    s.beta2 = o.beta2;
    s.eps = o.eps;
    s.weight_decay = o.weight_decay;
    s.step = step;
    if (step % 2 == 1) {
      adamw_update(ptr<float>(w), ptr<float>(gd), ptr<float>(m), ptr<float>(v), n, s, nullptr);
    } else {  // the scalars from device memory, as a captured training step reads them
      const AdamWElement e = adamw_element(s);
      std::vector<AdamWElement> one{e};
      Tensor ed = upload(one);
      adamw_update(ptr<float>(w), ptr<float>(gd), ptr<float>(m), ptr<float>(v), n,
                   ptr<const AdamWElement>(ed), nullptr, nullptr);
      synchronize(nullptr);
    }
    const std::vector<float> got = download<float>(w, n);
    int64_t differ = 0;
    for (int64_t j = 0; j < n; ++j)
      differ += got[j] != p.value.data<float>()[j];
    std::printf("  adamw step %d: %lld of %lld weights differ from the CPU's bits\n", step,
                static_cast<long long>(differ), static_cast<long long>(n));
    EXPECT_EQ(differ, 0) << "step " << step;
  }
  Tensor sq = empty({1}, DType::F64), scratch = empty({kSumSquaresScratch}, DType::F64);
  sum_squares(ptr<float>(w), n, ptr<double>(sq), ptr<double>(scratch), nullptr);
  double want = 0;
  const std::vector<float> wh = download<float>(w, n);
  for (float x : wh)
    want += double(x) * x;
  expect_close("sum_squares n100003", download<double>(sq, 1), {want}, 1e-12, 0);
  // Clipping to half the norm: every element times max_norm / (norm + 1e-6), rounded once.
  Tensor norm = empty({1}, DType::F64);
  const double max_norm = 0.5 * std::sqrt(want);
  clip_by_norm(ptr<float>(w), n, ptr<double>(sq), max_norm, ptr<double>(norm), nullptr);
  const std::vector<float> clipped = download<float>(w, n);
  const double got_sq = download<double>(sq, 1)[0];
  const double coef = max_norm / (std::sqrt(got_sq) + 1e-6);
  int64_t clip_differ = 0;
  for (int64_t j = 0; j < n; ++j)
    clip_differ += clipped[j] != static_cast<float>(wh[j] * coef);
  EXPECT_EQ(clip_differ, 0) << "clip_by_norm";
  EXPECT_EQ(download<double>(norm, 1)[0], std::sqrt(got_sq));
}

// A small step (AddNorm, dropout, AdamW on the result) captured once and replayed: the same bits
// as the same step run eagerly, and the graph is captured once for three runs.
TEST(CudaGraph, ReplayEqualsEagerSteps) {
  ATTN_SKIP_WITHOUT_GPU();
  const int64_t R = 256, E = 128, n = R * E;
  Stream stream;
  void* s = stream.handle();
  auto make = [&](uint64_t seed) {
    Tensor t = empty({n}, DType::F32, s);
    copy(t, Tensor::from_vector(to_f32(random(static_cast<size_t>(n), seed)), {n}), s);
    return t;
  };
  Tensor gamma = to_device(Tensor::full({E}, 1.0), s), beta = to_device(Tensor::zeros({E}), s);
  std::vector<float> results[2];
  for (int mode = 0; mode < 2; ++mode) {
    Tensor x = make(30), res = make(31), sum = empty({n}, DType::F32, s),
           y = empty({n}, DType::F32, s), mean = empty({R}, DType::F32, s),
           rstd = empty({R}, DType::F32, s), w = make(32), m = zeros({n}, DType::F32, s),
           v = zeros({n}, DType::F32, s);
    int64_t step = 0;
    AdamWStep opt;
    auto body = [&] {
      layer_norm_forward(ptr<float>(x), ptr<float>(res), ptr<float>(sum), ptr<float>(gamma),
                         ptr<float>(beta), ptr<float>(y), ptr<float>(mean), ptr<float>(rstd), R, E,
                         1e-5f, s);
      dropout_forward(ptr<float>(y), ptr<float>(y), n, 0.1f, 5, 0, 0, s);
      opt.step = 1;  // a graph replays the value captured: the step count is fixed in it
      adamw_update(ptr<float>(w), ptr<float>(y), ptr<float>(m), ptr<float>(v), n, opt, s);
    };
    if (mode == 0) {
      for (; step < 3; ++step)
        body();
    } else {
      GraphCache graphs(s);
      for (; step < 3; ++step)
        graphs.run({"step", {R, E}}, body);
      EXPECT_EQ(graphs.captures(), 1u);
      EXPECT_EQ(graphs.launches(), 3u);
    }
    stream.synchronize();
    results[mode] = download<float>(w, static_cast<size_t>(n));
  }
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i)
    differ += results[0][i] != results[1][i];
  std::printf("  graph replay vs eager: %lld of %lld weights differ\n",
              static_cast<long long>(differ), static_cast<long long>(n));
  EXPECT_EQ(differ, 0);
}

}  // namespace
}  // namespace attn::cuda
