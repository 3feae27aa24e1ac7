// Softmax cross-entropy over float32 logits, compiled per SIMD target and split over rows: the
// fast path of softmax_cross_entropy and its backward (attn/ops/loss.hpp has the contract,
// kernels/ref/loss.cpp the oracle). The arithmetic is the reference's, in double: per row the max,
// log sum exp(x - max) with Highway's double exp (at most 1 ULP from exact) in lanes of partial
// sums, and for the backward softmax = exp(x - lse); a row holding a NaN (or, in the backward,
// an infinite largest logit) goes through the reference's own row functions. So the results differ
// from the oracle's by double rounding (~1e-16 relative), far below float32. Why: the reference ran
// scalar glibc exp three times per logit on one thread, 18% of a seq2seq training step at a
// vocabulary of 1000.
//
// Glossary: N rows (positions), C classes; keep[n]: row n counts; targets[n] in [0, C) where kept.
#pragma once

#include <cstdint>

namespace attn::cpu {

// Sum over kept rows of lse(row) - row[target], in double: rows in chunks of a fixed size, each
// chunk's sum in row order, the chunks' sums added in order (the same for any thread count).
double cross_entropy_forward_f32(const float* logits, const int64_t* targets, const uint8_t* keep,
                                 int64_t N, int64_t C, int threads);

// dlogits[n, c] = scale * (softmax(row n)[c] - [c == targets[n]]) for kept rows, else 0.
void cross_entropy_backward_f32(const float* logits, const int64_t* targets, const uint8_t* keep,
                                float* dlogits, int64_t N, int64_t C, double scale, int threads);

// Both in one pass over the rows (a training step's loss and its gradient): returns the forward's
// sum and writes the backward's dlogits, the same bits as the two calls, each row's log-sum-exp
// taken once instead of twice.
double cross_entropy_forward_backward_f32(const float* logits, const int64_t* targets,
                                          const uint8_t* keep, float* dlogits, int64_t N, int64_t C,
                                          double scale, int threads);

// log(sum_i exp(x[i])) of one row of doubles whose largest element is m (finite), in the same
// lanes as the rows above: the normaliser greedy and beam search take once per decoder row and
// step (model/generation.cpp; a 236-token vocabulary made glibc's scalar exp a tenth of a beam
// search step at batch 1). Differs from the sequential sum of std::exp by a few ULP.
double log_sum_exp(const double* x, int64_t n, double m);
// The same of a float row, the same bits as of its widened copy.
double log_sum_exp(const float* x, int64_t n, double m);

}  // namespace attn::cpu
