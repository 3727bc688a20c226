// Scenario files: expansion of baselines, explicit variants and sweeps into
// resolved DeepSpeed configs; skipped sweep combinations with their reasons;
// every rejection (unknown key with a suggestion, an invalid combination, a
// missing model, a check naming no variant) naming the file and key; kind
// "simulate" variants read as simulated layouts by the same strict reader as
// simulate-only files; the step-time statistics of summarize_metrics.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>

#include "autotp/io/safetensors.h"
#include "autotp/base/error.h"
#include "scenario/scenario_runner.h"
#include "scenario/scenario_spec.h"
#include "support/model_fixtures.h"
#include "support/reference_models.h"

namespace autotp::scenario {
namespace {

using nlohmann::json;

class ScenarioSpecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("scenariospec");
    io::write_text_file_atomic(dir_ + "/corpus.txt", "some text to train on\n");
  }
  json base() const {
    return {{"model", "preset:llama-tiny"},
            {"data", "corpus.txt"},
            {"seq_len", 16},
            {"world_size", 4},
            {"config", {{"train_batch_size", 8}, {"optimizer", {{"type", "AdamW"}}}}},
            {"variants", json::array({{{"name", "z1"}, {"zero_stage", 1}}})}};
  }
  // A kind "simulate" variant: Llama-2-7B on one node of A100s at tp 2 + ZeRO-1.
  static json simulated() {
    return {{"name", "sim"}, {"kind", "simulate"}, {"model", "llama2-7b"}, {"cluster", "8xA100-80GB"},
            {"gpus", 8},     {"tp", 2},            {"zero_stage", 1},      {"seq_len", 2048}};
  }
  ScenarioSpec parse(const json& j) const { return ScenarioSpec::from_json(j, "s.json", dir_); }
  std::string error(const json& j) const {
    try {
      parse(j);
    } catch (const UserError& e) {
      return e.what();
    }
    return "(no error)";
  }
  std::string dir_;
};

TEST_F(ScenarioSpecTest, BaselineIsZero3AtTp1AndVariantsDeriveTheirMicroBatch) {
  json j = base();
  j["variants"].push_back({{"name", "tp2"}, {"tp", 2}, {"zero_stage", 1}, {"overrides", {{"gradient_clipping", 0.5}}}});
  auto s = parse(j);
  ASSERT_EQ(s.variants.size(), 3u);
  const auto& b = s.variants[0];
  EXPECT_EQ(b.name, "baseline");
  EXPECT_TRUE(b.is_baseline);
  EXPECT_EQ(b.config.zero.stage, 3);
  EXPECT_EQ(b.config.tensor_parallel.autotp_size, 1);
  EXPECT_EQ(b.config.train_micro_batch_size_per_gpu, 2);  // 8 / dp 4
  const auto& tp2 = s.variant("tp2");
  EXPECT_EQ(tp2.baseline, "baseline");
  EXPECT_EQ(tp2.config.train_micro_batch_size_per_gpu, 4);  // 8 / dp 2
  EXPECT_EQ(tp2.config.gradient_accumulation_steps, 1);
  EXPECT_DOUBLE_EQ(tp2.config.gradient_clipping, 0.5);
  EXPECT_EQ(tp2.ds_config["tensor_parallel"]["autotp_size"], 2);
  EXPECT_EQ(s.data, dir_ + "/corpus.txt");
  EXPECT_EQ(s.name, "s");
  ASSERT_EQ(s.checks.size(), 1u);  // no_failed_runs is always there
  EXPECT_EQ(s.checks[0].type, "no_failed_runs");
}

TEST_F(ScenarioSpecTest, SweepSkipsCombinationsThatCannotRunWithTheReason) {
  json j = base();
  j.erase("variants");
  j["sweep"] = {{"tp", {1, 2, 3, 4}}, {"zero_stage", {1, 3}}, {"micro_batch", {1, 2}}};
  auto s = parse(j);
  std::map<std::string, std::string> skipped;
  for (const auto& sk : s.skipped) skipped[sk.name] = sk.reason;
  std::vector<std::string> names;
  for (const auto& v : s.variants) names.push_back(v.name);
  // tp 3 does not divide 4; micro-batch 2 at tp 1 (dp 4) is the baseline's derived layout; tp 4 (dp 1) with
  // micro-batch 1 accumulates 8.
  EXPECT_NE(skipped["tp3_z1_mb1"].find("autotp_size 3 does not divide the world size 4"), std::string::npos)
      << skipped["tp3_z1_mb1"];
  EXPECT_NE(skipped["tp1_z3_mb2"].find("same layout as baseline"), std::string::npos) << skipped["tp1_z3_mb2"];
  EXPECT_EQ(skipped.count("tp4_z1_mb2"), 0u);
  EXPECT_EQ(s.variant("tp4_z1_mb1").config.gradient_accumulation_steps, 8);
  EXPECT_EQ(s.variant("tp1_z1_mb1").config.gradient_accumulation_steps, 2);
  // 1 baseline + (tp 1,2,4) x (z1, z3) x (mb 1, 2) - the baseline's own layout.
  EXPECT_EQ(s.variants.size(), 1u + 3 * 2 * 2 - 1);
  EXPECT_EQ(s.skipped.size(), 4u + 1);  // tp 3 x 4, and the baseline's layout
}

TEST_F(ScenarioSpecTest, SweepExcludeAndModelAxisGiveOneBaselinePerModel) {
  json j = base();
  j.erase("model");
  j.erase("variants");
  j["models"] = {{"gpt2", "preset:gpt2-tiny"}, {"llama", "preset:llama-tiny-tied"}};
  j["sweep"] = {{"tp", {2, 4}}, {"zero_stage", {1}}, {"exclude", {{{"tp", 4}, {"model", "gpt2"}, {"reason", "slow"}}}}};
  auto s = parse(j);
  EXPECT_EQ(s.variants[0].name, "baseline_gpt2");
  EXPECT_EQ(s.variants[1].name, "baseline_llama");
  EXPECT_EQ(s.variant("tp2_z1_gpt2").baseline, "baseline_gpt2");
  EXPECT_EQ(s.variant("tp4_z1_llama").baseline, "baseline_llama");
  ASSERT_EQ(s.skipped.size(), 1u);
  EXPECT_EQ(s.skipped[0].name, "tp4_z1_gpt2");
  EXPECT_EQ(s.skipped[0].reason, "excluded by sweep.exclude: slow");
}

TEST_F(ScenarioSpecTest, UnknownKeysAreRejectedWithASuggestion) {
  json j = base();
  j["world_sise"] = 4;
  EXPECT_EQ(error(j), "s.json: unknown key 'world_sise' (did you mean 'world_size'?)");
  j = base();
  j["variants"][0]["zero_stag"] = 1;
  EXPECT_EQ(error(j), "s.json: unknown key 'variants[0].zero_stag' (did you mean 'variants[0].zero_stage'?)");
  j = base();
  j["config"]["zero_optimisation"] = {{"stage", 1}};
  EXPECT_EQ(error(j), "s.json: config: unknown key 'zero_optimisation' (did you mean 'zero_optimization'?)");
  j = base();
  j["checks"] = {{{"type", "loss_agrement"}}};
  EXPECT_NE(error(j).find("checks[0].type is \"loss_agrement\" (did you mean 'loss_agreement'?)"),
            std::string::npos)
      << error(j);
  j = base();
  j["checks"] = {{{"type", "memory_ratio"}, {"variant", "z2"}, {"of", "baseline"}, {"metric", "model_states.total"},
                  {"max", 1}}};
  EXPECT_NE(error(j).find("checks[0] names variant 'z2', which the scenario does not define (did you mean 'z1'?)"),
            std::string::npos)
      << error(j);
  j["checks"][0]["variant"] = "z1";
  j["checks"][0]["metric"] = "model_state.total";
  EXPECT_NE(error(j).find("(did you mean 'model_states.total'?)"), std::string::npos) << error(j);
}

TEST_F(ScenarioSpecTest, InvalidCombinationsOfExplicitVariantsAreErrors) {
  json j = base();
  j["variants"][0]["tp"] = 3;
  EXPECT_EQ(error(j),
            "s.json: variant 'z1' (tp 3 ZeRO-1 fp32) cannot run on world 4: tensor_parallel.autotp_size 3 does not "
            "divide the world size 4 (allowed: a divisor of 4)");
  j = base();
  j["world_size"] = 8;
  j["variants"][0]["tp"] = 8;  // llama-tiny has 6 query heads
  EXPECT_NE(error(j).find("variant 'z1' (tp 8 ZeRO-1 fp32) cannot run on world 8"), std::string::npos) << error(j);
  j = base();
  j["variants"][0]["overrides"] = {{"train_batch_size", 16}};
  EXPECT_NE(error(j).find("global batch 16 differs from baseline 'baseline' (8)"), std::string::npos) << error(j);
  j = base();
  j["device"] = "tpu";
  EXPECT_EQ(error(j), "s.json: device is \"tpu\" (allowed: cpu, cuda)");
  j = base();
  j["backend"] = "nccl";
  EXPECT_EQ(error(j), "s.json: backend nccl needs device cuda (NCCL moves CUDA tensors)");
  j = base();
  j["variants"][0]["dtype"] = "int8";
  EXPECT_EQ(error(j), "s.json: variants[0].dtype is \"int8\" (allowed: fp32, bf16, fp16)");
  j = base();
  j["variants"].push_back({{"name", "z1"}, {"zero_stage", 2}});
  EXPECT_NE(error(j).find("the name 'z1' is already used"), std::string::npos) << error(j);
}

TEST_F(ScenarioSpecTest, MissingOrUnknownModelAndDataAreErrors) {
  json j = base();
  j.erase("model");
  EXPECT_EQ(error(j),
            "s.json: give exactly one of \"model\" (preset:NAME or an HF directory) and \"models\" ({\"key\": model})");
  j = base();
  j["model"] = "preset:llama-huge";
  EXPECT_NE(error(j).find("unknown preset 'llama-huge' (allowed: llama-tiny,"), std::string::npos) << error(j);
  j = base();
  j["model"] = "no/such/dir";
  EXPECT_NE(error(j).find("s.json: model 'no/such/dir': no such directory"), std::string::npos) << error(j);
  j = base();
  j["model"] = {{"source", "preset:llama-tiny"}, {"overrides", {{"num_attention_heads", 5}}}};  // 96 % 5 != 0
  EXPECT_NE(error(j).find("s.json: model:"), std::string::npos) << error(j);
  j = base();
  j["data"] = "missing.txt";
  EXPECT_EQ(error(j), "s.json: data 'missing.txt': no such file " + dir_ + "/missing.txt");
  j = base();
  j.erase("world_size");
  EXPECT_EQ(error(j), "s.json: world_size is missing (the number of ranks every variant runs on)");
}

TEST_F(ScenarioSpecTest, ModelOverridesAreValidatedAndChangeTheShapes) {
  json j = base();
  j["model"] = {{"source", "preset:llama-tiny"},
                {"overrides", {{"hidden_size", 80}, {"num_attention_heads", 5}, {"num_key_value_heads", 1},
                               {"vocab_size", 263}}}};
  auto s = parse(j);
  EXPECT_TRUE(s.models.at("").needs_dir());
  EXPECT_EQ(s.models.at("").config.num_heads, 5);
  EXPECT_EQ(s.models.at("").config.vocab_size, 263);
}

// "tokenizer": auto is decided per model when the file is read (a model with
// overrides trains from a written copy without tokenizer files).
TEST_F(ScenarioSpecTest, TokenizerIsDecidedPerModel) {
  const json config = test::preset_config("llama-tiny", {{"vocab_size", 1024}});  // room for the fixture's 956
  const std::string model = test::write_model_dir(dir_ + "/model", config, test::reference_random_weights(config, 1));
  json j = base();
  j["models"] = {{"preset", "preset:llama-tiny"}, {"dir", "model"}};
  j.erase("model");
  EXPECT_NE(error(j).find("s.json: data: " + model + ": the model directory has no tokenizer"), std::string::npos)
      << error(j);
  j["tokenizer"] = "bytes";
  auto s = parse(j);
  EXPECT_EQ(s.models.at("dir").tokenizer, "bytes");
  j["tokenizer"] = "nowhere";
  EXPECT_NE(error(j).find("--tokenizer " + dir_ + "/nowhere: not a directory"), std::string::npos) << error(j);
  for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
    std::filesystem::copy_file(AUTOTP_SOURCE_DIR "/tests/data/tokenizers/llama2_spm_bpe/" + std::string(file),
                               model + "/" + file);
  j.erase("tokenizer");
  s = parse(j);
  EXPECT_EQ(s.models.at("preset").tokenizer, "bytes");
  EXPECT_EQ(s.models.at("dir").tokenizer, model);
}

TEST_F(ScenarioSpecTest, OnlyKeepsTheBaselineAndSuggestsNames) {
  json j = base();
  j["variants"].push_back({{"name", "tp2_z1"}, {"tp", 2}, {"zero_stage", 1}});
  auto s = parse(j);
  s.select({"tp2_z1"});
  ASSERT_EQ(s.variants.size(), 2u);
  EXPECT_EQ(s.variants[0].name, "baseline");
  EXPECT_EQ(s.variants[1].name, "tp2_z1");
  auto t = parse(j);
  try {
    t.select({"tp2_z2"});
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--only tp2_z2: no such variant in s.json (did you mean 'tp2_z1'?)"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(ScenarioSpecTest, SimulateVariantsAreSimulatedLayouts) {
  json j = base();
  json v = simulated();
  v["micro_batch"] = 2;
  v["activation_checkpointing"] = "selective";
  v["overlap_comm"] = false;
  j["variants"].push_back(v);
  auto s = parse(j);
  ASSERT_EQ(s.variants.size(), 3u);
  const auto& sim = s.variant("sim");
  EXPECT_EQ(sim.kind, "simulate");
  EXPECT_TRUE(sim.baseline.empty());
  const SimulatedLayout& l = sim.simulated;
  EXPECT_EQ(l.model, "llama2-7b");
  EXPECT_EQ(l.cluster, "8xA100-80GB");
  EXPECT_EQ(l.gpus, 8);
  EXPECT_EQ(l.tp, 2);
  EXPECT_EQ(l.zero_stage, 1);
  EXPECT_EQ(l.seq_len, 2048);
  EXPECT_EQ(l.micro_batch, 2);
  EXPECT_EQ(l.gas, 1);
  EXPECT_EQ(l.dtype, "bf16");
  EXPECT_EQ(l.recompute, "selective");
  ASSERT_TRUE(l.overlap_comm.has_value());
  EXPECT_FALSE(*l.overlap_comm);
  EXPECT_EQ(l.simulate_args(),
            (std::vector<std::string>{"--model", "llama2-7b", "--cluster", "8xA100-80GB", "--gpus", "8", "--tp", "2",
                                      "--zero", "1", "--seq-len", "2048", "--micro-batch", "2", "--gas", "1",
                                      "--dtype", "bf16", "--recompute", "selective", "--overlap-comm", "false"}));
  auto result = simulate_layout(l);
  EXPECT_EQ(result.layout.dp(), 4);
  EXPECT_TRUE(result.layout.selective_recompute);
  EXPECT_FALSE(result.layout.overlap_comm);
  // A simulate variant has no baseline: --only keeps it alone.
  s.select({"sim"});
  ASSERT_EQ(s.variants.size(), 1u);
  EXPECT_EQ(s.variants[0].name, "sim");
}

TEST_F(ScenarioSpecTest, SimulateVariantsAreReadStrictly) {
  auto with = [&](const std::function<void(json&)>& edit) {
    json j = base();
    json v = simulated();
    edit(v);
    j["variants"].push_back(v);
    return error(j);
  };
  EXPECT_EQ(with([](json& v) { v["zero_stag"] = 1; }),
            "s.json: unknown key 'variants[1].zero_stag' in a kind \"simulate\" variant (did you mean "
            "'variants[1].zero_stage'?)");
  // The argument list of before is not a key any more.
  std::string e = with([](json& v) { v["simulate"] = {"--model", "llama2-7b"}; });
  EXPECT_EQ(e.find("s.json: unknown key 'variants[1].simulate' in a kind \"simulate\" variant"), 0u) << e;
  EXPECT_EQ(with([](json& v) { v["gpus"] = "8"; }), "s.json: variants[1].gpus must be an integer, got \"8\"");
  EXPECT_EQ(with([](json& v) { v["overlap_comm"] = "yes"; }),
            "s.json: variants[1].overlap_comm must be true or false, got \"yes\"");
  EXPECT_EQ(with([](json& v) { v["zero_stage"] = 4; }), "s.json: variants[1].zero_stage is 4 (allowed: 0, 1, 2, 3)");
  EXPECT_EQ(with([](json& v) { v["dtype"] = "int8"; }),
            "s.json: variants[1].dtype is \"int8\" (allowed: fp32, bf16, fp16)");
  e = with([](json& v) { v.erase("cluster"); });
  EXPECT_EQ(e.find("s.json: variants[1].cluster is missing (one of 8xA100-80GB,"), 0u) << e;
  e = with([](json& v) { v["cluster"] = "8xA100-80G"; });
  EXPECT_NE(e.find("variants[1].cluster is \"8xA100-80G\" (did you mean '8xA100-80GB'?)"), std::string::npos) << e;
  e = with([](json& v) { v["model"] = "llama-9000"; });
  EXPECT_EQ(e.find("s.json: variants[1].model is \"llama-9000\": unknown model (allowed: llama2-7b,"), 0u) << e;
  EXPECT_EQ(with([](json& v) { v["tp"] = 3; }),
            "s.json: variants[1].tp is 3, which does not divide gpus 8 (allowed: a divisor of 8)");
  EXPECT_EQ(with([](json& v) { v["seq_len"] = 8192; }),
            "s.json: variants[1].seq_len is 8192, beyond the model's 4096 positions (allowed: 1..4096)");
  EXPECT_EQ(with([](json& v) { v["kind"] = "simulat"; }),
            "s.json: variants[1].kind is \"simulat\" (allowed: train, simulate)");
  EXPECT_EQ(with([](json& v) { v["name"] = "z1"; }), "s.json: variants[1].name is \"z1\", a name already used");
  // A simulate-only scenario file is not a training scenario.
  json only = {{"simulate", true}, {"model", "llama2-7b"}};
  EXPECT_EQ(error(only),
            "s.json: a simulate-only scenario (\"simulate\": true): run it with `autotp simulate --scenario s.json`");
}

TEST(ScenarioMetrics, StepTimeMedianAndP90SkipTheFirstStep) {
  std::vector<json> lines;
  const double times[] = {9.0, 1.0, 4.0, 2.0, 3.0, 5.0, 6.0, 7.0, 8.0, 10.0, 0.5};
  for (int i = 0; i < 11; ++i)
    lines.push_back({{"step", i + 1}, {"loss", 5.0 - i}, {"grad_norm", 1.0}, {"lr", 1e-3},
                     {"step_time_s", times[i]}, {"tokens_per_s", 100.0 / times[i]}});
  json s = summarize_metrics(lines);
  // Steps 2..11: {1, 4, 2, 3, 5, 6, 7, 8, 10, 0.5}: median (4 + 5) / 2, p90 at rank 0.9 x 9 = 8.1
  // of the sorted ten (linear interpolation, base/quantile.h): 8 + 0.1 x (10 - 8).
  EXPECT_DOUBLE_EQ(s["step_time"]["median_s"].get<double>(), 4.5);
  EXPECT_NEAR(s["step_time"]["p90_s"].get<double>(), 8.2, 1e-12);
  EXPECT_EQ(s["step_time"]["steps_measured"], 10);
  EXPECT_DOUBLE_EQ(s["tokens_per_s_median"].get<double>(), (100.0 / 4 + 100.0 / 5) / 2);
  ASSERT_EQ(s["loss"].size(), 11u);
  EXPECT_DOUBLE_EQ(s["loss"][10].get<double>(), -5.0);
}

}  // namespace
}  // namespace autotp::scenario
