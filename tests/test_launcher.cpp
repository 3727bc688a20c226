// The local launcher: the environment each rank sees, fail-fast when a rank
// fails (by error, by signal, while its peers hang or ignore SIGTERM), output
// forwarding, and signal forwarding.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "launcher/launcher.h"
#include "launcher/restarts.h"
#include "support/model_fixtures.h"
#include "support/child_process.h"
#include "support/multiprocess.h"
#include "support/worker_zygote.h"

namespace {

using autotp::launcher::LaunchOptions;
using autotp::launcher::LaunchResult;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

void sleep_seconds(double seconds) { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); }

LaunchOptions worker_options(const std::string& worker, int nproc,
                             const std::vector<std::string>& args = {}) {
  LaunchOptions options;
  options.nproc = nproc;
  options.argv = {autotp::launcher::self_executable(), "--autotp-worker", worker};
  options.argv.insert(options.argv.end(), args.begin(), args.end());
  options.threads_per_rank = 1;
  options.prefix_output = true;
  return options;
}

std::string temp_path(const std::string& stem) {
  return (std::filesystem::temp_directory_path() / (stem + "_" + std::to_string(getpid()))).string();
}

}  // namespace

// Ranks other than 2 block in a barrier; rank 2 fails after a moment.
AUTOTP_WORKER(fail_rank2_in_barrier) {
  auto topology = ctx.topology(1);
  if (ctx.env.rank == 2) {
    sleep_seconds(0.5);
    throw std::runtime_error("deliberate failure on rank 2");
  }
  topology->world().barrier();
}

// Peers that would hang forever (no collective to break) are stopped by the launcher.
AUTOTP_WORKER(fail_rank2_while_others_sleep) {
  if (ctx.env.rank == 2) {
    sleep_seconds(0.3);
    throw std::runtime_error("rank 2 gives up");
  }
  sleep_seconds(120);
}

// Rank 0 ignores SIGTERM (and says so through a file); rank 1 fails once it has.
AUTOTP_WORKER(ignore_sigterm) {
  const std::string ready = ctx.args.at(0);
  if (ctx.env.rank == 0) {
    signal(SIGTERM, SIG_IGN);
    std::ofstream(ready) << "ready\n";
    sleep_seconds(120);
  }
  while (!std::filesystem::exists(ready)) sleep_seconds(0.01);
  throw std::runtime_error("rank 1 fails after rank 0 ignores SIGTERM");
}

AUTOTP_WORKER(sigkill_rank1) {
  if (ctx.env.rank == 1) {
    sleep_seconds(0.2);
    raise(SIGKILL);
  }
  sleep_seconds(120);
}

// Rank 1 stops itself (SIGSTOP) before a barrier; the others time out in it after 2 s.
AUTOTP_WORKER(sigstop_rank1_before_barrier) {
  ctx.timeout = std::chrono::seconds(2);
  auto topology = ctx.topology(1);
  if (ctx.env.rank == 1) raise(SIGSTOP);
  topology->world().barrier();
}

AUTOTP_WORKER(sleep_long) { sleep_seconds(120); }

// Touches 256 MiB of its own and holds it long enough for the launcher's samples.
AUTOTP_WORKER(hold_256_mib) {
  std::vector<char> held(256u << 20, 1);
  sleep_seconds(2.5);
  WORKER_CHECK(held[12345] == 1, "held memory changed");
}

AUTOTP_WORKER(succeed) { std::fprintf(stderr, "rank %d is fine\n", ctx.env.rank); }

AUTOTP_WORKER(chatty_failure) {
  for (int i = 0; i < 100; ++i) std::fprintf(stderr, "line %d\n", i);
  throw std::runtime_error("chatty done");
}

// args: expected threads, expected MASTER_PORT (or "any"), expected AUTOTP_TEST_EXTRA.
AUTOTP_WORKER(check_env) {
  const std::string threads = ctx.args.at(0);
  const std::string port = ctx.args.at(1);
  const std::string extra = ctx.args.at(2);
  const int rank = ctx.env.rank;
  WORKER_CHECK(autotp::launcher::in_distributed_world(), "RANK/WORLD_SIZE missing");
  WORKER_CHECK(env_or_empty("RANK") == std::to_string(rank), "RANK=", env_or_empty("RANK"));
  WORKER_CHECK(env_or_empty("LOCAL_RANK") == std::to_string(rank), "LOCAL_RANK=", env_or_empty("LOCAL_RANK"));
  WORKER_CHECK(env_or_empty("WORLD_SIZE") == std::to_string(ctx.env.world_size), "WORLD_SIZE mismatch");
  WORKER_CHECK(env_or_empty("LOCAL_WORLD_SIZE") == std::to_string(ctx.env.world_size),
               "LOCAL_WORLD_SIZE=", env_or_empty("LOCAL_WORLD_SIZE"));
  WORKER_CHECK(ctx.env.local_rank == rank && ctx.env.local_world_size == ctx.env.world_size,
               "DistEnv local fields");
  WORKER_CHECK(ctx.env.master_addr == "127.0.0.1", "MASTER_ADDR=", ctx.env.master_addr);
  WORKER_CHECK(ctx.env.master_port > 0, "MASTER_PORT=", env_or_empty("MASTER_PORT"));
  if (port != "any")
    WORKER_CHECK(env_or_empty("MASTER_PORT") == port, "MASTER_PORT=", env_or_empty("MASTER_PORT"));
  for (const char* name : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "AUTOTP_THREADS"}) {
    WORKER_CHECK(env_or_empty(name) == threads, name, "=", env_or_empty(name), " expected ", threads);
  }
  WORKER_CHECK(at::get_num_threads() == std::stoi(threads), "at::get_num_threads() ", at::get_num_threads());
  WORKER_CHECK(env_or_empty("AUTOTP_TEST_EXTRA") == extra,
               "AUTOTP_TEST_EXTRA=", env_or_empty("AUTOTP_TEST_EXTRA"));
  // Rank 0 inherits the launcher's socket listening on MASTER_PORT (no window in
  // which another process could take the port); with MASTER_PORT given, nobody does.
  if (rank == 0 && port == "any") {
    WORKER_CHECK(ctx.env.master_listen_fd == 3, "AUTOTP_MASTER_LISTEN_FD=", env_or_empty("AUTOTP_MASTER_LISTEN_FD"));
    sockaddr_in address{};
    socklen_t length = sizeof address;
    int accepting = 0;
    socklen_t flag_length = sizeof accepting;
    WORKER_CHECK(getsockname(3, reinterpret_cast<sockaddr*>(&address), &length) == 0, "fd 3 is not a socket");
    WORKER_CHECK(ntohs(address.sin_port) == ctx.env.master_port, "fd 3 is bound to port ", ntohs(address.sin_port));
    WORKER_CHECK(getsockopt(3, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &flag_length) == 0 && accepting == 1,
                 "fd 3 is not listening");
  } else {
    WORKER_CHECK(ctx.env.master_listen_fd == -1 && env_or_empty("AUTOTP_MASTER_LISTEN_FD").empty(),
                 "rank ", rank, " got AUTOTP_MASTER_LISTEN_FD=", env_or_empty("AUTOTP_MASTER_LISTEN_FD"));
  }
  if (port == "any") {
    // Every rank got a distinct RANK and the same MASTER_PORT: gather both. Rank 0's
    // store can only serve on the inherited socket: binding the port would fail.
    auto topology = ctx.topology(1);
    auto mine = torch::tensor({static_cast<int64_t>(rank), static_cast<int64_t>(ctx.env.master_port)});
    auto all = topology->world().all_gather(mine.unsqueeze(0), 0);
    for (int q = 0; q < ctx.env.world_size; ++q) {
      WORKER_CHECK(all[q][0].item<int64_t>() == q, "rank order ", all);
      WORKER_CHECK(all[q][1].item<int64_t>() == ctx.env.master_port, "ports differ: ", all);
    }
  }
}

// launch_with_restarts: a world whose rank fails in the first attempt only is started
// again once (AUTOTP_RESTART_COUNT 1, the same AUTOTP_RUN_START_NS); what another
// attempt would only repeat is final at once.
TEST(Restarts, RestartsTheWorldUntilItSucceedsButNeverRetriesFinalFailures) {
  const std::string dir = autotp::test::make_temp_dir("restarts");
  autotp::launcher::LaunchOptions options;
  options.nproc = 2;
  options.quiet = true;
  // Rank 1 fails with code 7 in attempt 0; every attempt appends "count start" to its rank's file.
  options.argv = {"/bin/sh", "-c",
                  "echo \"$AUTOTP_RESTART_COUNT $AUTOTP_RUN_START_NS\" >> " + dir +
                      "/rank$RANK; [ \"$RANK$AUTOTP_RESTART_COUNT\" != 10 ] || exit 7"};
  int told = 0;
  auto run = autotp::launcher::launch_with_restarts(options, 3, [&](int n, const LaunchResult& failed) {
    told = n;
    EXPECT_EQ(failed.exit_code, 7);
    EXPECT_EQ(failed.failed_rank, 1);
  });
  EXPECT_EQ(run.last.exit_code, 0) << run.last.summary;
  EXPECT_EQ(run.restarts, 1);
  EXPECT_EQ(told, 1);
  std::ifstream in(dir + "/rank1");  // rank 1 writes before it fails (rank 0 may be stopped first)
  std::string count0, start0, count1, start1;
  in >> count0 >> start0 >> count1 >> start1;
  EXPECT_EQ(count0, "0");
  EXPECT_EQ(count1, "1");
  EXPECT_FALSE(start0.empty());
  EXPECT_EQ(start0, start1);

  for (int code : {2, 3}) {
    options.argv = {"/bin/sh", "-c", "exit " + std::to_string(code)};
    auto final_run = autotp::launcher::launch_with_restarts(options, 3);
    EXPECT_EQ(final_run.last.exit_code, code);
    EXPECT_EQ(final_run.restarts, 0) << "exit code " << code << " must not be retried";
  }
  LaunchResult result;
  for (int code : {2, 3, 127, 128 + SIGINT}) {
    result.exit_code = code;
    EXPECT_FALSE(autotp::launcher::worth_restarting(result)) << code;
  }
  result.exit_code = 1;
  EXPECT_TRUE(autotp::launcher::worth_restarting(result));
  result.exit_code = 128 + SIGKILL;
  EXPECT_TRUE(autotp::launcher::worth_restarting(result));
  result.interrupted = true;
  EXPECT_FALSE(autotp::launcher::worth_restarting(result));
  result = {};
  EXPECT_FALSE(autotp::launcher::worth_restarting(result));  // success
}

TEST(Launcher, FailingRankStopsTheWorldFast) {
  const auto start = Clock::now();
  LaunchResult result = autotp::test::run_workers("fail_rank2_in_barrier", 4);
  const double elapsed = seconds_since(start);
  std::cerr << "fail-fast launch took " << elapsed << " s\n";
  EXPECT_LT(elapsed, 20.0) << "the peers' collective timeout is 60 s";
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_EQ(result.failed_rank, 2) << result.summary;
  EXPECT_NE(result.summary.find("rank 2 failed with exit code 1"), std::string::npos) << result.summary;
  EXPECT_NE(result.summary.find("deliberate failure on rank 2"), std::string::npos) << result.summary;
  ASSERT_EQ(result.ranks.size(), 4u);
  EXPECT_FALSE(result.ranks[2].killed_by_launcher);
  for (const auto& rank : result.ranks) EXPECT_NE(rank.exit_code, 0) << "rank " << rank.rank;
}

TEST(Launcher, HangingPeersAreTerminated) {
  const auto start = Clock::now();
  LaunchResult result = autotp::test::run_workers("fail_rank2_while_others_sleep", 4);
  EXPECT_LT(seconds_since(start), 15.0);
  EXPECT_EQ(result.failed_rank, 2) << result.summary;
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.summary.find("rank 2 gives up"), std::string::npos) << result.summary;
  for (int r : {0, 1, 3}) {
    EXPECT_TRUE(result.ranks[r].killed_by_launcher) << "rank " << r;
    EXPECT_EQ(result.ranks[r].exit_code, 128 + SIGTERM) << "rank " << r;
  }
}

TEST(Launcher, SigtermIgnoredEscalatesToSigkill) {
  const std::string ready = temp_path("autotp_ignore_sigterm");
  std::filesystem::remove(ready);
  LaunchOptions options = worker_options("ignore_sigterm", 2, {ready});
  options.kill_grace_s = 0.5;
  const auto start = Clock::now();
  LaunchResult result = autotp::launcher::launch_local(options);
  std::filesystem::remove(ready);
  EXPECT_LT(seconds_since(start), 15.0);
  EXPECT_EQ(result.failed_rank, 1) << result.summary;
  EXPECT_EQ(result.ranks[0].exit_code, 128 + SIGKILL);
  EXPECT_TRUE(result.ranks[0].killed_by_launcher);
}

TEST(Launcher, RankKilledBySignalIsReported) {
  const auto start = Clock::now();
  LaunchResult result = autotp::test::run_workers("sigkill_rank1", 3);
  EXPECT_LT(seconds_since(start), 15.0);
  EXPECT_EQ(result.failed_rank, 1) << result.summary;
  EXPECT_EQ(result.exit_code, 128 + SIGKILL);
  EXPECT_EQ(result.error_line, "rank 1 was killed by SIGKILL (exit code 137); the other ranks were stopped");
  EXPECT_EQ(result.failed_signal, SIGKILL);
  EXPECT_EQ(result.summary.rfind(result.error_line + "\n", 0), 0u) << result.summary;
  EXPECT_TRUE(result.ranks[0].killed_by_launcher);
  EXPECT_TRUE(result.ranks[2].killed_by_launcher);
}

// A stopped rank never exits and SIGTERM does not reach it: the launcher names it
// (not the peer that timed out first) and kills it, and never hangs.
TEST(Launcher, StoppedRankIsNamedAndKilled) {
  const auto start = Clock::now();
  LaunchResult result = autotp::test::run_workers("sigstop_rank1_before_barrier", 3);
  const double elapsed = seconds_since(start);
  std::cerr << "stopped-rank launch took " << elapsed << " s (timeout 2 s)\n";
  EXPECT_LT(elapsed, 30.0) << "timeout 2 s + grace 2 s + start-up of 3 ranks on a loaded machine";
  EXPECT_EQ(result.failed_rank, 1) << result.summary;
  EXPECT_TRUE(result.failed_stopped);
  EXPECT_EQ(result.failed_signal, SIGSTOP);
  EXPECT_EQ(result.ranks[1].exit_code, 128 + SIGKILL);
  EXPECT_EQ(result.error_line.rfind("rank 1 was stopped (process state T", 0), 0u) << result.error_line;
  for (int r : {0, 2}) EXPECT_NE(result.ranks[r].exit_code, 0) << "rank " << r;
}

TEST(Launcher, SuccessfulRun) {
  LaunchResult result = autotp::test::run_workers("succeed", 3);
  EXPECT_EQ(result.exit_code, 0) << result.summary;
  EXPECT_EQ(result.failed_rank, -1);
  EXPECT_TRUE(result.summary.empty()) << result.summary;
  ASSERT_EQ(result.ranks.size(), 3u);
  for (const auto& rank : result.ranks) {
    EXPECT_EQ(rank.exit_code, 0);
    EXPECT_EQ(rank.output_tail, "rank " + std::to_string(rank.rank) + " is fine\n");
  }
}

// This process's resident set (VmRSS), bytes.
static int64_t own_resident_bytes() {
  std::ifstream in("/proc/self/status");
  std::string key;
  int64_t kib = 0;
  while (in >> key)
    if (key == "VmRSS:" && in >> kib) return kib * 1024;
  return 0;
}

TEST(Launcher, PeakResidentMemoryCountsWhatTheRanksHold) {
  if (!std::filesystem::exists("/proc/self/smaps_rollup")) GTEST_SKIP() << "no /proc/PID/smaps_rollup on this kernel";
  LaunchResult result = autotp::test::run_workers("hold_256_mib", 2);
  ASSERT_EQ(result.exit_code, 0) << result.summary;
  const int64_t held = 2 * (int64_t{256} << 20);
  EXPECT_GE(result.peak_resident_bytes, held);
  // Each process holds at most what this one does besides the 256 MiB (the same
  // binary); shared pages make the sum smaller than that.
  EXPECT_LE(result.peak_resident_bytes, held + 3 * own_resident_bytes() + (int64_t{64} << 20))
      << "own resident " << own_resident_bytes();
}

TEST(Launcher, RanksSeeTheirEnvironment) {
  auto result =
      autotp::test::run_workers("check_env", 3, {"1", "any", "hello"}, {{"AUTOTP_TEST_EXTRA", "hello"}});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

TEST(Launcher, DefaultThreadsSplitTheCoresAndMasterPortCanBeGiven) {
  const int nproc = 2;
  const int expected_threads = std::max(1, autotp::launcher::available_cores() / nproc);
  const std::string port = std::to_string(autotp::launcher::free_port());
  LaunchOptions options = worker_options("check_env", nproc, {std::to_string(expected_threads), port, ""});
  options.threads_per_rank = 0;
  options.env = {{"MASTER_PORT", port}};
  LaunchResult result = autotp::launcher::launch_local(options);
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

TEST(Launcher, OutputTailKeepsTheLastLines) {
  LaunchOptions options = worker_options("chatty_failure", 1);
  options.quiet = true;
  LaunchResult result = autotp::launcher::launch_local(options);
  ASSERT_EQ(result.failed_rank, 0);
  const std::string& tail = result.ranks[0].output_tail;
  EXPECT_LE(std::count(tail.begin(), tail.end(), '\n'), 40);
  EXPECT_NE(tail.find("line 99\n"), std::string::npos) << tail;
  EXPECT_EQ(tail.find("line 5\n"), std::string::npos) << tail;
  EXPECT_NE(result.summary.find("chatty done"), std::string::npos) << result.summary;
}

TEST(Launcher, ProgramThatCannotStart) {
  LaunchOptions options;
  options.nproc = 2;
  options.argv = {"/nonexistent/autotp-no-such-program"};
  LaunchResult result = autotp::launcher::launch_local(options);
  EXPECT_EQ(result.failed_rank, 0);
  EXPECT_EQ(result.exit_code, 127);
  EXPECT_NE(result.summary.find("could not be started"), std::string::npos) << result.summary;
}

TEST(Launcher, SigtermToTheLauncherIsForwarded) {
  std::thread interrupter([] {
    sleep_seconds(1.5);
    kill(getpid(), SIGTERM);
  });
  const auto start = Clock::now();
  LaunchResult result = autotp::launcher::launch_local(worker_options("sleep_long", 2));
  interrupter.join();
  EXPECT_LT(seconds_since(start), 15.0);
  EXPECT_EQ(result.exit_code, 128 + SIGTERM) << result.summary;
  EXPECT_EQ(result.failed_rank, -1) << result.summary;
  EXPECT_NE(result.summary.find("interrupted by signal 15"), std::string::npos) << result.summary;
  for (const auto& rank : result.ranks) EXPECT_TRUE(rank.killed_by_launcher) << "rank " << rank.rank;
}

// args: "cloned" or "exec" (how the rank must have started), the launcher's pid.
AUTOTP_WORKER(report_start) {
  std::ifstream in("/proc/self/cmdline");
  const std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const bool execed = cmdline.find("--autotp-worker") != std::string::npos;
  WORKER_CHECK(execed == (ctx.args.at(0) == "exec"), "expected a rank started by ", ctx.args.at(0),
               "; its command line: ", cmdline);
  WORKER_CHECK(getppid() == std::stoi(ctx.args.at(1)), "parent ", getppid(), ", launcher ", ctx.args.at(1));
  WORKER_CHECK(at::get_num_threads() == 1, "at::get_num_threads() ", at::get_num_threads());
}

TEST(WorkerZygote, RanksAreClonedFromItAsChildrenOfTheLauncher) {
  if (!autotp::test::worker_zygote_spawner())
    GTEST_SKIP() << "no worker zygote in this process (AUTOTP_TEST_ZYGOTE=0, a sanitizer build, or threads "
                    "before main): run_workers execs every rank";
  const std::string launcher_pid = std::to_string(getpid());
  auto cloned = autotp::test::run_workers("report_start", 3, {"cloned", launcher_pid});
  ASSERT_EQ(cloned.exit_code, 0) << cloned.summary;
  // The launcher's own path (no spawner) still execs.
  auto execed = autotp::launcher::launch_local(worker_options("report_start", 2, {"exec", launcher_pid}));
  ASSERT_EQ(execed.exit_code, 0) << execed.summary;
}

TEST(WorkerZygote, SettingIsStrict) {
  const std::string log = temp_path("zygote_setting") + ".log";
  autotp::test::ChildProcess child(
      {"env", "AUTOTP_TEST_ZYGOTE=yes", autotp::launcher::self_executable(), "--gtest_list_tests"}, log);
  ASSERT_TRUE(child.wait_until(Clock::now() + std::chrono::seconds(60)));
  EXPECT_EQ(child.exit_code(), 2) << child.output();
  EXPECT_NE(child.output().find("AUTOTP_TEST_ZYGOTE=yes: allowed values are 0"), std::string::npos) << child.output();
  std::filesystem::remove(log);
}

TEST(Launcher, FreePortIsUsable) {
  const int port = autotp::launcher::free_port();
  EXPECT_GT(port, 0);
  EXPECT_LT(port, 65536);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0) << std::strerror(errno);
  EXPECT_EQ(listen(fd, 1), 0);
  close(fd);
}

TEST(Launcher, NotInADistributedWorldHere) {
  if (std::getenv("RANK") == nullptr) {
    EXPECT_FALSE(autotp::launcher::in_distributed_world());
  }
}
