// Generated tasks that need word order, made from a seed (nothing is downloaded).
//
// Self-attention without positional encoding is permutation-equivariant: permuting the tokens
// permutes its outputs the same way, so a mean-pooled sequence summary is permutation-invariant.
// Both tasks below are built so that this blindness leaves the model at chance level:
//
//   shift  (tagging, n -> n):   tag[i] = token[i-1] for i >= 1 (position 0 has no target).
//          Without positions, token i sees only its own value and the multiset of the sequence,
//          which does not say which token came just before it.
//   sorted (classification, n -> 1): label 1 iff the sequence is non-decreasing. A positive is
//          a random multiset in sorted order; a negative is a random multiset (drawn the same
//          way) shuffled until it is not sorted. The two classes have the same distribution of
//          multisets, so any order-blind model scores exactly 50% in expectation.
//
// Token ids: 0 = <pad>, 1 = <unk> (never generated), symbols are 2 .. num_symbols + 1, so the
// vocabulary size is num_symbols + 2 and shift's tag of symbol s is s - 2 (num_symbols tags).
// Lengths are uniform in [min_len, max_len]. Everything is drawn from Rng(seed, stream): the
// trainer uses one stream per step (batch s is generate(..., seed, s)) and separate streams for
// the evaluation sets, so a run is reproducible from its seed and resumable from its step.
#pragma once

#include "attn/model/data.hpp"

#include <cstdint>
#include <string>

namespace attn::model {

enum class GeneratedTask : uint8_t { kShift, kSorted };
const char* generated_task_name(GeneratedTask task);
// "shift" or "sorted"; Error otherwise.
GeneratedTask parse_generated_task(const std::string& name);
TaskType task_type(GeneratedTask task);

struct TaskOptions {
  GeneratedTask task = GeneratedTask::kShift;
  int64_t num_symbols = 8;
  int64_t min_len = 8, max_len = 16;
};

// Checks the options (num_symbols >= 2, 2 <= min_len <= max_len); Error("generate_task").
void validate(const TaskOptions& options);
int64_t task_vocab_size(const TaskOptions& options);
int64_t task_num_classes(const TaskOptions& options);

// `num_examples` examples from Rng(seed, stream).
Dataset generate_task(const TaskOptions& options, int64_t num_examples, uint64_t seed,
                      uint64_t stream);

// The stream of an evaluation set of sequences of exactly `length` tokens: far from the training
// streams (which count steps from 0), and different for each length.
constexpr uint64_t eval_stream(int64_t length) {
  return (uint64_t{1} << 62) + static_cast<uint64_t>(length);
}

}  // namespace attn::model
