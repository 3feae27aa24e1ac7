// Time per generated token of the Transformer decoder at a given position, with the key/value
// cache (nn::TransformerDecoder::step: one new query against the cached projections) and without
// it (the decoder's forward on the whole prefix, the last position's logits kept: what a loop
// without a cache computes, O(t) rows per token).
//
// Shapes of issue 14's generation target: E = 512, H = 8 (D = 64), FFN 2048, 6 decoder blocks,
// target vocabulary 10k, source of 64 tokens, fp32, eval mode, ATTN_THREADS threads (default 2).
// Arguments: {cache 1/0, position t, batch B}. Each iteration decodes kSteps tokens at positions
// t .. t + kSteps - 1 after an untimed prefill of t positions (one chunked step, or nothing without
// the cache); the reported time is per token and sequence: wall time / kSteps (manual time), and
// the counter us_per_token divides by B as well.
//
//   build/<dir>/bench/bench_decode --benchmark_filter='cache:1'
#include "attn/nn/decoder.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <vector>

namespace {

constexpr int64_t kE = 512, kH = 8, kF = 2048, kBlocks = 6, kVocab = 10000, kSource = 64,
                  kSteps = 8;

int bench_threads() {
  const char* env = std::getenv("ATTN_THREADS");
  return env != nullptr ? std::max(1, std::atoi(env)) : 2;
}

attn::nn::EncoderDecoder& model() {
  static std::unique_ptr<attn::nn::EncoderDecoder> m = [] {
    attn::nn::Seq2SeqConfig c;
    c.src_vocab_size = kVocab;
    c.tgt_vocab_size = kVocab;
    c.num_hiddens = kE;
    c.ffn_num_hiddens = kF;
    c.num_heads = kH;
    c.num_enc_blks = 1;  // only its outputs matter here
    c.num_dec_blks = kBlocks;
    c.dropout = 0.1;
    auto p = std::make_unique<attn::nn::EncoderDecoder>(c);
    p->eval();
    return p;
  }();
  return *m;
}

attn::Tensor token_ids(int64_t B, int64_t T, int64_t salt) {
  std::vector<int64_t> ids(static_cast<size_t>(B * T));
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<int64_t>((i * 7919 + static_cast<size_t>(salt) * 104729) % kVocab);
  return attn::Tensor::from_vector(ids, {B, T});
}

void BM_DecodeToken(benchmark::State& state) {
  const bool cache = state.range(0) != 0;
  const int64_t t0 = state.range(1), B = state.range(2);
  attn::Context ctx;
  ctx.threads = bench_threads();
  attn::nn::EncoderDecoder& m = model();
  const attn::Tensor enc = m.encoder.forward(ctx, token_ids(B, kSource, 1));
  const attn::Tensor prefix = token_ids(B, t0 + kSteps, 2);
  double total = 0;
  int64_t tokens = 0;
  for (auto _ : state) {
    double seconds = 0;
    if (cache) {
      attn::nn::DecoderState s = m.decoder.init_state(ctx, enc, {}, t0 + kSteps);
      if (t0 > 0) m.decoder.step(ctx, prefix.slice(1, 0, t0).contiguous(), s);  // prefill
      for (int64_t t = t0; t < t0 + kSteps; ++t) {
        const attn::Tensor ids = prefix.slice(1, t, t + 1).contiguous();
        const auto start = std::chrono::steady_clock::now();
        benchmark::DoNotOptimize(m.decoder.step(ctx, ids, s).raw_data());
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
    } else {
      for (int64_t t = t0; t < t0 + kSteps; ++t) {
        const attn::Tensor ids = prefix.slice(1, 0, t + 1).contiguous();
        const auto start = std::chrono::steady_clock::now();
        const attn::Tensor logits = m.decoder.forward(ctx, ids, enc);
        benchmark::DoNotOptimize(logits.select(1, t).contiguous().raw_data());
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
    }
    state.SetIterationTime(seconds / kSteps);
    total += seconds;
    tokens += kSteps * B;
  }
  state.counters["us_per_token"] = total * 1e6 / static_cast<double>(std::max<int64_t>(1, tokens));
  state.SetLabel(cache ? "cache" : "recompute");
}

BENCHMARK(BM_DecodeToken)
    ->ArgNames({"cache", "pos", "B"})
    ->ArgsProduct({{1}, {16, 64, 256, 1024}, {1, 16}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(BM_DecodeToken)
    ->ArgNames({"cache", "pos", "B"})
    ->ArgsProduct({{0}, {16, 64, 256}, {1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(2);

}  // namespace

BENCHMARK_MAIN();
