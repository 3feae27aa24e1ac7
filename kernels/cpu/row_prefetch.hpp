// Software prefetch of a block of rows, spread over the steps of a loop (the fp32 kernels'; the
// bf16 forward uses only Mode::kWholeItem: the last-steps prefetch measured nothing there), and
// the backward's prefetch of its next work item at short sequences (NextItemPrefetch: fp32 and
// bf16).
#pragma once

#include <algorithm>
#include <cstdint>

namespace attn::cpu {

// Software prefetch of `rows` rows of `cols` contiguous elements, `st` elements apart, spread
// over the last (up to 8) of a work item's n key tiles: Step(i, n) issues the share of tiles up
// to i.
// The forward reads its block of q from memory once, at the start, and writes its block of out
// once, at the end; fetching the next item's q and this item's out lines while the last products
// run hides those misses (the first q loads of an item show in a profile otherwise). Earlier
// prefetches would be evicted again by the K and V rows streaming
// through L2 at long S. Prefetches never fault: lines past the end of a tensor are harmless.
// At short sequences (the next item's rows are a small part of L2) the kernels prefetch all of
// the next item's rows instead, spread evenly over all of an item's steps and into L2 only
// (a burst of ~2000 lines into L1 evicts itself before use; prefetcht0 of the rows an item
// writes, or none, measured slower than prefetcht1): Mode::kWholeItem.
class RowPrefetch {
 public:
  enum class Mode : uint8_t {
    kLastSteps,  // into L1, over the last (up to 8) steps
    kWholeItem,  // into L2, over all steps
  };
  RowPrefetch() = default;
  template <typename T>
  RowPrefetch(const T* base, int64_t rows, int64_t cols, int64_t st, Mode mode = Mode::kLastSteps)
      : mode_(mode),
        row_(reinterpret_cast<const char*>(base)),
        row_bytes_(st * static_cast<int64_t>(sizeof(T))),
        lines_(Lines(reinterpret_cast<uintptr_t>(base), cols * static_cast<int64_t>(sizeof(T)),
                     st * static_cast<int64_t>(sizeof(T)))),
        total_(base == nullptr ? 0 : rows * lines_) {}
  void Step(int64_t i, int64_t n) {
    if (n <= 0) return;
    const int64_t span = mode_ == Mode::kLastSteps ? std::min<int64_t>(n, 8) : n, first = n - span;
    if (i < first) return;
    const int64_t upto = std::min(total_, total_ * (i - first + 1) / span);
    // Row and line counters, not done_ / lines_ and done_ % lines_ (a 64-bit division per line).
    for (; done_ < upto; ++done_) {
      const char* line = row_ + col_ * 64;
      if (mode_ == Mode::kLastSteps) {
        __builtin_prefetch(line);
      } else {
        __builtin_prefetch(line, 0, 2);
      }
      if (++col_ == lines_) {
        col_ = 0;
        row_ += row_bytes_;
      }
    }
  }

 private:
  // Lines per row: a row that starts on a line boundary, in every row, spans whole lines;
  // otherwise one more may be touched.
  static int64_t Lines(uintptr_t base, int64_t row, int64_t stride) {
    const bool aligned = base % 64 == 0 && stride % 64 == 0;
    return (row + 63) / 64 + (aligned ? 0 : 1);
  }
  Mode mode_ = Mode::kLastSteps;
  const char* row_ = nullptr;  // the row of line done_
  int64_t row_bytes_ = 0, lines_ = 0, total_ = 0, done_ = 0;
  int64_t col_ = 0;  // line done_'s place within its row
};

// Whether one batch row's q, k, v and out (or dO) rows are a small part of L2: below T + S = 1024
// at D = Dv = 32, 256 at 128. Then the kernels prefetch a whole work item ahead (below).
template <class Problem>
bool ShortRows(const Problem& p) {
  return (p.T + p.S) * (p.D + p.Dv) * int64_t{sizeof(float)} <= (int64_t{256} << 10);
}

// The rows one backward item reads (q, k, v, out, dO of its b) and writes (dq, dk, dv) (Args,
// Grads: kernels::AttentionArgs and AttentionGradArgs, float or bf16; ShortRows counts 4 bytes
// an element either way),
// prefetched during the item before it while they are a small part of L2 (ShortRows). Short items
// run for microseconds, with head strides each row a line or two of its own, and their first
// touches of these rows are the largest cost outside the products. Longer rows keep the hardware's
// prefetch: an item's own tiles would evict them before use.
class NextItemPrefetch {
 public:
  template <class Args, class Grads>
  NextItemPrefetch(const Args& p, const Grads& g, int64_t next_b) {
    if (next_b < 0 || !ShortRows(p)) return;
    const auto add = [&](const auto& view, int64_t rows, int64_t cols) {
      if (view.sd != 1) return;
      rows_[n_++] = RowPrefetch(view.data + p.row_offset(next_b, view.sb, view.sh), rows, cols,
                                view.st, RowPrefetch::Mode::kWholeItem);
    };
    add(p.q, p.T, p.D);
    add(g.dout, p.T, p.Dv);
    add(p.out, p.T, p.Dv);
    add(p.k, p.S, p.D);
    add(p.v, p.S, p.Dv);
    add(g.dk, p.S, p.D);
    add(g.dv, p.S, p.Dv);
    add(g.dq, p.T, p.D);
  }
  // Issues the share of steps up to i of n (RowPrefetch::Step).
  void Step(int64_t i, int64_t n) {
    for (int j = 0; j < n_; ++j)
      rows_[j].Step(i, n);
  }

 private:
  RowPrefetch rows_[8];
  int n_ = 0;
};

}  // namespace attn::cpu
