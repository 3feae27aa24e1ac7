// Where the elements of mma.sync.m16n8k16 (bf16 in, f32 accumulate) fragments sit: for lane
// `lane`, 32-bit register `reg` and its half `half` (the low bf16 first), the (row, col) of the
// element in its matrix (PTX ISA, "Matrix Fragments for mma.m16n8k16"); g = lane / 4, c = lane % 4.
//   A (16 x 16, row-major): reg0 (g, 2c + half), reg1 (g + 8, 2c + half),
//                           reg2 (g, 2c + 8 + half), reg3 (g + 8, 2c + 8 + half)
//   B (16 x 8, k x n):      reg0 (2c + half, g), reg1 (2c + 8 + half, g)
//   C (16 x 8), element e:  (g + 8 * (e / 2), 2c + e % 2)
// Host-and-device: flash_mma.cu indexes with these, and tests/cuda/test_cuda_host.cpp checks them
// (each a bijection onto its matrix) and runs the kernel's warp arithmetic through an emulated mma.
#pragma once

#include "attn/core/rng.hpp"  // ATTN_HOST_DEVICE

namespace attn::cuda {

struct FragPos {
  int row, col;
};

ATTN_HOST_DEVICE inline FragPos mma_a_pos(int lane, int reg, int half) {
  return {lane / 4 + (reg & 1) * 8, 2 * (lane % 4) + half + (reg >> 1) * 8};
}
ATTN_HOST_DEVICE inline FragPos mma_b_pos(int lane, int reg, int half) {  // (k, n)
  return {2 * (lane % 4) + half + reg * 8, lane / 4};
}
ATTN_HOST_DEVICE inline FragPos mma_c_pos(int lane, int e) {
  return {lane / 4 + (e >> 1) * 8, 2 * (lane % 4) + (e & 1)};
}
// The accumulator of key tile n (8 keys) is half of the A fragment of key chunk n / 2 (16 keys):
// element e of it goes to register p_reg_of(n, e), half e % 2.
ATTN_HOST_DEVICE inline int p_reg_of(int n, int e) {
  return 2 * (n % 2) + (e >> 1);
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (PTX ISA): lane l gives the address of row
// l % 8 of matrix l / 8 (16 bytes, 8 bf16); register i of lane `lane` then holds two elements of
// matrix i, the low one first: without .trans (row lane / 4, cols 2 (lane % 4) + half), with
// .trans the transposed pair (rows 2 (lane % 4) + half, col lane / 4) of the stored matrix.
ATTN_HOST_DEVICE inline FragPos ldmatrix_pos(int lane, bool trans, int half) {
  return trans ? FragPos{2 * (lane % 4) + half, lane / 4}
               : FragPos{lane / 4, 2 * (lane % 4) + half};
}
// The row a lane addresses for the pipelined forward's two x4 loads (flash_mma.cu), relative to
// the block of 16 keys x 16 dims it reads, as (key, dim):
//  - from the K tile (keys x dims, row-major), without .trans: registers 0, 1 are B = K^T's
//    fragment (reg0, reg1) of keys 0..7, registers 2, 3 that of keys 8..15;
//  - from the V tile (keys x dims, row-major), with .trans: registers 0, 1 are B = V's fragment
//    of dims 0..7, registers 2, 3 that of dims 8..15.
ATTN_HOST_DEVICE inline FragPos ldsm_k_row(int lane) {
  const int i = lane / 8, r = lane % 8;
  return {(i / 2) * 8 + r, (i % 2) * 8};
}
ATTN_HOST_DEVICE inline FragPos ldsm_v_row(int lane) {
  const int i = lane / 8, r = lane % 8;
  return {(i % 2) * 8 + r, (i / 2) * 8};
}
// The row a lane addresses for an x4 load, without .trans, of the A fragment of a 16 x 16 block of
// a row-major matrix (the backward's K and V rows as A operands), as (row, col): matrix i holds
// register i's elements, rows 8 (i % 2) .. + 7 and columns 8 (i / 2) .. + 7 (mma_a_pos); the same
// addresses as ldsm_v_row's.
ATTN_HOST_DEVICE inline FragPos ldsm_a_row(int lane) {
  return ldsm_v_row(lane);
}

}  // namespace attn::cuda
