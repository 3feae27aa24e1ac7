// The training step's formerly serial parts, now threaded or vectorised, against the plain loops
// they replaced: the bias gradient's column sums (kernels/cpu/matmul), the float32 <-> bf16
// conversions of mixed precision (nn/internal.hpp's convert), the residual gradient sums
// (nn/transformer_internal.hpp's add_all), the position table's broadcast add (nn/positional.cpp),
// the embedding's row copies and gradient sums (ops/embedding.cpp against the reference kernel),
// the weight gradients' accumulation (nn/internal.hpp's accumulate), LayerNorm's sum of its
// per-chunk partials (kernels/cpu/encoder_ops.hpp) and clip_grad_norm's sum of squares
// (nn/optim.cpp).
// The first three are elementwise or keep each sum's order, so they must give the old bits for
// every thread count; clip_grad_norm's 8-lane sum changes the order, so it is checked against an
// exact (long double) sum within double rounding, and for its NaN / Inf rules, and its tasks of
// 16K elements (threaded) for the same bits on 1, 2 and 3 threads.
#include "attn/core/context.hpp"
#include "attn/nn/optim.hpp"
#include "attn/nn/positional.hpp"
#include "attn/ops/embedding.hpp"
#include "kernels/cpu/encoder_ops.hpp"
#include "kernels/cpu/matmul.hpp"
#include "kernels/cpu/parallel.hpp"
#include "nn/internal.hpp"
#include "nn/transformer_internal.hpp"
#include "testing.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace attn {
namespace {

using attn::testing::random_tensor;

// Bit-for-bit equality of two float tensors of one dtype and shape (NaN payloads included).
::testing::AssertionResult same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "shapes or dtypes differ";
  const Tensor ac = a.contiguous(), bc = b.contiguous();
  if (std::memcmp(ac.raw_data(), bc.raw_data(), ac.nbytes()) != 0) {
    for (int64_t i = 0; i < ac.numel(); ++i)
      if (ac.flat(i) != bc.flat(i) && !(std::isnan(ac.flat(i)) && std::isnan(bc.flat(i))))
        return ::testing::AssertionFailure()
               << "element " << i << ": " << ac.flat(i) << " vs " << bc.flat(i);
    return ::testing::AssertionFailure() << "NaN payloads differ";
  }
  return ::testing::AssertionSuccess();
}

// The column sums as the plain loop did them: row by row into doubles.
template <typename T>
std::vector<float> column_sum_loop(const T* dy, int64_t M, int64_t N, int64_t ld,
                                   const std::vector<float>& db0, bool accumulate) {
  std::vector<double> acc(static_cast<size_t>(N), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      if constexpr (std::is_same_v<T, uint16_t>) {
        acc[n] += bf16_to_float(dy[m * ld + n]);
      } else {
        acc[n] += dy[m * ld + n];
      }
    }
  std::vector<float> out(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n)
    out[n] = accumulate ? db0[n] + static_cast<float>(acc[n]) : static_cast<float>(acc[n]);
  return out;
}

TEST(ColumnSum, ThreadedBlocksGiveTheRowByRowLoopsBits) {
  // Sizes around the 32-column blocks and the threading threshold (M N >= 2^15), row strides
  // wider than N; values of mixed sign and magnitude so that the order of the sum shows.
  for (const auto& [M, N, pad] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {1, 1, 0}, {3, 31, 1}, {7, 33, 0}, {300, 127, 3}, {4096, 128, 0}, {1025, 97, 5}}) {
    const int64_t ld = N + pad;
    const Tensor x = random_tensor({M, ld}, DType::F32, static_cast<uint64_t>(M * 131 + N), -8, 8);
    std::vector<float> dy(static_cast<size_t>(M * ld));
    std::vector<uint16_t> dy16(dy.size());
    for (size_t i = 0; i < dy.size(); ++i) {
      const double v = x.flat(static_cast<int64_t>(i));
      dy[i] = static_cast<float>(v * std::ldexp(1.0, static_cast<int>(i % 23) - 11));
      dy16[i] = float_to_bf16(dy[i]);
    }
    const std::vector<float> db0(static_cast<size_t>(N), 0.375f);
    for (const bool accumulate : {false, true}) {
      const std::vector<float> want = column_sum_loop(dy.data(), M, N, ld, db0, accumulate);
      const std::vector<float> want16 = column_sum_loop(dy16.data(), M, N, ld, db0, accumulate);
      for (const int threads : {1, 2, 3}) {
        std::vector<float> got = db0, got16 = db0;
        cpu::column_sum(dy.data(), M, N, ld, got.data(), accumulate, threads);
        cpu::column_sum(dy16.data(), M, N, ld, got16.data(), accumulate, threads);
        EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4))
            << M << "x" << N << " threads " << threads << " accumulate " << accumulate;
        EXPECT_EQ(0, std::memcmp(got16.data(), want16.data(), want16.size() * 4))
            << "bf16 " << M << "x" << N << " threads " << threads;
      }
    }
  }
}

TEST(Convert, ChunkedOnThreadsIsTensorTo) {
  for (const int64_t n :
       {int64_t{5}, int64_t{16383}, int64_t{16384}, int64_t{65536}, int64_t{200003}}) {
    Tensor x = random_tensor({n}, DType::F32, static_cast<uint64_t>(n), -1e3, 1e3);
    // Specials and halfway cases of the rounding.
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              -0.0f,
                              1.00390625f,  // 1 + 2^-8: halfway, rounds to even
                              1.01171875f,  // 1 + 3 2^-8: halfway, rounds up
                              std::numeric_limits<float>::denorm_min()};
    for (size_t i = 0; i < std::size(specials) && static_cast<int64_t>(i * 997) < n; ++i)
      x.data<float>()[i * 997] = specials[i];
    const Tensor x3 = x.reshape({1, n, 1});
    for (const int threads : {1, 2, 3}) {
      Context ctx;
      ctx.threads = threads;
      const Tensor b = nn::detail::convert(ctx, x3, DType::BF16);
      EXPECT_TRUE(same_bits(b, x3.to(DType::BF16))) << n << " threads " << threads;
      EXPECT_TRUE(same_bits(nn::detail::convert(ctx, b, DType::F32), b.to(DType::F32)))
          << n << " threads " << threads;
      // Same dtype, or a strided view: x.to's own result.
      EXPECT_TRUE(same_bits(nn::detail::convert(ctx, x3, DType::F32), x3));
      const Tensor strided = x.reshape({n, 1}).transpose(0, 1);
      EXPECT_TRUE(
          same_bits(nn::detail::convert(ctx, strided, DType::BF16), strided.to(DType::BF16)));
    }
  }
}

TEST(Accumulate, SplitOnThreadsIsTheElementwiseLoop) {
  for (const int64_t n :
       {int64_t{1}, int64_t{100}, int64_t{16383}, int64_t{16384}, int64_t{40001}}) {
    for (const DType src : {DType::F32, DType::BF16}) {
      const Tensor g =
          random_tensor({n}, DType::F32, static_cast<uint64_t>(7 + n), -10, 10).to(src);
      const Tensor grad0 = random_tensor({n}, DType::F32, static_cast<uint64_t>(11 + n), -10, 10);
      Tensor want = grad0.clone();  // grad += g element by element, as the plain loop did
      for (int64_t i = 0; i < n; ++i)
        want.data<float>()[i] += static_cast<float>(g.flat(i));
      for (const int threads : {1, 2, 3, 7}) {
        Tensor grad = grad0.clone();
        nn::detail::accumulate(grad, g, threads);
        EXPECT_TRUE(same_bits(grad, want))
            << n << " elements of " << dtype_name(src) << ", threads " << threads;
      }
    }
  }
  // A strided gradient takes the element-by-element path, whatever the threads.
  const Tensor g = random_tensor({10, 10}, DType::F32, 3, -1, 1).transpose(0, 1);
  Tensor grad = Tensor::zeros({100}, DType::F32), want = grad.clone();
  for (int64_t i = 0; i < 100; ++i)
    want.data<float>()[i] += static_cast<float>(g.flat(i));
  nn::detail::accumulate(grad, g, 2);
  EXPECT_TRUE(same_bits(grad, want));
}

TEST(LayerNormPartials, ChunkByChunkIsTheColumnByColumnSum) {
  for (const int64_t E : {int64_t{1}, int64_t{7}, int64_t{128}}) {
    for (const int64_t chunks : {int64_t{1}, int64_t{5}, int64_t{190}}) {
      const Tensor p = random_tensor({chunks * 2 * E}, DType::F64,
                                     static_cast<uint64_t>(E * 1000 + chunks), -1e3, 1e3);
      const double* partial = p.data<double>();
      std::vector<float> dgamma(static_cast<size_t>(E)), dbeta(static_cast<size_t>(E));
      cpu::layer_norm_sum_partials_f32(partial, chunks, E, dgamma.data(), dbeta.data());
      for (int64_t e = 0; e < E; ++e) {
        double g = 0.0, b = 0.0;  // the chunks in order, one column at a time
        for (int64_t c = 0; c < chunks; ++c) {
          g += partial[c * 2 * E + e];
          b += partial[c * 2 * E + E + e];
        }
        EXPECT_EQ(std::bit_cast<uint32_t>(dgamma[static_cast<size_t>(e)]),
                  std::bit_cast<uint32_t>(static_cast<float>(g)))
            << "E " << E << " chunks " << chunks << " e " << e;
        EXPECT_EQ(std::bit_cast<uint32_t>(dbeta[static_cast<size_t>(e)]),
                  std::bit_cast<uint32_t>(static_cast<float>(b)))
            << "E " << E << " chunks " << chunks << " e " << e;
      }
    }
  }
}

TEST(AddAll, ChunkedOnThreadsIsTheLeftToRightSum) {
  for (const int64_t n : {int64_t{7}, int64_t{16384}, int64_t{16385}, int64_t{100001}}) {
    for (const DType dt : {DType::F32, DType::F64}) {
      const Tensor a = random_tensor({n}, dt, 1, -1, 1), b = random_tensor({n}, dt, 2, -1e-3, 1);
      const Tensor c = random_tensor({n}, dt, 3, -1e3, 1e3), d = random_tensor({n}, dt, 4);
      // ((a + b) + c) + d element by element, in the tensor's precision.
      Tensor want = Tensor::empty({n}, dt);
      for (int64_t i = 0; i < n; ++i) {
        if (dt == DType::F32) {
          want.data<float>()[i] =
              ((a.data<float>()[i] + b.data<float>()[i]) + c.data<float>()[i]) + d.data<float>()[i];
        } else {
          want.data<double>()[i] =
              ((a.data<double>()[i] + b.data<double>()[i]) + c.data<double>()[i]) +
              d.data<double>()[i];
        }
      }
      for (const int threads : {1, 2, 3}) {
        EXPECT_TRUE(same_bits(nn::detail::add_all({a, b, c, d}, threads), want))
            << n << " threads " << threads;
        EXPECT_TRUE(same_bits(nn::detail::add_all({a}, threads), a));
        // A strided term is read through its contiguous copy.
        const Tensor at = a.reshape({n, 1}).transpose(0, 1).reshape({n});
        EXPECT_TRUE(
            same_bits(nn::detail::add_all({at, b}, threads), nn::detail::add_all({a, b}, 1)));
      }
    }
  }
}

TEST(PositionalEncoding, ThreadedAddIsXPlusTheTable) {
  // Large enough to run on threads (B T E >= 2^16), odd sizes; X contiguous and a view with
  // permuted batch / position strides.
  for (const DType dt : {DType::F32, DType::F64}) {
    nn::PositionalEncoding pe(131, 0.0, 1000, dt);
    pe.eval();
    const Tensor X = random_tensor({5, 103, 131}, dt, 7, -4, 4);
    const Tensor P = pe.P(103);
    Tensor want = Tensor::empty(X.shape(), dt);
    for (int64_t b = 0; b < 5; ++b)
      for (int64_t t = 0; t < 103; ++t)
        for (int64_t e = 0; e < 131; ++e) {
          const int64_t i = (b * 103 + t) * 131 + e;
          if (dt == DType::F32) {
            want.data<float>()[i] = X.data<float>()[i] + P.data<float>()[t * 131 + e];
          } else {
            want.data<double>()[i] = X.data<double>()[i] + P.data<double>()[t * 131 + e];
          }
        }
    const Tensor Xt = X.transpose(0, 1).contiguous().transpose(0, 1);  // same values
    for (const int threads : {1, 2, 3}) {
      Context ctx;
      ctx.threads = threads;
      EXPECT_TRUE(same_bits(pe.forward(ctx, X), want)) << "threads " << threads;
      EXPECT_TRUE(same_bits(pe.forward(ctx, Xt), want)) << "strided, threads " << threads;
    }
  }
}

TEST(Embedding, ThreadedIsTheReferenceKernel) {
  // Ids with many repeats (each gradient row sums many positions, in order), odd E, N E >= 2^16.
  const int64_t V = 50, E = 131;
  for (const DType id_dt : {DType::I32, DType::I64})
    for (const DType dt : {DType::F32, DType::F64}) {
      std::vector<int64_t> id_values(4 * 150);
      for (size_t i = 0; i < id_values.size(); ++i)
        id_values[i] = static_cast<int64_t>((i * 7919) % 97) % V;
      const Tensor ids = Tensor::from_vector(id_values, {4, 150}, id_dt);
      const Tensor W = random_tensor({V, E}, dt, 5), dout = random_tensor({4, 150, E}, dt, 6);
      Context ref;
      ref.backend = Backend::kReference;
      const Tensor want = embedding(ref, ids, W), dwant = embedding_backward(ref, dout, ids, V);
      for (const int threads : {1, 2, 3}) {
        Context ctx;
        ctx.threads = threads;
        EXPECT_TRUE(same_bits(embedding(ctx, ids, W), want)) << "threads " << threads;
        EXPECT_TRUE(same_bits(embedding_backward(ctx, dout, ids, V), dwant))
            << "threads " << threads;
      }
    }
}

TEST(ClipGradNorm, LaneSumIsTheExactSumWithinDoubleRounding) {
  // Parameters of odd sizes (lanes restart at each), float32 and float64, magnitudes spread over
  // many binades.
  std::vector<nn::Parameter> ps(5);
  const int64_t sizes[] = {1, 7, 1000, 12345, 9};
  long double exact = 0;
  nn::NamedParameters named;
  for (size_t k = 0; k < ps.size(); ++k) {
    const DType dt = k == 3 ? DType::F64 : DType::F32;
    ps[k].value = Tensor::zeros({sizes[k]}, dt);
    ps[k].grad = random_tensor({sizes[k]}, dt, 10 + k, -1, 1);
    for (int64_t j = 0; j < sizes[k]; ++j) {
      const double g = ps[k].grad.flat(j) * std::ldexp(1.0, static_cast<int>(j % 17) - 8);
      ps[k].grad.set_flat(j, g);
      const long double gd = ps[k].grad.flat(j);
      exact += gd * gd;
    }
    named.emplace_back("p" + std::to_string(k), &ps[k]);
  }
  const double norm = nn::clip_grad_norm(named, 1e30);
  const double want = static_cast<double>(std::sqrt(exact));
  // n terms summed in double: relative error <= ~n 2^-53 in the worst case; far tighter in
  // practice (8 lanes of ~2700 terms each, then a pairwise sum).
  EXPECT_NEAR(norm, want, 1e-12 * want);
  EXPECT_EQ(nn::clip_grad_norm(named, 1e30), norm);  // deterministic

  // Clipping scales every gradient by max_norm / (norm + 1e-6).
  const double before = ps[2].grad.flat(5);
  const double clipped = nn::clip_grad_norm(named, 0.5 * norm);
  EXPECT_EQ(clipped, norm);
  EXPECT_NEAR(ps[2].grad.flat(5), before * 0.5 * norm / (norm + 1e-6), 1e-7 * std::abs(before));

  // A NaN gradient makes the norm NaN, an infinite one infinite.
  ps[2].grad.set_flat(999, std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isinf(nn::clip_grad_norm(named, 1e30)));
  ps[2].grad.set_flat(3, std::numeric_limits<double>::quiet_NaN());
  EXPECT_TRUE(std::isnan(nn::clip_grad_norm(named, 1e30)));
}

TEST(ClipGradNorm, ThreadsChangeNoBit) {
  // Gradients cut into several 16K-element tasks (and odd tails), f32, f64 and bf16: the norm, L2
  // and max, and the clipped gradients are the same bits on 1, 2 and 3 threads, and the L2 norm
  // is the exact sum within double rounding.
  struct ForkAtAnySize {  // so that 1, 2 and 3 threads each take their own split here
    ForkAtAnySize() { cpu::set_min_flops_per_thread(0); }
    ~ForkAtAnySize() { cpu::set_min_flops_per_thread(cpu::kMinFlopsPerThread); }
  } fork_at_any_size;
  const int64_t sizes[] = {40000, 16384, 16385, 3, 70001};
  const DType dtypes[] = {DType::F32, DType::F32, DType::F64, DType::BF16, DType::F32};
  auto make = [&](std::vector<nn::Parameter>& ps, nn::NamedParameters& named) {
    ps.assign(std::size(sizes), nn::Parameter{});
    named.clear();
    for (size_t k = 0; k < ps.size(); ++k) {
      ps[k].value = Tensor::zeros({sizes[k]}, dtypes[k]);
      ps[k].grad = random_tensor({sizes[k]}, DType::F32, 40 + k, -1, 1).to(dtypes[k]);
      named.emplace_back("p" + std::to_string(k), &ps[k]);
    }
  };
  std::vector<nn::Parameter> one_ps;
  nn::NamedParameters one;
  make(one_ps, one);
  long double exact = 0;
  for (const auto& [n, p] : one)
    for (int64_t j = 0; j < p->grad.numel(); ++j)
      exact += static_cast<long double>(p->grad.flat(j)) * p->grad.flat(j);
  const double norm1 = nn::clip_grad_norm(one, 1e30, 2.0, 1);
  EXPECT_NEAR(norm1, static_cast<double>(std::sqrt(exact)), 1e-12 * norm1);
  const double max1 = nn::clip_grad_norm(one, 1e30, INFINITY, 1);
  nn::clip_grad_norm(one, 0.25 * norm1, 2.0, 1);  // clips
  for (int threads : {2, 3}) {
    std::vector<nn::Parameter> ps;
    nn::NamedParameters named;
    make(ps, named);
    EXPECT_EQ(nn::clip_grad_norm(named, 1e30, 2.0, threads), norm1) << "threads " << threads;
    EXPECT_EQ(nn::clip_grad_norm(named, 1e30, INFINITY, threads), max1) << "threads " << threads;
    nn::clip_grad_norm(named, 0.25 * norm1, 2.0, threads);
    for (size_t k = 0; k < ps.size(); ++k)
      EXPECT_TRUE(same_bits(ps[k].grad, one_ps[k].grad)) << "threads " << threads << " p" << k;
  }
}

}  // namespace
}  // namespace attn
