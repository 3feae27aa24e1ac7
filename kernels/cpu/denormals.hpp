// Subnormal floats flushed to zero on the calling thread while a scope lasts: FTZ (results that
// would be subnormal are 0) and DAZ (subnormal inputs read as 0) in x86's MXCSR, restored as they
// were when the scope ends. The fused attention kernels run their work under it, on every thread
// of their teams (flash_driver.hpp, decode_attention.cpp).
//
// Why: attention weights p = exp(s - max) far below the row's maximum (a score 87 below it in
// nats, which sqrt(E)-scaled embeddings give at initialization) are subnormal, and so are
// products of small weights and values. Intel cores take a microcode assist, on the order of a
// hundred cycles, for every vector instruction with a subnormal input or result; AMD's do not.
// On the GPU machine's Xeon (AMX-BF16, 2 threads) the fp32 d2l training step spent 44% of its
// samples in the forward's P V product and 21% in the backward's products (bench/sample_prof.cpp,
// session 25) where Zen 3 spends 2% and 10%: 0.08% of the weights were subnormal, but a subnormal
// lane stalls the whole vector, and each vector of weights takes part in Dv / 8 multiply-adds.
//
// What it changes: a weight or partial sum below 2^-126 (1.2e-38) counts as 0. Next to the row's
// largest weight, 1 before normalization, that is below float's resolution by 2^102, so every
// output is within the kernels' error bound of the reference's; the results stay a function of the
// shape and data alone (every thread flushes alike), so thread-count invariance holds.
//
// A/B: ATTN_ATTENTION_DENORMALS=keep at start leaves MXCSR alone (the kernels as before).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cstdlib>
#include <cstring>

namespace attn::cpu {

// Whether the scopes flush (not ATTN_ATTENTION_DENORMALS=keep), read once.
inline bool flush_denormals() {
  static const bool on = [] {
    const char* v = std::getenv("ATTN_ATTENTION_DENORMALS");
    return v == nullptr || std::strcmp(v, "keep") != 0;
  }();
  return on;
}

class FlushDenormalsScope {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushDenormalsScope() : saved_(_mm_getcsr()) {
    if (flush_denormals()) _mm_setcsr(saved_ | kFtz | kDaz);
  }
  ~FlushDenormalsScope() {
    _mm_setcsr(saved_);
  }
#else
  FlushDenormalsScope() = default;
#endif
  FlushDenormalsScope(const FlushDenormalsScope&) = delete;
  FlushDenormalsScope& operator=(const FlushDenormalsScope&) = delete;

 private:
#if defined(__x86_64__) || defined(__i386__)
  static constexpr unsigned kFtz = 0x8000, kDaz = 0x0040;
  unsigned saved_;
#endif
};

}  // namespace attn::cpu
