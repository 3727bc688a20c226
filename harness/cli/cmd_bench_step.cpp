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

#include "autotp/model/presets.h"
#include "autotp/arch/model_flops.h"
#include "autotp/base/device.h"
#include "autotp/base/error.h"
#include "autotp/base/quantile.h"
#include "autotp/base/log.h"
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
// calls (CUDA events on a GPU).
double gemm_rate(int64_t m, int64_t k, int64_t n, torch::ScalarType dtype, const torch::Device& device) {
  auto on = torch::TensorOptions().device(device);
  auto a = torch::randn({m, k}, on).to(dtype), b = torch::randn({k, n}, on).to(dtype);
  auto c = torch::matmul(a, b);  // warm-up (thread pools, page faults, cuBLAS handles)
  synchronize(device);
  double best = 0;
  const auto start = Clock::now();
  for (int i = 0; i < 20 && (i < 3 || seconds_since(start) < 0.5); ++i) {
    StepClock clock(device);
    clock.mark();
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
  std::string model, json, dtype = "f32", profile;
  int tp = 1, zero = 0;
  int64_t micro_batch = 4, seq_len = 256, gas = 1, steps = 5, warmup = 2;
  bool checkpointing = false;
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
                       {"tensor_parallel", {{"autotp_size", args.tp}}},
                       {"seed", args.seed}};
  if (dtype == torch::kBFloat16) ds["bf16"] = {{"enabled", true}};
  if (args.checkpointing) ds["activation_checkpointing"] = {{"enabled", true}};
  if (args.overlap_comm) ds["zero_optimization"]["overlap_comm"] = *args.overlap_comm;
  auto config = TrainConfig::from_json(ds, "bench-step");
  config.resolve_batch(world_size);
  return config;
}

// What this rank measured over the timed steps.
struct TimedSteps {
  std::vector<double> step, comm, forward_backward, optimizer, comm_forward_backward, comm_optimizer, lane;
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
    t.loss = m.loss;
    t.last = m;
    StepCommVolume step{GroupVolume::between(before[0], groups[0]->stats()),
                        GroupVolume::between(before[1], groups[1]->stats()),
                        GroupVolume::between(before[2], groups[2]->stats())};
    double comm = 0;
    for (int g = 0; g < 3; ++g) comm += groups[g]->stats().seconds - before[g].seconds;
    t.comm.push_back(comm);
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

}  // namespace

void register_bench_step(CLI::App& app) {
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("bench-step", "Time training steps of one layout: tokens/s, MFU, comm volume");
  cmd->add_option("--model", args->model, "HF model directory or preset:NAME")->required();
  cmd->add_option("--tp", args->tp, "Tensor-parallel size (default 1)")->check(CLI::PositiveNumber);
  cmd->add_option("--zero", args->zero, "ZeRO stage 0-3 over the data-parallel group (default 0)")
      ->check(CLI::Range(0, 3));
  cmd->add_option("--micro-batch", args->micro_batch, "Sequences per micro-batch per rank (default 4)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--seq-len", args->seq_len, "Tokens per sequence (default 256)")->check(CLI::PositiveNumber);
  cmd->add_option("--gas", args->gas, "Gradient accumulation steps (default 1)")->check(CLI::PositiveNumber);
  cmd->add_option("--steps", args->steps, "Timed steps after the warm-up (default 5)")->check(CLI::PositiveNumber);
  cmd->add_option("--warmup", args->warmup, "Untimed steps first (default 2)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--dtype", args->dtype, "f32 or bf16 (default f32)")->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_flag("--activation-checkpointing", args->checkpointing, "Recompute every layer in the backward");
  cmd->add_option("--overlap-comm", args->overlap_comm,
                  "zero_optimization.overlap_comm: ZeRO collectives behind compute (default: on for CUDA, off on CPU)");
  cmd->add_option("--seed", args->seed, "Seed of the weights and the random tokens (default 1)");
  cmd->add_option("--json", args->json, "Write the result as JSON here (rank 0)");
  cmd->add_option("--profile", args->profile,
                  "Write a Chrome trace of one more step (torch's autograd profiler) here, per rank: PATH.rankN.json");
  add_world_options(*cmd, args->world);
  add_device_options(*cmd, args->world);
  cmd->callback([args] {
    if (!run_as_rank(args->world)) return;
    retain_freed_memory();  // steps repeat the same allocations: reuse them instead of faulting pages in
    auto source = resolve_model(args->model);
    DistEnv env = DistEnv::from_environment();
    const torch::ScalarType dtype = parse_dtype(args->dtype);
    const TrainConfig config = bench_config(*args, dtype, env.world_size);
    AUTOTP_USER_CHECK(args->seq_len <= source.config.max_positions, "--seq-len {} exceeds the model's {} positions",
                      args->seq_len, source.config.max_positions);
    TpPlanOptions plan_options;
    plan_options.tp_size = args->tp;
    auto plan = TpPlan::build(source.config, plan_options);
    const Placement placement = place_rank(args->world, config.device);
    const torch::Device device = placement.device;
    auto topology = join_world(args->world, args->tp, placement.backend);
    const int rank = topology->rank(), world = topology->world_size();
    torch::manual_seed(config.seed);
    auto model = load_model(source, plan, topology->tp(), dtype, config.seed, nullptr, device);

    // Threads as this rank really runs them.
    const int torch_threads = at::get_num_threads();
    const int local_ranks = env.local_world_size;
    const int cores = launcher::available_cores();
    auto threads_row = torch::tensor({static_cast<int64_t>(torch_threads), static_cast<int64_t>(blas_threads()),
                                      static_cast<int64_t>(env_int("OMP_NUM_THREADS")),
                                      static_cast<int64_t>(env_int("OPENBLAS_NUM_THREADS"))},
                                     torch::kLong);

    // The compute limit: every rank runs the step's largest GEMM shapes at
    // once, with its thread count (so shared cores are shared here too).
    const int64_t tokens = args->micro_batch * args->seq_len;
    const auto& mc = source.config;
    const double limit_mlp =
        gemm_rate(tokens, mc.hidden_size, (mc.intermediate_size + args->tp - 1) / args->tp, dtype, device);
    const double limit_head = gemm_rate(tokens, mc.hidden_size, (mc.vocab_size + args->tp - 1) / args->tp, dtype, device);
    // On a GPU also a large square GEMM in the run's dtype (the rate a GPU's MFU is
    // usually quoted against; bf16 for the GPU regression run).
    const double square_bf16 = device.is_cuda() ? gemm_rate(8192, 8192, 8192, dtype, device) : 0.0;
    const double rank_limit = std::max({limit_mlp, limit_head, square_bf16});
    const std::string gpu = cuda_device_name(device);
    const double spec_peak = bf16_peak_flops(gpu);

    Trainer trainer(config, topology, std::move(model), nullptr, false);
    const int64_t dp_rank = topology->dp_rank();
    auto make_batches = [&](int64_t step) {
      // Random tokens, the same on every rank of a tp group, distinct across dp ranks and steps.
      std::vector<Batch> batches;
      auto gen = at::detail::createCPUGenerator(args->seed * 1000003 + step * 1009 + dp_rank);
      for (int64_t m = 0; m < config.gradient_accumulation_steps; ++m) {
        auto ids = torch::randint(mc.vocab_size, {args->micro_batch, args->seq_len + 1}, gen, torch::kLong);
        batches.push_back({ids.narrow(1, 0, args->seq_len).contiguous(), ids.narrow(1, 1, args->seq_len).contiguous()});
      }
      return batches;
    };
    for (int64_t s = 0; s < args->warmup; ++s) trainer.train_step(make_batches(s));

    StepShape shape;
    shape.tp_size = topology->tp_size();
    shape.dp_size = topology->dp_size();
    shape.tp_rank = topology->tp_rank();
    shape.micro_batch = args->micro_batch;
    shape.seq_len = args->seq_len;
    const StepCommVolume analytic = analytic_step_comm_volume(trainer.model(), config, shape);
    const TimedSteps timed = run_timed_steps(trainer, *topology, analytic, args->warmup, args->steps, make_batches);
    const StepMetrics& last = timed.last;
    const StepCommVolume& counted = timed.counted;

    if (!args->profile.empty()) {
      // An extra step under the profiler: its overhead stays out of the timed steps.
      auto batches = make_batches(args->warmup + args->steps);
      torch::autograd::profiler::RecordProfile guard(fmt::format("{}.rank{}.json", args->profile, rank));
      trainer.train_step(batches);
    }

    // Every rank's numbers to rank 0 (outside the timed steps).
    std::vector<double> mine = {median(timed.step), median(timed.comm), rank_limit, timed.volume_matches ? 1.0 : 0.0};
    for (int64_t i = 0; i < 4; ++i) mine.push_back(static_cast<double>(threads_row[i].item<int64_t>()));
    auto row = torch::tensor(mine, torch::kFloat64).view({1, -1});
    auto all = topology->world().all_gather(row, 0);
    std::vector<double> all_steps(timed.step);
    auto steps_tensor = torch::tensor(timed.step, torch::kFloat64);
    topology->world().all_reduce(steps_tensor, ReduceOp::kMax);  // a step ends when its slowest rank does
    for (int64_t s = 0; s < args->steps; ++s) all_steps[s] = steps_tensor[s].item<double>();
    topology->world().barrier();
    if (rank != 0) return;

    const double step_median = median(all_steps), p90 = quantile(all_steps, 0.9);
    double comm_mean = 0, cluster_limit = 0;
    bool all_match = true, oversubscribed = false;
    nlohmann::json ranks = nlohmann::json::array();
    for (int r = 0; r < world; ++r) {
      auto a = all[r];
      comm_mean += a[1].item<double>() / world;
      cluster_limit += a[2].item<double>();
      all_match = all_match && a[3].item<double>() == 1.0;
      const int t = static_cast<int>(a[4].item<double>()), blas = static_cast<int>(a[5].item<double>());
      oversubscribed = oversubscribed || t * local_ranks > cores || blas * local_ranks > cores;
      ranks.push_back({{"rank", r},
                       {"step_time_median_s", a[0].item<double>()},
                       {"comm_s", a[1].item<double>()},
                       {"gemm_limit_flops", a[2].item<double>()},
                       {"torch_threads", t},
                       {"blas_threads", blas},
                       {"OMP_NUM_THREADS", static_cast<int>(a[6].item<double>())},
                       {"OPENBLAS_NUM_THREADS", static_cast<int>(a[7].item<double>())},
                       {"comm_volume_matches", a[3].item<double>() == 1.0}});
    }
    const int64_t global_tokens = config.train_batch_size * args->seq_len;
    const double flops_per_step = model_flops_per_token(mc, args->seq_len) * global_tokens;
    const double achieved = flops_per_step / step_median;
    const double mfu = achieved / cluster_limit;
    const std::string layout = fmt::format("tp{}-dp{}-zero{}-{}x{}t", topology->tp_size(), topology->dp_size(),
                                           config.zero.stage, world, torch_threads);

    std::cout << fmt::format("# autotp bench-step: {} ({}), {}, micro-batch {} x seq {} x gas {}, {} warm-up + {} steps\n",
                             source.label, hf_dtype_name(dtype), layout, args->micro_batch, args->seq_len,
                             config.gradient_accumulation_steps, args->warmup, args->steps);
    std::cout << fmt::format("  tokens/s            {:.1f}  ({} tokens per step)\n", global_tokens / step_median,
                             global_tokens);
    std::cout << fmt::format("  step time           median {:.4f} s, p90 {:.4f} s (slowest rank per step)\n", step_median, p90);
    std::cout << fmt::format("  communication       {:.4f} s per step (mean over ranks), compute {:.4f} s ({:.1f}% comm)\n",
                             comm_mean, step_median - comm_mean, 100.0 * comm_mean / step_median);
    std::cout << fmt::format("  model FLOPs         {:.3g} per step, achieved {:.2f} GFLOP/s\n", flops_per_step,
                             achieved / 1e9);
    std::cout << fmt::format("  GEMM limit          {:.2f} GFLOP/s ({} rank(s) x {} thread(s), measured together)\n",
                             cluster_limit / 1e9, world, torch_threads);
    std::cout << fmt::format("  MFU                 {:.1f}%\n", 100.0 * mfu);
    if (device.is_cuda()) {
      std::cout << fmt::format("  GPU                 {}: {} 8192^3 GEMM {:.1f} TFLOP/s, bf16 spec peak {}\n", gpu,
                               hf_dtype_name(dtype), square_bf16 / 1e12, spec_peak > 0 ? fmt::format("{:.0f} TFLOP/s", spec_peak / 1e12)
                                                                 : std::string("unknown"));
      if (spec_peak > 0)
        std::cout << fmt::format("  MFU (spec peak)     {:.1f}%\n", 100.0 * achieved / (spec_peak * world));
      std::cout << fmt::format("  GPU memory (rank 0) peak allocated {:.2f} GiB, peak reserved {:.2f} GiB\n",
                               last.peak_allocated_bytes / 1073741824.0, last.peak_reserved_bytes / 1073741824.0);
    }
    std::cout << fmt::format("  phases (rank 0)     forward+backward {:.4f} s, optimizer {:.4f} s (medians)\n",
                             median(timed.forward_backward), median(timed.optimizer));
    std::cout << fmt::format("  exposed comm        forward+backward {:.4f} s, optimizer {:.4f} s; started collectives "
                             "ran {:.4f} s on the lanes (rank 0 medians; overlap_comm {})\n",
                             median(timed.comm_forward_backward), median(timed.comm_optimizer),
                             median(timed.lane), config.zero.overlaps(device.is_cuda()));
    std::cout << fmt::format("  threads per rank    torch {}, BLAS {}, {} local rank(s) on {} core(s): {}\n",
                             torch_threads, blas_threads(), local_ranks, cores,
                             oversubscribed ? "OVERSUBSCRIBED" : "not oversubscribed");
    print_volume_table(counted, analytic);
    std::cout << fmt::format("  loss (last step)    {:.4f}\n", timed.loss) << std::flush;

    if (!args->json.empty()) {
      BenchReport report("bench-step");
      report.context["model"] = source.label;
      report.context["cores"] = cores;
      report.context["device"] = device.str();
      if (device.is_cuda()) report.context["gpu"] = gpu;
      report.add({{"name", fmt::format("step/{}/{}/{}", source.label, hf_dtype_name(dtype), layout)},
                  {"model", source.label},
                  {"dtype", hf_dtype_name(dtype)},
                  {"tp", topology->tp_size()},
                  {"dp", topology->dp_size()},
                  {"zero_stage", config.zero.stage},
                  {"world", world},
                  {"micro_batch", args->micro_batch},
                  {"seq_len", args->seq_len},
                  {"gradient_accumulation_steps", config.gradient_accumulation_steps},
                  {"steps", args->steps},
                  {"warmup", args->warmup},
                  {"tokens_per_step", global_tokens},
                  {"tokens_per_s", global_tokens / step_median},
                  {"step_time_median_s", step_median},
                  {"step_time_p90_s", p90},
                  {"step_times_s", all_steps},
                  {"comm_s", comm_mean},
                  {"exposed_comm_forward_backward_s", median(timed.comm_forward_backward)},
                  {"exposed_comm_optimizer_s", median(timed.comm_optimizer)},
                  {"async_comm_s", median(timed.lane)},
                  {"overlap_comm", config.zero.overlaps(device.is_cuda())},
                  {"compute_s", step_median - comm_mean},
                  {"model_flops_per_step", flops_per_step},
                  {"achieved_flops", achieved},
                  {"gemm_limit_flops", cluster_limit},
                  {"mfu", mfu},
                  {"device", device.is_cuda() ? "cuda" : "cpu"},
                  {"forward_backward_s", median(timed.forward_backward)},
                  {"optimizer_s", median(timed.optimizer)},
                  {"peak_allocated_bytes", last.peak_allocated_bytes},
                  {"memory_device", last.memory_device},
                  {"threads_per_rank", torch_threads},
                  {"local_ranks", local_ranks},
                  {"cores", cores},
                  {"oversubscribed", oversubscribed},
                  {"comm_volume", {{"counted", counted.to_json()}, {"analytic", analytic.to_json()}}},
                  {"comm_volume_matches", all_match},
                  {"ranks", ranks},
                  {"higher_is_better", "tokens_per_s"}});
      if (device.is_cuda()) {
        auto& row = report.rows().back();
        row["gpu"] = gpu;
        row["gemm_tflops"] = square_bf16 / 1e12;
        row["mfu_measured_gemm"] = achieved / (square_bf16 * world);
        row["mfu_spec"] = spec_peak > 0 ? nlohmann::json(achieved / (spec_peak * world)) : nlohmann::json();
        row["spec_peak_tflops"] = spec_peak / 1e12;
        row["peak_reserved_bytes"] = last.peak_reserved_bytes;
      }
      report.write(args->json);
    }
    if (!all_match) throw std::runtime_error("bench-step: counted communication differs from the analytic volume");
  });
}

}  // namespace autotp::cli
