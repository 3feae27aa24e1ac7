// The cache key of a cuBLASLt matmul plan (descriptors, layouts and the heuristic's algorithm):
// everything the heuristic's choice depends on, pointers excepted but their alignment included
// (cuBLASLt picks vectorised algorithms for 16-byte aligned operands). Plain C++, tested on the
// CPU (tests/cuda/test_cuda_host.cpp).
#pragma once

#include "kernels/cuda/kernels.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>

namespace attn::cuda {

struct GemmKey {
  GemmType type = GemmType::kF32;
  int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldc = 0;
  int64_t batch = 1, stride_a = 0, stride_b = 0, stride_c = 0;
  bool trans_a = false, trans_b = false, bias = false, accumulate = false;
  uint8_t alignment = 0;  // bit i: operand i (A, B, C, bias) is 16-byte aligned
  bool operator==(const GemmKey&) const = default;
};

inline GemmKey gemm_key(const GemmArgs& g) {
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  GemmKey k;
  k.type = g.type;
  k.M = g.M;
  k.N = g.N;
  k.K = g.K;
  k.lda = g.lda;
  k.ldb = g.ldb;
  k.ldc = g.ldc;
  k.batch = g.batch;
  k.stride_a = g.batch > 1 ? g.stride_a : 0;
  k.stride_b = g.batch > 1 ? g.stride_b : 0;
  k.stride_c = g.batch > 1 ? g.stride_c : 0;
  k.trans_a = g.trans_a;
  k.trans_b = g.trans_b;
  k.bias = g.bias != nullptr;
  k.accumulate = g.beta != 0.0f;
  k.alignment = static_cast<uint8_t>(aligned(g.A) | aligned(g.B) << 1 | aligned(g.C) << 2 |
                                     (g.bias == nullptr || aligned(g.bias)) << 3);
  return k;
}

struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
    auto mix = [&h](uint64_t v) {
      h ^= v;
      h *= 1099511628211ull;
    };
    mix(static_cast<uint64_t>(k.type));
    for (int64_t v :
         {k.M, k.N, k.K, k.lda, k.ldb, k.ldc, k.batch, k.stride_a, k.stride_b, k.stride_c})
      mix(static_cast<uint64_t>(v));
    mix(static_cast<uint64_t>(k.trans_a) | static_cast<uint64_t>(k.trans_b) << 1 |
        static_cast<uint64_t>(k.bias) << 2 | static_cast<uint64_t>(k.accumulate) << 3 |
        static_cast<uint64_t>(k.alignment) << 8);
    return static_cast<size_t>(h);
  }
};

// The column-major problem cuBLASLt sees for a row-major C = op(A) op(B): C^T = op(B)^T op(A)^T,
// so its first operand is B. Dimensions (rows, cols) of each stored matrix read column-major.
struct ColumnMajorGemm {
  bool trans_first = false, trans_second = false;  // op of B, op of A
  int64_t first_rows = 0, first_cols = 0;          // B as stored, read column-major
  int64_t second_rows = 0, second_cols = 0;        // A as stored, read column-major
  int64_t m = 0, n = 0, k = 0;                     // D = (m, n) column-major = C^T
};

inline ColumnMajorGemm column_major(const GemmArgs& g) {
  ColumnMajorGemm c;
  // B row-major (K, N) is column-major (N, K): already op(B)^T. Stored (N, K) needs a transpose.
  c.trans_first = g.trans_b;
  c.first_rows = g.trans_b ? g.K : g.N;
  c.first_cols = g.trans_b ? g.N : g.K;
  // A row-major (M, K) is column-major (K, M): already op(A)^T. Stored (K, M) needs a transpose.
  c.trans_second = g.trans_a;
  c.second_rows = g.trans_a ? g.M : g.K;
  c.second_cols = g.trans_a ? g.K : g.M;
  c.m = g.N;
  c.n = g.M;
  c.k = g.K;
  return c;
}

}  // namespace attn::cuda
