// Helpers of the GPU tests: a visible skip without a GPU, device buffers filled from host vectors,
// and the error summary every comparison prints (shape and largest error), so that one run on a
// GPU machine reports every failing case rather than the first.
#pragma once

#include "attn/cuda/runtime.hpp"
#include "kernels/cuda/device_math.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace attn::cuda::testing {

#define ATTN_SKIP_WITHOUT_GPU()                                                                 \
  do {                                                                                          \
    if (::attn::cuda::device_count() == 0)                                                      \
      GTEST_SKIP() << "no CUDA device here (no driver or no GPU); run scripts/gpu-check.sh on " \
                      "a GPU machine";                                                          \
  } while (0)

// A device copy of a host vector (any trivially copyable element type), and back.
template <class T>
Tensor upload(const std::vector<T>& v) {
  Tensor host = Tensor::empty({static_cast<int64_t>((v.size() * sizeof(T) + 3) / 4)}, DType::I32);
  if (!v.empty()) std::memcpy(host.raw_data(), v.data(), v.size() * sizeof(T));
  return to_device(host);
}
template <class T>
std::vector<T> download(const Tensor& dev, size_t n) {
  Tensor host = to_host(dev);
  std::vector<T> v(n);
  if (n) std::memcpy(v.data(), host.raw_data(), n * sizeof(T));
  return v;
}
template <class T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.raw_data());
}

inline std::vector<uint16_t> to_bf16(const std::vector<double>& v) {
  std::vector<uint16_t> r(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    r[i] = bf16_round(static_cast<float>(v[i]));
  return r;
}
inline std::vector<float> to_f32(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}
inline std::vector<double> widen(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}
inline std::vector<double> widen(const std::vector<uint16_t>& v) {
  std::vector<double> r(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    r[i] = bf16_widen(v[i]);
  return r;
}

// Largest |got - want| and the largest |want|; `what` names the case for the report.
struct ErrorReport {
  double max_err = 0, max_ref = 0;
  bool nan = false;
};
inline ErrorReport compare(const std::vector<double>& got, const std::vector<double>& want) {
  ErrorReport r;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(want[i])) r.nan = true;
    if (std::isnan(got[i]) || std::isnan(want[i])) continue;
    r.max_err = std::max(r.max_err, std::abs(got[i] - want[i]));
    r.max_ref = std::max(r.max_ref, std::abs(want[i]));
  }
  return r;
}
// Checks max error <= atol + rtol * max |want| (a norm-relative bound, as the bf16 tests on the
// CPU use) and prints one line per comparison either way.
inline void expect_close(const std::string& what, const std::vector<double>& got,
                         const std::vector<double>& want, double rtol, double atol) {
  const ErrorReport r = compare(got, want);
  const double bound = atol + rtol * r.max_ref;
  std::printf("  %-60s max err %.3g (bound %.3g, max |ref| %.3g)%s\n", what.c_str(), r.max_err,
              bound, r.max_ref, r.nan ? " NaN MISMATCH" : "");
  EXPECT_EQ(got.size(), want.size()) << what;
  EXPECT_FALSE(r.nan) << what << ": NaN where the reference has none (or the reverse)";
  EXPECT_LE(r.max_err, bound) << what;
}

}  // namespace attn::cuda::testing
