// End-to-end reliability of `autotp train` (docs/reliability.md): non-finite
// numbers stop the run (or skip the step) naming step, rank and parameter and
// never reach a checkpoint; divergence warnings; --max-restarts restarts the
// world from the newest complete checkpoint and ends bit for bit as an
// uninterrupted run; torchrun-style restarts and --resume auto.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "autotp/io/safetensors.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::run_cli;

json ds_config(double lr, int tp, int stage, const json& extra = json::object()) {
  json c = {{"train_batch_size", 4},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", lr}, {"weight_decay", 0.01}}}}},
            {"zero_optimization", {{"stage", stage}}},
            {"tensor_parallel", {{"autotp_size", tp}}}};
  c.update(extra);
  return c;
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

class CliReliability : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("clireliability");
    data_ = test::write_line_corpus(dir_ + "/corpus.txt", 60);
  }
  std::string config(const std::string& name, const json& c) {
    const std::string path = dir_ + "/" + name + ".json";
    io::write_text_file_atomic(path, c.dump());
    return path;
  }
  std::string train(const std::string& cfg, int steps, int nproc) const {
    return "train --config " + cfg + " --model preset:llama-tiny --data " + data_ + " --seq-len 16 --seed 7 --steps " +
           std::to_string(steps) + " --nproc " + std::to_string(nproc) + " --threads 1 --timeout 30";
  }
  // Every value of every floating tensor of the checkpoint's rank files is finite.
  static void expect_finite_checkpoint(const std::string& step_dir) {
    int files = 0;
    for (const auto& entry : fs::directory_iterator(step_dir)) {
      if (entry.path().extension() != ".safetensors") continue;
      ++files;
      auto file = io::SafetensorsFile::open(entry.path().string());
      for (const auto& info : file->tensors()) {
        const torch::Tensor t = file->read(info.name);
        const std::string& name = info.name;
        if (t.is_floating_point()) {
          EXPECT_TRUE(torch::isfinite(t).all().item<bool>()) << entry.path() << " " << name;
        }
      }
    }
    EXPECT_GT(files, 0) << step_dir;
  }
  std::string dir_, data_;
};

// A learning rate of 1e30 sends the weights to ~1e30 after step 1, and step 2's
// forward overflows: exit code 3 with one error naming the step, the rank and
// the first parameter whose gradient is non-finite; the step-1 checkpoint stays
// the newest and holds finite numbers only.
TEST_F(CliReliability, NonFiniteLossStopsTrainingNamingStepRankAndParameter) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    const std::string name = bf16 ? "huge_lr_bf16" : "huge_lr";
    const std::string cfg = config(name, ds_config(1e30, 2, 1, {{"bf16", {{"enabled", bf16}}}}));
    const std::string save = dir_ + "/" + name;
    auto r = run_cli(train(cfg, 4, 2) + " --save " + save + " --save-every 1 --max-restarts 2");
    EXPECT_EQ(r.exit_code, 3) << r.output;
    EXPECT_NE(r.output.find("step 2: non-finite numbers"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("first non-finite gradient: model."), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("(found on rank "), std::string::npos) << r.output;
    EXPECT_EQ(count(r.output, "restarting all"), 0) << "a non-finite run repeats itself: never restarted\n"
                                                    << r.output;
    EXPECT_EQ(test::read_file(save + "/latest"), "step_1\n");
    EXPECT_FALSE(fs::exists(save + "/step_2"));
    expect_finite_checkpoint(save + "/step_1");
  }
}

// "non_finite": "skip": every non-finite step is reported and skipped, the run
// completes and its checkpoint is finite.
TEST_F(CliReliability, SkipModeDropsNonFiniteStepsAndSavesFiniteWeights) {
  const std::string cfg = config("skip", ds_config(1e30, 2, 3, {{"non_finite", "skip"}}));
  auto r = run_cli(train(cfg, 4, 2) + " --save " + dir_ + "/ckpt --metrics " + dir_ + "/m.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto lines = test::read_json_lines(dir_ + "/m.jsonl");
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_FALSE(lines[0]["skipped"].get<bool>());
  for (int s = 1; s < 4; ++s) EXPECT_TRUE(lines[s]["skipped"].get<bool>()) << lines[s].dump();
  EXPECT_EQ(count(r.output, "the step's update was skipped"), 3) << r.output;
  expect_finite_checkpoint(dir_ + "/ckpt/step_4");
}

// The example: a learning rate of 1e6 (clipped AdamW) collapses llama-tiny
// to a constant output (loss ln 259, gradient norm 0) without a NaN; the run now
// says so, once. (Unclipped, the same run overflows at step 3 and stops.)
TEST_F(CliReliability, ZeroGradientNormWarnsOnce) {
  const json adam = {{"type", "AdamW"}, {"params", {{"lr", 1e6}, {"weight_decay", 0.0}}}};
  const std::string cfg = config("collapse", ds_config(1e6, 1, 0, {{"gradient_clipping", 1.0}, {"optimizer", adam}}));
  auto r = run_cli(train(cfg, 12, 1) + " --metrics " + dir_ + "/m.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto lines = test::read_json_lines(dir_ + "/m.jsonl");
  ASSERT_EQ(lines.size(), 12u);
  EXPECT_EQ(lines.back()["grad_norm"].get<double>(), 0.0) << lines.back().dump();
  EXPECT_EQ(count(r.output, "the gradient norm is exactly 0"), 1) << r.output;
}

// Rank 1 SIGKILLed in the backward of step 6 (the test hook of docs/testing.md;
// checkpoints every 4 steps): the launcher stops the others, starts the world
// again from step_4, and the run ends with the same checkpoint, byte for byte, as
// an uninterrupted one; the metrics file has each step once and counts the restart.
TEST_F(CliReliability, MaxRestartsResumesFromTheNewestCheckpointBitForBit) {
  const std::string cfg = config("restart", ds_config(1e-3, 2, 2));
  auto reference = run_cli(train(cfg, 24, 2) + " --save " + dir_ + "/reference");
  ASSERT_EQ(reference.exit_code, 0) << reference.output;

  const std::string metrics = dir_ + "/m.jsonl";
  const char* cli = std::getenv("AUTOTP_CLI");
  ASSERT_NE(cli, nullptr);
  const int status = std::system(("AUTOTP_TEST_FAULT=rank=1,phase=backward,step=6,signal=KILL " + std::string(cli) +
                                  " " + train(cfg, 24, 2) + " --save " + dir_ +
                                  "/ckpt --save-every 4 --max-restarts 2 --metrics " + metrics + " > " + dir_ +
                                  "/out.txt 2>&1")
                                     .c_str());
  const std::string output = test::read_file(dir_ + "/out.txt");
  ASSERT_EQ(WEXITSTATUS(status), 0) << output;
  EXPECT_EQ(count(output, "rank 1 was killed by SIGKILL (exit code 137) during backward of step 6"), 1) << output;
  EXPECT_EQ(count(output, "restarting all 2 ranks (restart 1 of 2)"), 1) << output;
  EXPECT_NE(output.find("restart 1 of this run: resumed at step 4"), std::string::npos) << output;

  auto lines = test::read_json_lines(metrics);
  ASSERT_EQ(lines.size(), 24u);
  for (int s = 0; s < 24; ++s) EXPECT_EQ(lines[s]["step"].get<int64_t>(), s + 1);
  EXPECT_EQ(lines.front()["restarts"].get<int>(), 0);
  EXPECT_EQ(lines.back()["restarts"].get<int>(), 1);
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir_ + "/reference/step_24")) {
    if (entry.path().extension() != ".safetensors") continue;
    ++files;
    EXPECT_EQ(test::read_file(entry.path().string()),
              test::read_file(dir_ + "/ckpt/step_24/" + entry.path().filename().string()))
        << entry.path().filename() << " differs from the uninterrupted run's";
  }
  EXPECT_EQ(files, 2);
}

// scenario --max-restarts: every variant's first attempt loses rank 1 in the forward
// of step 2 (the test hook fires only in a world's first attempt); each variant runs
// again from its first step, results.json counts it, and the checks still pass.
TEST_F(CliReliability, ScenarioRunsAFailedVariantAgain) {
  const char* cli = std::getenv("AUTOTP_CLI");
  ASSERT_NE(cli, nullptr);
  const std::string out = dir_ + "/scenario";
  const int status = std::system(("AUTOTP_TEST_FAULT=rank=1,phase=forward,step=2,signal=KILL " + std::string(cli) +
                                  " scenario " AUTOTP_SOURCE_DIR "/scenarios/ci.json --no-report --max-restarts 1 --out " +
                                  out + " > " + dir_ + "/scenario.txt 2>&1")
                                     .c_str());
  const std::string output = test::read_file(dir_ + "/scenario.txt");
  ASSERT_EQ(WEXITSTATUS(status), 0) << output;
  const json results = json::parse(test::read_file(out + "/results.json"));
  EXPECT_TRUE(results.at("passed").get<bool>());
  ASSERT_EQ(results.at("variants").size(), 3u);  // the two of the file and their ZeRO-3 baseline
  for (const json& v : results["variants"]) {
    EXPECT_EQ(v.at("status"), "ok") << v.at("name");
    EXPECT_EQ(v.at("restarts"), 1) << v.at("name");
    EXPECT_EQ(v.at("steps_done"), 4) << v.at("name");
  }
}

// Bad input would fail again: exit code 2 at once, no restart.
TEST_F(CliReliability, BadInputIsNotRestarted) {
  const std::string cfg = config("bad", ds_config(1e-3, 2, 1, {{"non_finite", "ignore"}}));
  auto r = run_cli(train(cfg, 2, 2) + " --max-restarts 3");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("non_finite"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("one of error, skip"), std::string::npos) << r.output;
  EXPECT_EQ(count(r.output, "restarting all"), 0) << r.output;
}

// The test hook's variable is read strictly: each bad value is exit 2 before any
// rank starts, in one line naming the variable, the bad part and what is allowed.
// A good one says so in one line, on the rank it is armed on (here at a step the
// run never reaches, so it trains to the end).
TEST_F(CliReliability, TestFaultVariableIsStrictAndSaysWhenArmed) {
  const std::string cfg = config("fault", ds_config(1e-3, 1, 1));
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"rank=1,phase=backward,step=6,signal=KIL", "unknown signal \"KIL\" (one of KILL, STOP, TERM)"},
      {"rank=1,phase=backwards,step=6",
       "unknown phase \"backwards\" (one of startup, rendezvous, load, forward,"},
      {"rank=1,phase=backward,stp=6", "unknown key \"stp\" (one of rank, phase, step, signal, at)"},
      {"rank=1,phase=backward,step=-1", "step=\"-1\" is not a non-negative integer"},
      {"rank=1,phase=backward,step=6x", "step=\"6x\" is not a non-negative integer"},
      {"rank=one,phase=backward", "rank=\"one\" is not a non-negative integer"},
      {"rank=0,phase=checkpoint,step=2,at=renamd",
       "unknown point \"renamd\" (one of rank_file_partly_written,"},
      {"rank=0,phase=forward,step=2,at=renamed", "at=renamed is a point of phase checkpoint, not of forward"},
      {"phase=backward,step=6", "rank is missing"},
      {"rank=1,step=6", "phase is missing"},
      {"rank=1,phase=backward,step=6,", "an empty item after the last comma"},
  };
  for (const auto& [value, message] : bad) {
    SCOPED_TRACE(value);
    ::setenv("AUTOTP_TEST_FAULT", value.c_str(), 1);
    auto r = run_cli(train(cfg, 2, 2));
    ::unsetenv("AUTOTP_TEST_FAULT");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("autotp: error: AUTOTP_TEST_FAULT=\"" + value + "\": " + message),
              std::string::npos)
        << r.output;
    EXPECT_EQ(count(r.output, "AUTOTP_TEST_FAULT"), 1) << r.output;
  }
  ::setenv("AUTOTP_TEST_FAULT", "rank=1,phase=backward,step=99,signal=STOP", 1);
  auto r = run_cli(train(cfg, 2, 2));
  ::unsetenv("AUTOTP_TEST_FAULT");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "AUTOTP_TEST_FAULT"), 1) << r.output;
  EXPECT_EQ(
      count(r.output,
            "[rank 1] warning: AUTOTP_TEST_FAULT is armed: rank 1 raises SIGSTOP during backward of step 99"),
      1)
      << r.output;
}

// AUTOTP_CPU_BF16_GEMM (base/bf16_matmul.h) is read at startup, whatever the run's
// dtype. Both paths train bf16 at tp 2 alike on any CPU: the widened products and
// LibTorch's bf16 ones give losses within 5e-3 of each other, step after step.
TEST_F(CliReliability, CpuBf16GemmVariableIsStrictAndBothPathsTrainAlike) {
  const std::string fp32_cfg = config("fp32", ds_config(1e-3, 1, 1));
  ::setenv("AUTOTP_CPU_BF16_GEMM", "bf16", 1);
  auto r = run_cli(train(fp32_cfg, 1, 1));
  ::unsetenv("AUTOTP_CPU_BF16_GEMM");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(count(r.output, "autotp: error: AUTOTP_CPU_BF16_GEMM=bf16: allowed values are auto, native, fp32"), 1)
      << r.output;
  const std::string cfg = config("bf16", ds_config(1e-3, 2, 1, {{"bf16", {{"enabled", true}}}}));
  std::vector<std::vector<json>> runs;
  for (const std::string mode : {"native", "fp32"}) {
    ::setenv("AUTOTP_CPU_BF16_GEMM", mode.c_str(), 1);
    r = run_cli(train(cfg, 4, 2) + " --metrics " + dir_ + "/" + mode + ".jsonl");
    ::unsetenv("AUTOTP_CPU_BF16_GEMM");
    ASSERT_EQ(r.exit_code, 0) << mode << r.output;
    runs.push_back(test::read_json_lines(dir_ + "/" + mode + ".jsonl"));
    ASSERT_EQ(runs.back().size(), 4u);
  }
  for (int s = 0; s < 4; ++s)
    EXPECT_NEAR(runs[1][s]["loss"].get<double>(), runs[0][s]["loss"].get<double>(), 5e-3) << s;  // measured: 9e-4
}

// torchrun restarts its workers with TORCHELASTIC_RESTART_COUNT > 0: autotp then
// resumes from --save's latest. --resume auto does the same on a first start,
// and starts from the beginning when there is no checkpoint yet.
TEST_F(CliReliability, TorchrunRestartAndResumeAutoContinueFromLatest) {
  const std::string cfg = config("torchrun", ds_config(1e-3, 1, 1));
  const std::string save = dir_ + "/ckpt";
  auto first = run_cli(train(cfg, 2, 1) + " --save " + save + " --resume auto");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_EQ(test::read_file(save + "/latest"), "step_2\n");

  const char* cli = std::getenv("AUTOTP_CLI");
  ASSERT_NE(cli, nullptr);
  const std::string restarted_out = dir_ + "/restarted.txt";
  const int status = std::system(("RANK=0 WORLD_SIZE=1 TORCHELASTIC_RESTART_COUNT=1 " + std::string(cli) + " " +
                                  train(cfg, 4, 1) + " --save " + save + " --metrics " + dir_ + "/m.jsonl > " +
                                  restarted_out + " 2>&1")
                                     .c_str());
  const std::string output = test::read_file(restarted_out);
  ASSERT_EQ(WEXITSTATUS(status), 0) << output;
  EXPECT_NE(output.find("restart 1 of this run: resumed at step 2"), std::string::npos) << output;
  auto lines = test::read_json_lines(dir_ + "/m.jsonl");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["step"], 3);
  EXPECT_EQ(lines[1]["restarts"], 1);

  auto resumed = run_cli(train(cfg, 5, 1) + " --save " + save + " --resume auto --metrics " + dir_ + "/m2.jsonl");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  auto more = test::read_json_lines(dir_ + "/m2.jsonl");
  ASSERT_EQ(more.size(), 1u);
  EXPECT_EQ(more[0]["step"], 5);

  auto no_save = run_cli(train(cfg, 1, 1) + " --resume auto");
  EXPECT_EQ(no_save.exit_code, 2) << no_save.output;
  EXPECT_NE(no_save.output.find("--resume auto resumes from --save DIR"), std::string::npos) << no_save.output;
}

}  // namespace
}  // namespace autotp
