// Multi-process tests with real Gloo ranks. A test binary doubles as its own
// worker: run_workers() starts it (launch_local) as `<binary> --autotp-worker
// NAME ARGS...` once per rank, cloned from the worker zygote that test_main forked
// before anything ran (worker_zygote.h; an exec with AUTOTP_TEST_ZYGOTE=0), and
// test_main.cpp dispatches that to the function registered with AUTOTP_WORKER.
//
//   AUTOTP_WORKER(sum_ranks) {
//     auto topo = ctx.topology(/*tp_size=*/2);
//     ...
//     WORKER_CHECK(x == 3, "x was ", x);
//   }
//   TEST(Comm, SumRanks) {
//     auto result = autotp::test::run_workers("sum_ranks", 4);
//     ASSERT_EQ(result.exit_code, 0) << result.summary;
//   }
//
// A worker fails by throwing: the message goes to stderr, the rank exits 1 and
// the launcher stops the other ranks and reports the failing rank's output.
#pragma once
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "autotp/comm/dist_env.h"
#include "autotp/comm/topology.h"
#include "launcher/launcher.h"

namespace autotp::test {

class WorkerContext {
 public:
  WorkerContext(DistEnv env, std::vector<std::string> args) : env(std::move(env)), args(std::move(args)) {}

  DistEnv env;                    // this rank's RANK / WORLD_SIZE / ... (from the launcher)
  std::vector<std::string> args;  // arguments after the worker name
  std::chrono::milliseconds timeout{
      std::chrono::seconds(60)};  // rendezvous and collectives; set before topology()
  // After a successful worker, every rank meets in a world barrier before exiting,
  // so rank 0 (which hosts the store) does not leave while peers still open groups.
  // Workers that break their groups on purpose turn it off.
  bool barrier_at_exit = true;

  // A Topology over the launcher's world (TCPStore on MASTER_PORT). May be
  // called several times (every rank in the same order): each call gets its own
  // groups over one shared store. The context keeps every topology alive until
  // the worker has finished, so a failing rank reports before its peers see it go.
  std::shared_ptr<Topology> topology(int tp_size, int ep_size = 1);

  // The world barrier described at barrier_at_exit (run_worker_main calls it).
  void finish();

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::vector<std::shared_ptr<Topology>> topologies_;
};

using WorkerFunction = void (*)(WorkerContext& ctx);
bool register_worker(const std::string& name, WorkerFunction function);

// Runs the registered worker `name` in this process (the `--autotp-worker` path
// of test_main): 0 on success; on an exception prints it, records it for the
// launcher and exits 1 at once (peers then see this rank go).
int run_worker_main(const std::string& name, const std::vector<std::string>& args);

// Starts `world` ranks of this test binary running worker `name`, one thread each,
// with the rank output forwarded as "[rank N] ..." to stderr.
launcher::LaunchResult run_workers(const std::string& name, int world,
                                   const std::vector<std::string>& args = {},
                                   const std::map<std::string, std::string>& env = {});

// A parametrized test (TEST_P of `suite`, whose parameter is the world size)
// that runs the registered worker `worker` on that many ranks and expects exit 0.
#define AUTOTP_WORKER_TEST_P(suite, test_name, worker)              \
  TEST_P(suite, test_name) {                                        \
    auto result = autotp::test::run_workers(#worker, GetParam());   \
    ASSERT_EQ(result.exit_code, 0) << result.summary;               \
  }

// Checks for worker code: a failed check throws with a message naming the place.
[[noreturn]] void worker_fail(const char* file, int line, const std::string& condition,
                              const std::string& message);

template <typename... Args>
std::string concat_message(const Args&... args) {
  std::ostringstream out;
  ((out << args), ...);
  return out.str();
}

// Throws unless actual and expected have the same shape and
// |actual - expected| <= atol + rtol * |expected| everywhere; the message gives
// the largest difference, its index and both values.
void worker_expect_close(const torch::Tensor& actual, const torch::Tensor& expected, double rtol, double atol,
                         const std::string& what);
// Same as above with exact equality (integer tensors, data movement).
void worker_expect_equal(const torch::Tensor& actual, const torch::Tensor& expected, const std::string& what);

}  // namespace autotp::test

#define WORKER_CHECK(cond, ...)                                                                            \
  do {                                                                                                     \
    if (!(cond)) {                                                                                         \
      ::autotp::test::worker_fail(__FILE__, __LINE__, #cond, ::autotp::test::concat_message(__VA_ARGS__)); \
    }                                                                                                      \
  } while (0)

#define AUTOTP_WORKER(name)                                             \
  static void autotp_worker_##name(::autotp::test::WorkerContext& ctx); \
  [[maybe_unused]] static const bool autotp_worker_registered_##name =  \
      ::autotp::test::register_worker(#name, &autotp_worker_##name);    \
  static void autotp_worker_##name([[maybe_unused]] ::autotp::test::WorkerContext& ctx)
