// End to end with the files users have today: stanford_alpaca's HF-Trainer
// DeepSpeed config (all its "auto" values and offload keys) trains unchanged at
// ZeRO-3 and at tp 2; a transformers 5 model directory trains and exports into a
// complete model directory (tokenizer, chat template, generation config).
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "autotp/base/json_file.h"
#include "autotp/io/safetensors.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

using nlohmann::json;
using test::run_cli;
namespace fs = std::filesystem;

const std::string kAlpaca = AUTOTP_SOURCE_DIR "/tests/data/deepspeed/stanford_alpaca_default_offload_opt_param.json";

class CliHfConfigs : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("clihf");
    text_ = test::write_line_corpus(dir_ + "/corpus.txt", 60);
  }
  std::string write_config(const std::string& name, const json& c) {
    const std::string path = dir_ + "/" + name + ".json";
    io::write_text_file_atomic(path, c.dump(2));
    return path;
  }
  std::string dir_, text_;
};

// stanford_alpaca's README flags, scaled to llama-tiny on 2 ranks.
const std::string kHfFlags =
    " --per_device_train_batch_size 2 --gradient_accumulation_steps 2 --learning_rate 2e-4 --weight_decay 0. "
    "--warmup_ratio 0.03 --max_steps 3";

TEST_F(CliHfConfigs, StanfordAlpacaConfigTrainsAtZero3Unchanged) {
  fs::create_directories(dir_ + "/z3");
  auto r = run_cli("train --deepspeed " + kAlpaca + " --model preset:llama-tiny --data " + text_ +
                   " --seq-len 32 --nproc 2 --metrics " + dir_ + "/z3/m.jsonl" + kHfFlags);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = test::read_json_lines(dir_ + "/z3/m.jsonl");
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["layout"]["zero_stage"], 3);
  EXPECT_EQ(lines[0]["layout"]["dp"], 2);
  EXPECT_EQ(lines[0]["layout"]["micro_batch"], 2);
  EXPECT_EQ(lines[0]["layout"]["gradient_accumulation_steps"], 2);
  EXPECT_EQ(lines[0]["layout"]["dtype"], "float32");  // bf16 "auto" without --bf16
  EXPECT_NE(r.output.find("ZeRO-Offload: fp32 master, optimizer states and a gradient copy in pageable host memory, "
                          "the update on the CPU; the stage-3 parameter partitions in host memory too"),
            std::string::npos)
      << r.output;
  const json resolved = read_json_file(dir_ + "/z3/resolved_config.json", "resolved");
  EXPECT_EQ(resolved["train_batch_size"], 2 * 2 * 2);
  EXPECT_EQ(resolved["optimizer"]["params"]["lr"], 2e-4);
  EXPECT_EQ(resolved["scheduler"]["params"]["total_num_steps"], 3);
  EXPECT_EQ(resolved["scheduler"]["params"]["warmup_num_steps"], 1);  // max(1, ceil(3 x 0.03))
  EXPECT_EQ(resolved["zero_optimization"]["reduce_bucket_size"], 96 * 96);  // llama-tiny: hidden 96
  EXPECT_EQ(resolved["zero_optimization"]["offload_param"]["device"], "cpu");
  // WarmupDecayLR runs from the filled values: it starts at warmup_min_lr 0 and reaches
  // warmup_max_lr = --learning_rate, never more.
  double peak = 0;
  for (const auto& l : lines) peak = std::max(peak, l["lr"].get<double>());
  EXPECT_EQ(lines[0]["lr"].get<double>(), 0);
  EXPECT_NEAR(peak, 2e-4, 1e-12);
}

TEST_F(CliHfConfigs, StanfordAlpacaConfigWithTensorParallelTrainsAtTp2) {
  json config = read_json_file(kAlpaca, "config");
  config["tensor_parallel"] = {{"autotp_size", 2}};
  const std::string path = write_config("alpaca_tp2", config);
  auto r = run_cli("train --deepspeed " + path + " --model preset:llama-tiny --data " + text_ +
                   " --seq-len 32 --nproc 2 --bf16 True --metrics " + dir_ + "/m.jsonl" + kHfFlags);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lines = test::read_json_lines(dir_ + "/m.jsonl");
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["layout"]["tp"], 2);
  EXPECT_EQ(lines[0]["layout"]["dp"], 1);
  EXPECT_EQ(lines[0]["layout"]["dtype"], "bfloat16");
  const json resolved = read_json_file(dir_ + "/resolved_config.json", "resolved");
  EXPECT_EQ(resolved["train_batch_size"], 2 * 2 * 1);  // data-parallel ranks: world 2 / tp 2
  EXPECT_EQ(resolved["bf16"]["enabled"], true);
}

TEST_F(CliHfConfigs, RefusedConfigsExitWith2AndWriteNothing) {
  json config = read_json_file(kAlpaca, "config");
  config["optimizer"]["params"]["lr"] = 1e-3;
  const std::string contradicting = write_config("contradicting", config);
  auto r = run_cli("train --deepspeed " + contradicting + " --model preset:llama-tiny --data " + text_ +
                   " --seq-len 32 --nproc 2 --metrics " + dir_ + "/m.jsonl" + kHfFlags);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("optimizer.params.lr is 0.001 but --learning_rate is 0.0002"), std::string::npos) << r.output;
  // No --steps / --max_steps: total_num_steps "auto" has nothing to take.
  r = run_cli("train --deepspeed " + kAlpaca + " --model preset:llama-tiny --data " + text_ +
              " --seq-len 32 --metrics " + dir_ + "/m.jsonl");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("scheduler.params.total_num_steps is \"auto\" and the number of steps is not given (give "
                          "--max_steps or --steps)"),
            std::string::npos)
      << r.output;
  r = run_cli("train --deepspeed " + kAlpaca + " --model preset:llama-tiny --data " + text_ +
              " --seq-len 32 --steps 2 --bf16 maybe --metrics " + dir_ + "/m.jsonl");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--bf16 maybe: not a boolean"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir_ + "/m.jsonl"));
  EXPECT_FALSE(fs::exists(dir_ + "/resolved_config.json"));
}

// stage3_max_live_parameters bounds what is gathered at once: below two layers the
// next layer is not prefetched, so the gathered peak drops; the losses do not move.
TEST_F(CliHfConfigs, MaxLiveParametersBoundsTheGatheredLayers) {
  json peak[2], loss[2];
  for (int bounded : {0, 1}) {
    json zero = {{"stage", 3}, {"overlap_comm", true}, {"stage3_param_persistence_threshold", 0}};
    if (bounded) zero["stage3_max_live_parameters"] = 1;
    const std::string path = write_config("live" + std::to_string(bounded),
                                          {{"train_micro_batch_size_per_gpu", 2},
                                           {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                                           {"zero_optimization", zero}});
    const std::string metrics = dir_ + "/live" + std::to_string(bounded) + ".jsonl";
    auto r = run_cli("train --config " + path + " --model preset:llama-tiny --data " + text_ +
                     " --seq-len 32 --steps 2 --nproc 2 --metrics " + metrics);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto lines = test::read_json_lines(metrics);
    ASSERT_EQ(lines.size(), 2u);
    peak[bounded] = lines[1]["memory"]["ranks"][0]["peak_gathered_params_bytes"];
    loss[bounded] = json::array({lines[0]["loss"], lines[1]["loss"]});
  }
  EXPECT_EQ(loss[0], loss[1]);
  EXPECT_LT(peak[1].get<int64_t>(), peak[0].get<int64_t>()) << "bounded " << peak[1] << " vs " << peak[0];
}

// A transformers 5 directory with its tokenizer, chat template and generation config:
// the live export and the export from a checkpoint are complete model directories in
// the generation they were read in.
TEST_F(CliHfConfigs, ExportIsACompleteModelDirectoryOfTheSameGeneration) {
  const std::string model = dir_ + "/llama_v5";
  fs::create_directories(model);
  for (const char* file : {"config.json", "model.safetensors", "generation_config.json"})
    fs::copy_file(AUTOTP_SOURCE_DIR "/tests/data/hf_models/llama_v5/" + std::string(file), model + "/" + file);
  for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
    fs::copy_file(AUTOTP_SOURCE_DIR "/tests/data/tokenizers/llama3_bpe/" + std::string(file), model + "/" + file);
  io::write_text_file_atomic(model + "/chat_template.jinja",
                             "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}");
  json tokens = json::array();
  for (int s = 0; s < 8; ++s) {
    json seq = json::array();
    for (int t = 0; t < 13; ++t) seq.push_back((s * 31 + t * 7 + t * t) % 96);
    tokens.push_back(seq);
  }
  const std::string data = dir_ + "/tokens.json";
  io::write_text_file_atomic(data, tokens.dump());
  const std::string cfg = write_config("ds", {{"train_batch_size", 4}, {"zero_optimization", {{"stage", 2}}},
                                              {"tensor_parallel", {{"autotp_size", 2}}}, {"bf16", {{"enabled", true}}}});
  // Exporting over the model it trains from is refused before anything runs.
  auto r = run_cli("train --config " + cfg + " --model " + model + " --data " + data + " --steps 1 --nproc 2 " +
                   "--export-hf " + model + "/");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("is the --model directory"), std::string::npos) << r.output;
  r = run_cli("train --config " + cfg + " --model " + model + " --data " + data + " --steps 2 --nproc 2 --save " +
              dir_ + "/ckpt --export-hf " + dir_ + "/live");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_cli("export --checkpoint " + dir_ + "/ckpt --out " + dir_ + "/offline --dtype f32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const std::string& out : {dir_ + "/live", dir_ + "/offline"}) {
    for (const char* file : {"generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"})
      EXPECT_EQ(test::read_file(out + "/" + file), test::read_file(model + "/" + file)) << out << "/" << file;
    const json config = read_json_file(out + "/config.json", "export");
    EXPECT_TRUE(config.contains("rope_parameters")) << out;
    EXPECT_FALSE(config.contains("torch_dtype")) << out;
    EXPECT_FALSE(config.contains("rope_theta")) << out;
    EXPECT_EQ(config["dtype"], out == dir_ + "/live" ? "bfloat16" : "float32");
  }
  // The export reads back as a model (eval through the CLI).
  r = run_cli("eval --model " + dir_ + "/offline --tokens " + data + " --out " + dir_ + "/eval.json");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

}  // namespace
}  // namespace autotp
