// Network faults between two "hosts" (issue 24): ranks of `autotp train` started
// torchrun-style in two network namespaces joined by one veth pair, Gloo over
// TCP on that link (AUTOTP_SHARED_MEMORY=0, GLOO_SOCKET_IFNAME = the veth end).
// World 4 = dp 2 x tp 2: ranks 0, 1 (a tp pair) on side a, ranks 2, 3 on side b,
// so the tp traffic stays inside a namespace and every dp collective crosses the link.
//
// Cases: a slow link (tbf) trains to the same losses bit for bit; a partition
// mid-step, a partition in the middle of a checkpoint and a link too slow for
// the timeout each stop every rank within the timeout plus a margin, with one
// error line per rank naming its collective, group and phase, leave no process,
// and leave `latest` on the newest complete checkpoint, which resumes (on
// loopback) into the same losses; a partition before the rendezvous stops every
// rank within the timeout. Skips without root / CAP_NET_ADMIN / iproute2.
// Measured figures: docs/reliability.md, "Network faults".
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <thread>

#include "support/child_process.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"
#include "support/veth_link.h"

namespace autotp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::ChildProcess;
using test::VethLink;
using Clock = std::chrono::steady_clock;

constexpr int kWorld = 4;
constexpr int kTimeoutS = 5;  // --timeout of the faulted runs
// Exit within the timeout plus this: the timeout fires at kTimeoutS; the rest
// (a rank's exit, collectives that still finish on a slow link, start-up before
// the rendezvous) took up to 3.5 s on the shared 2-core machine under load.
constexpr double kExitMarginS = 10.0;

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

std::string cli_path() {
  const char* cli = std::getenv("AUTOTP_CLI");
  if (!cli) throw std::runtime_error("AUTOTP_CLI is not set (run the tests through ctest)");
  return cli;
}

// Complete lines of a file another process appends to (a partial last line is not counted).
size_t complete_lines(const std::string& path) {
  const std::string text = test::read_file(path);
  return static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
}

// step -> (loss, grad_norm) of a metrics file.
std::map<int64_t, std::pair<double, double>> losses(const std::string& path) {
  std::map<int64_t, std::pair<double, double>> out;
  for (const auto& line : test::read_json_lines(path))
    out[line.at("step").get<int64_t>()] = {line.at("loss").get<double>(), line.at("grad_norm").get<double>()};
  return out;
}

double median_step_time(const std::string& path) {
  std::vector<double> times;
  for (const auto& line : test::read_json_lines(path))
    if (line.at("step").get<int64_t>() > 1)
      times.push_back(line.at("step_time_s").get<double>());  // step 1 warms up
  if (times.empty()) return 0;
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

std::vector<std::string> error_lines(const std::string& output) {
  std::vector<std::string> lines;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("autotp: error:", 0) == 0) lines.push_back(line);
  return lines;
}

// The step of the last "saved checkpoint DIR/step_N" line of rank 0's log; -1 if none.
int64_t last_logged_save(const std::string& output) {
  static const std::regex saved(R"(saved checkpoint \S*step_(\d+) )");
  int64_t step = -1;
  for (std::sregex_iterator it(output.begin(), output.end(), saved), end; it != end; ++it)
    step = std::stoll((*it)[1].str());
  return step;
}

class NetworkFault : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto reason = VethLink::why_unavailable()) GTEST_SKIP() << reason->c_str();
    link_ = std::make_unique<VethLink>();
    dir_ = test::make_temp_dir("netfault");
    test::write_line_corpus(dir_ + "/corpus.txt", 60, "pack my box with five dozen liquor jugs.");
    const json ds = {
        {"train_batch_size", 8},
        {"gradient_accumulation_steps", 1},
        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"weight_decay", 0.01}, {"eps", 1e-6}}}}},
        {"gradient_clipping", 1.0},
        {"zero_optimization", {{"stage", 1}}},
        {"tensor_parallel", {{"autotp_size", 2}}}};
    std::ofstream(dir_ + "/ds.json") << ds.dump();
  }

  void TearDown() override {
    ranks_.clear();  // kills what is left before the namespaces go
    link_.reset();
  }

  std::vector<std::string> train_args(int steps, const std::string& metrics, int timeout_s) const {
    return {cli_path(),    "train",
            "--config",    dir_ + "/ds.json",
            "--model",     "preset:llama-tiny",
            "--data",      dir_ + "/corpus.txt",
            "--tokenizer", "bytes",
            "--seq-len",   "32",
            "--threads",   "1",
            "--steps",     std::to_string(steps),
            "--timeout",   std::to_string(timeout_s),
            "--metrics",   metrics};
  }

  // Starts the four ranks torchrun-style, two per namespace; rank 0 (side a) hosts the store.
  void start_world(int steps, const std::string& metrics, int timeout_s,
                   const std::vector<std::string>& extra = {}) {
    ranks_.clear();
    for (int rank = 0; rank < kWorld; ++rank) {
      const int side = rank / 2;
      std::vector<std::string> argv = {"ip", "netns", "exec", link_->ns(side), "env",
                                       "RANK=" + std::to_string(rank), "WORLD_SIZE=" + std::to_string(kWorld),
                                       "LOCAL_RANK=" + std::to_string(rank % 2), "LOCAL_WORLD_SIZE=2",
                                       "MASTER_ADDR=" + link_->address(0), "MASTER_PORT=29500",
                                       // The namespaces share the hostname and boot id: force TCP.
                                       "AUTOTP_SHARED_MEMORY=0", "GLOO_SOCKET_IFNAME=" + link_->device(side)};
      for (const auto& arg : train_args(steps, metrics, timeout_s)) argv.push_back(arg);
      for (const auto& arg : extra) argv.push_back(arg);
      ranks_.push_back(std::make_unique<ChildProcess>(argv, dir_ + "/rank" + std::to_string(rank) + ".log"));
    }
  }

  // Waits for every rank until `deadline`; false if one is still running then.
  // Polls all of them in turn, so each one's exit time is its own.
  bool wait_world(Clock::time_point deadline) {
    for (;;) {
      bool all = true;
      for (auto& rank : ranks_) all = rank->poll() && all;
      if (all) return true;
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  std::string world_output() const {
    std::string text;
    for (size_t r = 0; r < ranks_.size(); ++r)
      text += "--- rank " + std::to_string(r) + ":\n" + ranks_[r]->output();
    return text;
  }

  // Waits until `path` holds `lines` complete lines while every rank still runs.
  void wait_for_metrics(const std::string& path, size_t lines, double limit_s = 120) {
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(limit_s));
    while (complete_lines(path) < lines) {
      for (auto& rank : ranks_)
        ASSERT_FALSE(rank->poll()) << "a rank exited before step " << lines << "\n" << world_output();
      ASSERT_LT(Clock::now(), deadline) << "no step " << lines << " within " << limit_s << " s\n"
                                        << world_output();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  // A normal run of `steps` steps on the link as it is; returns the metrics path.
  std::string train_to_completion(const std::string& name, int steps) {
    const std::string metrics = dir_ + "/" + name + ".jsonl";
    start_world(steps, metrics, 60);
    EXPECT_TRUE(wait_world(Clock::now() + std::chrono::seconds(120))) << world_output();
    for (size_t r = 0; r < ranks_.size(); ++r)
      EXPECT_EQ(ranks_[r]->exit_code(), 0) << "rank " << r << "\n" << world_output();
    return metrics;
  }

  // After a fault at `fault_at`: every rank exits 1 within the timeout plus the
  // margin, with exactly one error line: that of a collective of a group holding
  // this rank, named with the phase, which timed out or (a peer that timed out
  // first has gone) lost the connection, named by the peer's address. No
  // process is left in either namespace. Prints the times to exit and the lines.
  // Returns each rank's phase as its line names it ("optimizer of step 4").
  std::vector<std::string> expect_every_rank_stopped(Clock::time_point fault_at, const std::string& what) {
    std::vector<std::string> phases;
    const auto deadline = fault_at + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(kTimeoutS + kExitMarginS));
    if (!wait_world(deadline)) {
      ADD_FAILURE() << "ranks still running " << kTimeoutS + kExitMarginS << " s after the " << what << "\n"
                    << world_output();
      return phases;
    }
    static const std::regex line_form(
        R"(autotp: error: Comm::\w+ on group '(\w+)' \(rank \d+ of \d+, global ranks \[([0-9, ]+)\]; this is global rank \d+\) )"
        R"(failed during (forward|backward|optimizer|checkpoint) of step (\d+): )"
        R"(.*(Timed out waiting )" +
        std::to_string(kTimeoutS * 1000) +
        R"(ms for (send|recv) operation to complete|(Connection closed by peer|Read error|Write error) )"
        R"(\[10\.77\.0\.[12]\]:\d+))");
    std::ostringstream times, lines_seen;
    times << std::fixed << std::setprecision(2);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      const std::string output = ranks_[r]->output();
      EXPECT_EQ(ranks_[r]->exit_code(), 1) << "rank " << r << "\n" << output;
      times << " " << seconds_between(fault_at, ranks_[r]->exited_at());
      const auto lines = error_lines(output);
      std::smatch match;
      if (lines.size() != 1 || !std::regex_search(lines[0], match, line_form)) {
        ADD_FAILURE() << "rank " << r << ": not one error line of the expected form\n" << output;
        continue;
      }
      phases.push_back(match[3].str() + " of step " + match[4].str());
      // The group named is one this rank belongs to.
      const std::string members = ", " + match[2].str() + ",";
      EXPECT_NE(members.find(" " + std::to_string(r) + ","), std::string::npos) << lines[0];
      lines_seen << "[ error line ] rank " << r << ": " << lines[0] << "\n";
    }
    std::cout << "[ measured ] " << what << ": ranks 0-3 exited" << times.str() << " s after the fault\n"
              << lines_seen.str();
    for (int side = 0; side < 2; ++side)
      EXPECT_TRUE(link_->pids(side).empty()) << "processes left in side " << side;
    return phases;
  }

  std::string latest(const std::string& root) const {
    std::string text = test::read_file(root + "/latest");
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
    return text;
  }

  // Resumes `root` on loopback (4 local ranks, Gloo over TCP as in the faulted
  // run) up to `steps`; returns the metrics of the resumed steps.
  std::string resume_on_loopback(const std::string& root, int steps,
                                 const std::vector<std::string>& extra = {}) {
    const std::string metrics = dir_ + "/resumed.jsonl";
    std::vector<std::string> argv = {"env", "AUTOTP_SHARED_MEMORY=0"};
    for (const auto& arg : train_args(steps, metrics, 60)) argv.push_back(arg);
    for (const auto& arg : {std::string("--nproc"), std::to_string(kWorld), std::string("--resume"), root})
      argv.push_back(arg);
    for (const auto& arg : extra) argv.push_back(arg);
    ChildProcess resumed(argv, dir_ + "/resumed.log");
    EXPECT_TRUE(resumed.wait_until(Clock::now() + std::chrono::seconds(120))) << resumed.output();
    EXPECT_EQ(resumed.exit_code(), 0) << resumed.output();
    return metrics;
  }

  // The resumed run starts right after `saved_step` and repeats, bit for bit,
  // every step the faulted run logged after it (at least one).
  void expect_resumed_continuation(const std::string& faulted_metrics, const std::string& resumed_metrics,
                                   int64_t saved_step) {
    const auto before = losses(faulted_metrics);
    const auto after = losses(resumed_metrics);
    ASSERT_FALSE(after.empty());
    EXPECT_EQ(after.begin()->first, saved_step + 1);
    int compared = 0;
    for (const auto& [step, values] : after) {
      auto it = before.find(step);
      if (it == before.end()) continue;
      EXPECT_EQ(values.first, it->second.first) << "loss of step " << step;
      EXPECT_EQ(values.second, it->second.second) << "grad_norm of step " << step;
      ++compared;
    }
    EXPECT_GE(compared, 1) << "the faulted run logged no step after the checkpoint of step " << saved_step;
  }

  std::unique_ptr<VethLink> link_;
  std::string dir_;
  std::vector<std::unique_ptr<ChildProcess>> ranks_;
};

// tbf at 20 Mbit/s each way: the same losses and grad norms bit for bit, slower steps.
TEST_F(NetworkFault, SlowLinkTrainsToTheSameLossesBitForBit) {
  constexpr int kSteps = 3;
  const std::string normal = train_to_completion("normal", kSteps);
  link_->shape("20mbit");
  const std::string slow = train_to_completion("slow", kSteps);
  const auto a = losses(normal), b = losses(slow);
  ASSERT_EQ(a.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(b.size(), static_cast<size_t>(kSteps));
  for (const auto& [step, values] : a) {
    EXPECT_EQ(b.at(step).first, values.first) << "loss of step " << step;
    EXPECT_EQ(b.at(step).second, values.second) << "grad_norm of step " << step;
  }
  // About 0.9 MB crosses the link each way per step: >= 0.36 s at 20 Mbit/s.
  const double normal_s = median_step_time(normal), slow_s = median_step_time(slow);
  std::cout << "[ measured ] median step time: " << normal_s << " s on the plain veth, " << slow_s
            << " s through tbf 20mbit\n";
  EXPECT_GT(slow_s, 0.3);
  EXPECT_GT(slow_s, normal_s);
}

// The link goes down in the middle of step 6 (steps 2 and 4 saved).
TEST_F(NetworkFault, PartitionStopsEveryRankAndTheLastCheckpointResumes) {
  const std::string metrics = dir_ + "/partition.jsonl", root = dir_ + "/ckpt";
  start_world(200, metrics, kTimeoutS, {"--save", root, "--save-every", "2"});
  wait_for_metrics(metrics, 5);  // step 5 done (its line follows step 5's work): step 6 runs
  const auto cut_at = Clock::now();
  link_->cut(1);
  expect_every_rank_stopped(cut_at, "partition");
  const int64_t saved = last_logged_save(ranks_[0]->output());
  ASSERT_GE(saved, 4) << ranks_[0]->output();
  EXPECT_EQ(latest(root), "step_" + std::to_string(saved));
  const auto resumed = resume_on_loopback(root, static_cast<int>(saved) + 2);
  expect_resumed_continuation(metrics, resumed, saved);
}

// The link goes down the moment rank 0 creates the staging directory of step 6's
// checkpoint: the half-written checkpoint is never named by `latest`, resuming
// loads step 4, and the next save of step 6 replaces the leftover.
TEST_F(NetworkFault, PartitionDuringACheckpointKeepsThePreviousOne) {
  const std::string metrics = dir_ + "/partition.jsonl", root = dir_ + "/ckpt";
  fs::create_directories(root);
  const int watch = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  ASSERT_GE(watch, 0);
  ASSERT_GE(inotify_add_watch(watch, root.c_str(), IN_CREATE), 0);
  link_->arm_cut(1);
  start_world(200, metrics, kTimeoutS, {"--save", root, "--save-every", "2"});
  const std::string staging = ".step_6.partial";
  Clock::time_point cut_at;
  for (bool seen = false; !seen;) {
    pollfd fd = {watch, POLLIN, 0};
    ASSERT_GE(::poll(&fd, 1, 120000), 1) << "no checkpoint of step 6 within 120 s\n" << world_output();
    alignas(inotify_event) char buffer[4096];
    const ssize_t n = ::read(watch, buffer, sizeof(buffer));
    for (ssize_t at = 0; at < n;) {
      const auto* event = reinterpret_cast<const inotify_event*>(buffer + at);
      if (event->len > 0 && staging == event->name) seen = true;
      at += static_cast<ssize_t>(sizeof(inotify_event) + event->len);
    }
  }
  cut_at = Clock::now();
  link_->fire_cut();
  ::close(watch);
  const auto phases = expect_every_rank_stopped(cut_at, "partition during a checkpoint");
  EXPECT_EQ(phases, std::vector<std::string>(kWorld, "checkpoint of step 6"));
  EXPECT_EQ(last_logged_save(ranks_[0]->output()), 4);
  EXPECT_EQ(latest(root), "step_4");
  EXPECT_FALSE(fs::exists(root + "/step_6"));
  EXPECT_TRUE(fs::exists(root + "/" + staging)) << "the cut landed after the save of step 6";
  const auto resumed = resume_on_loopback(root, 6, {"--save", root});
  expect_resumed_continuation(metrics, resumed, 4);
  EXPECT_EQ(latest(root), "step_6");
  EXPECT_FALSE(fs::exists(root + "/" + staging));
}

// After step 3 the link drops to 100 kbit/s: one dp reduce-scatter (~216 KB)
// would need ~17 s, more than the 5 s timeout.
TEST_F(NetworkFault, LinkTooSlowForTheTimeoutStopsEveryRank) {
  const std::string metrics = dir_ + "/slow.jsonl", root = dir_ + "/ckpt";
  start_world(200, metrics, kTimeoutS, {"--save", root, "--save-every", "2"});
  wait_for_metrics(metrics, 3);
  const auto shaped_at = Clock::now();
  link_->shape("100kbit");
  expect_every_rank_stopped(shaped_at, "100 kbit/s link");
  const int64_t saved = last_logged_save(ranks_[0]->output());
  ASSERT_GE(saved, 2) << ranks_[0]->output();
  EXPECT_EQ(latest(root), "step_" + std::to_string(saved));
}

// Rank 0's end of the link is down before the ranks start: ranks 2 and 3 send
// into a link that drops everything (no refusal, no unreachable network: their
// own end is up), ranks 0 and 1 wait in rank 0's store for keys that never come
// (rank 1 may instead see the store close when rank 0 gives up). Every rank
// exits 1 within the timeout (plus start-up and the margin), naming the rendezvous.
TEST_F(NetworkFault, PartitionBeforeTheRendezvousStopsEveryRank) {
  link_->cut(0);
  const auto started_at = Clock::now();
  start_world(5, dir_ + "/never.jsonl", kTimeoutS);
  const auto deadline =
      started_at + std::chrono::seconds(kTimeoutS) +
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kExitMarginS));
  ASSERT_TRUE(wait_world(deadline)) << "ranks still running " << kTimeoutS + kExitMarginS
                                    << " s after the start\n"
                                    << world_output();
  const std::regex host_side(
      R"(autotp: error: rank [01]: creating process group 'world' \(4 ranks\) failed: )"
      R"((wait timeout after 5000ms|Failed to recv, got 0 bytes\. Connection was likely closed))");
  const std::regex store_host(R"(autotp: error: rank 0: .* failed: wait timeout after 5000ms)");
  const std::regex cut_side(
      R"(autotp: error: rank [23] of 4: TCPStore rendezvous at 10\.77\.0\.1:29500 failed: )"
      R"(no connection within the timeout of 5000 ms \(last error: (Connection timed out|No route to host)\))");
  std::ostringstream times;
  times << std::fixed << std::setprecision(2);
  for (size_t r = 0; r < ranks_.size(); ++r) {
    EXPECT_EQ(ranks_[r]->exit_code(), 1) << "rank " << r << "\n" << ranks_[r]->output();
    const auto lines = error_lines(ranks_[r]->output());
    ASSERT_EQ(lines.size(), 1u) << "rank " << r << "\n" << ranks_[r]->output();
    EXPECT_TRUE(std::regex_search(lines[0], r < 2 ? host_side : cut_side))
        << "rank " << r << ": " << lines[0];
    if (r == 0) {
      EXPECT_TRUE(std::regex_search(lines[0], store_host)) << lines[0];
    }
    EXPECT_NE(lines[0].find("rank " + std::to_string(r)), std::string::npos) << lines[0];
    times << " " << seconds_between(started_at, ranks_[r]->exited_at());
    std::cout << "[ error line ] rank " << r << ": " << lines[0] << "\n";
  }
  std::cout << "[ measured ] partition before the rendezvous: ranks 0-3 exited" << times.str()
            << " s after they were started\n";
  for (int side = 0; side < 2; ++side)
    EXPECT_TRUE(link_->pids(side).empty()) << "processes left in side " << side;
}

}  // namespace
}  // namespace autotp
