// Reference linear layer, forward and backward side by side (see linear.hpp).
#include "kernels/ref/linear.hpp"

#include "attn/core/dtype.hpp"

#include <cmath>
#include <cstring>
#include <type_traits>

namespace attn::ref {

uint16_t double_to_bf16(double d) {
  // Rounding to float first and then to bf16 rounds twice, which differs from one rounding only
  // when the float lands exactly on a bf16 tie (low 16 bits 0x8000) that d itself is not on:
  // then d lies strictly on one side of the tie and decides the direction. float keeps bf16's
  // exponent range, so this also holds for subnormals and overflow (to infinity).
  const float f = static_cast<float>(d);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0xffffu) == 0x8000u && !std::isnan(d) && static_cast<double>(f) != d) {
    const bool away = std::abs(d) > std::abs(static_cast<double>(f));
    return static_cast<uint16_t>((u >> 16) + (away ? 1u : 0u));  // magnitude bits, sign kept
  }
  return float_to_bf16(f);
}

namespace {

// Element type -> double exactly; double -> element type with one rounding. uint16_t is bf16.
double widen(float v) {
  return v;
}
double widen(double v) {
  return v;
}
double widen(uint16_t v) {
  return bf16_to_float(v);
}
template <typename T>
T narrow(double v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return double_to_bf16(v);
  } else {
    return static_cast<T>(v);
  }
}

template <typename T>
void forward_impl(const T* x, const T* W, const T* b, T* y, int64_t N, int64_t I, int64_t O) {
  for (int64_t n = 0; n < N; ++n) {
    const T* xn = x + n * I;
    for (int64_t o = 0; o < O; ++o) {
      const T* wo = W + o * I;
      double acc = b != nullptr ? widen(b[o]) : 0.0;
      for (int64_t i = 0; i < I; ++i)
        acc += widen(xn[i]) * widen(wo[i]);
      y[n * O + o] = narrow<T>(acc);
    }
  }
}

template <typename T>
void backward_impl(const T* dy, const T* x, const T* W, T* dx, T* dW, T* db, int64_t N, int64_t I,
                   int64_t O) {
  // forward: y[n,o] = b[o] + sum_i x[n,i] W[o,i]
  // so:      dx[n,i] = sum_o dy[n,o] W[o,i]
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < I; ++i) {
      double acc = 0.0;
      for (int64_t o = 0; o < O; ++o)
        acc += widen(dy[n * O + o]) * widen(W[o * I + i]);
      dx[n * I + i] = narrow<T>(acc);
    }
  }
  //          dW[o,i] = sum_n dy[n,o] x[n,i]
  for (int64_t o = 0; o < O; ++o) {
    for (int64_t i = 0; i < I; ++i) {
      double acc = 0.0;
      for (int64_t n = 0; n < N; ++n)
        acc += widen(dy[n * O + o]) * widen(x[n * I + i]);
      dW[o * I + i] = narrow<T>(acc);
    }
  }
  //          db[o] = sum_n dy[n,o]
  if (db != nullptr) {
    for (int64_t o = 0; o < O; ++o) {
      double acc = 0.0;
      for (int64_t n = 0; n < N; ++n)
        acc += widen(dy[n * O + o]);
      db[o] = narrow<T>(acc);
    }
  }
}

}  // namespace

template <typename T>
void linear_forward(const T* x, const T* W, const T* b, T* y, int64_t N, int64_t I, int64_t O) {
  forward_impl(x, W, b, y, N, I, O);
}

template <typename T>
void linear_backward(const T* dy, const T* x, const T* W, T* dx, T* dW, T* db, int64_t N, int64_t I,
                     int64_t O) {
  backward_impl(dy, x, W, dx, dW, db, N, I, O);
}

void linear_forward_bf16(const uint16_t* x, const uint16_t* W, const uint16_t* b, uint16_t* y,
                         int64_t N, int64_t I, int64_t O) {
  forward_impl(x, W, b, y, N, I, O);
}

void linear_backward_bf16(const uint16_t* dy, const uint16_t* x, const uint16_t* W, uint16_t* dx,
                          uint16_t* dW, uint16_t* db, int64_t N, int64_t I, int64_t O) {
  backward_impl(dy, x, W, dx, dW, db, N, I, O);
}

template void linear_forward<float>(const float*, const float*, const float*, float*, int64_t,
                                    int64_t, int64_t);
template void linear_forward<double>(const double*, const double*, const double*, double*, int64_t,
                                     int64_t, int64_t);
template void linear_backward<float>(const float*, const float*, const float*, float*, float*,
                                     float*, int64_t, int64_t, int64_t);
template void linear_backward<double>(const double*, const double*, const double*, double*, double*,
                                      double*, int64_t, int64_t, int64_t);

}  // namespace attn::ref
