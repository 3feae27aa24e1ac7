// Generation throughput of attn's greedy search with the key/value cache (model/generation.cpp,
// nn::TransformerDecoder::step, the decode kernel), the attn half of bench/run_decode.sh (the
// other half is bench/torch_decode.py, d2l's predict_step loop in PyTorch).
//
// Shapes of issue 14's target: E = 512, H = 8, FFN 2048, 6 encoder and 6 decoder blocks, vocab
// 10k (source and target), source 64 tokens, 256 generated tokens per sequence, fp32, eval mode,
// ATTN_THREADS threads (default 2). Random weights (seed 0), the dense bias of <eos> set to -1e9
// so that every sequence runs the 256 steps (d2l's loop never stops early either).
//
//   build/<dir>/bench/bench_generate BATCH [ROUNDS]       ATTN_CACHE=bf16: a bfloat16 KV cache
// One JSON line per round: {"impl": "attn" or "attn-bf16-cache", "batch", "tokens" (B * steps),
// "seconds", "tok_s"}.
#include "attn/model/generation.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  constexpr int64_t kVocab = 10000, kSource = 64, kSteps = 256, kEos = 2;
  const int64_t B = argc > 1 ? std::max(1, std::atoi(argv[1])) : 1;
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 1;
  const char* env = std::getenv("ATTN_THREADS");
  attn::Context ctx;
  ctx.threads = env != nullptr ? std::max(1, std::atoi(env)) : 2;

  attn::nn::Seq2SeqConfig c;
  c.src_vocab_size = c.tgt_vocab_size = kVocab;
  c.num_hiddens = 512, c.ffn_num_hiddens = 2048, c.num_heads = 8;
  c.num_enc_blks = 6, c.num_dec_blks = 6;
  c.dropout = 0.1;
  attn::nn::EncoderDecoder model(c);
  model.eval();
  if (model.decoder.dense.has_bias()) model.decoder.dense.bias.value.data<float>()[kEos] = -1e9f;

  std::vector<int64_t> ids(static_cast<size_t>(B * kSource));
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = 4 + static_cast<int64_t>((i * 7919) % (kVocab - 4));
  const attn::Tensor src = attn::Tensor::from_vector(ids, {B, kSource});
  attn::model::GenerationOptions o;
  o.bos = 1, o.eos = kEos, o.max_len = kSteps;
  const char* cache = std::getenv("ATTN_CACHE");
  const bool bf16 = cache != nullptr && std::string(cache) == "bf16";
  if (bf16) o.cache_dtype = attn::DType::BF16;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    const attn::model::Generation g = attn::model::greedy_search(ctx, model, src, {}, o);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int64_t tokens = B * g.steps;
    std::printf(
        "{\"impl\": \"%s\", \"batch\": %lld, \"tokens\": %lld, \"seconds\": %.4f, "
        "\"tok_s\": %.2f}\n",
        bf16 ? "attn-bf16-cache" : "attn", static_cast<long long>(B),
        static_cast<long long>(tokens), s, static_cast<double>(tokens) / s);
    std::fflush(stdout);
  }
  return 0;
}
