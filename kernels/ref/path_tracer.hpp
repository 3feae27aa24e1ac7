// PathTracer: a scalar type that the sequence-layer reference kernels (conv1d, rnn) can be
// instantiated with, to measure the dependency structure of a forward pass instead of its values.
//
// Every value carries two numbers:
//   longest   the longest chain of dependent steps behind the value (its "ready time" when every
//             step runs as soon as its operands exist): the critical path of the forward, i.e.
//             the chapter's "sequential operations".
//   shortest  the fewest steps on any path from the traced source (one input position, marked
//             with source()) to this value; kUnreached when no path exists. Used for the
//             "maximum path length" between input 1 and output n.
// Arithmetic (+, *) combines operands: a step can only start when all operands are ready
// (longest = max) and a value is reached as soon as one operand is (shortest = min). A "step" is
// one stored result of a layer (an output element, a hidden state): it adds 1 to both. Weights,
// biases and zero padding are constants: ready at 0 and not connected to the source.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace attn::ref {

struct PathTracer {
  static constexpr int64_t kUnreached = INT64_MAX / 4;

  int64_t longest = 0;
  int64_t shortest = kUnreached;

  PathTracer() = default;
  // A constant (weight, bias, padding, initial state): what the kernels write as A(value).
  explicit PathTracer(double /*value*/) {}
  static PathTracer source() {
    PathTracer p;
    p.shortest = 0;
    return p;
  }
  bool reached() const { return shortest < kUnreached; }
  // The value stored at the end of one step of the layer.
  PathTracer step() const {
    PathTracer p;
    p.longest = longest + 1;
    p.shortest = reached() ? shortest + 1 : kUnreached;
    return p;
  }
  PathTracer& operator+=(const PathTracer& o) {
    longest = std::max(longest, o.longest);
    shortest = std::min(shortest, o.shortest);
    return *this;
  }
  friend PathTracer operator+(PathTracer a, const PathTracer& b) { return a += b; }
  friend PathTracer operator*(PathTracer a, const PathTracer& b) { return a += b; }
};

// The accumulator of a kernel instantiated with T: double for float and double (the reference
// kernels accumulate in double), the tracer itself for PathTracer.
template <typename T>
struct Accum {
  using type = double;
};
template <>
struct Accum<PathTracer> {
  using type = PathTracer;
};
template <typename T>
using accum_t = typename Accum<T>::type;

// Stores a finished accumulator as an output element (one step).
template <typename T>
inline T store_step(accum_t<T> acc) {
  return static_cast<T>(acc);
}
template <>
inline PathTracer store_step<PathTracer>(PathTracer acc) {
  return acc.step();
}

// Stores tanh(acc) (one step: the nonlinearity of a recurrent update).
template <typename T>
inline T store_tanh(accum_t<T> acc) {
  return static_cast<T>(std::tanh(acc));
}
template <>
inline PathTracer store_tanh<PathTracer>(PathTracer acc) {
  return acc.step();
}

}  // namespace attn::ref
