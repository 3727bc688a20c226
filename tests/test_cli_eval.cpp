// End-to-end: `autotp presets`, `init`, `plan` and `eval` as a user runs them.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "autotp/io/safetensors.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

using nlohmann::json;
using test::run_cli;

std::string write_tokens(const std::string& dir, const json& tokens, const std::string& name = "tokens") {
  std::string path = dir + "/" + name + ".json";
  io::write_text_file_atomic(path, tokens.dump());
  return path;
}

json sample_tokens() {
  json tokens = json::array();
  for (int s = 0; s < 3; ++s) {
    json seq = json::array();
    for (int t = 0; t < 10; ++t) seq.push_back((s * 37 + t * 11) % 259);
    tokens.push_back(seq);
  }
  return tokens;
}

TEST(CliPresets, ListsEveryPresetWithParameterCount) {
  auto r = run_cli("presets");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("preset:llama-tiny "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("preset:gpt2-tiny"), std::string::npos);
  EXPECT_NE(r.output.find("GPT2LMHeadModel"), std::string::npos);
}

class CliEval : public ::testing::TestWithParam<std::string> {};

TEST_P(CliEval, InitThenEvalAtTp1AndTp3Agree) {
  const std::string preset = GetParam();
  std::string dir = test::make_temp_dir("cli");
  auto init = run_cli("init --model preset:" + preset + " --out " + dir + "/model --seed 3");
  ASSERT_EQ(init.exit_code, 0) << init.output;
  json config = json::parse(test::read_file(dir + "/model/config.json"));
  EXPECT_EQ(config["torch_dtype"], "float32");
  std::string tokens = write_tokens(dir, sample_tokens());
  auto one = run_cli("eval --model " + dir + "/model --tokens " + tokens + " --out " + dir + "/r1.json --logits " +
                     dir + "/l1.safetensors");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto three = run_cli("eval --model " + dir + "/model --tokens " + tokens + " --out " + dir +
                       "/r3.json --logits " + dir + "/l3.safetensors --nproc 3 --tp 3");
  ASSERT_EQ(three.exit_code, 0) << three.output;
  json r1 = json::parse(test::read_file(dir + "/r1.json"));
  json r3 = json::parse(test::read_file(dir + "/r3.json"));
  EXPECT_EQ(r1["tokens"], 27);
  EXPECT_NEAR(r1["perplexity"].get<double>(), std::exp(r1["loss"].get<double>()), 1e-9);
  // Random weights with std 0.02 give a loss near ln(vocab).
  EXPECT_NEAR(r1["loss"].get<double>(), std::log(259.0), 0.1);
  EXPECT_NEAR(r3["loss"].get<double>(), r1["loss"].get<double>(), 1e-5 * r1["loss"].get<double>());
  auto l1 = io::SafetensorsFile::open(dir + "/l1.safetensors")->read("logits");
  auto l3 = io::SafetensorsFile::open(dir + "/l3.safetensors")->read("logits");
  EXPECT_EQ(l1.sizes(), (std::vector<int64_t>{3, 9, 259}));
  EXPECT_LT((l1 - l3).abs().max().item<double>(), 1e-5);
  // Sequence parallelism changes where norms run, not the result.
  auto sp = run_cli("eval --model " + dir + "/model --tokens " + tokens + " --out " + dir + "/rsp.json --logits " +
                    dir + "/lsp.safetensors --nproc 3 --tp 3 --sequence-parallel");
  ASSERT_EQ(sp.exit_code, 0) << sp.output;
  EXPECT_NEAR(json::parse(test::read_file(dir + "/rsp.json"))["loss"].get<double>(), r1["loss"].get<double>(),
              1e-5 * r1["loss"].get<double>());
  auto lsp = io::SafetensorsFile::open(dir + "/lsp.safetensors")->read("logits");
  EXPECT_LT((l1 - lsp).abs().max().item<double>(), 1e-5);
  // A preset evaluates directly too (same seed, same weights).
  auto direct = run_cli("eval --model preset:" + preset + " --seed 3 --tokens " + tokens + " --out " + dir +
                        "/rp.json");
  ASSERT_EQ(direct.exit_code, 0) << direct.output;
  EXPECT_EQ(json::parse(test::read_file(dir + "/rp.json"))["loss"], r1["loss"]);
}

INSTANTIATE_TEST_SUITE_P(Presets, CliEval, ::testing::Values("llama-tiny", "gpt2-tiny", "qwen2-tiny"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (auto& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

TEST(CliErrors, BadInputExitsWithCode2AndANamedCause) {
  std::string dir = test::make_temp_dir("clierr");
  std::string tokens = write_tokens(dir, sample_tokens());
  struct Case {
    std::string args, expected;
  };
  std::vector<Case> cases = {
      {"eval --model preset:nope --tokens " + tokens + " --out " + dir + "/r.json", "unknown preset 'nope'"},
      {"eval --model " + dir + "/missing --tokens " + tokens + " --out " + dir + "/r.json", "no such directory"},
      {"eval --model preset:llama-tiny --tokens " + write_tokens(dir, json::parse("[[1,2,3],[4,5]]"), "ragged") + " --out " +
           dir + "/r.json",
       "sequence 1 has 2 tokens"},
      {"eval --model preset:llama-tiny --tokens " + write_tokens(dir, json::parse("[[1,2,300]]"), "range") + " --out " + dir +
           "/r.json",
       "token id 300 is outside the vocabulary"},
      {"eval --model preset:llama-tiny --tokens " + write_tokens(dir, json::parse("[]"), "empty") + " --out " + dir +
           "/r.json",
       "holds no sequences"},
      {"plan --model preset:llama-tiny --tp 7", "autotp_size 7 exceeds num_attention_heads 6"},
      {"init --model preset:llama-tiny --out " + dir + "/m --dtype f64", "unknown dtype 'f64'"},
      {"eval --model preset:llama-tiny --tokens " + tokens + " --out " + dir + "/r.json --bogus-flag", "--bogus-flag"},
  };
  for (const auto& c : cases) {
    auto r = run_cli(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\n" << r.output;
  }
}

TEST(CliErrors, AFailingRankFailsTheRunAndIsNamed) {
  std::string dir = test::make_temp_dir("clirank");
  std::string tokens = write_tokens(dir, sample_tokens());
  // tp 7 > 6 heads: every rank rejects it; the launcher reports a failed rank with code 2.
  auto r = run_cli("eval --model preset:llama-tiny --tokens " + tokens + " --out " + dir + "/r.json --nproc 7");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("rank"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exceeds num_attention_heads"), std::string::npos) << r.output;
}

TEST(CliPlan, ShowsUnevenAndSharedShards) {
  auto r = run_cli("plan --model preset:llama-tiny --tp 4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[32, 96] [32, 96] [16, 96] [16, 96]"), std::string::npos) << r.output;  // q_proj
  EXPECT_NE(r.output.find("(kv heads shared)"), std::string::npos);
  EXPECT_NE(r.output.find("rank 3:"), std::string::npos);
  auto sp = run_cli("plan --model preset:llama-tiny --tp 2 --sequence-parallel");
  ASSERT_EQ(sp.exit_code, 0) << sp.output;
  EXPECT_NE(sp.output.find("tp = 2, sequence parallel"), std::string::npos) << sp.output;
  EXPECT_NE(sp.output.find("sequence parallel: each rank sees its tokens"), std::string::npos) << sp.output;
}

}  // namespace
}  // namespace autotp
