// Tokenizer throughput on one core: encoding tests/data/tokenizers/corpus_mixed.txt
// (200 KB of prose, code, numbers, CJK, emoji, whitespace runs and special-token
// strings) as one string without special tokens, with each fixture's tokenizer.json
// loaded once (HF's figures in bench/README.md load a fresh tokenizer per run: it
// has a word cache, autotp has none). bytes/s counts corpus bytes.
#include <benchmark/benchmark.h>

#include <fstream>
#include <iterator>
#include <string>

#include "autotp/tokenizer/tokenizer.h"

namespace {

const std::string kFixtures = AUTOTP_SOURCE_DIR "/tests/data/tokenizers";

const std::string& corpus() {
  static const std::string text = [] {
    std::ifstream in(kFixtures + "/corpus_mixed.txt", std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  return text;
}

void encode_corpus(benchmark::State& state, const std::string& name) {
  const auto tokenizer = autotp::tok::Tokenizer::from_file(kFixtures + "/" + name + "/tokenizer.json");
  const std::string& text = corpus();
  size_t ids = 0;
  for (auto _ : state) {
    auto encoded = tokenizer.encode(text, false);
    ids = encoded.size();
    benchmark::DoNotOptimize(encoded.data());
  }
  state.counters["bytes/s"] = benchmark::Counter(
      static_cast<double>(text.size()) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["ids"] = static_cast<double>(ids);
}

}  // namespace

BENCHMARK_CAPTURE(encode_corpus, gpt2_bpe, std::string("gpt2_bpe"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(encode_corpus, llama3_bpe, std::string("llama3_bpe"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(encode_corpus, llama2_spm_bpe, std::string("llama2_spm_bpe"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(encode_corpus, mistral_spm_metaspace, std::string("mistral_spm_metaspace"))
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(encode_corpus, unigram, std::string("unigram"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(encode_corpus, wordpiece, std::string("wordpiece"))->Unit(benchmark::kMillisecond);
