// Reference layer normalisation over the last dimension (internal; see attn/ops/layer_norm.hpp).
//
// Glossary: R rows (all leading dims flattened), E normalised width.
#pragma once

#include <cstdint>

namespace attn::ref {

// x (R, E), gamma/beta (E) or null (no affine) -> y (R, E), mean (R), rstd (R).
template <typename T>
void layer_norm_forward(const T* x, const T* gamma, const T* beta, T* y, T* mean, T* rstd,
                        int64_t R, int64_t E, double eps);

// dy (R, E) -> dx (R, E); dgamma, dbeta (E) written (not accumulated) when non-null.
template <typename T>
void layer_norm_backward(const T* dy, const T* x, const T* gamma, const T* mean, const T* rstd,
                         T* dx, T* dgamma, T* dbeta, int64_t R, int64_t E);

}  // namespace attn::ref
