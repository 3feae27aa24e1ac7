// Training a Transformer encoder-decoder (d2l 11.7, n -> m): one step of AdamW with gradient
// clipping under teacher forcing, evaluation by greedy decoding (BLEU and exact match), and
// checkpoints that hold everything needed to resume bit for bit or to translate.
//
// Vocabulary: B batch, S source positions, T target positions, E = num_hiddens, V target
// vocabulary.
//
//   logits = EncoderDecoder(src, dec_input, src_valid_lens)        (B, T, V)
//            dec_input = <bos> y_0 .. y_{T-2}  (teacher forcing: the label shifted right)
//   loss   = sum_{b, t < tgt_valid_lens[b]} CE(logits[b, t], labels[b, t]) / sum_b
//   tgt_valid_lens[b]
//            d2l 1.0's Seq2Seq.loss: the mean over the non-pad labels of the batch (<eos> counts)
//   grads  = backward; clip_grad_norm(clip_norm); AdamW step
//
// Reproducibility (as model::Trainer): a step is a pure function of (parameters, AdamW state,
// batch, dropout offset); parameters come from the seed; the kernels give the same bits for any
// thread count; a checkpoint stores the parameters, the AdamW state, the step and the dropout
// offset exactly. Batches must be a pure function of the step (the generated tasks and
// EpochSampler are), so "train N, save, load, train M" repeats N + M steps in one go bitwise.
//
// Checkpoint file (safetensors): tensors "model.<EncoderDecoder state dict>" and
// "optimizer.<AdamW state>"; metadata attn.format = "attn-seq2seq-checkpoint/1", attn.options
// (to_json below: model config, num_steps, preprocessing, AdamW, clip, seed), attn.src_vocab and
// attn.tgt_vocab (Vocabulary::to_json), attn.step, attn.dropout_offset, attn.precision ("fp32"
// or "bf16", informative: from_checkpoint takes it up), plus the caller's extra entries. The
// encoder tasks' checkpoints (model::Trainer) are "attn-checkpoint/1": loading one here, or this
// one there, is an Error that says which kind the file is.
#pragma once

#include "attn/core/context.hpp"
#include "attn/model/generation.hpp"
#include "attn/model/precision.hpp"
#include "attn/model/seq2seq_data.hpp"
#include "attn/nn/decoder.hpp"
#include "attn/nn/optim.hpp"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace attn::model {

// The format tags of the two checkpoint kinds (metadata "attn.format").
inline constexpr const char* kEncoderCheckpointFormat = "attn-checkpoint/1";
inline constexpr const char* kSeq2SeqCheckpointFormat = "attn-seq2seq-checkpoint/1";

// "attn-checkpoint/1", "attn-seq2seq-checkpoint/1", or Error("checkpoint") for a file that is
// not a safetensors file or has no attn.format (one line naming the path and what is wrong).
std::string checkpoint_format(const std::string& path);

struct Seq2SeqTrainOptions {
  // Widths, blocks, dropout and both vocabulary sizes. dtype must be F32; model.seed is ignored
  // (the parameters are drawn from `seed` below).
  nn::Seq2SeqConfig model;
  // The model's limit: sources and targets are cut to this many tokens, <eos> included (d2l's
  // num_steps); translation generates at most this many tokens unless asked for fewer.
  int64_t num_steps = 16;
  // How raw source text is read (training data and `attn translate` input alike).
  TextPreprocess preprocess;
  nn::AdamWOptions adamw;  // lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01
  double clip_norm = 1.0;  // global L2 norm of the gradients; 0 turns clipping off
  uint64_t seed = 0;       // parameter initialisation and the dropout stream
  int threads = 0;         // 0: all hardware threads; results do not depend on it
  // The training step's and the teacher-forced evaluation loss's precision (attn/model/
  // precision.hpp); not in to_json. Decoding (greedy and beam search: evaluate's BLEU,
  // translate, greedy_ids) runs in float32 on the float32 parameters in either precision, so a
  // checkpoint translates the same whichever precision trained it or loads it.
  Precision precision = Precision::kFloat32;
};

// JSON text of the options (threads left out: they do not change results) and back;
// Error("Seq2SeqTrainOptions") for malformed text.
std::string to_json(const Seq2SeqTrainOptions& options);
Seq2SeqTrainOptions seq2seq_train_options_from_json(const std::string& json);

struct Seq2SeqStepStats {
  int64_t step = 0;      // the step just taken, counting from 1
  double loss = 0;       // the batch's masked mean loss before the update
  double grad_norm = 0;  // before clipping
  int64_t tokens = 0;    // target tokens that count in the loss
};

struct Seq2SeqEvalStats {
  double loss = 0;         // teacher-forced masked mean over every target token of the set
  double bleu = 0;         // mean sentence BLEU (d2l's, k = 4) of the greedy translations
  double exact_match = 0;  // fraction of greedy translations equal to their target
  int64_t examples = 0, tokens = 0;
};

struct TranslateOptions {
  int64_t beam_size = 1;         // 1: greedy search; > 1: beam search
  double length_penalty = 0.75;  // beam search: log P / L^alpha
  int64_t max_len = 0;           // tokens generated at most, <eos> included (0: num_steps)
  int64_t batch_size = 64;       // sources decoded together
};

struct Translations {
  std::vector<std::vector<std::string>> tokens;  // per source, without <eos>
  std::vector<int64_t> cut;  // sources longer than num_steps - 1 tokens, cut (by index)
};

class Seq2SeqTrainer {
 public:
  // The vocabularies must be Reserved::kSeq2Seq and of the sizes options.model names.
  Seq2SeqTrainer(const Seq2SeqTrainOptions& options, Vocabulary src_vocab, Vocabulary tgt_vocab);

  // One optimisation step on `batch` (make_seq2seq_batch). Error("train") when the loss is not
  // finite.
  Seq2SeqStepStats train_step(const Seq2SeqBatch& batch);
  // Loss, BLEU and exact match on `data` (greedy decoding with the KV cache, at most num_steps
  // tokens), in eval mode; the training state and the dropout stream are unchanged.
  Seq2SeqEvalStats evaluate(const Seq2SeqDataset& data, int64_t batch_size = 64);
  // Translates token sequences (unknown tokens become <unk>). An empty source gives an empty
  // translation without running the model. Sources are cut to num_steps tokens with <eos>.
  Translations translate(const std::vector<std::vector<std::string>>& sources,
                         const TranslateOptions& options = {});
  // Greedy translations of encoded sources (ids without <eos>), as target ids without <eos>.
  std::vector<std::vector<int64_t>> greedy_ids(const std::vector<std::vector<int64_t>>& sources,
                                               int64_t batch_size = 64);

  // Atomic (a temporary file renamed over `path`). `extra` names must not start with "attn.".
  void save_checkpoint(const std::string& path,
                       const std::map<std::string, std::string>& extra = {}) const;
  // Restores what save_checkpoint wrote. The options (threads aside) and vocabularies must equal
  // this trainer's, else Error("load_checkpoint") naming the first difference; nothing changes
  // when anything is wrong. Returns the extra metadata.
  std::map<std::string, std::string> load_checkpoint(const std::string& path);
  // A trainer built from a checkpoint's options and vocabularies and loaded from it (threads
  // from the argument). Error for an encoder-task checkpoint or a corrupt file.
  static std::unique_ptr<Seq2SeqTrainer> from_checkpoint(const std::string& path, int threads = 0);

  int64_t step() const { return step_; }
  const Seq2SeqTrainOptions& options() const { return options_; }
  const Vocabulary& src_vocab() const { return src_vocab_; }
  const Vocabulary& tgt_vocab() const { return tgt_vocab_; }
  nn::EncoderDecoder& model() { return *model_; }
  Context& context() { return ctx_; }
  nn::AdamW& optimizer() { return *optimizer_; }

 private:
  Seq2SeqTrainOptions options_;
  Vocabulary src_vocab_, tgt_vocab_;
  Context ctx_;
  std::unique_ptr<nn::EncoderDecoder> model_;
  std::unique_ptr<nn::AdamW> optimizer_;
  int64_t step_ = 0;
};

}  // namespace attn::model
