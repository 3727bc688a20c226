// End-to-end: `autotp tokenize` writes the ids HF's tokenizers library gives for
// the 200 KB mixed corpus (its corpus_summary.json), and training on that .bin
// equals training on the text itself; a real model directory without tokenizer
// files is exit 2 for text data, never a silent byte-level run.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "autotp/io/safetensors.h"
#include "autotp/tokenizer/tokenizer.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"
#include "support/reference_models.h"

namespace autotp {
namespace {

using nlohmann::json;
using test::run_cli;

const std::string kFixtures = AUTOTP_SOURCE_DIR "/tests/data/tokenizers";

// FNV-1a 64 over the ids as consecutive little-endian uint32 (corpus_summary.json).
std::string fnv1a64_hex(const std::vector<uint32_t>& ids) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (uint32_t id : ids)
    for (int b = 0; b < 4; ++b) {
      hash ^= (id >> (8 * b)) & 0xff;
      hash *= 0x100000001b3ULL;
    }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
  return hex;
}

class CliTokenize : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("cli_tokenize");
    // llama-tiny's shape with the fixture's vocabulary (998 ids: 1024 leaves room).
    const json config = test::preset_config("llama-tiny", {{"vocab_size", 1024}});
    model_ = test::write_model_dir(dir_ + "/model", config, test::reference_random_weights(config, 5));
    for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
      std::filesystem::copy_file(kFixtures + "/llama3_bpe/" + file, model_ + "/" + file);
    io::write_text_file_atomic(dir_ + "/ds.json", json({{"train_micro_batch_size_per_gpu", 2},
                                                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}}})
                                                      .dump());
  }
  std::string dir_, model_;
};

TEST_F(CliTokenize, IdsEqualHfAndTrainingOnThemEqualsTrainingOnText) {
  const json summary = json::parse(test::read_file(kFixtures + "/llama3_bpe/corpus_summary.json"));
  const std::string corpus = kFixtures + "/corpus_mixed.txt";
  auto r = run_cli("tokenize --model " + model_ + " --data " + corpus + " --out " + dir_ + "/corpus.bin");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("MB/s"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--bin-dtype uint16"), std::string::npos) << r.output;
  // BOS (add_bos from the template), the corpus's ids, EOS; uint16 little-endian.
  const std::string bytes = test::read_file(dir_ + "/corpus.bin");
  const auto count = summary["count"].get<size_t>();
  ASSERT_EQ(bytes.size(), (count + 2) * 2);
  std::vector<uint32_t> ids;
  for (size_t i = 0; i < bytes.size(); i += 2)
    ids.push_back(static_cast<uint8_t>(bytes[i]) | static_cast<uint32_t>(static_cast<uint8_t>(bytes[i + 1])) << 8);
  const auto tokenizer = tok::Tokenizer::from_file(model_ + "/tokenizer.json");
  EXPECT_EQ(ids.front(), tokenizer.token_id("<|begin_of_text|>").value());
  EXPECT_EQ(ids.back(), tokenizer.token_id("<|end_of_text|>").value());
  const std::vector<uint32_t> body(ids.begin() + 1, ids.end() - 1);
  EXPECT_EQ(fnv1a64_hex(body), summary["fnv1a64"].get<std::string>());
  std::vector<uint32_t> first;
  for (const auto& id : summary["first_ids"]) first.push_back(id.get<uint32_t>());
  EXPECT_EQ(std::vector<uint32_t>(body.begin(), body.begin() + static_cast<std::ptrdiff_t>(first.size())), first);

  // --dtype uint32: the same ids, four bytes each.
  r = run_cli("tokenize --model " + model_ + " --data " + corpus + " --dtype uint32 --out " + dir_ + "/corpus32.bin");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string wide = test::read_file(dir_ + "/corpus32.bin");
  ASSERT_EQ(wide.size(), (count + 2) * 4);
  std::vector<uint32_t> wide_ids(count + 2);
  std::memcpy(wide_ids.data(), wide.data(), wide.size());
  EXPECT_EQ(wide_ids, ids);

  // Same examples, same losses.
  const std::string common = "train --config " + dir_ + "/ds.json --model " + model_ +
                             " --seq-len 32 --steps 3 --no-shuffle --seed 3 --metrics ";
  auto from_text = run_cli(common + dir_ + "/text.jsonl --data " + corpus);
  ASSERT_EQ(from_text.exit_code, 0) << from_text.output;
  auto from_bin = run_cli(common + dir_ + "/bin.jsonl --data " + dir_ + "/corpus.bin --bin-dtype uint16");
  ASSERT_EQ(from_bin.exit_code, 0) << from_bin.output;
  const auto a = test::read_json_lines(dir_ + "/text.jsonl"), b = test::read_json_lines(dir_ + "/bin.jsonl");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << i;
  EXPECT_NE(from_text.output.find("tokenizer.json"), std::string::npos) << from_text.output;
}

TEST_F(CliTokenize, RealModelWithoutTokenizerIsExit2ForText) {
  for (const char* file : {"tokenizer.json", "tokenizer_config.json"}) std::filesystem::remove(model_ + "/" + file);
  io::write_text_file_atomic(dir_ + "/a.txt", "some text to train on, long enough for an example or two");
  auto r = run_cli("train --config " + dir_ + "/ds.json --model " + model_ + " --data " + dir_ +
                   "/a.txt --seq-len 8 --steps 1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(model_ + ": the model directory has no tokenizer"), std::string::npos) << r.output;
  // Said explicitly, byte ids are fine (the model's vocabulary holds 258).
  r = run_cli("train --config " + dir_ + "/ds.json --model " + model_ + " --data " + dir_ +
              "/a.txt --seq-len 8 --steps 1 --tokenizer bytes");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = run_cli("tokenize --model " + model_ + " --data " + dir_ + "/a.txt --out " + dir_ + "/a.bin");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/a.bin"));
}

}  // namespace
}  // namespace autotp
