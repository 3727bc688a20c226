// The fault matrix of docs/reliability.md over real ranks: `autotp train
// --nproc 4` at tp 2 x dp 2 and every ZeRO stage, with one rank SIGKILLed or
// SIGSTOPped in forward, in a backward collective, in the optimizer step and
// while writing a checkpoint; the store host (rank 0) killed; a file-size limit
// hit while saving; a checkpoint shard corrupted after the save. Each case
// checks: a non-zero exit within timeout + grace + margin of the fault, exactly
// one launcher error line naming the failing rank and its phase, no rank process
// left, and a resume that loads the newest complete checkpoint (never a
// `.partial` staging directory or a temporary file).
//
// A phase is hit exactly through the test hook AUTOTP_TEST_FAULT (docs/testing.md):
// the victim signals itself when it publishes that phase and step. The phases of
// the tiny model last milliseconds, too short to hit from outside reliably.
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "autotp/io/safetensors.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kTimeoutS = 5;         // --timeout of every run
constexpr double kGraceS = 2.0;      // the launcher's SIGTERM -> SIGKILL grace (LaunchOptions default)
constexpr double kMarginS = 6.0;     // reaching the collective, unwinding and exit on a loaded 2-core machine
constexpr int kResumeTimeoutS = 60;  // runs without a timing fault: a slow start-up must not fail them
constexpr int64_t kSaveEvery = 2;    // checkpoints at steps 2, 4, 6

int64_t realtime_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct ShellRun {
  int exit_code = -1;
  std::string output;
  int64_t ended_ns = 0;  // realtime when the command had exited
};

// `command` through the shell, stdout and stderr together.
ShellRun run_shell(const std::string& command) {
  ShellRun run;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) throw std::runtime_error("popen failed: " + command);
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) run.output.append(buffer, n);
  const int status = pclose(pipe);
  run.ended_ns = realtime_ns();
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return run;
}

std::vector<std::string> lines_starting(const std::string& text, const std::string& prefix) {
  std::vector<std::string> found;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(prefix, 0) == 0) found.push_back(line);
  return found;
}

// Processes (other than zombies) whose environment holds `marker`.
int processes_with(const std::string& marker) {
  int count = 0;
  DIR* proc = opendir("/proc");
  while (dirent* entry = readdir(proc)) {
    if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
    std::ifstream in(std::string("/proc/") + entry->d_name + "/environ", std::ios::binary);
    std::string environment((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (environment.find(marker + '\0') != std::string::npos) ++count;
  }
  closedir(proc);
  return count;
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

enum class Fault { kSignal, kDiskFull, kCorruptShard };

struct FaultCase {
  std::string name;
  int stage = 0;
  Fault fault = Fault::kSignal;
  std::string signal;  // KILL or STOP
  int rank = 1;        // the victim
  std::string phase;   // forward, backward, optimizer, checkpoint
  int64_t step = 3;    // the victim's step (a checkpoint's step for "checkpoint")
  std::string at;      // a point inside the phase (a save's "rank_file_partly_written")
};

std::ostream& operator<<(std::ostream& out, const FaultCase& c) { return out << c.name; }

// Each fault once, the ZeRO stages spread over them (every stage 2-3 times):
// stage 0: kill_forward, stop_checkpoint, corrupt_shard; stage 1: kill_backward,
// stop_forward, store_host_killed; stage 2: kill_optimizer, stop_backward,
// disk_full; stage 3: kill_checkpoint, stop_optimizer.
const std::vector<FaultCase> kCases = {
    {"kill_forward", 0, Fault::kSignal, "KILL", 1, "forward", 3, ""},
    {"kill_backward", 1, Fault::kSignal, "KILL", 2, "backward", 3, ""},
    {"kill_optimizer", 2, Fault::kSignal, "KILL", 3, "optimizer", 3, ""},
    {"kill_checkpoint", 3, Fault::kSignal, "KILL", 1, "checkpoint", 4, "rank_file_partly_written"},
    {"stop_forward", 1, Fault::kSignal, "STOP", 3, "forward", 3, ""},
    {"stop_backward", 2, Fault::kSignal, "STOP", 1, "backward", 3, ""},
    {"stop_optimizer", 3, Fault::kSignal, "STOP", 2, "optimizer", 3, ""},
    {"stop_checkpoint", 0, Fault::kSignal, "STOP", 1, "checkpoint", 4, "rank_file_partly_written"},
    {"store_host_killed", 1, Fault::kSignal, "KILL", 0, "backward", 3, ""},
    {"disk_full", 2, Fault::kDiskFull, "", -1, "checkpoint", 4, ""},
    {"corrupt_shard", 0, Fault::kCorruptShard, "", -1, "load", 4, ""},
};

class FaultMatrix : public ::testing::TestWithParam<FaultCase> {
 protected:
  void SetUp() override {
    const char* cli = std::getenv("AUTOTP_CLI");
    ASSERT_NE(cli, nullptr) << "run through ctest (AUTOTP_CLI)";
    cli_ = cli;
    dir_ = test::make_temp_dir("faults");
    // 56 examples of 32 tokens: 7 steps an epoch
    test::write_line_corpus(dir_ + "/corpus.txt", 40, "pack my box with five dozen liquor jugs.");
    const json config = {{"train_batch_size", 8},
                         {"gradient_accumulation_steps", 2},
                         {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                         {"zero_optimization", {{"stage", GetParam().stage}}},
                         {"tensor_parallel", {{"autotp_size", 2}}}};
    io::write_text_file_atomic(dir_ + "/config.json", config.dump());
    save_ = dir_ + "/ckpt";
    marker_ = "AUTOTP_FAULT_CASE=" + fs::path(dir_).filename().string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // `autotp train` on 4 ranks; `prefix` goes before the binary (environment, prlimit).
  ShellRun train(const std::string& prefix, int64_t steps, const std::string& extra,
                 int timeout_s = kTimeoutS) {
    return run_shell("env " + marker_ + " " + prefix + " " + cli_ + " train --config " + dir_ +
                     "/config.json --model preset:llama-tiny --data " + dir_ +
                     "/corpus.txt --tokenizer bytes --seq-len 32 --nproc 4 --timeout " +
                     std::to_string(timeout_s) + " --steps " + std::to_string(steps) + " " + extra);
  }

  // Resumes from the checkpoint root and trains nothing: the step it loaded.
  int64_t resumed_step(const std::string& from) {
    ShellRun run = train("", 1, "--resume " + from, kResumeTimeoutS);
    EXPECT_EQ(run.exit_code, 0) << run.output;
    std::smatch match;
    const std::regex resumed("resumed from (\\S+) at step (\\d+)");
    if (!std::regex_search(run.output, match, resumed)) {
      ADD_FAILURE() << "no 'resumed from' line:\n" << run.output;
      return -1;
    }
    EXPECT_EQ(match[1].str().find(".partial"), std::string::npos) << match[1];
    EXPECT_EQ(fs::path(match[1].str()).filename().string(), "step_" + match[2].str()) << match[1];
    return std::stoll(match[2].str());
  }

  std::string latest() { return trimmed(test::read_file(save_ + "/latest")); }

  // The launcher's error line (exactly one) and its checks common to every case.
  std::string error_line(const ShellRun& run) {
    const auto lines = lines_starting(run.output, "autotp: rank ");
    EXPECT_EQ(lines.size(), 1u) << run.output;
    return lines.empty() ? "" : lines.front();
  }

  void report(const std::string& how, double seconds, const std::string& line) {
    std::cerr << fmt::format("fault matrix | {} | stage {} | {} | {:.2f} s | {}\n", GetParam().name,
                             GetParam().stage, how, seconds, line);
  }

  std::string cli_, dir_, save_, marker_;
};

TEST_P(FaultMatrix, ExitsInTimeNamesTheRankAndResumesFromTheNewestCompleteCheckpoint) {
  const FaultCase& c = GetParam();
  const std::string save = "--save " + save_ + " --save-every " + std::to_string(kSaveEvery);

  if (c.fault == Fault::kSignal) {
    const std::string spec = fmt::format("AUTOTP_TEST_FAULT=rank={},phase={},step={},signal={}{}", c.rank,
                                         c.phase, c.step, c.signal, c.at.empty() ? "" : ",at=" + c.at);
    const ShellRun run = train(spec, 6, save);
    EXPECT_NE(run.exit_code, 0) << run.output;
    std::smatch match;
    const std::regex fault_line("autotp: test fault: rank (\\d+) raises SIG(\\w+) during .* at (\\d+) ns");
    ASSERT_TRUE(std::regex_search(run.output, match, fault_line)) << run.output;
    ASSERT_EQ(std::stoi(match[1].str()), c.rank);
    const double seconds = (run.ended_ns - std::stoll(match[3].str())) / 1e9;
    EXPECT_LE(seconds, kTimeoutS + kGraceS + kMarginS) << run.output;
    const std::string line = error_line(run);
    const std::string during = fmt::format(" during {} of step {}", c.phase, c.step);
    EXPECT_EQ(line.rfind(fmt::format("autotp: rank {} ", c.rank), 0), 0u) << line;
    EXPECT_NE(line.find(during), std::string::npos) << line;
    if (c.signal == "KILL") {
      EXPECT_NE(line.find("was killed by SIGKILL"), std::string::npos) << line;
      EXPECT_LE(seconds, kGraceS + kMarginS) << "a dead rank is noticed at once:\n" << run.output;
    } else {
      EXPECT_NE(line.find("was stopped"), std::string::npos) << line;
      // Its peers waited for their collective timeout: the cause is not theirs.
      EXPECT_GE(seconds, kTimeoutS - 0.5) << run.output;
    }
    EXPECT_EQ(processes_with(marker_), 0) << "a rank process is left";
    report(fmt::format("SIG{} of rank {} in {}", c.signal, c.rank, c.phase), seconds, line);

    if (c.phase == "checkpoint") {
      // The interrupted save left its staging directory, never `step_4` or `latest`.
      EXPECT_TRUE(fs::exists(save_ + "/.step_4.partial")) << "the fault hit after the save";
      EXPECT_FALSE(fs::exists(save_ + "/step_4"));
    }
    EXPECT_EQ(latest(), "step_2");
    EXPECT_EQ(resumed_step(save_), 2);
    return;
  }

  if (c.fault == Fault::kDiskFull) {
    // step_2 complete, then a run whose files may not pass 200 kB: its rank
    // files (~650 kB each) fail at the save of step 4.
    ASSERT_EQ(train("", 2, save, kResumeTimeoutS).exit_code, 0);
    const int64_t started_ns = realtime_ns();
    const ShellRun run = train("prlimit --fsize=200000 --", 4, save + " --resume " + save_, kResumeTimeoutS);
    EXPECT_EQ(run.exit_code, 2) << run.output;
    EXPECT_NE(run.output.find(".safetensors.tmp."), std::string::npos) << run.output;
    EXPECT_NE(run.output.find("write failed: File too large"), std::string::npos) << run.output;
    const std::string line = error_line(run);
    EXPECT_TRUE(
        std::regex_search(line, std::regex("^autotp: rank \\d failed with exit code 2 during checkpoint of "
                                           "step 4; the other ranks were stopped$")))
        << line;
    EXPECT_EQ(processes_with(marker_), 0) << "a rank process is left";
    report("file-size limit 200 kB (RLIMIT_FSIZE) at the save of step 4 (whole run)",
           (run.ended_ns - started_ns) / 1e9, line);
    EXPECT_FALSE(fs::exists(save_ + "/step_4"));
    EXPECT_EQ(latest(), "step_2");
    EXPECT_EQ(resumed_step(save_), 2);
    return;
  }

  // A shard of the newest checkpoint corrupted after its save.
  ASSERT_EQ(train("", 4, save, kResumeTimeoutS).exit_code, 0);
  const std::string shard = save_ + "/step_4/tp1_dp0.safetensors";
  {
    std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-100, std::ios::end);
    char bytes[4];
    file.read(bytes, sizeof bytes);
    for (char& byte : bytes) byte = static_cast<char>(~byte);
    file.seekp(-100, std::ios::end);
    file.write(bytes, sizeof bytes);
  }
  const int64_t started_ns = realtime_ns();
  const ShellRun run = train("", 6, "--resume " + save_, kResumeTimeoutS);
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("tp1_dp0.safetensors"), std::string::npos) << run.output;
  const std::string line = error_line(run);
  EXPECT_TRUE(std::regex_search(
      line,
      std::regex(
          "^autotp: rank \\d failed with exit code 2 during load of step 4; the other ranks were stopped$")))
      << line;
  EXPECT_EQ(processes_with(marker_), 0) << "a rank process is left";
  report("bytes of step_4/tp1_dp0.safetensors flipped (whole run)", (run.ended_ns - started_ns) / 1e9, line);
  // Nothing falls back silently: `latest` still names step_4, and the older
  // complete checkpoint is resumed by naming it.
  EXPECT_EQ(latest(), "step_4");
  EXPECT_EQ(resumed_step(save_ + "/step_2"), 2);
}

INSTANTIATE_TEST_SUITE_P(World4Tp2, FaultMatrix, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace autotp
