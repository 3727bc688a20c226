// End-to-end: `autotp train` as a user runs it, on 2 local ranks: the metrics
// file (one JSON line per step with losses, timings and every rank's model-state
// bytes), layout independence of the first loss, and bad input (exit code 2 with
// a message naming the problem).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "autotp/io/safetensors.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

using nlohmann::json;
using test::run_cli;

std::string write(const std::string& path, const std::string& text) {
  io::write_text_file_atomic(path, text);
  return path;
}

json ds_config(int tp, int stage, const json& batch) {
  json c = {{"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"weight_decay", 0.01}}}}},
            {"gradient_clipping", 1.0},
            {"zero_optimization", {{"stage", stage}}},
            {"tensor_parallel", {{"autotp_size", tp}}}};
  c.update(batch);
  return c;
}


void expect_metrics(const std::vector<json>& lines, int tp, int dp, int stage) {
  ASSERT_EQ(lines.size(), 3u);
  for (size_t i = 0; i < lines.size(); ++i) {
    const json& l = lines[i];
    SCOPED_TRACE(l.dump());
    EXPECT_EQ(l.at("step").get<int64_t>(), static_cast<int64_t>(i + 1));
    for (const char* key : {"loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"}) {
      ASSERT_TRUE(l.contains(key)) << key;
      EXPECT_TRUE(l[key].is_number()) << key;
    }
    EXPECT_GT(l["loss"].get<double>(), 0);
    EXPECT_GT(l["grad_norm"].get<double>(), 0);
    EXPECT_DOUBLE_EQ(l["lr"].get<double>(), 1e-3);
    EXPECT_GT(l["step_time_s"].get<double>(), 0);
    EXPECT_GT(l["tokens_per_s"].get<double>(), 0);
    const json& states = l.at("memory").at("model_states");
    int64_t sum = 0;
    for (const char* key : {"params", "grads", "master_weights", "optimizer_states"}) {
      ASSERT_TRUE(states.contains(key)) << key;
      sum += states[key].get<int64_t>();
    }
    EXPECT_EQ(states.at("total").get<int64_t>(), sum);
    EXPECT_GT(states["params"].get<int64_t>(), 0);
    EXPECT_EQ(states["master_weights"].get<int64_t>(), 0);  // fp32 training
    EXPECT_EQ(l["memory"].at("model_states_analytic"), states);
    const json& ranks = l["memory"].at("ranks");
    ASSERT_TRUE(ranks.is_array());
    ASSERT_EQ(ranks.size(), 2u);
    EXPECT_EQ(ranks[0].at("params"), states["params"]);  // rank 0's line is rank 0's bytes
    EXPECT_EQ(ranks[1].at("rank"), 1);
    EXPECT_GT(ranks[1].at("params").get<int64_t>(), 0);
    const json& layout = l.at("layout");
    EXPECT_EQ(layout.at("tp"), tp);
    EXPECT_EQ(layout.at("dp"), dp);
    EXPECT_EQ(layout.at("zero_stage"), stage);
  }
}

class CliTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("clitrain");
    text_ = test::write_line_corpus(dir_ + "/corpus.txt", 60);  // about 3.2 KB: ~100 examples of 33 tokens
  }
  std::string config(const std::string& name, const json& c) { return write(dir_ + "/" + name + ".json", c.dump()); }
  std::string dir_, text_;
};

TEST_F(CliTrain, Tp2WritesOneMetricsLinePerStep) {
  std::string cfg = config("tp2", ds_config(2, 1, {{"train_micro_batch_size_per_gpu", 2}}));
  auto r = run_cli("train --config " + cfg + " --model preset:llama-tiny --data " + text_ + " --seq-len 32 --steps 3 " +
                   "--nproc 2 --metrics " + dir_ + "/m.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_metrics(test::read_json_lines(dir_ + "/m.jsonl"), 2, 1, 1);
}

TEST_F(CliTrain, Tp1Stage3WritesOneMetricsLinePerStep) {
  std::string cfg = config("z3", ds_config(1, 3, {{"train_micro_batch_size_per_gpu", 2}}));
  auto r = run_cli("train --config " + cfg + " --model preset:llama-tiny --data " + text_ + " --seq-len 32 --steps 3 " +
                   "--nproc 2 --metrics " + dir_ + "/m.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto lines = test::read_json_lines(dir_ + "/m.jsonl");
  expect_metrics(lines, 1, 2, 3);
  // Stage 3 partitions the parameters: each rank holds half of the (padded) buffer.
  if (lines.size() == 3u) {
    const json& ranks = lines[0]["memory"]["ranks"];
    EXPECT_EQ(ranks[0]["params"], ranks[1]["params"]);
  }
}

TEST_F(CliTrain, FirstLossIsTheSameAtTp1AndTp2WithoutShuffling) {
  json tokens = json::array();
  for (int s = 0; s < 8; ++s) {
    json seq = json::array();
    for (int t = 0; t < 17; ++t) seq.push_back((s * 31 + t * 7 + t * t) % 259);
    tokens.push_back(seq);
  }
  std::string data = write(dir_ + "/tokens.json", tokens.dump());
  double loss[2] = {0, 0};
  for (int tp : {1, 2}) {
    std::string cfg = config("nos" + std::to_string(tp), ds_config(tp, tp == 1 ? 2 : 0, {{"train_batch_size", 4}}));
    std::string metrics = dir_ + "/nos" + std::to_string(tp) + ".jsonl";
    auto r = run_cli("train --config " + cfg + " --model preset:llama-tiny --data " + data +
                     " --no-shuffle --steps 1 --nproc 2 --metrics " + metrics);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto lines = test::read_json_lines(metrics);
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0]["layout"]["tp"], tp);
    EXPECT_EQ(lines[0]["tokens"], 4 * 16);
    loss[tp - 1] = lines[0]["loss"].get<double>();
  }
  EXPECT_NEAR(loss[1], loss[0], 1e-5 * loss[0]) << "tp 1 " << loss[0] << " vs tp 2 " << loss[1];
}

TEST_F(CliTrain, BadInputExitsWithCode2AndNamesTheProblem) {
  json typo = ds_config(2, 1, {{"train_micro_batch_size_per_gpu", 2}});
  typo["zero_optimisation"] = typo["zero_optimization"];
  typo.erase("zero_optimization");
  struct Case {
    std::string config, data, expected[2];
  };
  std::vector<Case> cases = {
      {config("typo", typo), text_, {"zero_optimisation", "did you mean"}},
      {config("tp3", ds_config(3, 1, {{"train_micro_batch_size_per_gpu", 2}})), text_,
       {"autotp_size 3", "does not divide the world size 2"}},
      {config("ok", ds_config(2, 1, {{"train_micro_batch_size_per_gpu", 2}})), dir_ + "/missing.txt",
       {dir_ + "/missing.txt", "cannot open"}},
  };
  for (const auto& c : cases) {
    std::string args = "train --config " + c.config + " --model preset:llama-tiny --data " + c.data +
                       " --seq-len 32 --steps 3 --nproc 2 --metrics " + dir_ + "/bad.jsonl";
    auto r = run_cli(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    for (const auto& expected : c.expected)
      EXPECT_NE(r.output.find(expected), std::string::npos) << "missing '" << expected << "'\n" << args << "\n"
                                                            << r.output;
  }
}

}  // namespace
}  // namespace autotp
