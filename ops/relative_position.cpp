// rotary_embedding / _backward and alibi_slopes: validation, then the reference kernel
// (kernels/ref/relative_position.cpp).
#include "attn/ops/relative_position.hpp"

#include "kernels/ref/relative_position.hpp"
#include "ops/common.hpp"

#include <cmath>

namespace attn {
namespace {

Tensor rotate(const char* op, const Tensor& x, const RotaryOptions& opts, double sign) {
  detail::check_float_tensor(op, "x", x);
  detail::check_ndim(op, "x", x, 3, "(N, T, D)");
  check(x.dim(2) % 2 == 0, op,
        "x has shape {}: D = {} is odd, RoPE rotates pairs and needs an "
        "even width",
        shape_arg(x.shape()), x.dim(2));
  check(std::isfinite(opts.base) && opts.base > 0.0, op, "base is {}, expected a positive number",
        opts.base);
  check(opts.position_offset >= 0, op, "position_offset is {}, expected >= 0",
        opts.position_offset);
  const Tensor xc = x.contiguous();
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  detail::dispatch_float(x.dtype(), [&](auto zero) {
    using F = decltype(zero);
    ref::rotary_apply<F>(xc.data<F>(), y.data<F>(), x.dim(0), x.dim(1), x.dim(2), opts, sign);
  });
  return y;
}

}  // namespace

Tensor rotary_embedding(Context& ctx, const Tensor& x, const RotaryOptions& opts) {
  (void)ctx;
  return rotate("rotary_embedding", x, opts, 1.0);
}

Tensor rotary_embedding_backward(Context& ctx, const Tensor& dy, const RotaryOptions& opts) {
  (void)ctx;
  return rotate("rotary_embedding_backward", dy, opts, -1.0);
}

std::vector<double> alibi_slopes(int64_t num_heads) {
  check(num_heads >= 1, "alibi_slopes", "num_heads is {}, expected >= 1", num_heads);
  // Largest power of two n <= H: slopes 2^(-8/n), 2^(-16/n), ..., 2^(-8).
  int64_t n = 1;
  while (n * 2 <= num_heads)
    n *= 2;
  std::vector<double> m;
  for (int64_t h = 1; h <= n; ++h)
    m.push_back(std::exp2(-8.0 * static_cast<double>(h) / static_cast<double>(n)));
  // The rest: every other slope of 2n (the odd multiples of 8/(2n)), interleaving between the
  // existing ones, as the paper's reference code does.
  for (int64_t h = 1; static_cast<int64_t>(m.size()) < num_heads; h += 2)
    m.push_back(std::exp2(-8.0 * static_cast<double>(h) / static_cast<double>(2 * n)));
  return m;
}

}  // namespace attn
