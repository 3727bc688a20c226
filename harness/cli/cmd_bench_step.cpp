// `autotp bench-step`: end-to-end training steps of one layout after warm-up:
// tokens/s, step time (median, p90), the compute / communication split, MFU
// against the GEMM rate measured on the same ranks with the same threads, the
// communication volume counted by the Comms against the closed form of
// step_comm_volume.h, and the threads every rank runs with.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_legacy.h>

#include "autotp/base/bf16_matmul.h"
#include "autotp/model/presets.h"
#include "autotp/arch/model_flops.h"
#include "autotp/base/device.h"
#include "autotp/base/error.h"
#include "autotp/base/json_file.h"
#include "autotp/base/quantile.h"
#include "autotp/base/log.h"
#include "autotp/base/memory_counter.h"
#include "autotp/runtime/step_comm_volume.h"
#include "autotp/runtime/trainer.h"
#include "cli/bench_report.h"
#include "cli/blas_threads.h"
#include "cli/cli.h"
#include "cli/malloc_policy.h"
#include "launcher/launcher.h"

namespace autotp::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// GEMM rate [m, k] x [k, n] in FLOP/s on `device`: the best of a few timed
// calls (CUDA events on a GPU), through the engine's product (bf16 widened to
// fp32 on CPUs without fast bf16 GEMMs, base/bf16_matmul.h).
double gemm_rate(int64_t m, int64_t k, int64_t n, torch::ScalarType dtype, const torch::Device& device) {
  auto on = torch::TensorOptions().device(device);
  auto a = torch::randn({m, k}, on).to(dtype), b = torch::randn({k, n}, on).to(dtype);
  auto c = matmul_nograd(a, b);  // warm-up (thread pools, page faults, cuBLAS handles)
  synchronize(device);
  double best = 0;
  const auto start = Clock::now();
  for (int i = 0; i < 20 && (i < 3 || seconds_since(start) < 0.5); ++i) {
    StepClock clock(device);
    clock.mark();
    if (widens_bf16(a, b))
      c = matmul_nograd(a, b);
    else
      torch::matmul_out(c, a, b);
    clock.mark();
    best = std::max(best, 2.0 * m * k * n / clock.seconds()[0]);
  }
  return best;
}

int env_int(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::atoi(value) : 0;
}

std::string volume_cell(const CollectiveVolume& v) { return fmt::format("{} / {}", v.calls, v.bytes); }

struct Args {
  std::string model, json, dtype = "f32", profile, config;
  int tp = 1, zero = 0, ep = 1;
  int64_t micro_batch = 4, seq_len = 256, gas = 1, steps = 5, warmup = 2;
  bool checkpointing = false, sequence_parallel = false, tp_overlap_comm = false;
  std::optional<bool> overlap_comm;
  uint64_t seed = 1;
  WorldOptions world;
};

// The training config bench-step runs: AdamW, clipping, the layout of the flags.
TrainConfig bench_config(const Args& args, torch::ScalarType dtype, int world_size) {
  nlohmann::json ds = {{"train_micro_batch_size_per_gpu", args.micro_batch},
                       {"gradient_accumulation_steps", args.gas},
                       {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-4}, {"weight_decay", 0.01}}}}},
                       {"gradient_clipping", 1.0},
                       {"zero_optimization", {{"stage", args.zero}}},
                       {"tensor_parallel",
                        {{"autotp_size", args.tp},
                         {"sequence_parallel", args.sequence_parallel},
                         {"tp_overlap_comm", args.tp_overlap_comm}}},
                       {"seed", args.seed}};
  if (dtype == torch::kBFloat16) ds["bf16"] = {{"enabled", true}};
  if (args.ep > 1) ds["expert_parallel"] = {{"enabled", true}, {"autoep_size", args.ep}};
  if (args.checkpointing) ds["activation_checkpointing"] = {{"enabled", true}};
  if (args.overlap_comm) ds["zero_optimization"]["overlap_comm"] = *args.overlap_comm;
  if (!args.config.empty()) {
    // The file's keys win over the flags' (e.g. zero_optimization.offload_optimizer); the stage must agree.
    const nlohmann::json file = read_json_file(args.config, "--config");
    AUTOTP_USER_CHECK(file.is_object(), "{}: a DeepSpeed config must be a JSON object", args.config);
    const nlohmann::json stage = file.value(nlohmann::json::json_pointer("/zero_optimization/stage"), nlohmann::json(args.zero));
    AUTOTP_USER_CHECK(stage == nlohmann::json(args.zero),
                      "{}: zero_optimization.stage is {} but --zero is {} (allowed: the same stage, or leave the key "
                      "out)",
                      args.config, stage.dump(), args.zero);
    ds.merge_patch(file);
  }
  auto config = TrainConfig::from_json(ds, args.config.empty() ? "bench-step" : args.config);
  config.resolve_batch(world_size);
  return config;
}

// What this rank measured over the timed steps.
struct TimedSteps {
  std::vector<double> step, comm, forward_backward, optimizer, comm_forward_backward, comm_optimizer, lane;
  std::vector<double> settle;  // Comm::run waiting for Gloo to drop buffers (exact peak accounting)
  std::vector<double> tp_forward, tp_backward;  // exposed tp communication per phase
  StepMetrics last;
  StepCommVolume counted;
  bool volume_matches = true;
  double loss = 0;
};

// Runs the timed steps, counting each step's collectives per group against `analytic`.
TimedSteps run_timed_steps(Trainer& trainer, Topology& topology, const StepCommVolume& analytic, int64_t first,
                           int64_t steps, const std::function<std::vector<Batch>(int64_t)>& make_batches) {
  Comm* groups[] = {&topology.tp(), &topology.dp(), &topology.world()};
  TimedSteps t;
  for (int64_t s = 0; s < steps; ++s) {
    auto batches = make_batches(first + s);
    CommStats before[3];
    for (int g = 0; g < 3; ++g) before[g] = groups[g]->stats();
    const auto start = Clock::now();
    StepMetrics m = trainer.train_step(batches);  // returns once the GPU has finished the step
    t.step.push_back(seconds_since(start));
    t.forward_backward.push_back(m.forward_backward_s);
    t.optimizer.push_back(m.optimizer_s);
    t.comm_forward_backward.push_back(m.comm_forward_backward_s);
    t.comm_optimizer.push_back(m.comm_optimizer_s);
    t.lane.push_back(m.comm_async_s);
    t.tp_forward.push_back(m.tp_comm_forward_s);
    t.tp_backward.push_back(m.tp_comm_backward_s);
    t.loss = m.loss;
    t.last = m;
    StepCommVolume step{GroupVolume::between(before[0], groups[0]->stats()),
                        GroupVolume::between(before[1], groups[1]->stats()),
                        GroupVolume::between(before[2], groups[2]->stats())};
    double comm = 0, settle = 0;
    for (int g = 0; g < 3; ++g) {
      comm += groups[g]->stats().seconds - before[g].seconds;
      settle += groups[g]->stats().settle_seconds - before[g].settle_seconds;
    }
    t.comm.push_back(comm);
    t.settle.push_back(settle);
    t.volume_matches = t.volume_matches && step == analytic;
    t.counted = step;
  }
  return t;
}

// The counted vs analytic table of one step's collectives, per group and op.
void print_volume_table(const StepCommVolume& counted, const StepCommVolume& analytic) {
  std::cout << "  communication per step, counted (calls / bytes) vs analytic:\n";
  const char* names[] = {"tp", "dp", "world"};
  const GroupVolume* counted_groups[] = {&counted.tp, &counted.dp, &counted.world};
  const GroupVolume* analytic_groups[] = {&analytic.tp, &analytic.dp, &analytic.world};
  for (int g = 0; g < 3; ++g) {
    const auto& c = *counted_groups[g];
    const auto& a = *analytic_groups[g];
    const std::pair<const char*, std::pair<const CollectiveVolume*, const CollectiveVolume*>> ops[] = {
        {"all_reduce", {&c.all_reduce, &a.all_reduce}},
        {"all_gather", {&c.all_gather, &a.all_gather}},
        {"reduce_scatter", {&c.reduce_scatter, &a.reduce_scatter}},
        {"broadcast", {&c.broadcast, &a.broadcast}}};
    for (const auto& [op, pair] : ops) {
      if (pair.first->calls == 0 && pair.second->calls == 0) continue;
      std::cout << fmt::format("    {:<6} {:<15} {:>24} {:>24}  {}\n", names[g], op, volume_cell(*pair.first),
                               volume_cell(*pair.second), *pair.first == *pair.second ? "equal" : "DIFFERENT");
    }
  }
}

void add_bench_step_options(CLI::App& cmd, Args& args) {
  cmd.add_option("--model", args.model, "HF model directory or preset:NAME")->required();
  cmd.add_option("--tp", args.tp, "Tensor-parallel size (default 1)")->check(CLI::PositiveNumber);
  cmd.add_option("--ep", args.ep, "Expert-parallel size of a mixture of experts (default 1)")
      ->check(CLI::PositiveNumber);
  cmd.add_flag("--sequence-parallel", args.sequence_parallel,
               "tensor_parallel.sequence_parallel: norms, residuals and dropout on 1/tp of the sequence");
  cmd.add_flag("--tp-overlap-comm", args.tp_overlap_comm,
               "tensor_parallel.tp_overlap_comm: tp collectives overlapped with compute");
  cmd.add_option("--zero", args.zero, "ZeRO stage 0-3 over the data-parallel group (default 0)")
      ->check(CLI::Range(0, 3));
  cmd.add_option("--micro-batch", args.micro_batch, "Sequences per micro-batch per rank (default 4)")
      ->check(CLI::PositiveNumber);
  cmd.add_option("--seq-len", args.seq_len, "Tokens per sequence (default 256)")->check(CLI::PositiveNumber);
  cmd.add_option("--gas", args.gas, "Gradient accumulation steps (default 1)")->check(CLI::PositiveNumber);
  cmd.add_option("--steps", args.steps, "Timed steps after the warm-up (default 5)")
      ->check(CLI::PositiveNumber);
  cmd.add_option("--warmup", args.warmup, "Untimed steps first (default 2)")->check(CLI::NonNegativeNumber);
  cmd.add_option("--dtype", args.dtype, "f32 or bf16 (default f32)")->check(CLI::IsMember({"f32", "bf16"}));
  cmd.add_flag("--activation-checkpointing", args.checkpointing, "Recompute every layer in the backward");
  cmd.add_option(
      "--overlap-comm", args.overlap_comm,
      "zero_optimization.overlap_comm: ZeRO collectives behind compute (default: on for CUDA, off on CPU)");
  cmd.add_option("--seed", args.seed, "Seed of the weights and the random tokens (default 1)");
  cmd.add_option("--config", args.config,
                 "A DeepSpeed JSON merged over the config the flags build (its keys win; its "
                 "zero_optimization.stage must equal --zero), e.g. bench/configs/offload_zero2.json")
      ->check(CLI::ExistingFile);
  cmd.add_option("--json", args.json, "Write the result as JSON here (rank 0)");
  cmd.add_option(
      "--profile", args.profile,
      "Write a Chrome trace of one more step (torch's autograd profiler) here, per rank: PATH.rankN.json");
  add_world_options(cmd, args.world);
  add_device_options(cmd, args.world);
}

// Threads as this rank really runs them.
struct RankThreads {
  int torch_threads = 0, local_ranks = 0, cores = 0;
  torch::Tensor row;  // torch, BLAS, OMP_NUM_THREADS, OPENBLAS_NUM_THREADS: gathered at rank 0
};

RankThreads rank_threads(const DistEnv& env) {
  RankThreads t;
  t.torch_threads = at::get_num_threads();
  t.local_ranks = env.local_world_size;
  t.cores = launcher::available_cores();
  t.row = torch::tensor({static_cast<int64_t>(t.torch_threads), static_cast<int64_t>(blas_threads()),
                         static_cast<int64_t>(env_int("OMP_NUM_THREADS")),
                         static_cast<int64_t>(env_int("OPENBLAS_NUM_THREADS"))},
                        torch::kLong);
  return t;
}

// What MFU is measured against on this rank.
struct ComputeLimit {
  double rank = 0;         // the best GEMM rate below
  double square_gemm = 0;  // GPU only: the 8192^3 GEMM in the run's dtype
  std::string gpu;         // cuda_device_name
  double spec_peak = 0;    // its bf16 spec peak (0: unknown)
};

// The compute limit: every rank runs the step's largest GEMM shapes at
// once, with its thread count (so shared cores are shared here too).
ComputeLimit measure_compute_limit(const Args& args, const ModelConfig& mc, torch::ScalarType dtype,
                                   const torch::Device& device) {
  const int64_t tokens = args.micro_batch * args.seq_len;
  const double limit_mlp =
      gemm_rate(tokens, mc.hidden_size, (mc.intermediate_size + args.tp - 1) / args.tp, dtype, device);
  const double limit_head =
      gemm_rate(tokens, mc.hidden_size, (mc.vocab_size + args.tp - 1) / args.tp, dtype, device);
  ComputeLimit limit;
  // On a GPU also a large square GEMM in the run's dtype (the rate a GPU's MFU is
  // usually quoted against; bf16 for the GPU regression run).
  limit.square_gemm = device.is_cuda() ? gemm_rate(8192, 8192, 8192, dtype, device) : 0.0;
  limit.rank = std::max({limit_mlp, limit_head, limit.square_gemm});
  limit.gpu = cuda_device_name(device);
  limit.spec_peak = bf16_peak_flops(limit.gpu);
  return limit;
}

// Random tokens, the same on every rank of a tp group, distinct across dp ranks and steps.
std::vector<Batch> random_batches(const Args& args, int64_t vocab_size, int64_t micro_batches,
                                  int64_t dp_rank, int64_t step) {
  std::vector<Batch> batches;
  auto gen = at::detail::createCPUGenerator(args.seed * 1000003 + step * 1009 + dp_rank);
  for (int64_t m = 0; m < micro_batches; ++m) {
    auto ids = torch::randint(vocab_size, {args.micro_batch, args.seq_len + 1}, gen, torch::kLong);
    batches.push_back(
        {ids.narrow(1, 0, args.seq_len).contiguous(), ids.narrow(1, 1, args.seq_len).contiguous()});
  }
  return batches;
}

StepShape step_shape(Topology& topology, const Args& args) {
  StepShape shape;
  shape.tp_size = topology.tp_size();
  shape.dp_size = topology.dp_size();
  shape.tp_rank = topology.tp_rank();
  shape.micro_batch = args.micro_batch;
  shape.seq_len = args.seq_len;
  return shape;
}

// Every rank's numbers, gathered at rank 0.
struct GatheredRanks {
  torch::Tensor all;               // per rank: median step, comm, GEMM limit, volume check, the threads row
  std::vector<double> step_times;  // per timed step: its slowest rank's time
};

// Collectives of every rank, outside the timed steps.
GatheredRanks gather_ranks(Topology& topology, const TimedSteps& timed, double rank_limit,
                           const torch::Tensor& threads_row, int64_t steps) {
  std::vector<double> mine = {median(timed.step), median(timed.comm), rank_limit,
                              timed.volume_matches ? 1.0 : 0.0};
  for (int64_t i = 0; i < 4; ++i) mine.push_back(static_cast<double>(threads_row[i].item<int64_t>()));
  auto row = torch::tensor(mine, torch::kFloat64).view({1, -1});
  GatheredRanks g;
  g.all = topology.world().all_gather(row, 0);
  g.step_times = timed.step;
  auto steps_tensor = torch::tensor(timed.step, torch::kFloat64);
  topology.world().all_reduce(steps_tensor, ReduceOp::kMax);  // a step ends when its slowest rank does
  for (int64_t s = 0; s < steps; ++s) g.step_times[s] = steps_tensor[s].item<double>();
  topology.world().barrier();
  return g;
}

// Rank 0's totals over the gathered rows, and each rank's row for the JSON.
struct RankSummary {
  double comm_mean = 0;      // communication seconds per step, mean over ranks
  double cluster_limit = 0;  // the ranks' GEMM limits, summed
  bool all_match = true, oversubscribed = false;
  nlohmann::json ranks = nlohmann::json::array();
};

RankSummary summarize_ranks(const torch::Tensor& all, int world, int local_ranks, int cores) {
  RankSummary sum;
  for (int r = 0; r < world; ++r) {
    auto a = all[r];
    sum.comm_mean += a[1].item<double>() / world;
    sum.cluster_limit += a[2].item<double>();
    sum.all_match = sum.all_match && a[3].item<double>() == 1.0;
    const int t = static_cast<int>(a[4].item<double>()), blas = static_cast<int>(a[5].item<double>());
    sum.oversubscribed = sum.oversubscribed || t * local_ranks > cores || blas * local_ranks > cores;
    sum.ranks.push_back({{"rank", r},
                         {"step_time_median_s", a[0].item<double>()},
                         {"comm_s", a[1].item<double>()},
                         {"gemm_limit_flops", a[2].item<double>()},
                         {"torch_threads", t},
                         {"blas_threads", blas},
                         {"OMP_NUM_THREADS", static_cast<int>(a[6].item<double>())},
                         {"OPENBLAS_NUM_THREADS", static_cast<int>(a[7].item<double>())},
                         {"comm_volume_matches", a[3].item<double>() == 1.0}});
  }
  return sum;
}

// What rank 0 reports, in text and in JSON.
struct StepReport {
  std::string model, dtype, layout;  // source label, HF dtype name, "tpT-dpD-zeroZ-WxNt"
  torch::Device device = torch::kCPU;
  int tp = 1, dp = 1, world = 1, ep = 1;
  int64_t expert_bytes = 0;  // rank 0's routed-expert parameters (mixtures of experts)
  RankThreads threads;
  ComputeLimit limit;
  RankSummary ranks;
  std::vector<double> step_times;  // per timed step, its slowest rank
  double step_median = 0, p90 = 0;
  int64_t global_tokens = 0;
  double flops_per_step = 0, achieved = 0, mfu = 0;
};

void print_step_report(const StepReport& r, const Args& args, const TrainConfig& config,
                       const TimedSteps& timed, const StepCommVolume& analytic) {
  const int world = r.world, torch_threads = r.threads.torch_threads;
  const double step_median = r.step_median, comm_mean = r.ranks.comm_mean, spec_peak = r.limit.spec_peak;
  std::cout << fmt::format(
      "# autotp bench-step: {} ({}), {}, micro-batch {} x seq {} x gas {}, {} warm-up + {} steps\n", r.model,
      r.dtype, r.layout, args.micro_batch, args.seq_len, config.gradient_accumulation_steps, args.warmup,
      args.steps);
  std::cout << fmt::format("  tokens/s            {:.1f}  ({} tokens per step)\n",
                           r.global_tokens / step_median, r.global_tokens);
  std::cout << fmt::format("  step time           median {:.4f} s, p90 {:.4f} s (slowest rank per step)\n",
                           step_median, r.p90);
  std::cout << fmt::format(
      "  communication       {:.4f} s per step (mean over ranks), compute {:.4f} s ({:.1f}% comm)\n",
      comm_mean, step_median - comm_mean, 100.0 * comm_mean / step_median);
  std::cout << fmt::format("  model FLOPs         {:.3g} per step, achieved {:.2f} GFLOP/s\n",
                           r.flops_per_step, r.achieved / 1e9);
  std::cout << fmt::format(
      "  GEMM limit          {:.2f} GFLOP/s ({} rank(s) x {} thread(s), measured together)\n",
      r.ranks.cluster_limit / 1e9, world, torch_threads);
  std::cout << fmt::format("  MFU                 {:.1f}%\n", 100.0 * r.mfu);
  if (r.expert_bytes > 0)
    std::cout << fmt::format("  expert parameters   {:.2f} MB on rank 0 (ep {})\n", r.expert_bytes / 1e6, r.ep);
  if (r.device.is_cuda()) {
    std::cout << fmt::format(
        "  GPU                 {}: {} 8192^3 GEMM {:.1f} TFLOP/s, bf16 spec peak {}\n", r.limit.gpu, r.dtype,
        r.limit.square_gemm / 1e12,
        spec_peak > 0 ? fmt::format("{:.0f} TFLOP/s", spec_peak / 1e12) : std::string("unknown"));
    if (spec_peak > 0)
      std::cout << fmt::format("  MFU (spec peak)     {:.1f}%\n", 100.0 * r.achieved / (spec_peak * world));
    std::cout << fmt::format("  GPU memory (rank 0) peak allocated {:.2f} GiB, peak reserved {:.2f} GiB\n",
                             timed.last.peak_allocated_bytes / 1073741824.0,
                             timed.last.peak_reserved_bytes / 1073741824.0);
  }
  std::cout << fmt::format("  phases (rank 0)     forward+backward {:.4f} s, optimizer {:.4f} s (medians)\n",
                           median(timed.forward_backward), median(timed.optimizer));
  std::cout << fmt::format(
      "  exposed comm        forward+backward {:.4f} s, optimizer {:.4f} s; started collectives "
      "ran {:.4f} s on the lanes (rank 0 medians; overlap_comm {})\n",
      median(timed.comm_forward_backward), median(timed.comm_optimizer), median(timed.lane),
      config.zero.overlaps(r.device.is_cuda()));
  std::cout << fmt::format("  exposed tp comm     forward {:.4f} s, backward {:.4f} s (rank 0 medians; "
                           "tp_overlap_comm {}, sequence_parallel {})\n",
                           median(timed.tp_forward), median(timed.tp_backward), args.tp_overlap_comm,
                           args.sequence_parallel);
  std::cout << fmt::format("  threads per rank    torch {}, BLAS {}, {} local rank(s) on {} core(s): {}\n",
                           torch_threads, blas_threads(), r.threads.local_ranks, r.threads.cores,
                           r.ranks.oversubscribed ? "OVERSUBSCRIBED" : "not oversubscribed");
  print_volume_table(timed.counted, analytic);
  std::cout << fmt::format("  loss (last step)    {:.4f}\n", timed.loss) << std::flush;
}

void write_step_json(const StepReport& r, const Args& args, const TrainConfig& config,
                     const TimedSteps& timed, const StepCommVolume& analytic) {
  const StepMetrics& last = timed.last;
  const bool cuda = r.device.is_cuda();
  const double step_median = r.step_median, comm_mean = r.ranks.comm_mean;
  BenchReport report("bench-step");
  report.context["model"] = r.model;
  report.context["cores"] = r.threads.cores;
  report.context["device"] = r.device.str();
  if (cuda) report.context["gpu"] = r.limit.gpu;
  report.add({{"name", fmt::format("step/{}/{}/{}", r.model, r.dtype, r.layout)},
              {"model", r.model},
              {"dtype", r.dtype},
              {"tp", r.tp},
              {"dp", r.dp},
              {"ep", r.ep},
              {"expert_param_bytes", r.expert_bytes},
              {"zero_stage", config.zero.stage},
              {"sequence_parallel", args.sequence_parallel},
              {"tp_overlap_comm", args.tp_overlap_comm},
              {"world", r.world},
              {"micro_batch", args.micro_batch},
              {"seq_len", args.seq_len},
              {"gradient_accumulation_steps", config.gradient_accumulation_steps},
              {"steps", args.steps},
              {"warmup", args.warmup},
              {"tokens_per_step", r.global_tokens},
              {"tokens_per_s", r.global_tokens / step_median},
              {"step_time_median_s", step_median},
              {"step_time_p90_s", r.p90},
              {"step_times_s", r.step_times},
              {"comm_s", comm_mean},
              {"exposed_comm_forward_backward_s", median(timed.comm_forward_backward)},
              {"exposed_comm_optimizer_s", median(timed.comm_optimizer)},
              {"async_comm_s", median(timed.lane)},
              {"comm_settle_s", median(timed.settle)},
              {"memory_counter", memory_counter_installed()},
              {"exposed_tp_comm_forward_s", median(timed.tp_forward)},
              {"exposed_tp_comm_backward_s", median(timed.tp_backward)},
              {"overlap_comm", config.zero.overlaps(cuda)},
              {"compute_s", step_median - comm_mean},
              {"model_flops_per_step", r.flops_per_step},
              {"achieved_flops", r.achieved},
              {"gemm_limit_flops", r.ranks.cluster_limit},
              {"mfu", r.mfu},
              {"device", cuda ? "cuda" : "cpu"},
              {"forward_backward_s", median(timed.forward_backward)},
              {"optimizer_s", median(timed.optimizer)},
              {"peak_allocated_bytes", last.peak_allocated_bytes},
              {"memory_device", last.memory_device},
              {"threads_per_rank", r.threads.torch_threads},
              {"local_ranks", r.threads.local_ranks},
              {"cores", r.threads.cores},
              {"oversubscribed", r.ranks.oversubscribed},
              {"comm_volume", {{"counted", timed.counted.to_json()}, {"analytic", analytic.to_json()}}},
              {"comm_volume_matches", r.ranks.all_match},
              {"ranks", r.ranks.ranks},
              {"higher_is_better", "tokens_per_s"}});
  if (cuda) {
    auto& row = report.rows().back();
    row["gpu"] = r.limit.gpu;
    row["gemm_tflops"] = r.limit.square_gemm / 1e12;
    row["mfu_measured_gemm"] = r.achieved / (r.limit.square_gemm * r.world);
    row["mfu_spec"] =
        r.limit.spec_peak > 0 ? nlohmann::json(r.achieved / (r.limit.spec_peak * r.world)) : nlohmann::json();
    row["spec_peak_tflops"] = r.limit.spec_peak / 1e12;
    row["peak_reserved_bytes"] = last.peak_reserved_bytes;
  }
  report.write(args.json);
}

void run_bench_step(const Args& args) {
  if (!run_as_rank(args.world)) return;
  retain_freed_memory();  // steps repeat the same allocations: reuse them instead of faulting pages in
  auto source = resolve_model(args.model);
  DistEnv env = DistEnv::from_environment();
  const torch::ScalarType dtype = parse_dtype(args.dtype);
  const TrainConfig config = bench_config(args, dtype, env.world_size);
  AUTOTP_USER_CHECK(args.seq_len <= source.config.max_positions,
                    "--seq-len {} exceeds the model's {} positions", args.seq_len,
                    source.config.max_positions);
  config.expert_parallel.validate(source.config, env.world_size, args.tp);
  const ExpertPlacement experts{args.ep, Topology::coordinates(env.rank, args.tp).dp_rank % args.ep,
                                source.config.num_experts};
  auto plan = place_experts(TpPlan::build(source.config, config.tensor_parallel.plan_options()), experts);
  const Placement placement = place_rank(args.world, config.device);
  const torch::Device device = placement.device;
  auto topology = join_world(args.world, args.tp, placement.backend, args.ep);
  const int rank = topology->rank(), world = topology->world_size();
  torch::manual_seed(config.seed);
  auto model = load_model(source, plan, topology->tp(), dtype, config.seed, nullptr, device);
  if (args.ep > 1) model->set_expert_parallel(experts, topology->ep());
  int64_t expert_bytes = 0;  // this rank's routed-expert parameters (rank 0's are the largest range)
  for (const auto& p : model->parameters())
    if (p.entry->expert >= 0) expert_bytes += p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
  const RankThreads threads = rank_threads(env);
  const ComputeLimit limit = measure_compute_limit(args, source.config, dtype, device);

  Trainer trainer(config, topology, std::move(model), nullptr, false);
  const int64_t dp_rank = topology->dp_rank();
  auto make_batches = [&](int64_t step) {
    return random_batches(args, source.config.vocab_size, config.gradient_accumulation_steps, dp_rank, step);
  };
  for (int64_t s = 0; s < args.warmup; ++s) trainer.train_step(make_batches(s));
  const StepCommVolume analytic =
      analytic_step_comm_volume(trainer.model(), config, step_shape(*topology, args));
  const TimedSteps timed =
      run_timed_steps(trainer, *topology, analytic, args.warmup, args.steps, make_batches);
  if (!args.profile.empty()) {
    // An extra step under the profiler: its overhead stays out of the timed steps.
    auto batches = make_batches(args.warmup + args.steps);
    torch::autograd::profiler::RecordProfile guard(fmt::format("{}.rank{}.json", args.profile, rank));
    trainer.train_step(batches);
  }
  GatheredRanks gathered = gather_ranks(*topology, timed, limit.rank, threads.row, args.steps);
  if (rank != 0) return;

  StepReport r;
  r.model = source.label;
  r.dtype = hf_dtype_name(dtype);
  r.device = device;
  r.tp = topology->tp_size();
  r.dp = topology->dp_size();
  r.ep = topology->ep_size();
  r.expert_bytes = expert_bytes;
  r.world = world;
  r.threads = threads;
  r.limit = limit;
  r.ranks = summarize_ranks(gathered.all, world, threads.local_ranks, threads.cores);
  r.step_times = std::move(gathered.step_times);
  r.step_median = median(r.step_times);
  r.p90 = quantile(r.step_times, 0.9);
  r.global_tokens = config.train_batch_size * args.seq_len;
  r.flops_per_step = model_flops_per_token(source.config, args.seq_len) * r.global_tokens;
  r.achieved = r.flops_per_step / r.step_median;
  r.mfu = r.achieved / r.ranks.cluster_limit;
  r.layout = fmt::format("tp{}-dp{}{}-zero{}-{}x{}t", r.tp, r.dp, r.ep > 1 ? fmt::format("-ep{}", r.ep) : "",
                         config.zero.stage, world, threads.torch_threads);
  print_step_report(r, args, config, timed, analytic);
  if (!args.json.empty()) write_step_json(r, args, config, timed, analytic);
  if (!r.ranks.all_match)
    throw std::runtime_error("bench-step: counted communication differs from the analytic volume");
}

}  // namespace

void register_bench_step(CLI::App& app) {
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("bench-step", "Time training steps of one layout: tokens/s, MFU, comm volume");
  add_bench_step_options(*cmd, *args);
  cmd->callback([args] { run_bench_step(*args); });
}

}  // namespace autotp::cli
