// LoRA end to end through the CLI: an adapter saved at tp 4 (ZeRO-3) evaluates at
// tp 1 with the same logits; the merged export equals base + adapter; a LoRA
// checkpoint resumes bit for bit and reshards; bad LoRA input exits 2.
#include <gtest/gtest.h>

#include <filesystem>

#include "autotp/io/safetensors.h"
#include "support/checks.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

using nlohmann::json;
using test::run_cli;
namespace fs = std::filesystem;

class CliLora : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("clilora");
    text_ = test::write_line_corpus(dir_ + "/corpus.txt", 60);
    tokens_ = dir_ + "/tokens.json";
    json rows = json::array();
    for (int r = 0; r < 2; ++r) {
      json row = json::array();
      for (int t = 0; t < 10; ++t) row.push_back((r * 37 + t * 11) % 250 + 3);
      rows.push_back(row);
    }
    io::write_text_file_atomic(tokens_, rows.dump());
  }
  std::string config(const std::string& name, int tp, int stage, int micro = 2) {
    json c = {{"train_micro_batch_size_per_gpu", micro},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}},
              {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 100}}},
              {"tensor_parallel", {{"autotp_size", tp}}},
              {"lora", {{"r", 4}, {"lora_alpha", 8}, {"target_modules", "all-linear"}}}};
    const std::string path = dir_ + "/" + name + ".json";
    io::write_text_file_atomic(path, c.dump());
    return path;
  }
  std::string train(const std::string& cfg, int nproc, const std::string& extra) {
    return "train --config " + cfg + " --model preset:llama-tiny --seed 0 --data " + text_ + " --seq-len 16 --nproc " +
           std::to_string(nproc) + " " + extra;
  }
  torch::Tensor logits(const std::string& model_and_flags, int nproc, const std::string& name) {
    const std::string out = dir_ + "/" + name + ".safetensors";
    auto r = run_cli("eval --model " + model_and_flags + " --tokens " + tokens_ + " --out " + dir_ + "/" + name +
                     ".json --logits " + out + " --nproc " + std::to_string(nproc));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return io::SafetensorsFile::open(out)->read("logits");
  }
  std::string dir_, text_, tokens_;
};

TEST_F(CliLora, AdapterSavedAtTp4EvaluatesAtTp1AndMergesExactly) {
  const std::string adapter = dir_ + "/adapter", merged = dir_ + "/merged";
  auto r = run_cli(train(config("tp4", 4, 3), 4, "--steps 2 --save-adapter " + adapter + " --export-hf " + merged +
                                                     " --merge-lora --metrics " + dir_ + "/m.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // PEFT's files: its keys, fp32, the resolved target modules.
  auto weights = io::SafetensorsFile::open(adapter + "/adapter_model.safetensors");
  ASSERT_TRUE(weights->contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  EXPECT_EQ(weights->info("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight").shape,
            (std::vector<int64_t>{96, 4}));
  EXPECT_EQ(weights->tensors().size(), 2u * 7 * 2);  // A and B of 7 linear layers in each of 2 layers
  const json cfg = json::parse(test::read_file(adapter + "/adapter_config.json"));
  EXPECT_EQ(cfg.at("peft_type"), "LORA");
  EXPECT_EQ(cfg.at("r"), 4);
  EXPECT_EQ(cfg.at("target_modules").size(), 14u);
  // The frozen base is counted; the trained states are the adapters only.
  const auto lines = test::read_json_lines(dir_ + "/m.jsonl");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_GT(lines[0]["memory"]["model_states"].value("frozen_params", 0), 0);
  EXPECT_EQ(lines[0]["memory"]["model_states"], lines[0]["memory"]["model_states_analytic"]);

  const torch::Tensor tp1 = logits("preset:llama-tiny --adapter " + adapter, 1, "tp1");
  const torch::Tensor tp4 = logits("preset:llama-tiny --adapter " + adapter, 4, "tp4");
  const torch::Tensor base = logits("preset:llama-tiny", 1, "base");
  const torch::Tensor from_merged = logits(merged, 1, "merged");
  EXPECT_LT(test::relative_max_diff(tp4, tp1), 1e-5);
  EXPECT_LT(test::relative_max_diff(from_merged, tp1), 1e-5);
  EXPECT_GT(test::relative_max_diff(base, tp1), 1e-3);  // the adapter changed the model
}

TEST_F(CliLora, CheckpointResumesBitForBitAndReshards) {
  const std::string cfg = config("tp2", 2, 2);
  auto whole = run_cli(train(cfg, 2, "--steps 4 --no-shuffle --metrics " + dir_ + "/whole.jsonl"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  auto first = run_cli(train(cfg, 2, "--steps 2 --no-shuffle --save " + dir_ + "/ckpt"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto resumed = run_cli(train(cfg, 2, "--steps 4 --no-shuffle --resume " + dir_ + "/ckpt --metrics " + dir_ +
                                           "/resumed.jsonl"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto a = test::read_json_lines(dir_ + "/whole.jsonl"), b = test::read_json_lines(dir_ + "/resumed.jsonl");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(a[2 + i]["loss"], b[i]["loss"]) << "step " << 3 + i;
  // The checkpoint holds the adapters only.
  const json meta = json::parse(test::read_file(dir_ + "/ckpt/step_2/metadata.json"));
  for (const auto& t : meta.at("tensors")) EXPECT_NE(t.at("name").get<std::string>().find("lora_"), std::string::npos);
  // Resharded to tp 1 x dp 2 at stage 1 (micro 1: the same global batch of 2): the same continuation within
  // fp32 summation order.
  auto reshard = run_cli("reshard --checkpoint " + dir_ + "/ckpt --tp 1 --dp 2 --stage 1 --out " + dir_ + "/re");
  ASSERT_EQ(reshard.exit_code, 0) << reshard.output;
  auto moved = run_cli(train(config("tp1", 1, 1, /*micro=*/1), 2, "--steps 4 --no-shuffle --resume " + dir_ + "/re --metrics " +
                                                          dir_ + "/moved.jsonl"));
  ASSERT_EQ(moved.exit_code, 0) << moved.output;
  const auto c = test::read_json_lines(dir_ + "/moved.jsonl");
  ASSERT_EQ(c.size(), 2u);
  for (size_t i = 0; i < 2; ++i)
    EXPECT_NEAR(c[i]["loss"].get<double>(), a[2 + i]["loss"].get<double>(), 1e-5 * a[2 + i]["loss"].get<double>());
  // An export of a LoRA checkpoint has no whole model to write.
  auto exported = run_cli("export --checkpoint " + dir_ + "/ckpt --out " + dir_ + "/x");
  EXPECT_EQ(exported.exit_code, 2) << exported.output;
  EXPECT_NE(exported.output.find("adapters only"), std::string::npos) << exported.output;
}

// One adapted module in the last layer: the checkpoint holds 2 tensors in ZeRO unit 2 (layer 1).
TEST_F(CliLora, CheckpointOfOneAdaptedModuleResumes) {
  const std::string cfg = config("one", 1, 3);
  const std::string one = "--lora-target-modules model\\.layers\\.1\\.self_attn\\.q_proj";
  auto first = run_cli(train(cfg, 2, "--steps 1 --no-shuffle --save " + dir_ + "/one " + one));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const json meta = json::parse(test::read_file(dir_ + "/one/step_1/metadata.json"));
  ASSERT_EQ(meta.at("tensors").size(), 2u);
  auto resumed = run_cli(train(cfg, 2, "--steps 2 --no-shuffle --resume " + dir_ + "/one " + one));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
}

TEST_F(CliLora, BadLoraInputExitsWith2) {
  const std::string cfg = config("bad", 1, 0);
  auto r = run_cli(train(cfg, 1, "--steps 1 --export-hf " + dir_ + "/out"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--merge-lora"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ + "/out"));
  r = run_cli(train(cfg, 1, "--steps 1 --lora-target-modules c_attn,c_proj"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("model.layers.0.mlp.down_proj"), std::string::npos) << r.output;
  r = run_cli(train(cfg, 1, "--steps 1 --lora-dropout 1.5"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--lora-dropout"), std::string::npos) << r.output;
  r = run_cli("eval --model preset:llama-tiny --tokens " + tokens_ + " --out " + dir_ + "/e.json --adapter " +
              AUTOTP_SOURCE_DIR "/tests/data/peft_adapters/llama_qkvo");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("do not fit"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace autotp
