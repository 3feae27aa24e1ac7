// In-register transpose of a 16 x 16 tile of 32-bit elements with AVX-512, shared by the fp32
// kernels (Highway's AVX-512 targets, flash_kernels-inl.h) and the bf16 kernels (bf16 pairs,
// flash_bf16.cpp). Compiled for the avx512f target (a pragma region with GCC, an attribute with
// clang) so that it can be defined in any translation unit and inlined into callers compiled for
// AVX-512 (a superset); call it only from such code.
#pragma once

#include <immintrin.h>

#if defined(__clang__)
#define ATTN_TARGET_AVX512F __attribute__((target("avx512f"), always_inline))
#else
#pragma GCC push_options
#pragma GCC target("avx512f")
// Always inlined: an out-of-line copy trips GCC 12's -Wuninitialized on the intrinsics'
// deliberately undefined pass-through operand (_mm512_undefined_epi32).
#define ATTN_TARGET_AVX512F __attribute__((always_inline))
#endif

namespace attn::cpu {

// r[i] holds row i on entry, column i on exit. Three stages: interleave 32-bit elements of row
// pairs, then 64-bit pairs of those (each 128-bit block then holds a 4 x 4 sub-tile), then move
// 128-bit blocks across vectors (vshufi32x4 twice): 64 instructions per 256 elements.
ATTN_TARGET_AVX512F inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4g + k], 128-bit block j: elements 4j + k of rows 4g .. 4g + 3.
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  // Column 4j + k = block j of u[k], u[4 + k], u[8 + k], u[12 + k].
  for (int k = 0; k < 4; ++k) {
    const __m512i v02 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);  // blocks 0, 2 of each
    const __m512i w02 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i v13 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);  // blocks 1, 3 of each
    const __m512i w13 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
    r[k] = _mm512_shuffle_i32x4(v02, w02, 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(v02, w02, 0xdd);
    r[4 + k] = _mm512_shuffle_i32x4(v13, w13, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(v13, w13, 0xdd);
  }
}

}  // namespace attn::cpu

#if !defined(__clang__)
#pragma GCC pop_options
#endif
#undef ATTN_TARGET_AVX512F
