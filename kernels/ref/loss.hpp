// Reference softmax cross-entropy (internal; see attn/ops/loss.hpp).
//
// Glossary: N positions (all leading dims flattened), C classes. keep[n] says whether position n
// counts (target not ignored, inside its valid length); targets of kept positions are in [0, C).
#pragma once

#include <cstdint>

namespace attn::ref {

// log sum_c exp(row[c]) in double (the max when it is infinite; NaN entries give NaN).
template <typename T>
double logsumexp_row(const T* row, int64_t C);

// Returns sum over kept n of (logsumexp(logits[n]) - logits[n, target[n]]), in double.
template <typename Id, typename T>
double cross_entropy_forward(const T* logits, const Id* targets, const uint8_t* keep, int64_t N,
                             int64_t C);

// dlogits[n, c] = scale * (softmax(logits[n])[c] - [c == target[n]]) for kept n, else 0.
template <typename Id, typename T>
void cross_entropy_backward(const T* logits, const Id* targets, const uint8_t* keep, T* dlogits,
                            int64_t N, int64_t C, double scale);

}  // namespace attn::ref
