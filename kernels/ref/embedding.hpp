// Reference embedding lookup and its scatter-add backward (internal; see attn/ops/embedding.hpp).
//
// Glossary: N positions (all dims of ids flattened), V vocabulary, E width. Ids are validated
// in ops/embedding.cpp (every id in [0, V)) before these run.
#pragma once

#include <cstdint>

namespace attn::ref {

// out[n, e] = weight[ids[n], e]
template <typename Id, typename T>
void embedding_forward(const Id* ids, const T* weight, T* out, int64_t N, int64_t E);

// dweight (V, E) = 0, then dweight[ids[n], e] += dout[n, e]   (accumulated in double)
template <typename Id, typename T>
void embedding_backward(const T* dout, const Id* ids, T* dweight, int64_t N, int64_t V, int64_t E);

}  // namespace attn::ref
