// Sinusoidal positional encoding (Vaswani et al. 2017; d2l PositionalEncoding's P matrix):
//   P[i, 2j]   = sin(i / 10000^(2j/d))
//   P[i, 2j+1] = cos(i / 10000^(2j/d))          i = 0..positions-1, d = dim
// returns (positions, dim). Odd d works (the last column is a sine); any number of positions
// (d2l fails for odd d and beyond max_len).
//
// Accuracy, two modes:
//   kMatchD2l (default for float32): d2l's float32 chain, op for op: e = f32(2j)/f32(d),
//             den = powf(10000, e), angle = f32(i)/den, sinf/cosf. Equal to PyTorch's table
//             within 1e-6 wherever torch's pow is correctly rounded (every column for d = 4 and
//             32); where it is not (d = 100, j = 2: one ulp off) the angle differs by one ulp,
//             up to 6e-5 at position 999.
//   kExact    (default for float64, and on request): angles and sin/cos in double, rounded once,
//             within 3e-8 of the true values.
// The float32 chain drifts from the true values by up to ~i * 2^-24 (2.8e-5 at d = 32,
// 6.2e-5 at d = 512 over positions 0..999; tests/test_ops_positional.cpp prints the table).
#pragma once

#include "attn/core/tensor.hpp"

#include <optional>

namespace attn {

enum class SinusoidalMode : uint8_t { kMatchD2l, kExact };

// mode defaults to kMatchD2l for F32 and kExact otherwise.
Tensor sinusoidal_encoding(int64_t positions, int64_t dim, DType dtype = DType::F32,
                           std::optional<SinusoidalMode> mode = std::nullopt);

// The angular frequency of column pair j: 1 / 10000^(2j/d) (radians per position), in double.
double sinusoidal_frequency(int64_t j, int64_t dim);

}  // namespace attn
