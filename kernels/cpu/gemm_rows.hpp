// The f32 GEMM attn runs itself where oneDNN's would make a row's bits depend on the rows beside
// it: every element is one fused multiply-add chain over k in order (from 0), then + bias, then
// + the old C, so a row comes out the same whatever M, whatever slice or shard it is computed
// in. cpu::gemm() (matmul.cpp) takes it for float32 products on x86-64 CPUs with AVX2 and FMA but
// without AVX-512, where oneDNN 2.6 runs its jit sgemm ("gemm:jit"): that kernel's bits depend
// on M in a way no cut can follow (an ad hoc probe: a 3040 x 128 x 128 product in pieces of 8 rows
// differed from the whole in 756 of its rows, in pieces of 16 in 4, in pieces of 3 in all of
// them), so 1 and 2 threads, or 1 and 4 data-parallel ranks, trained different models there. On
// AVX-512 oneDNN's brgemm keeps a row's bits, and stays.
#pragma once

#include "kernels/cpu/matmul.hpp"

namespace attn::cpu {

// Whether this CPU runs gemm_rows_f32 (x86-64 with AVX2 and FMA), and whether cpu::gemm() uses
// it for float32 products (the same, and no AVX-512 F).
bool gemm_rows_supported();
bool gemm_rows_preferred();

// C = op(A) op(B) (+ bias) (+ C) for matmul.hpp's args, on the calling thread. Requires
// gemm_rows_supported(). GemmType::kBF16 (CPUs without a bf16 matmul): A and B widened to float
// (exact) and the same chains, a bf16 output rounded once per element (C_bf16). `packed`: op(B) as
// gemm_rows_pack_panels wrote it for the same B (any rows of A, so that the slices of one product
// share one packing), or null to pack here.
void gemm_rows_f32(const GemmArgs& g, const float* packed = nullptr);

// op(B) in panels of 16 columns, k-major, zeros past N: gemm_rows_packed_size(g) floats (best
// 64-byte aligned); panels [p0, p1) of the (N + 15) / 16.
int64_t gemm_rows_packed_size(const GemmArgs& g);
void gemm_rows_pack_panels(const GemmArgs& g, float* packed, int64_t p0, int64_t p1);

// The calling thread's kept packing of g's op(B) (GemmFixedPackingScope in matmul.hpp), packed
// now if it was not kept; null when no scope lives on this thread, g is not b_fixed, or the
// thread keeps too much already (the caller packs then).
const float* gemm_rows_fixed_packing(const GemmArgs& g);

// A bf16 output's rows from a float product c32 (row stride ld32): out[m * ldo + n] is
// c32[m * ld32 + n], plus with `accumulate` the old out value added in float, rounded once to
// nearest even, as oneDNN's bf16 kernels store it. Any CPU; matmul.cpp's widened products too.
void round_rows_to_bf16(const float* c32, int64_t ld32, uint16_t* out, int64_t ldo, int64_t rows,
                        int64_t N, bool accumulate);

}  // namespace attn::cpu
