// Evaluation in the middle of training (internal to model/): Trainer (predict, evaluate) and
// Seq2SeqTrainer (evaluate, translate, the lazy layers' first forward) run the model in eval mode
// and must not move the training dropout stream; the scope puts back the mode and the dropout
// offset it found, also when what it guards throws.
#pragma once

#include "attn/core/context.hpp"
#include "attn/nn/module.hpp"

#include <cstdint>

namespace attn::model::detail {

class EvalScope {
 public:
  EvalScope(nn::Module& model, Context& ctx)
      : model_(model), ctx_(ctx), training_(model.training()), offset_(ctx.dropout_offset()) {
    model_.eval();
  }
  ~EvalScope() {
    model_.train(training_);
    ctx_.set_dropout_offset(offset_);
  }
  EvalScope(const EvalScope&) = delete;
  EvalScope& operator=(const EvalScope&) = delete;

 private:
  nn::Module& model_;
  Context& ctx_;
  bool training_;
  uint64_t offset_;
};

}  // namespace attn::model::detail
