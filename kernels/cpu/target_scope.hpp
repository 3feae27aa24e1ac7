// Restricts Highway's run-time dispatch to some SIMD targets for the length of one kernel call:
// AttentionProblem::simd_targets (kernels/attention_problem.hpp, from Context::kernel_targets).
// A test and benchmark switch, nonzero only where targets are compared on one machine; like
// Highway's own switch it is process-wide while it lasts, so not for concurrent calls.
#pragma once

#include "hwy/targets.h"

#include <cstdint>

namespace attn::cpu {

class TargetScope {
 public:
  explicit TargetScope(int64_t targets) : on_(targets != 0) {
    if (on_) hwy::SetSupportedTargetsForTest(targets);
  }
  ~TargetScope() {
    if (on_) hwy::SetSupportedTargetsForTest(0);  // 0: every target this CPU supports again
  }
  TargetScope(const TargetScope&) = delete;
  TargetScope& operator=(const TargetScope&) = delete;

 private:
  bool on_;
};

}  // namespace attn::cpu
