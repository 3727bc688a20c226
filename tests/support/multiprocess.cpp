#include "support/multiprocess.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <cstdlib>
#include <limits>

#include "autotp/comm/process_group.h"
#include "autotp/base/log.h"
#include "support/worker_zygote.h"

namespace autotp::test {
namespace {

std::map<std::string, WorkerFunction>& registry() {
  static std::map<std::string, WorkerFunction> workers;
  return workers;
}

std::string exception_text(const std::exception& error) {
  if (auto* c10_error = dynamic_cast<const c10::Error*>(&error)) return c10_error->what_without_backtrace();
  return error.what();
}

// Prints, records for the launcher, and leaves without unwinding: the worker's
// process groups stay open until the process is gone, so this rank's failure is
// recorded before any peer can notice it and fail in turn.
[[noreturn]] void fail_worker(const std::string& name, int rank, const std::string& text) {
  const std::string message = fmt::format("worker '{}' failed on rank {}: {}", name, rank, text);
  launcher::record_rank_failure(message);
  std::fflush(stdout);
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

std::string format_index(const std::vector<int64_t>& index) {
  return fmt::format("[{}]", fmt::join(index, ", "));
}

std::string shape_text(const torch::Tensor& tensor) {
  std::ostringstream out;
  out << tensor.sizes();
  return out.str();
}

}  // namespace

bool register_worker(const std::string& name, WorkerFunction function) {
  const bool inserted = registry().emplace(name, function).second;
  if (!inserted) {
    std::fprintf(stderr, "AUTOTP_WORKER(%s) is defined twice\n", name.c_str());
    std::abort();
  }
  return true;
}

std::shared_ptr<Topology> WorkerContext::topology(int tp_size, int ep_size) {
  TopologyOptions options;
  options.tp_size = tp_size;
  options.ep_size = ep_size;
  options.timeout = timeout;
  std::shared_ptr<Topology> topology;
  if (env.world_size == 1) {
    topology = Topology::create(env, options);
  } else {
    if (!store_) {
      StoreOptions store_options;
      store_options.timeout = timeout;
      store_ = create_tcp_store(env, store_options);
    }
    // Each topology's groups under their own prefix of the one store (rank 0
    // hosts a TCPStore on MASTER_PORT only once).
    auto store = prefix_store(fmt::format("topology{}", topologies_.size()), store_);
    topology = Topology::create_with_store(store, env.rank, env.world_size, options);
  }
  topologies_.push_back(topology);
  return topology;
}

void WorkerContext::finish() {
  if (barrier_at_exit && !topologies_.empty()) topologies_.front()->world().barrier();
}

int run_worker_main(const std::string& name, const std::vector<std::string>& args) {
  auto found = registry().find(name);
  if (found == registry().end()) {
    std::vector<std::string> names;
    for (const auto& entry : registry()) names.push_back(entry.first);
    std::fprintf(stderr, "unknown worker '%s' (registered: %s)\n", name.c_str(),
                 fmt::format("{}", fmt::join(names, ", ")).c_str());
    return 1;
  }
  int rank = 0;
  try {
    DistEnv env = DistEnv::from_environment();
    rank = env.rank;
    init_logging({env.rank});
    if (env.threads > 0) at::set_num_threads(env.threads);
    WorkerContext ctx(env, args);
    try {
      found->second(ctx);
      ctx.finish();
    } catch (const std::exception& error) {
      fail_worker(name, rank, exception_text(error));  // ctx (and its groups) still alive here
    }
  } catch (const std::exception& error) {
    fail_worker(name, rank, exception_text(error));
  } catch (...) {
    fail_worker(name, rank, "unknown exception");
  }
  return 0;
}

launcher::LaunchResult run_workers(const std::string& name, int world, const std::vector<std::string>& args,
                                   const std::map<std::string, std::string>& env) {
  launcher::LaunchOptions options;
  options.nproc = world;
  options.argv = {launcher::self_executable(), "--autotp-worker", name};
  options.argv.insert(options.argv.end(), args.begin(), args.end());
  options.env = env;
  options.threads_per_rank = 1;
  options.prefix_output = true;
  options.quiet = false;
  options.spawner = worker_zygote_spawner();
  return launcher::launch_local(options);
}

void worker_fail(const char* file, int line, const std::string& condition, const std::string& message) {
  throw std::runtime_error(fmt::format("WORKER_CHECK({}) failed at {}:{}{}{}", condition, file, line,
                                       message.empty() ? "" : ": ", message));
}

void worker_expect_close(const torch::Tensor& actual, const torch::Tensor& expected, double rtol, double atol,
                         const std::string& what) {
  if (actual.sizes() != expected.sizes()) {
    throw std::runtime_error(fmt::format("{}: shape {} differs from the expected {}", what,
                                         shape_text(actual), shape_text(expected)));
  }
  if (actual.numel() == 0) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor a = actual.detach().to(torch::kFloat64).contiguous();
  const torch::Tensor e = expected.detach().to(torch::kFloat64).contiguous();
  // NaN matches only NaN; a NaN on one side counts as an infinite difference.
  const torch::Tensor nan_mismatch = a.isnan().logical_xor(e.isnan());
  const torch::Tensor diff =
      torch::where(a.isnan().logical_and(e.isnan()), torch::zeros_like(a), (a - e).abs())
          .masked_fill(nan_mismatch, std::numeric_limits<double>::infinity());
  const torch::Tensor bad = diff.gt(e.abs().mul(rtol).add(atol));
  const int64_t bad_count = bad.sum().item<int64_t>();
  if (bad_count == 0) return;

  const int64_t flat = diff.reshape(-1).argmax().item<int64_t>();
  std::vector<int64_t> index(a.dim());
  for (int64_t d = a.dim() - 1, rest = flat; d >= 0; --d) {
    index[d] = rest % a.size(d);
    rest /= a.size(d);
  }
  std::string message = fmt::format(
      "{}: {} of {} elements outside rtol {} / atol {}; max abs diff {} at {} (actual {}, expected {})", what,
      bad_count, a.numel(), rtol, atol, diff.reshape(-1)[flat].item<double>(), format_index(index),
      a.reshape(-1)[flat].item<double>(), e.reshape(-1)[flat].item<double>());
  if (a.numel() <= 32) {
    std::ostringstream values;
    values << "\nactual:\n" << actual << "\nexpected:\n" << expected;
    message += values.str();
  }
  throw std::runtime_error(message);
}

void worker_expect_equal(const torch::Tensor& actual, const torch::Tensor& expected,
                         const std::string& what) {
  worker_expect_close(actual, expected, 0.0, 0.0, what);
}

}  // namespace autotp::test
