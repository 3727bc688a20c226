// `autotp bench-comm`: collective benchmark in the spirit of nccl-tests. Every
// row times one collective at one size over one implementation, reports time,
// algorithm bandwidth and bus bandwidth, and checks the result against a closed
// form (rank-distinct small integers, so float32 sums are exact).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "autotp/comm/process_group.h"
#include "autotp/comm/topology.h"
#include "autotp/io/safetensors.h"
#include "autotp/base/error.h"
#include "autotp/base/log.h"
#include "cli/bench_report.h"
#include "cli/cli.h"

namespace autotp::cli {
namespace {

using Clock = std::chrono::steady_clock;

const std::vector<std::string> kOps = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"};
const std::vector<std::string> kImpls = {"comm", "comm-gloo", "c10d"};

// A collective over one of the implementations; `count` float32 elements of
// the full buffer (all-reduce and broadcast: the tensor; all-gather: the
// gathered output; reduce-scatter: the input that is summed and split;
// all-to-all: what one rank sends, count / size to each rank, itself included).
class Collective {
 public:
  Collective(std::string op, std::string impl, Comm* comm, c10::intrusive_ptr<c10d::ProcessGroup> raw, int rank,
             int size, int64_t count)
      : op_(std::move(op)), impl_(std::move(impl)), comm_(comm), raw_(std::move(raw)), rank_(rank), size_(size),
        count_(count) {
    const int64_t chunk = count_ / size_;
    // comm: the gathered or reduced result lands in a buffer allocated once
    // (all_gather_into / reduce_scatter_into), as ZeRO's units use them.
    if (op_ == "all_gather") {
      input_ = torch::empty({chunk});
      output_ = torch::empty({chunk * size_});
    } else {
      input_ = torch::empty({count_});
      if (op_ == "reduce_scatter") output_ = torch::empty({chunk});
      if (op_ == "all_to_all") output_ = torch::empty({count_});
    }
    input_.fill_(1.0f);
  }

  // One timed call (the result of repeated in-place calls is not checked).
  void run() { (void)apply(input_); }

  // One call on rank-distinct data; returns the number of wrong elements here.
  int64_t check() {
    const int64_t chunk = count_ / size_;
    auto pattern = [](int64_t n, int64_t offset) {
      return (torch::arange(offset, offset + n, torch::kLong) % 13 + 1).to(torch::kFloat32);
    };
    const float rank_sum = static_cast<float>(size_) * (size_ + 1) / 2;
    torch::Tensor input, expected;
    if (op_ == "all_reduce") {
      input = pattern(count_, 0) * static_cast<float>(rank_ + 1);
      expected = pattern(count_, 0) * rank_sum;
    } else if (op_ == "all_gather") {
      // Rank q contributes 1000 q + pattern: every block lands where it belongs.
      input = pattern(chunk, 0) + 1000.0f * rank_;
      std::vector<torch::Tensor> blocks;
      for (int q = 0; q < size_; ++q) blocks.push_back(pattern(chunk, 0) + 1000.0f * q);
      expected = torch::cat(blocks);
    } else if (op_ == "reduce_scatter") {
      input = pattern(count_, 0) * static_cast<float>(rank_ + 1);
      expected = pattern(chunk, chunk * rank_) * rank_sum;
    } else if (op_ == "all_to_all") {
      // Rank q's block for rank j is pattern + 16 q + 2048 j: every block lands where it belongs.
      std::vector<torch::Tensor> sent, received;
      for (int j = 0; j < size_; ++j) {
        sent.push_back(pattern(chunk, 0) + static_cast<float>(16 * rank_ + 2048 * j));
        received.push_back(pattern(chunk, 0) + static_cast<float>(16 * j + 2048 * rank_));
      }
      input = torch::cat(sent);
      expected = torch::cat(received);
    } else {
      input = rank_ == 0 ? pattern(count_, 0) : torch::full({count_}, -1.0f);
      expected = pattern(count_, 0);
    }
    torch::Tensor result = apply(input);
    if (!result.sizes().equals(expected.sizes())) return std::max<int64_t>(expected.numel(), 1);
    return result.ne(expected).sum().item<int64_t>();
  }

  int64_t bytes() const { return count_ * 4; }

 private:
  // Runs the collective on `input` and returns the result (in place for all-reduce and broadcast).
  torch::Tensor apply(torch::Tensor& input) {
    const int64_t chunk = count_ / size_;
    if (impl_ != "c10d") {
      if (op_ == "all_reduce") {
        comm_->all_reduce(input);
        return input;
      }
      if (op_ == "all_gather") {
        comm_->all_gather_into(output_, input);
        return output_;
      }
      if (op_ == "reduce_scatter") {
        comm_->reduce_scatter_into(output_, input);
        return output_;
      }
      if (op_ == "all_to_all") {
        const std::vector<int64_t> counts(size_, chunk);
        return comm_->all_to_all(input, counts, counts, output_);  // into a buffer allocated once, as c10d's
      }
      comm_->broadcast(input, 0);
      return input;
    }
    // Raw c10d, as a caller of the ProcessGroup API would write it.
    if (op_ == "all_reduce") {
      std::vector<at::Tensor> tensors{input};
      raw_->allreduce(tensors)->wait();
      return input;
    }
    if (op_ == "all_gather") {
      torch::Tensor output = torch::empty({chunk * size_});
      std::vector<std::vector<at::Tensor>> outputs(1);
      for (int q = 0; q < size_; ++q) outputs[0].push_back(output.narrow(0, q * chunk, chunk));
      std::vector<at::Tensor> inputs{input};
      raw_->allgather(outputs, inputs)->wait();
      return output;
    }
    if (op_ == "reduce_scatter") {
      // ProcessGroupGloo's own reduce-scatter (an all-reduce underneath, then this rank's chunk).
      torch::Tensor output = torch::empty({chunk});
      raw_->_reduce_scatter_base(output, input)->wait();
      return output;
    }
    if (op_ == "all_to_all") {
      std::vector<int64_t> splits;  // empty: equal blocks
      raw_->alltoall_base(output_, input, splits, splits)->wait();
      return output_;
    }
    std::vector<at::Tensor> tensors{input};
    c10d::BroadcastOptions options;
    options.rootRank = 0;
    raw_->broadcast(tensors, options)->wait();
    return input;
  }

  std::string op_, impl_;
  Comm* comm_;
  c10::intrusive_ptr<c10d::ProcessGroup> raw_;
  int rank_, size_;
  int64_t count_;
  torch::Tensor input_, output_;
};

// Max over ranks of a double (times: a collective ends when its slowest rank does).
double max_over_ranks(c10d::ProcessGroup& group, double value) {
  auto t = torch::tensor({value}, torch::kFloat64);
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  group.allreduce(tensors, options)->wait();
  return t.item<double>();
}

int64_t sum_over_ranks(c10d::ProcessGroup& group, int64_t value) {
  auto t = torch::tensor({value}, torch::kLong);
  std::vector<at::Tensor> tensors{t};
  group.allreduce(tensors)->wait();
  return t.item<int64_t>();
}

std::vector<std::string> split_list(const std::string& text, const std::vector<std::string>& allowed,
                                    const char* flag) {
  std::vector<std::string> items;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(start, end - start);
    if (item == "all") return allowed;
    AUTOTP_USER_CHECK(std::find(allowed.begin(), allowed.end(), item) != allowed.end(),
                      "{} '{}' is not known (allowed: {}, all)", flag, item, fmt::join(allowed, ", "));
    items.push_back(item);
    start = end + 1;
  }
  return items;
}

struct Args {
  std::string ops = "all", impls = "all", min_bytes = "8", max_bytes = "256MiB", json;
  int64_t factor = 2, iters = 20, warmup = 2, repeat = 1;
  double row_seconds = 1.0;
  WorldOptions world;
};

void add_bench_comm_options(CLI::App& cmd, Args& args) {
  cmd.add_option("--ops", args.ops,
                 "Comma list of all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, or all");
  cmd.add_option("--impl", args.impls, "Comma list of comm, comm-gloo, c10d, or all (see bench/README.md)");
  cmd.add_option("--min-bytes", args.min_bytes, "Smallest buffer (default 8; KB/MB/GB, KiB/MiB/GiB)");
  cmd.add_option("--max-bytes", args.max_bytes, "Largest buffer (default 256MiB)");
  cmd.add_option("--factor", args.factor, "Size multiplier between rows (default 2)")
      ->check(CLI::Range(2, 1024));
  cmd.add_option("--iters", args.iters, "Timed calls per row, at most (default 20)")
      ->check(CLI::PositiveNumber);
  cmd.add_option("--warmup", args.warmup, "Untimed calls per row first (default 2)")
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--row-seconds", args.row_seconds,
                 "Time budget of one row's timed calls; fewer iterations for big sizes (default 1)")
      ->check(CLI::PositiveNumber);
  cmd.add_option("--repeat", args.repeat,
                 "Time each row this many times, implementations interleaved; report the median (default 1)")
      ->check(CLI::PositiveNumber);
  cmd.add_option("--json", args.json, "Write the rows as JSON here (rank 0)");
  add_world_options(cmd, args.world);
}

// One store; our Comm with and without shared memory, and a raw process group.
// Members in creation order, so they are destroyed in reverse as locals would be.
struct BenchGroups {
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<Topology> topology;          // comm
  std::shared_ptr<Topology> gloo;              // comm-gloo
  c10::intrusive_ptr<c10d::ProcessGroup> raw;  // c10d
};

BenchGroups create_bench_groups(const DistEnv& env, double timeout_s) {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  BenchGroups g;
  StoreOptions store_options;
  store_options.timeout = timeout;
  g.store = create_tcp_store(env, store_options);
  TopologyOptions with_shm;
  with_shm.timeout = timeout;
  TopologyOptions gloo_only = with_shm;
  gloo_only.shared_memory = false;
  g.topology = Topology::create_with_store(prefix_store("comm", g.store), env.rank, env.world_size, with_shm);
  g.gloo =
      Topology::create_with_store(prefix_store("comm-gloo", g.store), env.rank, env.world_size, gloo_only);
  g.raw =
      create_process_group(Backend::kGloo, prefix_store("c10d", g.store), env.rank, env.world_size, timeout);
  return g;
}

// What every row of a run shares.
struct BenchRun {
  const Args& args;
  BenchGroups& groups;
  int rank, n;
  BenchReport& report;
};

// Whole elements, a multiple of the world for the split collectives.
int64_t element_count(const std::string& op, int64_t bytes, int n) {
  int64_t count = std::max<int64_t>(bytes / 4, 1);
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") count = std::max<int64_t>(count / n * n, n);
  return count;
}

// Timed calls per row: as many as fit --row-seconds after one timed call (slowest rank), at most --iters.
int64_t row_iterations(Collective& collective, c10d::ProcessGroup& raw, const Args& args) {
  for (int64_t w = 0; w < args.warmup; ++w) collective.run();
  raw.barrier()->wait();
  auto start = Clock::now();
  collective.run();
  const double first = max_over_ranks(raw, std::chrono::duration<double>(Clock::now() - start).count());
  return std::clamp<int64_t>(static_cast<int64_t>(args.row_seconds / std::max(first, 1e-9)), 1, args.iters);
}

// Adds one implementation's row to the report and prints it on rank 0; false when its check failed.
bool report_row(BenchRun& run, const std::string& op, const std::string& impl, Collective& collective,
                int64_t count, int64_t iters, std::vector<double>& times) {
  std::sort(times.begin(), times.end());
  const double seconds = times[times.size() / 2];  // median of the repeats
  const int64_t wrong = sum_over_ranks(*run.groups.raw, collective.check());
  const double factor = bus_bandwidth_factor(op, run.n);
  const double algbw = collective.bytes() / seconds / 1e9;
  nlohmann::json row = {{"name", fmt::format("comm/{}/{}/{}", op, impl, collective.bytes())},
                        {"op", op},
                        {"impl", impl},
                        {"bytes", collective.bytes()},
                        {"count", count},
                        {"world", run.n},
                        {"iterations", iters},
                        {"repeats", run.args.repeat},
                        {"time_s", seconds},
                        {"algbw_GBps", algbw},
                        {"bus_factor", factor},
                        {"busbw_GBps", algbw * factor},
                        {"wrong", wrong},
                        {"check", wrong == 0 ? "ok" : "FAILED"},
                        {"higher_is_better", "busbw_GBps"}};
  run.report.add(row);
  if (run.rank == 0)
    std::cout << fmt::format("  {:>12} {:>10}  {:<14} {:<9} {:>6} {:>11.1f} {:>11.3f} {:>11.3f}  {}\n",
                             collective.bytes(), count, op, impl, iters, seconds * 1e6, algbw, algbw * factor,
                             wrong == 0 ? "ok" : fmt::format("FAILED ({} wrong)", wrong))
              << std::flush;
  return wrong == 0;
}

// The rows of one op at one size, one per implementation; returns how many failed the check.
// The implementations run back to back, so a shared machine's load changes as
// little as possible between the rows they are compared by.
int64_t bench_size(BenchRun& run, const std::string& op, int64_t bytes,
                   const std::vector<std::string>& impls) {
  std::vector<std::string> row_impls;
  // Broadcast never uses the shared-memory transport: comm-gloo rows would repeat comm rows.
  for (const auto& impl : impls)
    if (impl != "comm-gloo" || op != "broadcast") row_impls.push_back(impl);
  const int64_t count = element_count(op, bytes, run.n);
  c10d::ProcessGroup& raw = *run.groups.raw;
  const size_t k = row_impls.size();
  std::vector<std::unique_ptr<Collective>> collectives;
  std::vector<int64_t> iters(k);
  std::vector<std::vector<double>> times(k);
  for (size_t i = 0; i < k; ++i) {
    Comm* comm = row_impls[i] == "comm" ? &run.groups.topology->world() : &run.groups.gloo->world();
    collectives.push_back(
        std::make_unique<Collective>(op, row_impls[i], comm, run.groups.raw, run.rank, run.n, count));
    iters[i] = row_iterations(*collectives[i], raw, run.args);
  }
  for (int64_t rep = 0; rep < run.args.repeat; ++rep) {
    for (size_t i = 0; i < k; ++i) {
      raw.barrier()->wait();
      const auto start = Clock::now();
      for (int64_t it = 0; it < iters[i]; ++it) collectives[i]->run();
      times[i].push_back(max_over_ranks(raw, std::chrono::duration<double>(Clock::now() - start).count()) /
                         iters[i]);
    }
  }
  int64_t failed_rows = 0;
  for (size_t i = 0; i < k; ++i)
    if (!report_row(run, op, row_impls[i], *collectives[i], count, iters[i], times[i])) ++failed_rows;
  return failed_rows;
}

void run_bench_comm(const Args& args) {
  // Bad flags fail here, before any rank starts.
  const auto ops = split_list(args.ops, kOps, "--ops");
  const auto impls = split_list(args.impls, kImpls, "--impl");
  const int64_t min_bytes = static_cast<int64_t>(io::parse_byte_size(args.min_bytes));
  const int64_t max_bytes = static_cast<int64_t>(io::parse_byte_size(args.max_bytes));
  AUTOTP_USER_CHECK(min_bytes >= 4 && min_bytes <= max_bytes,
                    "--min-bytes {} and --max-bytes {}: need 4 <= min <= max", min_bytes, max_bytes);
  if (!run_as_rank(args.world)) return;
  DistEnv env = DistEnv::from_environment();
  AUTOTP_USER_CHECK(env.world_size >= 2, "bench-comm needs at least 2 ranks (use --nproc N, N >= 2)");
  init_logging(LogOptions{env.rank});
  const int threads = args.world.threads > 0 ? args.world.threads : env.threads;
  if (threads > 0) at::set_num_threads(threads);

  BenchGroups groups = create_bench_groups(env, args.world.timeout_s);
  const int n = env.world_size, rank = env.rank;
  const bool shm = groups.topology->world().uses_shared_memory();

  BenchReport report("bench-comm");
  report.context["world"] = n;
  report.context["dtype"] = "float32";
  report.context["threads_per_rank"] = at::get_num_threads();
  report.context["shared_memory_all_reduce"] = shm;
  if (rank == 0) {
    std::cout << fmt::format(
        "# autotp bench-comm: world {}, float32, {} thread(s) per rank, shared-memory all-reduce {}\n", n,
        at::get_num_threads(), shm ? "on" : "off");
    std::cout << fmt::format("# {:>12} {:>10}  {:<14} {:<9} {:>6} {:>11} {:>11} {:>11}  {}\n", "size(B)",
                             "count", "op", "impl", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
                             "check");
  }
  BenchRun run{args, groups, rank, n, report};
  int64_t failed_rows = 0;
  for (const auto& op : ops)
    for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= args.factor)
      failed_rows += bench_size(run, op, bytes, impls);
  if (rank == 0) {
    std::cout << fmt::format("# {} row(s), {} failed the check\n", report.size(), failed_rows);
    if (!args.json.empty()) report.write(args.json);
  }
  groups.raw->barrier()->wait();  // rank 0 hosts the store: leave together
  if (failed_rows > 0)
    throw std::runtime_error(fmt::format("bench-comm: {} row(s) failed the check", failed_rows));
}

}  // namespace

double bus_bandwidth_factor(const std::string& op, int world) {
  const double n = world;
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") return (n - 1) / n;
  if (op == "broadcast") return 1.0;
  throw_user_error("unknown collective '{}' (allowed: {})", op, fmt::join(kOps, ", "));
}

void register_bench_comm(CLI::App& app) {
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("bench-comm", "Collective benchmark (nccl-tests style): time, algbw, busbw, checked");
  add_bench_comm_options(*cmd, *args);
  cmd->callback([args] { run_bench_comm(*args); });
}

}  // namespace autotp::cli
