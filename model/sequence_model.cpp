// The sequence model `attn train` trains on the encoder tasks: d2l's TransformerEncoder with a
// classification head (masked mean over valid positions, then a linear layer) or a tagging head
// (a linear layer per position). Declared in attn/model/trainer.hpp beside the Trainer that owns
// it.
#include "attn/core/error.hpp"
#include "attn/model/trainer.hpp"

#include <string>

namespace attn::model {

namespace {

// The head's parameters draw from a stream of their own, derived from the run's seed by one
// splitmix64 round (the encoder's children derive theirs from `seed` by name).
uint64_t head_seed(uint64_t seed) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

nn::TransformerEncoderOptions encoder_options(const ModelConfig& c, uint64_t seed) {
  nn::TransformerEncoderOptions o;
  o.positional = c.positional;
  o.max_len = c.max_len;
  o.seed = seed;
  return o;
}

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

}  // namespace

SequenceModel::SequenceModel(const ModelConfig& c, uint64_t seed)
    : nn::Module(DType::F32),
      encoder(c.vocab_size, c.num_hiddens, c.ffn_num_hiddens, c.num_heads, c.num_blks, c.dropout,
              false, encoder_options(c, seed)),
      config_(c) {
  check(c.num_classes >= 1, "SequenceModel", "num_classes must be >= 1, got {}", c.num_classes);
  if (c.type == TaskType::kClassification)
    classifier = std::make_unique<nn::ClassificationHead>(c.num_classes, c.num_hiddens, DType::F32,
                                                          head_seed(seed));
  else
    tagger = std::make_unique<nn::TaggingHead>(c.num_classes, c.num_hiddens, DType::F32,
                                               head_seed(seed));
}

std::vector<std::pair<std::string, nn::Parameter*>> SequenceModel::named_parameters() {
  std::vector<std::pair<std::string, nn::Parameter*>> out;
  nn::append_parameters(out, "encoder", encoder);
  if (classifier) nn::append_parameters(out, "head", *classifier);
  if (tagger) nn::append_parameters(out, "head", *tagger);
  return out;
}

void SequenceModel::train(bool on) {
  Module::train(on);
  encoder.train(on);
  if (classifier) classifier->train(on);
  if (tagger) tagger->train(on);
}

Tensor SequenceModel::forward(Context& ctx, const Tensor& ids, const Tensor& valid_lens) {
  encoder.set_need_weights(need_weights);
  // X (B, T, E): every position attends to the valid keys of its sequence only.
  Tensor X = encoder.forward(ctx, ids, valid_lens);
  if (classifier) return classifier->forward(ctx, X, valid_lens);  // mean over valid positions
  return tagger->forward(ctx, X);
}

void SequenceModel::backward(Context& ctx, const Tensor& dlogits) {
  backward(ctx, dlogits, {});
}

void SequenceModel::backward(Context& ctx, const Tensor& dlogits,
                             const std::function<void(int64_t)>& stage_done) {
  Tensor dX = classifier ? classifier->backward(ctx, dlogits) : tagger->backward(ctx, dlogits);
  if (stage_done) stage_done(0);
  const int64_t n = encoder.num_blks();
  std::function<void(int64_t)> block_done;
  if (stage_done) block_done = [&](int64_t blk) { stage_done(n - blk); };
  encoder.backward(ctx, dX, block_done);
  if (stage_done) stage_done(n + 1);
}

int64_t SequenceModel::stage_of(const std::string& name) const {
  if (starts_with(name, "head.")) return 0;
  constexpr const char* kBlock = "encoder.blks.block";
  if (starts_with(name, kBlock)) {
    const int64_t blk = std::stoll(name.substr(std::string(kBlock).size()));
    return encoder.num_blks() - blk;
  }
  return encoder.num_blks() + 1;  // encoder.embedding.*, encoder.pos_encoding.*
}

}  // namespace attn::model
