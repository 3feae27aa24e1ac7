// log(sum_i exp(x[i])) of one row of doubles, compiled per SIMD target: the normaliser of a
// log-softmax, which greedy and beam search take once per decoder row and step (model/generation
// .cpp; a 236-token vocabulary made glibc's scalar exp a tenth of a beam search step at batch 1).
#pragma once

#include <cstdint>

namespace attn::cpu {

// m: the row's largest element (finite). Highway's vectorised exp (at most 1 ULP from the exact
// value) in lanes of partial sums, then the row's remainder with std::exp: differs from the
// sequential sum of std::exp by a few ULP of the result.
double log_sum_exp(const double* x, int64_t n, double m);

}  // namespace attn::cpu
