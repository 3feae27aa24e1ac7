// Shared test helpers: random tensors, closeness with a readable failure, and central finite
// differences for gradient checks.
#pragma once

#include "attn/core/rng.hpp"
#include "attn/core/tensor.hpp"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>

namespace attn::testing {

// A path in the temporary directory named stem + "_" + this process's id, so that two test runs
// at once (two build trees, ctest -j) never write the same file.
inline std::filesystem::path temp_path(const std::string& stem) {
  return std::filesystem::temp_directory_path() / (stem + "_" + std::to_string(::getpid()));
}

// Uniform values in [lo, hi) from a seeded Philox stream (never all zeros).
inline Tensor random_tensor(const Shape& shape, DType dtype = DType::F64, uint64_t seed = 1,
                            double lo = -1.0, double hi = 1.0) {
  Tensor t = Tensor::empty(shape, dtype);
  Rng rng(seed, 0x7e57);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.set_flat(i, rng.uniform(lo, hi));
  return t;
}

// gtest assertion: |a - b| <= atol + rtol |b| element-wise, printing the first offender.
inline ::testing::AssertionResult close(const Tensor& a, const Tensor& b, double rtol,
                                        double atol) {
  std::string detail;
  if (allclose(a, b, rtol, atol, &detail)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << detail << " (rtol " << rtol << ", atol " << atol
                                       << ", max |diff| " << max_abs_diff(a, b) << ")";
}

// sum(a * b) over all elements, in double.
inline double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    s += a.flat(i) * b.flat(i);
  return s;
}

// Checks `analytic` = d loss / d x by central differences, perturbing x in place (x must be a
// float64 tensor that `loss` reads). Tolerance is relative to the gradient's scale.
inline ::testing::AssertionResult gradcheck(const std::function<double()>& loss, Tensor x,
                                            const Tensor& analytic, double eps = 1e-6,
                                            double tol = 1e-6) {
  if (x.shape() != analytic.shape())
    return ::testing::AssertionFailure() << "gradient shape " << shape_str(analytic.shape())
                                         << " differs from input " << shape_str(x.shape());
  double scale = 1.0;
  for (int64_t i = 0; i < analytic.numel(); ++i)
    scale = std::max(scale, std::abs(analytic.flat(i)));
  for (int64_t i = 0; i < x.numel(); ++i) {
    double orig = x.flat(i);
    x.set_flat(i, orig + eps);
    double up = loss();
    x.set_flat(i, orig - eps);
    double down = loss();
    x.set_flat(i, orig);
    double numeric = (up - down) / (2 * eps);
    double a = analytic.flat(i);
    if (!(std::abs(numeric - a) <= tol * scale))
      return ::testing::AssertionFailure() << "element " << i << ": analytic " << a << ", numeric "
                                           << numeric << " (tolerance " << tol * scale << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace attn::testing
