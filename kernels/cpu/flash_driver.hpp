// The flash driver: the work schedule every fused attention kernel shares (float32:
// flash_attention.cpp, bfloat16: flash_bf16.cpp), so that a fix to the schedule reaches every
// kernel. A kernel supplies its block arithmetic as function objects; the driver owns
//   forward:  the work items (b, query block), their order (causal: each head's longest block
//             first), the dynamic schedule and the item each thread will probably run next
//             (for the kernels' prefetch), and the per-thread scratch;
//   backward: the key splits (backward_key_splits: a function of the shape, never of the thread
//             count), the items (b, key range), the dQ shares and their merge in a fixed order;
//   both:     the output row of a query without a kept key (masked_row_output).
// Items are independent and each one's arithmetic is fixed by (b, block) alone, so the results
// are bitwise identical for any thread count (the contract in kernels/attention_problem.hpp).
// Internal to kernels/cpu. Next file down: the kernel's own .cpp (ForwardBlock, BackwardItem).
#pragma once

#include "kernels/attention_problem.hpp"
#include "kernels/cpu/denormals.hpp"
#include "kernels/cpu/dropout_simd.hpp"
#include "kernels/cpu/parallel.hpp"
#include "kernels/cpu/scratch.hpp"

#include "attn/core/dtype.hpp"

#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace attn::cpu {

// How many work items the schedules aim for, where the shape allows. Constants of the shape,
// never the thread count: the items fix the arithmetic, so results stay bitwise identical for
// any number of threads.
//   forward: 2 items per thread of a 16-core machine; a half-size query block costs only
//     re-reading K and V.
//   backward: 4. Every extra key split packs all T rows of q and dO again and adds a T x D dQ
//     share to zero and merge, which costs more at one thread than more items gain on two
//     (measured: docs/kernels-cpu.md), so more splits wait for a cheaper split (dQ by query
//     blocks in a second pass) measured on a machine with more cores.
constexpr int64_t kForwardItems = 32;
constexpr int64_t kBackwardItems = 4;

// Query rows per forward item: the kernel's block, or half of it when whole blocks would give
// fewer than kForwardItems items (few heads of a short or medium sequence).
inline int64_t forward_block_rows(int64_t B, int64_t T, int64_t block_rows) {
  const int64_t items = B * ((T + block_rows - 1) / block_rows);
  return items < kForwardItems ? block_rows / 2 : block_rows;
}

// Key ranges [bounds[j], bounds[j+1]) of the backward's work items for one batch row: enough
// splits that B * splits reaches kBackwardItems (a function of the shape only, never of the
// thread count), at most S / 256 of them, each a multiple of 64 keys; with a causal mask the
// ranges hold equal work (key s is seen by T - s queries), not equal keys.
std::vector<int64_t> backward_key_splits(int64_t B, int64_t T, int64_t S, bool causal);

// The batch rows in the order the parallel schedules hand them out: the rows with the most kept
// keys first (the last query's count: a row's length under a length mask, its longest under a
// causal one), ties in row order; empty (row order) without a length mask. Why: a padded batch's
// rows cost up to twice each other, and handed out in row order the last item could be a long
// one, which one thread ran while the other waited (bench/omp_trace.py: 20-30 us at the end of
// each attention region of a padded `attn train` step at 2 threads). The order changes only who
// runs a row and when, never its arithmetic.
std::vector<int64_t> rows_longest_first(const kernels::AttentionProblem& p);

// No per-row preparation before a forward's items (flash_forward_driver's `prepare`).
struct NoPrepare {
  void operator()(int64_t) const {}
};

// The forward's arithmetic, 2 (D + Dv) flops per (query, key) pair (a causal mask halves it; the
// thread count it sizes does not need that precision). The backward does about 2.5 times as much.
inline double problem_flops(const kernels::AttentionProblem& p) {
  return 2.0 * static_cast<double>(p.B * p.T) * static_cast<double>(p.S * (p.D + p.Dv));
}

// The forward's items: B * ceil(T / rows) blocks of rows = forward_block_rows(B, T, max_rows)
// queries. `prepare(b)` runs once per batch row before any item (e.g. packing K and V), split
// statically over the threads; `block(scratch, b, t0, rows, next_b, next_t0)` computes queries
// [t0, min(t0 + rows, T)) of row b with `scratch_floats` floats of per-thread scratch (enough
// for max_rows); (next_b, next_t0) is the item this thread will probably run next (next_b < 0:
// none).
template <class Prepare, class Block>
void flash_forward_driver(const kernels::AttentionProblem& p, const char* op, int64_t max_rows,
                          size_t scratch_floats, Prepare&& prepare, Block&& block) {
  const int64_t block_rows = forward_block_rows(p.B, p.T, max_rows);
  const int64_t blocks = (p.T + block_rows - 1) / block_rows, items = p.B * blocks;
  const int threads = threads_for(problem_flops(p), std::max(1, p.threads));
  const Scratch<float> scratch(op, scratch_floats, static_cast<size_t>(threads));
  // A dynamic schedule balances causal masks and still gives the same bits for any thread count.
  // Causal blocks grow with t, so each head's blocks are handed out last (heaviest) first and the
  // schedule ends on the lightest ones. Heads stay in order: consecutive items share one head's K
  // and V in cache (an order across heads, all last blocks first, reads them from memory for every
  // item; docs/kernels-cpu.md).
  const auto row0 = [&](int64_t i) {
    return (p.causal ? blocks - 1 - i % blocks : i % blocks) * block_rows;
  };
  if (threads == 1) {  // small work: no OpenMP team (kernels/cpu/parallel.hpp)
    // Subnormals flushed on every thread that runs items (denormals.hpp).
    const FlushDenormalsScope flush;
    if constexpr (!std::is_same_v<std::decay_t<Prepare>, NoPrepare>) {
      for (int64_t b = 0; b < p.B; ++b)
        prepare(b);
    }
    for (int64_t it = 0; it < items; ++it)
      block(scratch.get(0), it / blocks, row0(it), block_rows,
            it + 1 < items ? (it + 1) / blocks : -1, it + 1 < items ? row0(it + 1) : 0);
    return;
  }
  // Batch rows longest first (rows_longest_first), each row's blocks together.
  const std::vector<int64_t> order = rows_longest_first(p);
  const auto row_of = [&](int64_t i) { return order.empty() ? i / blocks : order[i / blocks]; };
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormalsScope flush;
    if constexpr (!std::is_same_v<std::decay_t<Prepare>, NoPrepare>) {
#pragma omp for schedule(static)
      for (int64_t b = 0; b < p.B; ++b)
        prepare(b);
    }
    float* own = scratch.get(static_cast<size_t>(omp_get_thread_num()));
    // With a dynamic schedule of equal items, a thread's next item is most often it + threads.
    const int64_t stride = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t next = it + stride < items ? it + stride : -1;
      block(own, row_of(it), row0(it), block_rows, next < 0 ? -1 : row_of(next),
            next < 0 ? 0 : row0(next));
    }
  }
}

// The backward's items (b, key range [sa, sb)), from backward_key_splits. Each thread gets
// `scratch_bytes` of scratch (zeroed once when `zero_scratch`) and makes its state from it with
// `make_state(std::byte*)`. `item(state, b, sa, sb, part, next_b)` computes dK, dV of its keys
// and adds its share of dQ, unscaled, into part (T rows of ldq >= D floats, zeroed by the
// driver); next_b >= 0 is the batch row this thread will probably run next (single-split only).
// `store_dq(b, t0, t1, rows, ld)` writes dq rows [t0, t1) of b from the fp32 sums of the shares
// (rows[(t - t0) * ld + d]); the kernel applies the scale and rounds. With one split per row the
// sum is the one share itself, stored by the item's own thread while it is still in L2; with
// more, it is 0 + share_0 + share_1 + ... in split order, whatever thread made each share.
template <class MakeState, class Item, class StoreDq>
void flash_backward_driver(const kernels::AttentionProblem& p, const char* op, int64_t ldq,
                           size_t scratch_bytes, bool zero_scratch, MakeState&& make_state,
                           Item&& item, StoreDq&& store_dq) {
  const std::vector<int64_t> bounds = backward_key_splits(p.B, p.T, p.S, p.causal);
  const int64_t splits = static_cast<int64_t>(bounds.size()) - 1, items = p.B * splits;
  const int threads = threads_for(2.5 * problem_flops(p), std::max(1, p.threads));
  const size_t part_floats = static_cast<size_t>(p.T * ldq);
  const Scratch<std::byte> scratch(op, scratch_bytes, static_cast<size_t>(threads), zero_scratch);
  if (splits == 1) {
    // One item per b (B >= 4, e.g. MultiHeadAttention's B*H rows): its dQ share is the whole dQ
    // of b, from a per-thread buffer, instead of B buffers of T x ldq summed in a second pass.
    const Scratch<float> parts(op, part_floats, static_cast<size_t>(threads));
    // Batch rows longest first (rows_longest_first).
    const std::vector<int64_t> order = threads > 1 ? rows_longest_first(p) : std::vector<int64_t>{};
    const auto row_of = [&](int64_t i) { return order.empty() ? i : order[i]; };
#pragma omp parallel num_threads(threads)
    {
      const FlushDenormalsScope flush;  // denormals.hpp
      auto state = make_state(scratch.get(static_cast<size_t>(omp_get_thread_num())));
      float* part = parts.get(static_cast<size_t>(omp_get_thread_num()));
      const int64_t stride = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < p.B; ++i) {
        const int64_t b = row_of(i);
        std::memset(part, 0, sizeof(float) * part_floats);  // std::fill stayed scalar
        item(state, b, bounds[0], bounds[1], part, i + stride < p.B ? row_of(i + stride) : -1);
        store_dq(b, int64_t{0}, p.T, static_cast<const float*>(part), ldq);
      }
    }
    return;
  }
  // dQ shares, one (T, ldq) buffer per item, summed in item order below.
  const Scratch<float> all_parts(op, part_floats * static_cast<size_t>(items));
  float* const parts = all_parts.get();
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormalsScope flush;  // denormals.hpp
    {
      auto state = make_state(scratch.get(static_cast<size_t>(omp_get_thread_num())));
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < items; ++i) {
        float* part = parts + static_cast<size_t>(i) * part_floats;
        std::memset(part, 0, sizeof(float) * part_floats);
        const int64_t b = i / splits, j = i % splits;
        item(state, b, bounds[j], bounds[j + 1], part, int64_t{-1});
      }
    }
    std::vector<float> sum(static_cast<size_t>(ldq));
#pragma omp for schedule(static)
    for (int64_t bt = 0; bt < p.B * p.T; ++bt) {
      const int64_t b = bt / p.T, t = bt % p.T;
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t j = 0; j < splits; ++j) {
        const float* row = parts + static_cast<size_t>(b * splits + j) * part_floats + t * ldq;
        for (int64_t d = 0; d < ldq; ++d)
          sum[d] += row[d];
      }
      store_dq(b, t, t + 1, static_cast<const float*>(sum.data()), ldq);
    }
  }
}

// Kept-key limits of queries [t0, t0 + mq) of row b for a forward block: lim[r] and its float
// copy limv[r] (padding lanes [mq, mqp) get 0: junk columns, never stored). Returns the largest:
// keys past it are read by no query of the block.
inline int64_t block_row_limits(const kernels::AttentionProblem& p, int64_t b, int64_t t0,
                                int64_t mq, int64_t mqp, int64_t* lim, float* limv) {
  int64_t max_lim = 0;
  for (int64_t r = 0; r < mq; ++r) {
    lim[r] = p.row_limit(b, t0 + r);
    max_lim = std::max(max_lim, lim[r]);
    limv[r] = static_cast<float>(lim[r]);
  }
  std::fill(limv + mq, limv + mqp, 0.0f);
  return max_lim;
}

// Output row of query (b, t) that keeps no key, in fp32 (acc: Dv floats; z: z_len floats of
// scratch): the mean of v over all S keys (d2l's kUniform), dropout applied to the 1/S weights
// (then not a mean), or zeros (kZero). E: float, or bf16 bits as uint16_t. Always inlined: it
// then compiles for the caller's SIMD target, whose FMA contraction of acc += w * v gives each
// kernel's bits on each target (a shared out-of-line copy would round twice where they fuse).
template <class E>
__attribute__((always_inline)) inline void masked_row_output(const kernels::AttentionArgs<E>& p,
                                                             int64_t b, int64_t t, float* acc,
                                                             float* z, int64_t z_len) {
  std::fill(acc, acc + p.Dv, 0.0f);
  if (p.zero_masked_rows()) return;
  const E* v = p.v.data + p.row_offset(b, p.v.sb, p.v.sh);
  for (int64_t s0 = 0; s0 < p.S; s0 += z_len) {
    const int64_t nk = std::min(z_len, p.S - s0);
    if (p.dropout > 0.0f) {
      dropout_multipliers(p.dropout, p.seed, p.offset, p.dropout_index(b, t, s0), nk, z);
    } else {
      std::fill(z, z + nk, 1.0f);
    }
    for (int64_t s = 0; s < nk; ++s) {
      const float w = z[s] / static_cast<float>(p.S);
      const E* vs = v + (s0 + s) * p.v.st;
      for (int64_t e = 0; e < p.Dv; ++e) {
        if constexpr (std::is_same_v<E, float>) {
          acc[e] += w * vs[e * p.v.sd];
        } else {
          acc[e] += w * bf16_to_float(vs[e * p.v.sd]);
        }
      }
    }
  }
}

}  // namespace attn::cpu
