// Text data through a model's own tokenizer: which tokenizer runs (the model
// directory's, bytes, none for token files), where BOS / EOS / padding go, the
// instruction prompt mask at the tokenizer's boundary, and the errors that keep a
// real model from training on byte ids. Ids come from the HF fixtures
// (tests/data/tokenizers, made with HF's tokenizers library).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "autotp/base/error.h"
#include "autotp/data/data_tokenizer.h"
#include "autotp/data/dataset.h"
#include "autotp/tokenizer/tokenizer.h"
#include "support/checks.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

using Ids = std::vector<int64_t>;
using nlohmann::json;
const std::string kFixtures = AUTOTP_SOURCE_DIR "/tests/data/tokenizers";

std::string write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// A model directory holding only a fixture's tokenizer files.
std::string tokenizer_dir(const std::string& fixture) {
  const std::string dir = test::make_temp_dir("tok_" + fixture);
  for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
    std::filesystem::copy_file(kFixtures + "/" + fixture + "/" + file, dir + "/" + file);
  return dir;
}

Ids hf_ids(const std::string& fixture, const std::string& text) {
  return tok::Tokenizer::from_file(kFixtures + "/" + fixture + "/tokenizer.json").encode(text, false);
}

TEST(TextTokenizer, SpecialTokensFollowTokenizerConfig) {
  // Llama-2 style: add_bos_token true, <s> 1, </s> 2, no pad (then EOS pads).
  auto llama2 = tok::load_model_tokenizer(tokenizer_dir("llama2_spm_bpe"));
  EXPECT_EQ(llama2->bos_id, 1);
  EXPECT_EQ(llama2->eos_id, 2);
  EXPECT_EQ(llama2->pad_id, 2);
  EXPECT_TRUE(llama2->add_bos);
  // GPT-2: add_bos_token false; <|endoftext|> is both.
  auto gpt2 = tok::load_model_tokenizer(tokenizer_dir("gpt2_bpe"));
  const auto endoftext = tok::Tokenizer::from_file(kFixtures + "/gpt2_bpe/tokenizer.json").token_id("<|endoftext|>");
  ASSERT_TRUE(endoftext);
  EXPECT_EQ(gpt2->bos_id, endoftext);
  EXPECT_EQ(gpt2->eos_id, endoftext);
  EXPECT_FALSE(gpt2->add_bos);
  // Llama 3: no add_bos_token; the post-processor's template puts BOS first.
  const std::string llama3_dir = tokenizer_dir("llama3_bpe");
  auto llama3 = tok::load_model_tokenizer(llama3_dir);
  const auto begin = tok::Tokenizer::from_file(llama3_dir + "/tokenizer.json").token_id("<|begin_of_text|>");
  EXPECT_EQ(llama3->bos_id, begin);
  EXPECT_TRUE(llama3->add_bos);
  // Gemma-style unigram: its own pad token.
  auto unigram = tok::load_model_tokenizer(tokenizer_dir("unigram"));
  EXPECT_EQ(unigram->pad_id, 0);
  EXPECT_EQ(unigram->bos_id, 2);
  EXPECT_EQ(unigram->eos_id, 1);
  EXPECT_TRUE(unigram->add_bos);
}

TEST(TextTokenizer, PackedTextIsBosIdsEos) {
  const std::string dir = tokenizer_dir("llama2_spm_bpe");
  const std::string text = "Hello world, ça va? 12345\n  indented";
  const std::string path = write(dir + "/doc.txt", text);
  DataOptions options;
  options.seq_len = 4;
  options.vocab_size = 2000;
  options.tokenizer = tok::load_model_tokenizer(dir);
  auto data = open_dataset(path, options);
  Ids want = {1};
  for (int64_t id : hf_ids("llama2_spm_bpe", text)) want.push_back(id);
  want.push_back(2);
  Ids got;  // the stream back from consecutive windows of seq_len + 1
  for (int64_t i = 0; i < data->size(); ++i) {
    const Example e = data->get(i);
    got.push_back(e.input_ids[0]);
    for (size_t t = 0; t < e.labels.size() && e.labels[t] != kIgnoreLabel; ++t) got.push_back(e.labels[t]);
  }
  EXPECT_EQ(got, want);
  // The tail is padded with EOS (no pad token), its labels ignored.
  const Example last = data->get(data->size() - 1);
  if (last.labels.back() == kIgnoreLabel) {
    EXPECT_EQ(last.input_ids.back(), 2);
  }
  EXPECT_NE(data->describe().find("tokenizer.json"), std::string::npos) << data->describe();
}

TEST(TextTokenizer, JsonlTextRecordsEachEndWithEos) {
  const std::string dir = tokenizer_dir("gpt2_bpe");
  const std::string path = write(dir + "/docs.jsonl", "{\"text\": \"first doc\"}\n\n{\"text\": \"second one\"}\n");
  DataOptions options;
  options.vocab_size = 5000;
  options.tokenizer = tok::load_model_tokenizer(dir);
  const TokenizedText t = tokenize_documents(path, options);
  const int64_t eos = *options.tokenizer->eos_id;
  Ids want = hf_ids("gpt2_bpe", "first doc");  // add_bos_token false: no BOS
  want.push_back(eos);
  for (int64_t id : hf_ids("gpt2_bpe", "second one")) want.push_back(id);
  want.push_back(eos);
  EXPECT_EQ(Ids(t.tokens.begin(), t.tokens.end()), want);
  EXPECT_NE(t.what.find("2 text records"), std::string::npos) << t.what;
}

TEST(TextTokenizer, InstructionPromptMaskEndsAtTheTokenizersBoundary) {
  const std::string dir = tokenizer_dir("llama3_bpe");
  const std::string path =
      write(dir + "/sft.jsonl", R"({"instruction": "Name the capital of France.", "output": "Paris is the capital."})"
                                "\n");
  DataOptions options;
  options.sft.prompt_template = "plain";  // the longest-common-prefix mask under test
  options.seq_len = 64;
  options.vocab_size = 5000;
  options.tokenizer = tok::load_model_tokenizer(dir);
  auto data = open_dataset(path, options);
  const Example e = data->get(0);
  const Ids prompt = hf_ids("llama3_bpe", "Name the capital of France.\n");
  const Ids full = hf_ids("llama3_bpe", "Name the capital of France.\nParis is the capital.");
  const size_t common = static_cast<size_t>(
      std::mismatch(prompt.begin(), prompt.end(), full.begin(), full.end()).first - prompt.begin());
  Ids tokens = {*options.tokenizer->bos_id};
  tokens.insert(tokens.end(), full.begin(), full.end());
  tokens.push_back(*options.tokenizer->eos_id);
  ASSERT_LE(tokens.size(), 65u);
  for (size_t t = 0; t + 1 < tokens.size(); ++t) {
    EXPECT_EQ(e.input_ids[t], tokens[t]) << t;
    // Learned: every token after BOS + the prompt's tokens (the output and EOS).
    EXPECT_EQ(e.labels[t], t + 1 >= 1 + common ? tokens[t + 1] : kIgnoreLabel) << t;
  }
  for (size_t t = tokens.size() - 1; t < 64; ++t) EXPECT_EQ(e.labels[t], kIgnoreLabel) << t;
  EXPECT_GT(common, 3u);
}

// A hand-made tokenizer.json whose BPE merges "\n" + "x" into one token, so an
// instruction's output starting with "x" joins the prompt's last token.
std::string merging_tokenizer_dir(const json& post_processor, const json& config) {
  const std::string dir = test::make_temp_dir("tok_merge");
  const json tokenizer = {
      {"version", "1.0"},
      {"model",
       {{"type", "BPE"},
        {"vocab", {{"\n", 0}, {"x", 1}, {"\nx", 2}, {"q", 3}}},
        {"merges", json::array({json::array({"\n", "x"})})}}},
      {"added_tokens", {{{"content", "<s>"}, {"id", 4}, {"special", true}}, {{"content", "</s>"}, {"id", 5}, {"special", true}}}},
      {"post_processor", post_processor}};
  std::ofstream(dir + "/tokenizer.json") << tokenizer.dump();
  if (!config.is_null()) std::ofstream(dir + "/tokenizer_config.json") << config.dump();
  return dir;
}

json template_of(const json& single) {
  return {{"type", "TemplateProcessing"},
          {"single", single},
          {"special_tokens",
           {{"<s>", {{"id", "<s>"}, {"ids", {4}}, {"tokens", {"<s>"}}}},
            {"</s>", {{"id", "</s>"}, {"ids", {5}}, {"tokens", {"</s>"}}}}}}};
}

TEST(TextTokenizer, PromptTokenMergedWithTheOutputIsLearned) {
  const std::string dir = merging_tokenizer_dir(
      template_of({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}),
      {{"bos_token", "<s>"}, {"eos_token", "</s>"}});
  const std::string path = write(dir + "/sft.jsonl", R"({"instruction": "q", "output": "xq"})"
                                                     "\n");
  DataOptions options;
  options.sft.prompt_template = "plain";  // the longest-common-prefix mask under test
  options.seq_len = 6;
  options.vocab_size = 6;
  options.tokenizer = tok::load_model_tokenizer(dir);
  const Example e = open_dataset(path, options)->get(0);
  // "q\n" + "xq" = q, \nx, q: the prompt alone is q, \n; only q is common, so \nx is learned.
  EXPECT_EQ(e.input_ids, (Ids{4, 3, 2, 3, 5, 5}));  // <s> q \nx q </s>, padded with </s>
  EXPECT_EQ(e.labels, (Ids{kIgnoreLabel, 2, 3, 5, kIgnoreLabel, kIgnoreLabel}));
}

TEST(TextTokenizer, BosComesFromBeforeTheTextOnly) {
  // single = [$A, </s>]: no BOS; </s> is the EOS.
  const std::string dir = merging_tokenizer_dir(
      template_of({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}}),
      nullptr);
  auto t = tok::load_model_tokenizer(dir);
  EXPECT_EQ(t->bos_id, std::nullopt);
  EXPECT_EQ(t->eos_id, 5);
  EXPECT_FALSE(t->add_bos);
}

TEST(TextTokenizer, ChoiceAndErrors) {
  const std::string empty_model = test::make_temp_dir("no_tokenizer");
  const std::string txt = write(empty_model + "/a.txt", "some text");
  ModelSource real;
  real.dir = empty_model;
  ModelSource preset;  // no dir
  EXPECT_EQ(choose_tokenizer("auto", preset, txt), nullptr);
  EXPECT_EQ(choose_tokenizer("bytes", real, txt), nullptr);
  EXPECT_EQ(choose_tokenizer("auto", real, empty_model + "/tokens.bin"), nullptr);  // ids already
  const std::string missing = test::user_error_of([&] { choose_tokenizer("auto", real, txt); });
  EXPECT_NE(missing.find(empty_model), std::string::npos) << missing;
  EXPECT_NE(missing.find("tokenizer.json"), std::string::npos) << missing;
  EXPECT_NE(missing.find("--tokenizer bytes"), std::string::npos) << missing;
  const std::string not_dir = test::user_error_of([&] { choose_tokenizer(empty_model + "/nope", real, txt); });
  EXPECT_NE(not_dir.find("not a directory"), std::string::npos) << not_dir;
  // A tokenizer bigger than the model's vocabulary belongs to another model.
  DataOptions options;
  options.seq_len = 4;
  options.vocab_size = 300;
  options.tokenizer = choose_tokenizer(tokenizer_dir("gpt2_bpe"), preset, txt);
  const std::string too_big = test::user_error_of([&] { open_dataset(txt, options); });
  EXPECT_NE(too_big.find("more than the model's vocab_size 300"), std::string::npos) << too_big;
  // Chat records need a template autotp does not render.
  const std::string chat = write(empty_model + "/chat.jsonl", R"({"messages": [{"role": "user", "content": "hi"}]})"
                                                              "\n");
  options.vocab_size = 5000;
  const std::string messages = test::user_error_of([&] { open_dataset(chat, options); });
  EXPECT_NE(messages.find("line 1"), std::string::npos) << messages;
  EXPECT_NE(messages.find("chat_template"), std::string::npos) << messages;
  // Invalid UTF-8 (here an overlong NUL) names the file.
  const std::string bad_text = write(empty_model + "/bad.txt", "ok \xC0\x80");
  const std::string utf8 = test::user_error_of([&] { open_dataset(bad_text, options); });
  EXPECT_NE(utf8.find(bad_text + ": the text is not valid UTF-8 (byte 3 of 5)"), std::string::npos) << utf8;
  // A token file has no prompt mask.
  const std::string sft = write(empty_model + "/sft.jsonl", R"({"instruction": "a", "output": "b"})"
                                                            "\n");
  const std::string stream = test::user_error_of([&] { tokenize_documents(sft, options); });
  EXPECT_NE(stream.find("instruction records"), std::string::npos) << stream;
}

TEST(TextTokenizer, ByteLevelStaysThePresetsTokenizer) {
  const std::string dir = test::make_temp_dir("bytes");
  const std::string path = write(dir + "/a.txt", "ab");
  DataOptions options;
  options.seq_len = 3;
  options.vocab_size = 258;
  auto data = open_dataset(path, options);
  const Example e = data->get(0);
  EXPECT_EQ(e.input_ids, (Ids{256, 'a', 'b'}));
  EXPECT_EQ(e.labels, (Ids{'a', 'b', 257}));
}

}  // namespace
}  // namespace autotp
