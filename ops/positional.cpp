// sinusoidal_encoding: validation, then the reference kernel (kernels/ref/positional.cpp).
#include "attn/ops/positional.hpp"

#include "kernels/ref/positional.hpp"
#include "ops/common.hpp"

#include <cmath>

namespace attn {

Tensor sinusoidal_encoding(int64_t positions, int64_t dim, DType dtype,
                           std::optional<SinusoidalMode> mode) {
  constexpr const char* op = "sinusoidal_encoding";
  check(positions >= 0, op, "positions is {}, expected >= 0", positions);
  check(dim >= 1, op, "dim is {}, expected >= 1", dim);
  check(dtype == DType::F32 || dtype == DType::F64, op, "dtype {} requested, expected F32 or F64",
        dtype_name(dtype));
  const SinusoidalMode m =
      mode.value_or(dtype == DType::F32 ? SinusoidalMode::kMatchD2l : SinusoidalMode::kExact);
  Tensor P = Tensor::empty({positions, dim}, dtype);
  detail::dispatch_float(dtype, [&](auto zero) {
    using F = decltype(zero);
    if (m == SinusoidalMode::kMatchD2l) {
      ref::sinusoidal_match_d2l<F>(P.data<F>(), positions, dim);
    } else {
      ref::sinusoidal_exact<F>(P.data<F>(), positions, dim);
    }
  });
  return P;
}

double sinusoidal_frequency(int64_t j, int64_t dim) {
  constexpr const char* op = "sinusoidal_frequency";
  check(dim >= 1, op, "dim is {}, expected >= 1", dim);
  check(j >= 0 && 2 * j < dim, op, "pair {} out of range, expected 0 <= j < ceil(dim / 2) = {}", j,
        (dim + 1) / 2);
  return 1.0 / std::pow(10000.0, static_cast<double>(2 * j) / static_cast<double>(dim));
}

}  // namespace attn
