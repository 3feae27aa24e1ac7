// Shared validation and dispatch helpers for ops/*.cpp (internal; not installed).
#pragma once

#include "attn/core/error.hpp"
#include "attn/core/tensor.hpp"

#include <utility>

namespace attn::detail {

// Throws unless t is defined with dtype F32 or F64.
inline void check_float_tensor(const char* op, const char* name, const Tensor& t) {
  check(t.defined(), op, "{} is undefined, expected a float32 or float64 tensor", name);
  check(t.dtype() == DType::F32 || t.dtype() == DType::F64, op,
        "{} {} has dtype {}, expected F32 or F64", name, shape_arg(t.shape()),
        dtype_name(t.dtype()));
}

inline void check_ndim(const char* op, const char* name, const Tensor& t, int ndim,
                       const char* layout) {
  check(t.ndim() == ndim, op, "{} has shape {}, expected {}-D {}", name, shape_arg(t.shape()), ndim,
        layout);
}

inline void check_same_dtype(const char* op, const char* name, const Tensor& t,
                             const char* ref_name, const Tensor& ref) {
  check(t.dtype() == ref.dtype(), op, "{} has dtype {} but {} has dtype {}, expected the same",
        name, dtype_name(t.dtype()), ref_name, dtype_name(ref.dtype()));
}

// Calls f(float{}) or f(double{}) for a validated F32/F64 dtype.
template <typename F>
decltype(auto) dispatch_float(DType dtype, F&& f) {
  if (dtype == DType::F32) return std::forward<F>(f)(float{});
  return std::forward<F>(f)(double{});
}

}  // namespace attn::detail
