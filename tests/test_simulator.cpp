// The simulator's formulas against closed forms: published parameter counts of
// the catalog models, the ZeRO paper's model-state bytes, ZeRO-Offload's device,
// host and PCIe bytes, full-recomputation
// activations (2 s b h per layer), training FLOPs, collective counts and ring
// costs; expert parallelism (the two optimizers' model states, all-to-alls, expert
// FLOPs, Mixtral's 5.6 B experts per GPU at ep 8); and the CLI: --json fields, sweeps, bad input (exit code 2),
// simulate-only scenario files (--scenario: the single layouts, strict keys).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "autotp/io/safetensors.h"
#include "autotp/model/presets.h"
#include "autotp/base/error.h"
#include "autotp/base/host_cpu.h"
#include "autotp/optim/grad_norm.h"
#include "autotp/zero/flat_layout.h"
#include "autotp/tp/expert_parallel.h"
#include "autotp/zero/zero_units.h"
#include "simulator/op_count.h"
#include "simulator/simulator.h"
#include "support/checks.h"
#include "support/cli_runner.h"

namespace autotp::sim {
namespace {

using nlohmann::json;

TEST(SimulatorCatalog, ParameterCountsMatchThePublishedOnes) {
  ASSERT_GE(catalog_models().size(), 11u);
  for (const auto& m : catalog_models()) {
    auto config = ModelConfig::from_json(m.config, m.name);
    EXPECT_EQ(count_parameters(config), m.parameters) << m.name << " (" << m.hf_id << ")";
  }
  EXPECT_EQ(count_parameters(resolve_sim_model("llama2-7b").config), 6738415616);
}

TEST(SimulatorCatalog, ResolvesPresetsAndConfigFilesWithRopeScaling) {
  EXPECT_EQ(resolve_sim_model("preset:llama-tiny").config.hidden_size, 96);
  auto j = catalog_models().front().config;
  j["rope_scaling"] = {{"type", "llama3"}, {"factor", 8.0}};  // Llama-3.1 style: same shapes
  const std::string path = ::testing::TempDir() + "/sim_config.json";
  io::write_text_file_atomic(path, j.dump());
  EXPECT_EQ(count_parameters(resolve_sim_model(path).config), 6738415616);
  EXPECT_THROW(resolve_sim_model("llama-9000"), UserError);
}

SimLayout layout(int gpus, int tp, int stage, torch::ScalarType dtype = torch::kFloat32) {
  SimLayout l;
  l.gpus = gpus;
  l.tp = tp;
  l.zero_stage = stage;
  l.micro_batch = 1;
  l.seq_len = 2048;
  l.dtype = dtype;
  return l;
}

// A made-up cpu-local calibration for two ranks (GEMM, all-reduce, all-gather fits).
Calibration two_rank_calibration() {
  Calibration cal;
  cal.world = 2;
  cal.compute.gemm_peak_flops = 1e10;
  cal.compute.gemm_fit = {1e-6, 1e10};
  cal.all_reduce[2] = {1e-4, 1e9};
  cal.all_gather[2] = {2e-4, 1e9};
  return cal;
}

TEST(SimulatorMemory, ZeroPaperModelStates) {
  // Llama-2-7B, tp 1, Nd = 8 (Psi divisible by 8, so no padding): fp32 AdamW has
  // 4-byte params and grads and K = 8 (ZeRO paper, fp32 variant).
  auto model = resolve_sim_model("llama2-7b");
  const int64_t psi = 6738415616, nd = 8;
  auto shape = rank_shape(model.config, build_plan(model.config, 1), 0);
  ASSERT_EQ(shape.local_numel, psi);
  auto states = [&](int stage, torch::ScalarType dtype, int64_t gas = 1) {
    SimLayout l = layout(8, 1, stage, dtype);
    l.gas = gas;
    l.persistence_threshold = 0;  // every tensor partitioned at stage 3
    return estimate_memory(model.config, shape, l).states;
  };
  EXPECT_EQ(states(0, torch::kFloat32).total(), 16 * psi);
  EXPECT_EQ(states(1, torch::kFloat32).total(), 4 * psi + 4 * psi + 8 * psi / nd);
  EXPECT_EQ(states(2, torch::kFloat32).total(), 4 * psi + 12 * psi / nd);
  EXPECT_EQ(states(3, torch::kFloat32).total(), 16 * psi / nd);
  // bf16: the paper's 2 + 2 + 12 per element, partitioned as the stages say.
  EXPECT_EQ(states(0, torch::kBFloat16).total(), (2 + 2 + 12) * psi);
  EXPECT_EQ(states(1, torch::kBFloat16).total(), (2 + 2) * psi + 12 * psi / nd);
  EXPECT_EQ(states(2, torch::kBFloat16).total(), 2 * psi + 14 * psi / nd);
  EXPECT_EQ(states(3, torch::kBFloat16).total(), 16 * psi / nd);
  EXPECT_EQ(states(3, torch::kBFloat16).master_weights, 4 * psi / nd);
  // With gradient accumulation the gradients accumulate in fp32: 4 bytes instead of 2.
  EXPECT_EQ(states(1, torch::kBFloat16, 4).total(), (2 + 2 + 4) * psi + 12 * psi / nd);
  EXPECT_EQ(states(3, torch::kBFloat16, 4).total(), 18 * psi / nd);
}

TEST(SimulatorMemory, TensorParallelShardsAndPadding) {
  // llama-tiny at tp 4: uneven heads (2/2/1/1), kv heads replicated where shared; the
  // per-rank Psi is the plan's own numbers, and the flat buffer pads to a multiple of dp.
  auto model = resolve_sim_model("preset:llama-tiny");
  auto plan = build_plan(model.config, 4);
  for (int r = 0; r < 4; ++r) {
    auto shape = rank_shape(model.config, plan, r);
    int64_t expected = 0;
    for (const auto& e : plan.entries()) expected += e.spec.local_numel(r);
    EXPECT_EQ(shape.local_numel, expected);
    SimLayout l = layout(12, 4, 3);
    l.seq_len = 64;
    l.persistence_threshold = 0;
    // Each unit (embeddings, each layer, head) pads to a multiple of dp = 3.
    std::map<int, int64_t> units;
    const auto ids = zero_unit_ids(plan, 3, 0);
    for (size_t i = 0; i < plan.entries().size(); ++i) units[ids[i]] += plan.entries()[i].spec.local_numel(r);
    int64_t padded = 0;
    for (const auto& [id, n] : units) padded += (n + 2) / 3 * 3;
    EXPECT_EQ(estimate_memory(model.config, shape, l).states.total(), 16 * padded / 3);
  }
  EXPECT_FALSE(rank_shape(model.config, plan, 1).shared_numel.empty());  // rank 1 shares a kv head
}

TEST(SimulatorMemory, FullRecomputationKeepsTwoBytesPerTokenAndHidden) {
  // Korthikanti et al.: with full recomputation a layer keeps its input, 2 s b h bytes in 16 bits.
  auto model = resolve_sim_model("llama2-7b");
  ModelConfig half = model.config;
  half.num_layers = 16;
  SimLayout l = layout(8, 1, 1, torch::kBFloat16);
  l.activation_checkpointing = true;
  l.micro_batch = 2;
  const int64_t s = 2048, b = 2, h = 4096;
  auto saved = [&](const ModelConfig& c) {
    return saved_activation_bytes(c, rank_shape(c, build_plan(c, 1), 0), l);
  };
  EXPECT_EQ(saved(model.config) - saved(half), 2 * s * b * h * 16);
  // Without recomputation a layer keeps far more (fp32 norms, the s x s probabilities).
  l.activation_checkpointing = false;
  EXPECT_GT(saved(model.config) - saved(half), 16 * 2 * s * b * h * 16);
}

TEST(SimulatorMemory, SequenceParallelDividesTheResidualStreamByTp) {
  // Per Llama layer the two norms' inputs (bf16), fp32 reciprocal RMS and outputs
  // shrink from s to ceil(s / tp) tokens; attention and MLP terms stay.
  auto model = resolve_sim_model("llama2-7b");
  ModelConfig half = model.config;
  half.num_layers = 16;
  SimLayout l = layout(8, 4, 1, torch::kBFloat16);
  l.seq_len = 2047;  // uneven: the busiest rank holds 512 tokens
  const int64_t s = 2047, st = 512, h = 4096;
  auto per_16_layers = [&](const SimLayout& lay) {
    auto shape = [&](const ModelConfig& c) { return rank_shape(c, build_plan(c, 4), 0); };
    return saved_activation_bytes(model.config, shape(model.config), lay) -
           saved_activation_bytes(half, shape(half), lay);
  };
  const int64_t plain = per_16_layers(l);
  l.sequence_parallel = true;
  const int64_t sp = per_16_layers(l);
  EXPECT_EQ(plain - sp, 16 * 2 * (2 * 2 * (s - st) * h + 4 * (s - st)));
  // With full recomputation a layer keeps its input: ceil(s / tp) tokens of it.
  l.activation_checkpointing = true;
  EXPECT_EQ(per_16_layers(l), 16 * 2 * st * h);
}

TEST(SimulatorMemory, OptimizerTemporariesAreTheEnginesChunks) {
  // The norm's fp64 chunk is the engine's for the device (64 Ki on CPU, 4 Mi on
  // CUDA); the update upcasts 16-bit gradients to fp32 4 Mi at a time on CUDA,
  // 256 Ki on the CPU.
  auto model = resolve_sim_model("llama2-7b");
  SimLayout l = layout(1, 1, 0, torch::kBFloat16);
  auto shape = rank_shape(model.config, build_plan(model.config, 1), 0);
  EXPECT_EQ(estimate_memory(model.config, shape, l).optimizer_temporaries, 8 * kGradNormChunkCuda);
  l.cuda = false;
  EXPECT_EQ(estimate_memory(model.config, shape, l).optimizer_temporaries,
            std::max(8 * kGradNormChunkCpu, 4 * kUpdateChunkCpu));
}

// ZeRO-Offload (docs/simulator.md): Llama-2-7B at tp 1, dp 8 (Psi divisible by 8,
// every tensor partitioned), so the partition is Psi / 8 and the closed forms exact.
struct OffloadCase {
  ResolvedModel model = resolve_sim_model("llama2-7b");
  RankShape shape = rank_shape(model.config, build_plan(model.config, 1), 0);
  ClusterSpec cluster = find_cluster("8xA100-80GB");
  static constexpr int64_t psi = 6738415616, part = psi / 8;
  SimLayout at(int stage, torch::ScalarType dtype, int64_t gas = 1, bool optimizer = true,
               bool params = false) const {
    SimLayout l = layout(8, 1, stage, dtype);
    l.gas = gas;
    l.persistence_threshold = 0;
    l.offload_optimizer = optimizer;
    l.offload_param = params;
    return l;
  }
  MemoryEstimate memory(const SimLayout& l) const { return estimate_memory(model.config, shape, l); }
  TimeEstimate time(const SimLayout& l) const { return estimate_time(model.config, shape, l, cluster); }
};

TEST(SimulatorOffload, OptimizerOffloadMovesMasterAndStatesToTheHost) {
  const OffloadCase c;
  const int64_t part = OffloadCase::part;
  for (int stage : {1, 2, 3}) {
    for (int64_t gas : {1, 4}) {
      SCOPED_TRACE(fmt::format("stage {} gas {}", stage, gas));
      const MemoryEstimate off = c.memory(c.at(stage, torch::kBFloat16, gas, false));
      const MemoryEstimate on = c.memory(c.at(stage, torch::kBFloat16, gas));
      // The device drops exactly the fp32 master partition and the two AdamW moments.
      EXPECT_EQ(off.states.master_weights + off.states.optimizer_states, 12 * part);
      EXPECT_EQ(off.states.total() - on.states.total(), 12 * part);
      EXPECT_EQ(on.states.params, off.states.params);
      EXPECT_EQ(on.states.grads, off.states.grads);
      EXPECT_EQ(off.forward_backward_peak - on.forward_backward_peak, 12 * part);
      EXPECT_EQ(off.host.total(), 0);
      // Host: master 4 + moments 8 + the gradient copy (fp32 when accumulating) + the bf16 staging copy.
      EXPECT_EQ(on.host.master_weights, 4 * part);
      EXPECT_EQ(on.host.optimizer_states, 8 * part);
      EXPECT_EQ(on.host.grads, (gas > 1 ? 4 : 2) * part);
      EXPECT_EQ(on.host.params, 2 * part);
      EXPECT_EQ(on.host.total(), (gas > 1 ? 18 : 16) * part);
      // PCIe per step: the gradient partition down, the updated bf16 partition up.
      const TimeEstimate t = c.time(c.at(stage, torch::kBFloat16, gas));
      EXPECT_EQ(t.pcie_d2h_bytes, (gas > 1 ? 4 : 2) * part);
      EXPECT_EQ(t.pcie_h2d_bytes, 2 * part);
    }
  }
  // fp32 training has no separate master on the device, but the host keeps one (and no staging copy).
  const MemoryEstimate off32 = c.memory(c.at(2, torch::kFloat32, 1, false));
  const MemoryEstimate on32 = c.memory(c.at(2, torch::kFloat32));
  EXPECT_EQ(off32.states.total() - on32.states.total(), 8 * part);
  EXPECT_EQ(on32.host.total(), (4 + 8 + 4) * part);
  EXPECT_EQ(on32.host.params, 0);
  EXPECT_EQ(c.time(c.at(2, torch::kFloat32)).pcie_h2d_bytes, 4 * part);
}

TEST(SimulatorOffload, ParamOffloadMovesTheStageThreePartition) {
  const OffloadCase c;
  const int64_t part = OffloadCase::part;
  for (int64_t gas : {1, 2}) {
    const MemoryEstimate opt = c.memory(c.at(3, torch::kBFloat16, gas));
    const MemoryEstimate both = c.memory(c.at(3, torch::kBFloat16, gas, true, true));
    EXPECT_EQ(opt.states.params, 2 * part);
    EXPECT_EQ(both.states.params, 0);  // threshold 0: no persistent tensors stay
    EXPECT_EQ(opt.states.total() - both.states.total(), 2 * part);
    EXPECT_EQ(both.host.params, 2 * part);  // the partition itself, no staging copy beside it
    EXPECT_EQ(both.host.total(), opt.host.total());
    // Every gather copies the rank's slice in: forward and backward of each layer
    // and the head, the embeddings once (untied), per micro-batch.
    const TimeEstimate t = c.time(c.at(3, torch::kBFloat16, gas, true, true));
    const int64_t embed_slice = int64_t{32000} * 4096 / 8;
    EXPECT_EQ(t.pcie_h2d_bytes, gas * 2 * (2 * part - embed_slice));
    EXPECT_EQ(t.pcie_d2h_bytes, (gas > 1 ? 4 : 2) * part);
  }
  // With the default threshold the persistent tensors (the norms) stay on the device.
  SimLayout l = c.at(3, torch::kBFloat16, 1, true, true);
  l.persistence_threshold = 100000;
  const int64_t norms = (2 * 32 + 1) * 4096;
  EXPECT_EQ(c.memory(l).states.params, 2 * norms);
}

TEST(SimulatorOffload, TimeComponentsAddUpToTheStep) {
  const OffloadCase c;
  const int64_t part = OffloadCase::part;
  const TimeEstimate t = c.time(c.at(2, torch::kBFloat16));
  // 8 ranks share the node's 128 cores (8 x 16 x 10 GB/s) and 0.7 x 409.6 GB/s of DRAM:
  // the DRAM bound, over 28 AdamW + 12 conversion bytes per element.
  const double rate = std::min(10e9 * 128 / 8, 0.7 * 2 * 8 * 25.6e9 / 8);
  EXPECT_NEAR(t.cpu_adam_s, 40.0 * part / rate, 1e-9);
  EXPECT_NEAR(t.pcie_d2h_s, 2.0 * part / 25e9, 1e-9);
  EXPECT_NEAR(t.offload_h2d_exposed_s, std::max(2.0 * kUpdateChunk / 25e9, 2.0 * part / 25e9 - t.cpu_adam_s), 1e-9);
  EXPECT_GT(t.offload_d2h_exposed_s, 0);
  EXPECT_LE(t.offload_d2h_exposed_s, t.pcie_d2h_s);
  EXPECT_NEAR(t.step_s,
              t.compute_s + t.tp_comm_s + t.zero_comm_s - t.overlap_s + t.offload_d2h_exposed_s + t.cpu_adam_s +
                  t.offload_h2d_exposed_s,
              1e-12);
  // The device no longer runs the update: less optimizer time than without offload.
  EXPECT_LT(t.optimizer_s, c.time(c.at(2, torch::kBFloat16, 1, false)).optimizer_s);
}

TEST(SimulatorOffload, StageZeroIgnoresItAndParamOffloadNeedsStageThreeAndTheOptimizer) {
  const OffloadCase c;
  const MemoryEstimate plain = c.memory(c.at(0, torch::kBFloat16, 1, false));
  const MemoryEstimate ignored = c.memory(c.at(0, torch::kBFloat16));
  EXPECT_EQ(ignored.states.total(), plain.states.total());
  EXPECT_EQ(ignored.total, plain.total);
  EXPECT_EQ(ignored.host.total(), 0);
  const SimResult r = simulate(c.model, c.cluster, c.at(0, torch::kBFloat16));
  EXPECT_EQ(r.time.cpu_adam_s, 0);
  EXPECT_NE(fmt::format("{}", fmt::join(r.notes, "\n")).find("ignored at ZeRO stage 0"), std::string::npos);
  EXPECT_NE(test::user_error_of([&] { simulate(c.model, c.cluster, c.at(3, torch::kBFloat16, 1, false, true)); })
                .find("--offload-param needs --offload-optimizer"),
            std::string::npos);
  EXPECT_NE(test::user_error_of([&] { simulate(c.model, c.cluster, c.at(2, torch::kBFloat16, 1, true, true)); })
                .find("--offload-param applies at ZeRO stage 3 only"),
            std::string::npos);
  const std::string base =
      "simulate --model llama2-7b --cluster 8xA100-80GB --gpus 8 --tp 1 --micro-batch 1 --seq-len 512 ";
  auto r1 = test::run_cli(base + "--zero 3 --offload-param");
  EXPECT_EQ(r1.exit_code, 2) << r1.output;
  EXPECT_NE(r1.output.find("--offload-param needs --offload-optimizer"), std::string::npos) << r1.output;
  auto r2 = test::run_cli(base + "--zero 1 --offload-optimizer --offload-param");
  EXPECT_EQ(r2.exit_code, 2) << r2.output;
  EXPECT_NE(r2.output.find("applies at ZeRO stage 3 only (got --zero 1)"), std::string::npos) << r2.output;
  auto ok = test::run_cli(base + "--zero 3 --offload-optimizer --offload-param");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("CPU Adam"), std::string::npos) << ok.output;
  EXPECT_NE(ok.output.find("host memory per rank"), std::string::npos) << ok.output;
}

TEST(SimulatorTime, TrainingFlopsPerToken) {
  // 6 x matmul parameters (everything but the embedding and norms) + 12 L h s.
  auto model = resolve_sim_model("llama2-7b");
  const double matmul = 6738415616.0 - 32000.0 * 4096 - 65.0 * 4096;
  EXPECT_DOUBLE_EQ(model_flops_per_token(model.config, 2048), 6 * matmul + 12.0 * 32 * 4096 * 2048);
}

TEST(SimulatorTime, RingCollectiveCost) {
  auto c = find_cluster("8xA100-80GB");
  const double bytes = 1e9;
  EXPECT_DOUBLE_EQ(collective_seconds(c, CollectiveOp::kAllReduce, bytes, 8, GroupScope::kIntraNode),
                   c.intra_node.latency_s + 2.0 * 7 / 8 * bytes / c.intra_node.bus_bytes_per_s);
  EXPECT_DOUBLE_EQ(collective_seconds(c, CollectiveOp::kAllGather, bytes, 4, GroupScope::kInterNode),
                   c.inter_node.latency_s + 3.0 / 4 * bytes / c.inter_node.bus_bytes_per_s);
  EXPECT_EQ(collective_seconds(c, CollectiveOp::kAllReduce, bytes, 1, GroupScope::kIntraNode), 0);
  EXPECT_DOUBLE_EQ(c.intra_node.bus_bytes_per_s, 0.8 * 300e9);
}

TEST(SimulatorTime, CollectiveCountsFollowTheEngine) {
  auto model = resolve_sim_model("preset:llama-tiny");
  auto cluster = find_cluster("8xH100-80GB");
  const int64_t L = model.config.num_layers;
  {
    // tp 2: per layer 2 row all-reduces (forward) + 2 block-input gradient all-reduces
    // (backward); embedding + LM-head input; cross-entropy max and sums; one data hash.
    SimLayout l = layout(8, 2, 1);
    l.seq_len = 64;
    auto shape = rank_shape(model.config, build_plan(model.config, 2), 0);
    auto t = estimate_time(model.config, shape, l, cluster);
    EXPECT_EQ(t.tp_collectives, 4 * L + 2 + 2 + 1 + static_cast<int64_t>(shape.shared_numel.size()));
    // ZeRO-1: tokens + loss; per unit (embeddings, each layer, head) one
    // reduce-scatter and one all-gather; the world norm.
    EXPECT_EQ(t.zero_collectives, 2 + 2 * (L + 2) + 1);
  }
  {
    // ZeRO-3, gas 2, small reduce buckets, every tensor partitioned: per micro-batch
    // each unit reduce-scattered in buckets of 10000 / 8 columns, the embeddings
    // gathered once, each layer and the head twice.
    SimLayout l = layout(8, 1, 3);
    l.seq_len = 64;
    l.gas = 2;
    l.reduce_bucket_size = 10000;
    l.persistence_threshold = 0;
    auto shape = rank_shape(model.config, build_plan(model.config, 1), 0);
    auto t = estimate_time(model.config, shape, l, cluster);
    const FlatLayout flat = zero_layout(build_plan(model.config, 1), 0, 8, 3, 0);
    ASSERT_EQ(static_cast<int64_t>(flat.units.size()), L + 2);
    int64_t buckets = 0;
    for (const auto& u : flat.units) buckets += (u.length / 8 + 1249) / 1250;
    EXPECT_EQ(t.tp_collectives, 0);
    EXPECT_EQ(t.zero_collectives, 2 + 2 * buckets + 2 * (1 + 2 * L + 2) + 1);
    EXPECT_GT(t.compute_s, 0);
    EXPECT_DOUBLE_EQ(t.step_s, t.compute_s + t.tp_comm_s + t.zero_comm_s - t.overlap_s);
  }
}

TEST(SimulatorTime, ZeroThreeGathersAUnitEvenly) {
  // A unit of 10 over 4 ranks is padded to 12: every rank sends 3.
  EXPECT_DOUBLE_EQ(zero3_gather_elements({10, 20}, 40, 4), 12);
  EXPECT_DOUBLE_EQ(zero3_gather_elements({0, 20}, 20, 2), 20);
  // The spans the engine gathers: each layer's parameters back to back, outer ones one by one.
  auto model = resolve_sim_model("preset:llama-tiny");
  for (int tp : {1, 2}) {
    auto shape = rank_shape(model.config, build_plan(model.config, tp), tp - 1);
    ASSERT_EQ(static_cast<int64_t>(shape.layer_ranges.size()), model.config.num_layers);
    ASSERT_EQ(static_cast<int64_t>(shape.outer_ranges.size()), shape.outer_tensors);
    int64_t covered = 0;
    for (size_t l = 0; l < shape.layer_ranges.size(); ++l) {
      EXPECT_EQ(shape.layer_ranges[l].end - shape.layer_ranges[l].begin, shape.layer_numel[l]) << l;
      covered += shape.layer_numel[l];
    }
    for (const auto& r : shape.outer_ranges) covered += r.end - r.begin;
    EXPECT_EQ(covered, shape.local_numel);
  }
}

TEST(SimulatorTime, InStepCollectiveSkewIsAShareOfTheComputeWhereRanksShareCores) {
  // cpu-local: ranks time-sharing the cores arrive at a collective apart, in
  // proportion to the compute since they last met. Each gradient all-reduce and
  // parameter gather after the backward costs step_collective_skew of the forward +
  // backward, the ZeRO-3 layer gathers together layer_gather_skew of it, scaled by
  // how much the layout oversubscribes the cores against the calibration.
  auto model = resolve_sim_model("preset:llama-tiny");
  Calibration cal = two_rank_calibration();
  cal.cores = 1;  // two single-thread ranks on one core: oversubscribed 2x
  cal.threads_per_rank = 1;
  Calibration skewed = cal;
  skewed.step_collective_skew[2] = 0.03;
  skewed.layer_gather_skew[2] = 0.05;
  auto shape = rank_shape(model.config, build_plan(model.config, 1), 0);
  for (int stage : {0, 1, 2, 3}) {
    SimLayout l = layout(2, 1, stage);
    l.micro_batch = 2;
    l.seq_len = 64;
    l.gas = 2;
    l.persistence_threshold = 0;  // llama-tiny's tensors would all stay whole
    auto base = estimate_time(model.config, shape, l, cpu_local_cluster(cal, "base"));
    auto with = estimate_time(model.config, shape, l, cpu_local_cluster(skewed, "skewed"));
    const double fb = base.gemm_s + base.elementwise_s + base.overhead_s;
    const double expected = stage == 1 || stage == 2 ? 2 * 0.03 * fb : stage == 0 ? 0.03 * fb : (0.03 + 0.05) * fb;
    EXPECT_NEAR(with.zero_comm_s - base.zero_comm_s, expected, 1e-9 * fb) << "stage " << stage;
    EXPECT_EQ(with.zero_collectives, base.zero_collectives);
    EXPECT_DOUBLE_EQ(with.compute_s, base.compute_s);
  }
  // Each lock-step collective also waits collective_wake_s for a descheduled partner.
  Calibration woken = cal;
  woken.collective_wake_s[2] = 2e-4;
  for (int tp : {1, 2}) {
    SimLayout l = layout(2, tp, 1);
    l.micro_batch = 2;
    l.seq_len = 64;
    auto tp_shape = rank_shape(model.config, build_plan(model.config, tp), 0);
    auto base = estimate_time(model.config, tp_shape, l, cpu_local_cluster(cal, "base"));
    auto with = estimate_time(model.config, tp_shape, l, cpu_local_cluster(woken, "woken"));
    EXPECT_NEAR(with.tp_comm_s - base.tp_comm_s, static_cast<double>(base.tp_collectives) * 2e-4, 1e-12) << tp;
    EXPECT_NEAR(with.zero_comm_s - base.zero_comm_s, static_cast<double>(base.zero_collectives) * 2e-4, 1e-12) << tp;
  }
  // Where every rank has a core of its own there is no skew.
  Calibration roomy = skewed;
  roomy.cores = 2;
  roomy.world = 4;  // measured with 4 ranks on 2 cores
  EXPECT_DOUBLE_EQ(roomy.skew_share(2), 0.0);
  EXPECT_DOUBLE_EQ(roomy.skew_share(4), 1.0);
  // Negative shares in a file are bad input, naming the key.
  json j = skewed.to_json();
  j["layer_gather_skew"]["2"] = -1;
  try {
    Calibration::from_json(j, "cal.json");
    ADD_FAILURE() << "accepted a negative skew";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("cal.json: 'layer_gather_skew.2' must be a number >= 0"), std::string::npos)
        << e.what();
  }
  // Older files without them read as none.
  j.erase("layer_gather_skew");
  j.erase("step_collective_skew");
  auto old = Calibration::from_json(j, "old.json");
  EXPECT_TRUE(old.step_collective_skew.empty());
  EXPECT_TRUE(old.layer_gather_skew.empty());
}

TEST(SimulatorTime, GemmsOfUnmeasuredShapesAtTheGridsInterpolatedRate) {
  // A calibration times a grid of shapes whatever its model: a shape it did not
  // time is priced at the FLOP rate interpolated log-linearly between grid points.
  ComputeCosts costs;
  costs.gemm_fit = {1, 1};  // never used while the grid is there
  auto rate_at = [](int64_t m, int64_t k, int64_t n) { return 1e9 * std::log2(double(m)) + 1e8 * std::log2(double(k * n)); };
  for (int64_t m : kGemmGrid)
    for (int64_t k : kGemmGrid)
      for (int64_t n : kGemmGrid) costs.gemm_seconds[GemmShape{m, k, n, 1}] = GemmShape{m, k, n, 1}.flops() / rate_at(m, k, n);
  // Measured shapes are their own time.
  const GemmShape on_grid{64, 256, 1024, 1};
  EXPECT_DOUBLE_EQ(costs.gemm(on_grid), on_grid.flops() / rate_at(64, 256, 1024));
  // Halfway (in log) between two grid points of m: the geometric mean of their rates.
  const GemmShape mid{128, 256, 256, 1};
  const double expected_rate = std::sqrt(rate_at(64, 256, 256) * rate_at(256, 256, 256));
  EXPECT_NEAR(costs.gemm(mid), mid.flops() / expected_rate, 1e-9 * costs.gemm(mid));
  // A batch runs as that many GEMMs; beyond the grid the edge's rate holds.
  const GemmShape batched{128, 256, 256, 6};
  EXPECT_NEAR(costs.gemm(batched), 6 * costs.gemm(mid), 1e-12);
  const GemmShape big{2048, 2048, 32000, 1};
  EXPECT_NEAR(costs.gemm(big), big.flops() / rate_at(2048, 2048, 2048), 1e-9 * costs.gemm(big));
  // Without a grid (older files) the fit prices it.
  ComputeCosts old;
  old.gemm_fit = {1e-6, 1e10};
  EXPECT_DOUBLE_EQ(old.gemm(mid), 1e-6 + mid.flops() / 1e10);
}

TEST(SimulatorTime, OverlapHidesWhatTheEngineRunsBehindCompute) {
  // The engine's overlap_comm: stage 2-3 reductions and stage-3 prefetched
  // gathers hide behind forward/backward compute, stage 1-2 parameter gathers
  // behind the update; stage 0 hides nothing; never more than the compute.
  auto model = resolve_sim_model("llama2-7b");
  auto cluster = find_cluster("8xA100-80GB");
  auto shape = rank_shape(model.config, build_plan(model.config, 1), 0);
  for (int stage : {0, 1, 2, 3}) {
    SimLayout l = layout(8, 1, stage, torch::kBFloat16);
    l.micro_batch = 2;
    l.seq_len = 256;
    l.overlap_comm = false;
    const auto off = estimate_time(model.config, shape, l, cluster);
    l.overlap_comm = true;
    const auto on = estimate_time(model.config, shape, l, cluster);
    EXPECT_EQ(off.overlap_s, 0);
    EXPECT_DOUBLE_EQ(on.zero_comm_s, off.zero_comm_s) << "stage " << stage;
    EXPECT_DOUBLE_EQ(on.step_s, on.compute_s + on.tp_comm_s + on.zero_comm_s - on.overlap_s);
    EXPECT_LE(on.overlap_s, on.zero_comm_s);
    EXPECT_LE(on.overlap_s, on.compute_s);
    if (stage == 0) {
      EXPECT_EQ(on.overlap_s, 0);
    } else {
      EXPECT_GT(on.overlap_s, 0) << "stage " << stage;
    }
    // Stage 3 hides most of its traffic: all but the embeddings' collectives and the norm.
    if (stage == 3) {
      EXPECT_GT(on.overlap_s, 0.8 * on.zero_comm_s);
    }
  }
  // cpu-local: the collectives share the compute's cores, nothing is hidden.
  Calibration cal = two_rank_calibration();
  auto tiny = resolve_sim_model("preset:llama-tiny");
  SimLayout l = layout(2, 1, 3);
  l.persistence_threshold = 0;
  EXPECT_EQ(estimate_time(tiny.config, rank_shape(tiny.config, build_plan(tiny.config, 1), 0), l,
                          cpu_local_cluster(cal, "cpu"))
                .overlap_s,
            0);
}

TEST(SimulatorMemory, OverlapKeepsThePrefetchedLayerAndTheBucketInFlight) {
  // Stage 3 with overlap holds one more layer (prefetched) and, while a layer's
  // backward runs, the previous unit's gradient bucket; stage 1 holds the same.
  auto model = resolve_sim_model("llama2-7b");
  auto shape = rank_shape(model.config, build_plan(model.config, 1), 0);
  SimLayout l = layout(8, 1, 3, torch::kBFloat16);
  l.micro_batch = 2;
  l.seq_len = 256;
  l.overlap_comm = false;
  const auto off = estimate_memory(model.config, shape, l);
  l.overlap_comm = true;
  const auto on = estimate_memory(model.config, shape, l);
  const int64_t layer = 2 * (4 * 4096LL * 4096 + 3 * 4096LL * 11008 + 2 * 4096);  // one decoder layer, bf16 bytes
  EXPECT_GT(on.total - off.total, layer);      // the prefetched layer and the bucket in flight
  EXPECT_LT(on.total - off.total, 3 * layer);
  EXPECT_EQ(on.states.total(), off.states.total());
  l.zero_stage = 1;
  l.overlap_comm = false;
  const auto one_off = estimate_memory(model.config, shape, l);
  l.overlap_comm = true;
  EXPECT_EQ(estimate_memory(model.config, shape, l).forward_backward_peak, one_off.forward_backward_peak);
}

TEST(SimulatorMemory, PeakComponentsAreOneMomentsAndSumToThePeak) {
  // Every reported component of the forward/backward peak is non-negative and
  // they sum to it exactly (what the notes print), over stages, tp, overlap,
  // recomputation, LoRA and offload; at stages 0-2 nothing is gathered.
  auto model = resolve_sim_model("llama2-7b");
  int checked = 0;
  for (int tp : {1, 2})
    for (int stage = 0; stage <= 3; ++stage)
      for (bool overlap : {false, true})
        for (int variant = 0; variant < 3; ++variant) {
          SimLayout l = layout(8, tp, stage, torch::kBFloat16);
          l.micro_batch = 2;
          l.seq_len = 256;
          l.overlap_comm = overlap;
          if (variant == 1) l.activation_checkpointing = true;
          if (variant == 2 && stage >= 1) l.offload_optimizer = true;
          if (variant == 2 && stage == 3) l.offload_param = true;
          if (variant == 2 && stage == 0) l.lora_r = 16;
          for (int rank = 0; rank < tp; ++rank) {
            auto shape = rank_shape(model.config, layout_plan(model.config, l), rank);
            const MemoryEstimate m = estimate_memory(model.config, shape, l);
            const PeakMoment& at = m.at_peak;
            EXPECT_GE(at.activations, 0);
            EXPECT_GE(at.gathered, 0);
            EXPECT_GE(at.gradients, 0);
            EXPECT_EQ(m.states.total() + at.total(), m.forward_backward_peak)
                << "tp " << tp << " stage " << stage << " variant " << variant;
            if (stage < 3) {
              EXPECT_EQ(at.gathered, 0) << "stage " << stage << " gathers nothing";
            }
            EXPECT_LE(at.gathered, m.comm_buffers);  // a moment holds at most the largest amount
            ++checked;
          }
        }
  EXPECT_EQ(checked, 72);
}

TEST(SimulatorTime, MultiNodeDataParallelUsesTheNic) {
  auto model = resolve_sim_model("llama2-7b");
  auto one = simulate(model, find_cluster("8xH100-80GB"), layout(8, 8, 1, torch::kBFloat16));
  auto two = simulate(model, find_cluster("8xH100-80GB"), layout(16, 8, 1, torch::kBFloat16));
  ClusterOptions slow;
  slow.inter_node_GBps = 5;
  auto slower = simulate(model, find_cluster("8xH100-80GB", slow), layout(16, 8, 1, torch::kBFloat16));
  EXPECT_GT(two.time.zero_comm_s, one.time.zero_comm_s);
  EXPECT_GT(slower.time.zero_comm_s, 5 * two.time.zero_comm_s);
  EXPECT_DOUBLE_EQ(two.time.tp_comm_s, one.time.tp_comm_s);  // tp stays inside a node
}

TEST(SimulatorFits, SeventyBillionNeedsSharding) {
  auto model = resolve_sim_model("llama2-70b");
  auto cluster = find_cluster("8xA100-80GB");
  EXPECT_FALSE(simulate(model, cluster, layout(8, 1, 0, torch::kBFloat16)).fits);  // > 1 TB of states per GPU
  // ZeRO-3 + tp 8: one node of H200s holds 16 bytes per local element (140 GiB of model
  // states alone); two nodes fit (101 GiB), the states shrinking with every dp rank.
  EXPECT_FALSE(simulate(model, find_cluster("8xH200-141GB"), layout(8, 8, 3, torch::kBFloat16)).fits);
  EXPECT_TRUE(simulate(model, find_cluster("8xH200-141GB"), layout(16, 8, 3, torch::kBFloat16)).fits);
}

TEST(SimulatorCli, JsonHasTheContractFields) {
  auto r = test::run_cli(
      "simulate --model llama2-7b --cluster 8xA100-80GB --gpus 8 --tp 2 --zero 1 --micro-batch 1 --seq-len 2048 "
      "--json 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  json j = json::parse(r.output);
  EXPECT_TRUE(j.at("fits").is_boolean());
  for (const char* key : {"params", "grads", "master_weights", "optimizer_states", "activations", "comm_buffers",
                          "total"})
    EXPECT_TRUE(j.at("memory").at(key).is_number_integer()) << key;
  for (const char* key : {"compute_s", "tp_comm_s", "zero_comm_s", "overlap_s", "step_s"})
    EXPECT_TRUE(j.at("time").at(key).is_number()) << key;
  EXPECT_GT(j.at("tokens_per_s").get<double>(), 0);
  EXPECT_GT(j.at("mfu").get<double>(), 0);
  EXPECT_LT(j.at("mfu").get<double>(), 1);
  // tp 2 halves the sharded weights: params = 2 bytes x rank 0's shard.
  auto model = resolve_sim_model("llama2-7b");
  auto shape = rank_shape(model.config, build_plan(model.config, 2), 0);
  EXPECT_EQ(j["memory"]["params"].get<int64_t>(), 2 * ((shape.local_numel + 3) / 4 * 4));
}

TEST(SimulatorCli, SweepListsEveryLayoutSorted) {
  auto r = test::run_cli(
      "simulate --model llama2-7b --cluster 8xH100-80GB --gpus 8 --micro-batch 1 --seq-len 4096 --sweep --json "
      "2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto results = json::parse(r.output).at("results");
  ASSERT_EQ(results.size(), 4u * 4);  // tp 1, 2, 4, 8 x stages 0-3
  for (size_t i = 1; i < results.size(); ++i) {
    const auto &prev = results[i - 1], &cur = results[i];
    EXPECT_FALSE(!prev["fits"].get<bool>() && cur["fits"].get<bool>()) << "fitting layouts come first";
    if (prev["fits"] == cur["fits"]) {
      EXPECT_LE(cur["tokens_per_s"].get<double>(), prev["tokens_per_s"].get<double>());
    }
  }
}

TEST(SimulatorCli, CalibratesCpuLocalAndSimulatesOnIt) {
  const std::string file = ::testing::TempDir() + "/sim_calibration.json";
  // Four ranks, so that the group of 2 is measured around the model at tp 2 (the
  // layout tp 2 dp 2) and the group of 4 around tp 1.
  auto cal = test::run_cli("simulate --calibrate --nproc 4 --calibration " + file + " 2>&1");
  ASSERT_EQ(cal.exit_code, 0) << cal.output;
  auto c = Calibration::from_file(file);
  EXPECT_EQ(c.world, 4);
  EXPECT_GT(c.compute.gemm_peak_flops, 0);
  EXPECT_GE(c.concurrency_slowdown, 1.0);
  ASSERT_TRUE(c.optimizer_step.has_value());
  EXPECT_GT(c.optimizer_step->rate, 1.0);
  EXPECT_GE(c.overhead_ratio, 0.0);
  // The framework's cost per op or node, from the narrow copy's three windows: a
  // few microseconds on any CPU this runs on (7-16 us here), never zero.
  ASSERT_TRUE(c.dispatch_op_s.has_value());
  EXPECT_GT(*c.dispatch_op_s, 1e-7);
  EXPECT_LT(*c.dispatch_op_s, 1e-3);
  for (int g : {2, 4}) {
    EXPECT_EQ(c.all_reduce.count(g), 1u) << g;
    EXPECT_EQ(c.all_gather.count(g), 1u) << g;
    EXPECT_EQ(c.overhead_ratio_by_tp.count(g), 1u) << g;  // llama-tiny's real step at tp g
    EXPECT_EQ(c.step_collective_skew.count(g), 1u) << g;
    EXPECT_EQ(c.layer_gather_skew.count(g), 1u) << g;
    EXPECT_EQ(c.collective_wake_s.count(g), 1u) << g;
  }
  // The other compute dtype was timed too, on the same grid.
  ASSERT_EQ(c.other_dtypes.count("bf16"), 1u);
  EXPECT_GT(c.other_dtypes.at("bf16").gemm_peak_flops, 0);
  for (int64_t m : kGemmGrid) {
    const GemmShape square{m, m, m, 1};
    EXPECT_EQ(c.compute.gemm_seconds.count(square), 1u) << m;
    EXPECT_EQ(c.other_dtypes.at("bf16").gemm_seconds.count(square), 1u) << m;
  }
  EXPECT_DOUBLE_EQ(c.slowdown(1), 1.0);
  EXPECT_DOUBLE_EQ(c.slowdown(4), c.concurrency_slowdown);
  // Two ranks share the cores as ranks x threads / cores says; what was measured beyond
  // that (memory, caches) grows linearly with the ranks.
  const double oversub2 = std::max(1.0, 2.0 * c.threads_per_rank / c.cores),
               oversub4 = std::max(1.0, 4.0 * c.threads_per_rank / c.cores);
  EXPECT_DOUBLE_EQ(c.slowdown(2), oversub2 * (1 + (c.concurrency_slowdown / oversub4 - 1) / 3));
  // Every GEMM of a llama-tiny step at tp 1, 2 and 4 was measured at its exact shape.
  auto model = resolve_sim_model("preset:llama-tiny");
  for (int tp : {1, 2, 4}) {
    SimLayout l = layout(4, tp, 1);
    l.micro_batch = 2;
    l.seq_len = 64;
    for (int r = 0; r < tp; ++r)
      for (const auto& [shape, count] : step_gemms(model.config, rank_shape(model.config, build_plan(model.config, tp), r), l))
        EXPECT_EQ(c.compute.gemm_seconds.count(shape), 1u) << shape.m << "x" << shape.k << "x" << shape.n;
  }
  auto r = test::run_cli("simulate --model preset:llama-tiny --cluster cpu-local --calibration " + file +
                         " --gpus 2 --tp 2 --zero 1 --micro-batch 2 --seq-len 64 --dtype fp32 --json 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  json j = json::parse(r.output);
  EXPECT_GT(j["time"]["tp_comm_s"].get<double>(), 0);
  EXPECT_GT(j["time"]["step_s"].get<double>(), j["time"]["compute_s"].get<double>());
  // Compute scales with the calibrated slowdown: the same file at 3x contention.
  {
    json raw = json::parse(io::read_text_file(file));
    raw["concurrency_slowdown"] = 3 * c.concurrency_slowdown;
    const std::string slower = ::testing::TempDir() + "/sim_calibration_slower.json";
    io::write_text_file_atomic(slower, raw.dump());
    auto base_cluster = cpu_local_cluster(c, file), slow_cluster = cpu_local_cluster(Calibration::from_file(slower), slower);
    SimLayout l = layout(4, 2, 1);  // all four ranks: the slowdown is the calibrated one
    l.micro_batch = 2;
    l.seq_len = 64;
    auto a = simulate(model, base_cluster, l), b = simulate(model, slow_cluster, l);
    EXPECT_NEAR(b.time.compute_s, 3 * a.time.compute_s, 1e-12 * a.time.compute_s);
    EXPECT_DOUBLE_EQ(b.time.tp_comm_s, a.time.tp_comm_s);
  }
  // --measured: median, 10th percentile and fastest of the steps after the first.
  {
    const std::string metrics = ::testing::TempDir() + "/sim_measured.jsonl";
    std::string text;
    // The first (9 s) is left out; of the 11 others (sorted 20, 25, 30, ..., 70 ms) the
    // median is the 6th and the 10th percentile the 2nd.
    const double steps[] = {9.0, 0.050, 0.030, 0.040, 0.020, 0.060, 0.025, 0.070, 0.035, 0.045, 0.055, 0.065};
    // Host CPU: steps after the first ran 0.3 s busy with 0.1 s stolen (a quarter);
    // the first, left out, would say otherwise.
    for (double t : steps)
      text += json{{"step_time_s", t},
                   {"host_cpu", {{"busy_s", 0.3}, {"steal_s", t > 1 ? 5.0 : 0.1}}},
                   {"layout", {{"world", 2}, {"tp", 2}, {"zero_stage", 1}, {"dtype", "float32"}}},
                   {"memory", {{"ranks", json::array({{{"peak_allocated_bytes", 1000}}, {{"peak_allocated_bytes", 3000}}})}}}}
                  .dump() +
              "\n";
    io::write_text_file_atomic(metrics, text);
    auto m = test::run_cli("simulate --model preset:llama-tiny --cluster cpu-local --calibration " + file +
                           " --micro-batch 2 --seq-len 64 --measured " + metrics + " --json 2>/dev/null");
    ASSERT_EQ(m.exit_code, 0) << m.output;
    json jm = json::parse(m.output);
    EXPECT_DOUBLE_EQ(jm["measured"]["step_s"].get<double>(), 0.045);
    EXPECT_DOUBLE_EQ(jm["measured"]["p10_step_s"].get<double>(), 0.025);
    EXPECT_DOUBLE_EQ(jm["measured"]["fastest_step_s"].get<double>(), 0.020);
    EXPECT_EQ(jm["measured"]["peak_allocated_bytes"].get<int64_t>(), 3000);
    const double sim = jm["simulated"]["time"]["step_s"].get<double>();
    EXPECT_NEAR(jm["step_error"].get<double>(), sim / 0.045 - 1, 1e-12);
    EXPECT_NEAR(jm["p10_step_error"].get<double>(), sim / 0.025 - 1, 1e-12);
    // Simulated at the run's steal: every time / (1 - 0.25), against --host-steal 0.
    EXPECT_NEAR(jm["measured"]["host_steal_fraction"].get<double>(), 0.25, 1e-12);
    auto unstolen = test::run_cli("simulate --model preset:llama-tiny --cluster cpu-local --calibration " + file +
                                  " --micro-batch 2 --seq-len 64 --host-steal 0 --measured " + metrics +
                                  " --json 2>/dev/null");
    ASSERT_EQ(unstolen.exit_code, 0) << unstolen.output;
    const json ju = json::parse(unstolen.output);
    EXPECT_DOUBLE_EQ(ju["measured"]["host_steal_fraction"].get<double>(), 0.0);
    EXPECT_NEAR(sim, ju["simulated"]["time"]["step_s"].get<double>() / 0.75, 1e-12 * sim);
    EXPECT_NEAR(jm["simulated"]["time"]["zero_comm_s"].get<double>(),
                ju["simulated"]["time"]["zero_comm_s"].get<double>() / 0.75, 1e-12 * sim);
    // Rounds of the same layout (repeated --measured): the medians over the rounds of
    // each round's median, measured and simulated (each round at its own steal).
    std::string args;
    for (int round : {1, 2, 3}) {
      const std::string path = ::testing::TempDir() + "/sim_measured_round" + std::to_string(round) + ".jsonl";
      std::string round_text;
      for (double t : steps)
        round_text += json{{"step_time_s", t * round},
                           {"host_cpu", {{"busy_s", 0.3}, {"steal_s", round == 3 ? 0.0 : 0.1}}},
                           {"layout", {{"world", 2}, {"tp", 2}, {"zero_stage", 1}, {"dtype", "float32"}}},
                           {"memory", {{"ranks", json::array({{{"peak_allocated_bytes", 1000 * round}}})}}}}
                          .dump() +
                      "\n";
      io::write_text_file_atomic(path, round_text);
      args += " --measured " + path;
    }
    auto r3 = test::run_cli("simulate --model preset:llama-tiny --cluster cpu-local --calibration " + file +
                            " --micro-batch 2 --seq-len 64" + args + " --json 2>/dev/null");
    ASSERT_EQ(r3.exit_code, 0) << r3.output;
    const json j3 = json::parse(r3.output);
    ASSERT_EQ(j3["rounds"].size(), 3u);
    EXPECT_DOUBLE_EQ(j3["measured"]["step_s"].get<double>(), 0.090);  // of 0.045, 0.090, 0.135
    EXPECT_NEAR(j3["rounds"][2]["simulated_step_s"].get<double>(), ju["simulated"]["time"]["step_s"].get<double>(),
                1e-12 * sim);  // round 3 had no steal
    EXPECT_NEAR(j3["simulated_step_s"].get<double>(), sim, 1e-12 * sim);  // the median: rounds 1-2 at 25%
    EXPECT_NEAR(j3["step_error"].get<double>(), sim / 0.090 - 1, 1e-12);
    EXPECT_EQ(j3["measured"]["peak_allocated_bytes"].get<int64_t>(), 3000);
    // A round of another layout is bad input naming it.
    auto mixed = test::run_cli("simulate --model preset:llama-tiny --cluster cpu-local --calibration " + file +
                               " --micro-batch 2 --seq-len 64" + args + " --measured " + metrics + " 2>&1");
    EXPECT_EQ(mixed.exit_code, 0) << mixed.output;  // the same layout: a fourth round
    const std::string other = ::testing::TempDir() + "/sim_measured_other.jsonl";
    io::write_text_file_atomic(other, json{{"step_time_s", 0.05},
                                           {"layout", {{"world", 2}, {"tp", 1}, {"zero_stage", 1}, {"dtype", "float32"}}},
                                           {"memory", {{"ranks", json::array({{{"peak_allocated_bytes", 1}}})}}}}
                                              .dump() + "\n");
    auto bad_round = test::run_cli("simulate --model preset:llama-tiny --cluster cpu-local --calibration " + file +
                                   " --micro-batch 2 --seq-len 64" + args + " --measured " + other + " 2>&1");
    EXPECT_EQ(bad_round.exit_code, 2) << bad_round.output;
    EXPECT_NE(bad_round.output.find(other + ": its layout differs"), std::string::npos) << bad_round.output;
  }
  // A file that is not a calibration is bad input.
  io::write_text_file_atomic(file, "{\"world\": 2}");
  auto bad = test::run_cli("simulate --model preset:llama-tiny --cluster cpu-local --calibration " + file +
                           " --gpus 2 --tp 1 --zero 0 --seq-len 64");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("not an autotp calibration file"), std::string::npos) << bad.output;
}

TEST(HostCpu, StealFractionIsStolenOverWanted) {
  EXPECT_DOUBLE_EQ(steal_fraction({10, 2}, {13, 3}), 0.25);  // 3 s ran, 1 s taken
  EXPECT_DOUBLE_EQ(steal_fraction({10, 2}, {10, 2}), 0.0);   // nothing ran
  EXPECT_DOUBLE_EQ(steal_fraction({10, 2}, {14, 2}), 0.0);   // nothing taken
  const HostCpuTimes now = host_cpu_times();  // this test runs on Linux
  EXPECT_GT(now.busy_s, 0);
  EXPECT_GE(now.steal_s, 0);
}

TEST(SimulatorCli, BadInputExitsWithTwo) {
  const std::string base = "simulate --micro-batch 1 --seq-len 512 ";
  struct Bad {
    std::string args, message;
  };
  for (const Bad& b : {Bad{"--model llama-9000 --cluster 8xH100-80GB --gpus 8 --tp 1 --zero 0", "unknown model"},
                       Bad{"--model llama2-7b --cluster tpu-v9 --gpus 8 --tp 1 --zero 0", "unknown cluster"},
                       Bad{"--model llama2-7b --cluster 8xH100-80GB --gpus 8 --tp 3 --zero 0", "--tp 3 does not divide --gpus 8"},
                       Bad{"--model preset:llama-tiny --cluster 8xH100-80GB --gpus 8 --tp 8 --zero 0",
                           "larger than the model's 6 attention heads"},
                       Bad{"--model llama2-7b --cluster 8xH100-80GB --gpus 8 --tp 1 --zero 4", "not a ZeRO stage"},
                       Bad{"--model llama2-7b --cluster 8xH100-80GB --gpus 12 --tp 1 --zero 0", "multiple of its 8"},
                       Bad{"--model llama2-7b --cluster 8xH100-80GB --gpus 8 --tp 1 --zero 0 --host-steal 0.2",
                           "--host-steal applies to cpu-local only"},
                       Bad{"--model llama2-7b --cluster cpu-local --calibration /nonexistent.json --gpus 4 --tp 1 --zero 0",
                           "needs a calibration file"}}) {
    auto r = test::run_cli(base + b.args);
    EXPECT_EQ(r.exit_code, 2) << b.args << "\n" << r.output;
    EXPECT_NE(r.output.find(b.message), std::string::npos) << b.args << "\n" << r.output;
  }
}

// A simulate-only scenario file (scenarios/llama2_7b_8gpu.json's schema): the top level's layout keys, each
// variant's name, tp and zero_stage.
json simulate_only_scenario() {
  return {{"name", "small"},
          {"simulate", true},
          {"model", "llama2-7b"},
          {"cluster", "8xA100-80GB"},
          {"gpus", 8},
          {"seq_len", 512},
          {"micro_batch", 2},
          {"activation_checkpointing", true},
          {"assumptions", "none"},
          {"variants", json::array({{{"name", "zero3"}, {"tp", 1}, {"zero_stage", 3}},
                                    {{"name", "tp2-zero1"}, {"tp", 2}, {"zero_stage", 1}},
                                    {{"name", "zero3-offload"},
                                     {"tp", 1},
                                     {"zero_stage", 3},
                                     {"offload_optimizer", true},
                                     {"offload_param", true}}})}};
}

TEST(SimulatorCli, ScenarioFileVariantsAreTheSingleLayouts) {
  const std::string file = ::testing::TempDir() + "/sim_scenario.json";
  io::write_text_file_atomic(file, simulate_only_scenario().dump(2));
  auto r = test::run_cli("simulate --scenario " + file + " --json 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json j = json::parse(r.output);
  EXPECT_EQ(j["name"], "small");
  ASSERT_EQ(j["variants"].size(), 3u);
  const std::vector<std::pair<std::string, std::string>> variants = {
      {"zero3", "--tp 1 --zero 3"},
      {"tp2-zero1", "--tp 2 --zero 1"},
      {"zero3-offload", "--tp 1 --zero 3 --offload-optimizer --offload-param"}};
  for (size_t i = 0; i < variants.size(); ++i) {
    SCOPED_TRACE(variants[i].first);
    auto one = test::run_cli("simulate --model llama2-7b --cluster 8xA100-80GB --gpus 8 --seq-len 512 --micro-batch 2 "
                             "--recompute full " + variants[i].second + " --json 2>/dev/null");
    ASSERT_EQ(one.exit_code, 0) << one.output;
    json v = j["variants"][i];
    EXPECT_EQ(v["name"], variants[i].first);
    v.erase("name");
    EXPECT_EQ(v, json::parse(one.output));
  }
  const std::string md = ::testing::TempDir() + "/sim_scenario.md";
  r = test::run_cli("simulate --scenario " + file + " --markdown " + md);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string report = test::read_file(md);
  EXPECT_NE(report.find("# Simulated: small\n"), std::string::npos) << report;
  EXPECT_NE(report.find("- 8 GPUs, sequence length 512, micro-batch 2, gradient accumulation 1, bf16, AdamW\n"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("- assumptions: none\n"), std::string::npos) << report;
  EXPECT_NE(report.find("| tp2-zero1 | 2 | 4 | 1 |"), std::string::npos) << report;
  EXPECT_NE(report.find("| zero3-offload | 1 | 8 | 3 | - | optimizer + params |"), std::string::npos) << report;
  // Hand-written text after the marker survives a regeneration.
  const std::string kept =
      "<!-- Not generated: `autotp simulate --scenario --markdown` keeps what follows. -->\n\npasted rows\n";
  io::write_text_file_atomic(md, report + "\n" + kept);
  r = test::run_cli("simulate --scenario " + file + " --markdown " + md);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(test::read_file(md), report + "\n" + kept);
}

TEST(SimulatorCli, BadScenarioFileExitsWithTwoNamingFileAndKey) {
  const std::string file = ::testing::TempDir() + "/sim_bad_scenario.json";
  auto edited = [](const std::function<void(json&)>& edit) {
    json j = simulate_only_scenario();
    edit(j);
    return j;
  };
  const std::vector<std::pair<json, std::string>> bad = {
      {edited([](json& j) { j["gpu"] = 8; }), "unknown key 'gpu' (did you mean 'gpus'?)"},
      {edited([](json& j) { j["variants"][0]["zero_stag"] = 3; }), "unknown key 'variants[0].zero_stag'"},
      {edited([](json& j) { j["variants"][0]["zero_stag"] = 3; }), "(did you mean 'variants[0].zero_stage'?)"},
      {edited([](json& j) { j["variants"][1]["micro_batch"] = 4; }), "unknown key 'variants[1].micro_batch'"},
      {edited([](json& j) { j["seq_len"] = "512"; }), "seq_len must be an integer, got \"512\""},
      {edited([](json& j) { j["variants"][1]["tp"] = 2.5; }), "variants[1].tp must be an integer, got 2.5"},
      {edited([](json& j) { j["activation_checkpointing"] = 1; }), "activation_checkpointing is 1 (allowed:"},
      {edited([](json& j) { j["variants"][0]["zero_stage"] = 4; }), "variants[0].zero_stage is 4 (allowed: 0, 1, 2, 3)"},
      {edited([](json& j) { j["variants"][1]["tp"] = 3; }), "variants[1].tp is 3, which does not divide gpus 8"},
      {edited([](json& j) { j["variants"][1].erase("tp"); }), "variants[1].tp is missing"},
      {edited([](json& j) { j.erase("model"); }), "model is missing"},
      {edited([](json& j) { j["cluster"] = "8xA100"; }), "cluster is \"8xA100\""},
      {edited([](json& j) { j["simulate"] = false; }), "simulate is false"},
      {edited([](json& j) { j.erase("simulate"); }), "not a simulate-only scenario"},
      {edited([](json& j) { j["variants"][1]["offload_param"] = true; }), "--offload-param needs --offload-optimizer"},
      {edited([](json& j) { j["variants"][1]["offload_optimizer"] = "cpu"; }),
       "variants[1].offload_optimizer must be true or false"},
  };
  for (const auto& [j, message] : bad) {
    io::write_text_file_atomic(file, j.dump(2));
    auto r = test::run_cli("simulate --scenario " + file + " --json");
    EXPECT_EQ(r.exit_code, 2) << j.dump() << "\n" << r.output;
    EXPECT_NE(r.output.find("autotp: error: " + file + ": "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << message << "\n" << r.output;
  }
}


// Expert parallelism (docs/simulator.md, "Expert parallelism"): the model states of
// the two optimizers are the engine's formula on the layouts the engine builds from
// the placed plan, the experts' over edp; all-to-alls and expert GEMMs in closed form.

// The engine's two held sets (zero_optimizer.cpp: kDense over dp, kExperts over edp)
// rebuilt here from place_experts' plan: the rank's own entries, expert or not.
FlatLayout engine_flat(const ModelConfig& config, const TpPlan& placed, int tp_rank, int dp, int stage,
                       bool experts) {
  std::vector<const PlanEntry*> entries;
  for (const auto& e : placed.entries())
    if (!e.remote && !e.frozen && (e.expert >= 0) == experts) entries.push_back(&e);
  return zero_layout(entries, ZeroUnits{config.num_layers}, tp_rank, dp, stage,
                     ZeroConfig{}.stage3_param_persistence_threshold);
}

TEST(SimulatorExpertParallel, ModelStatesAreTheEnginesFormulaOverDpAndEdp) {
  struct Case {
    std::string model;
    int gpus, tp, ep;
  };
  // mixtral-tiny: 5 experts over ep 2 (3 + 2: rank 0 holds the most); qwen2-moe-tiny: 6 over
  // ep 4 (2, 2, 1, 1) at tp 2, with a shared expert and a dense layer that stay on every rank.
  for (const Case& c : {Case{"preset:mixtral-tiny", 4, 1, 2}, Case{"preset:qwen2-moe-tiny", 8, 2, 4}}) {
    auto model = resolve_sim_model(c.model);
    const ExpertPlacement rank0{c.ep, 0, model.config.num_experts};
    const TpPlan placed = place_experts(build_plan(model.config, c.tp), rank0);
    for (int stage = 0; stage <= 3; ++stage) {
      for (int tp_rank = 0; tp_rank < c.tp; ++tp_rank) {
        SimLayout l = layout(c.gpus, c.tp, stage, torch::kBFloat16);
        l.seq_len = 32;
        l.ep = c.ep;
        auto shape = rank_shape(model.config, layout_plan(model.config, l), tp_rank, c.ep);
        const MemoryEstimate m = estimate_memory(model.config, shape, l);
        const int dp = c.gpus / c.tp, edp = dp / c.ep;
        const OptimizerConfig adamw;
        const ModelStateBytes dense = ZeroOptimizer::analytic_bytes(
            engine_flat(model.config, placed, tp_rank, dp, stage, false), torch::kBFloat16, adamw, false);
        const ModelStateBytes experts = ZeroOptimizer::analytic_bytes(
            engine_flat(model.config, placed, tp_rank, edp, stage, true), torch::kBFloat16, adamw, false);
        EXPECT_EQ(m.expert_states.total(), experts.total()) << c.model << " stage " << stage;
        EXPECT_EQ(m.states.total(), dense.total() + experts.total()) << c.model << " stage " << stage;
        // The expert elements: this rank's shards of ep rank 0's experts, count(0) of E.
        int64_t all_experts = 0;
        for (const auto& e : placed.entries())
          if (e.expert >= 0) all_experts += e.spec.local_numel(tp_rank);
        EXPECT_EQ(m.expert_numel * model.config.num_experts, all_experts * rank0.count(0)) << c.model;
        // Stage 0 holds every element of them: 2 + 2 + 12 bytes each (bf16 AdamW), units padded to edp.
        if (stage == 0) {
          EXPECT_EQ(m.expert_states.total(), 16 * m.expert_numel) << c.model;
        }
      }
    }
  }
}

TEST(SimulatorExpertParallel, MixtralAtEpEightHoldsOneExpertPerLayer) {
  // 32 layers x one expert of 3 x 4096 x 14336: 5.64 B expert parameters per GPU, with
  // no expert-data-parallel replica (edp 1) all of them held at 16 bytes each (bf16 AdamW).
  auto model = resolve_sim_model("mixtral-8x7b");
  SimLayout l = layout(8, 1, 3, torch::kBFloat16);
  l.seq_len = 4096;
  l.ep = 8;
  l.activation_checkpointing = true;
  const SimResult r = simulate(model, find_cluster("8xH100-80GB"), l);
  EXPECT_EQ(r.memory.expert_numel, int64_t{32} * 3 * 4096 * 14336);
  EXPECT_NEAR(static_cast<double>(r.memory.expert_numel) / 5.6e9, 1.0, 0.02);
  EXPECT_EQ(r.memory.expert_states.total(), 16 * r.memory.expert_numel);
  EXPECT_FALSE(r.fits);  // 84 GiB of expert states alone
  // Two nodes: edp 2 partitions them at ZeRO-3 (8 bytes each, 42 GiB).
  l.gpus = 16;
  const SimResult two = simulate(model, find_cluster("8xH100-80GB"), l);
  EXPECT_EQ(two.memory.expert_states.total(), 8 * two.memory.expert_numel);
  EXPECT_TRUE(two.fits);
}

TEST(SimulatorExpertParallel, AllToAllVolumeAndTimeInClosedForm) {
  auto model = resolve_sim_model("preset:mixtral-tiny");  // 5 experts, top-2, hidden 72, 2 layers
  auto cluster = find_cluster("8xH100-80GB");
  const int64_t B = 2, T = 32, k = 2, H = 72, a = 2, L = 2;
  for (const bool recompute : {false, true}) {
    // ep 5 over 5 GPUs: one expert each, balanced routing sends 4/5 of the rank's k rows per token away.
    SimLayout l = layout(5, 1, 1, torch::kBFloat16);
    l.micro_batch = B;
    l.seq_len = T;
    l.gas = 3;
    l.ep = 5;
    l.activation_checkpointing = recompute;
    auto shape = rank_shape(model.config, layout_plan(model.config, l), 0, l.ep);
    EXPECT_DOUBLE_EQ(shape.expert_rows_share, 1.0);
    const ExpertExchanges x = expert_exchanges(model.config, shape, l);
    const int64_t passes = recompute ? 2 : 1;
    EXPECT_EQ(x.exchanges, L * (2 * passes + 2));  // 4 per sparse layer, 6 recomputed
    EXPECT_EQ(x.count_exchanges, L * passes);
    EXPECT_DOUBLE_EQ(x.bytes, static_cast<double>(B * T * k * H * a));
    EXPECT_DOUBLE_EQ(x.bytes_out, static_cast<double>(B * T * k * H * a) * 4 / 5);
    const TimeEstimate t = estimate_time(model.config, shape, l, cluster);
    const LinkSpec& nv = cluster.intra_node;
    const double exchange = nv.latency_s + 0.8 * B * T * k * H * a / nv.bus_bytes_per_s;
    const double counts = nv.latency_s + 0.8 * 8 * 5 * 1 / nv.bus_bytes_per_s;
    EXPECT_NEAR(t.ep_comm_s, 3 * (x.exchanges * exchange + x.count_exchanges * counts), 1e-12);
    EXPECT_EQ(t.ep_collectives, 3 * (x.exchanges + x.count_exchanges));
    EXPECT_DOUBLE_EQ(t.ep_bytes, 3.0 * x.exchanges * x.bytes_out);
    EXPECT_DOUBLE_EQ(t.step_s, t.compute_s + t.tp_comm_s + t.ep_comm_s + t.zero_comm_s - t.overlap_s);
  }
  // ep 2 over 5 experts: rank 0 holds 3 and receives 2 x 3 / 5 = 1.2 times its own rows.
  SimLayout l = layout(4, 1, 1, torch::kBFloat16);
  l.seq_len = T;
  l.ep = 2;
  auto shape = rank_shape(model.config, layout_plan(model.config, l), 0, l.ep);
  EXPECT_EQ(shape.local_experts, 3);
  EXPECT_DOUBLE_EQ(shape.expert_rows_share, 1.2);
  EXPECT_DOUBLE_EQ(expert_exchanges(model.config, shape, l).bytes, 1.2 * T * k * H * a);
}

TEST(SimulatorExpertParallel, ExpertGemmFlopsPerRankAreEpOnesUnderBalancedRouting) {
  // Qwen3-30B-A3B: at ep 8 a rank runs 16 of the 128 experts on 8 x (its tokens x 8 / 128)
  // rows each: the same expert FLOPs as ep 1's 128 experts on tokens x 8 / 128 rows each.
  auto model = resolve_sim_model("qwen3-30b-a3b");
  auto cluster = find_cluster("8xH100-80GB");
  SimLayout l = layout(8, 1, 1, torch::kBFloat16);
  l.seq_len = 4096;
  auto one = estimate_time(model.config, rank_shape(model.config, layout_plan(model.config, l), 0), l, cluster);
  l.ep = 8;
  auto shape = rank_shape(model.config, layout_plan(model.config, l), 0, 8);
  EXPECT_EQ(shape.local_experts, 16);
  auto eight = estimate_time(model.config, shape, l, cluster);
  EXPECT_DOUBLE_EQ(eight.executed_flops, one.executed_flops);
  EXPECT_DOUBLE_EQ(eight.model_flops, one.model_flops);
  // Expert elements per rank: 48 layers x 16 experts x 3 x 2048 x 768.
  EXPECT_EQ(shape.expert_numel, int64_t{48} * 16 * 3 * 2048 * 768);
}

TEST(SimulatorExpertParallel, ExpertZeroCollectivesRunOverEdp) {
  // ZeRO-1, mixtral-tiny (2 layers) over dp 4: the dense optimizer reduce-scatters and
  // gathers its 4 units (embeddings, 2 layers, head) over dp; the experts' 2 layer units
  // over edp 2 at ep 2, none at ep 4 (edp 1); + tokens, loss and the world's norm.
  auto model = resolve_sim_model("preset:mixtral-tiny");
  auto cluster = find_cluster("8xH100-80GB");
  for (const auto& [ep, expected] : std::vector<std::pair<int, int64_t>>{{1, 2 + 2 * 4 + 1},
                                                                         {2, 2 + 2 * 4 + 2 * 2 + 1},
                                                                         {4, 2 + 2 * 4 + 1}}) {
    SimLayout l = layout(4, 1, 1, torch::kBFloat16);
    l.seq_len = 32;
    l.ep = ep;
    auto shape = rank_shape(model.config, layout_plan(model.config, l), 0, ep);
    EXPECT_EQ(estimate_time(model.config, shape, l, cluster).zero_collectives, expected) << "ep " << ep;
  }
}

TEST(SimulatorCli, ExpertParallelJsonAndSweep) {
  auto r = test::run_cli(
      "simulate --model qwen3-30b-a3b --cluster 8xH100-80GB --gpus 8 --tp 1 --ep 8 --zero 3 --seq-len 4096 "
      "--recompute full --json 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  json j = json::parse(r.output);
  EXPECT_EQ(j["layout"]["ep"], 8);
  EXPECT_EQ(j["layout"]["edp"], 1);
  EXPECT_EQ(j["memory"]["expert_parameters"].get<int64_t>(), int64_t{48} * 16 * 3 * 2048 * 768);
  EXPECT_GT(j["memory"]["expert_model_states"].get<int64_t>(), 0);
  EXPECT_GT(j["time"]["ep_comm_s"].get<double>(), 0);
  EXPECT_NE(j["notes"].dump().find("balanced routing"), std::string::npos) << j["notes"].dump();
  // A sweep of a mixture tries every ep of each dp (at most the 5 experts): tp 1 (dp 4) ep 1, 2, 4;
  // tp 2 (dp 2) ep 1, 2; tp 4 ep 1; x ZeRO 0-3. --ep 2 keeps the tps whose dp it divides.
  const std::string sweep = "simulate --model preset:mixtral-tiny --cluster 8xH100-80GB --gpus 4 --seq-len 32 --sweep ";
  auto all = test::run_cli(sweep + "--json 2>/dev/null");
  ASSERT_EQ(all.exit_code, 0) << all.output;
  EXPECT_EQ(json::parse(all.output).at("results").size(), (3u + 2u + 1u) * 4);
  auto two = test::run_cli(sweep + "--ep 2 --json 2>/dev/null");
  ASSERT_EQ(two.exit_code, 0) << two.output;
  const auto results = json::parse(two.output).at("results");
  EXPECT_EQ(results.size(), 2u * 4);
  for (const auto& x : results) EXPECT_EQ(x["layout"]["ep"], 2);
  auto text = test::run_cli(sweep + "2>/dev/null");
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find(" ep "), std::string::npos) << text.output;
}

TEST(SimulatorCli, BadExpertParallelSizeExitsWithTwo) {
  const std::string base = "simulate --cluster 8xH100-80GB --seq-len 512 ";
  struct Bad {
    std::string args, message;
  };
  for (const Bad& b :
       {Bad{"--model llama2-7b --gpus 8 --tp 1 --zero 1 --ep 2", "--ep 2: LlamaForCausalLM is a dense model"},
        Bad{"--model llama2-7b --gpus 8 --tp 1 --zero 1 --ep 2", "(allowed: --ep 1)"},
        Bad{"--model mixtral-8x7b --gpus 8 --tp 1 --zero 1 --ep 3",
            "--ep 3 must divide --gpus / --tp = 8 and be at most the model's 8 experts (allowed: 1, 2, 4, 8)"},
        Bad{"--model mixtral-8x7b --gpus 8 --tp 2 --zero 1 --ep 8", "--ep 8 must divide --gpus / --tp = 4"},
        Bad{"--model mixtral-8x7b --gpus 16 --tp 1 --zero 1 --ep 16", "at most the model's 8 experts"},
        Bad{"--model mixtral-8x7b --gpus 8 --tp 1 --zero 1 --ep 0", "--ep 0 is not an expert-parallel size"},
        Bad{"--model mixtral-8x7b --gpus 8 --ep 3 --sweep", "--ep 3 must divide"},
        Bad{"--model mixtral-8x7b --gpus 8 --tp 1 --zero 1 --ep 2 --lora-r 8",
            "--ep 2 with --lora-r 8 is not supported"}}) {
    auto r = test::run_cli(base + b.args);
    EXPECT_EQ(r.exit_code, 2) << b.args << "\n" << r.output;
    EXPECT_NE(r.output.find(b.message), std::string::npos) << b.args << "\n" << r.output;
  }
}

TEST(SimulatorDispatch, CountsTopLevelOpsAndTheNodesTheBackwardRuns) {
  // A chain of n products: n ops forward (nothing they run inside counts), and the
  // backward's n MulBackward0 nodes plus one AccumulateGrad per leaf; summing the
  // shared factor's n gradients happens inside the nodes.
  torch::AutoGradMode on(true);
  auto x = torch::randn({16}).requires_grad_(true), w = torch::ones({16}).requires_grad_(true);
  constexpr int n = 7;
  auto chain = [&] {
    torch::Tensor y = x;
    for (int i = 0; i < n; ++i) y = y * w;
    return y;
  };
  const OpCounts forward = count_ops([&] { chain(); });
  EXPECT_EQ(forward.ops, n);
  EXPECT_EQ(forward.nodes, 0);
  const OpCounts both = count_ops([&] { chain().backward(torch::ones({16})); });
  EXPECT_EQ(both.nodes, n + 2);
  EXPECT_EQ(both.ops, n + 1);  // the chain and the backward's seed gradient (ones)
}

TEST(SimulatorDispatch, StepCountsFollowTheLayoutAndPriceEachOp) {
  auto model = resolve_sim_model("preset:llama-tiny");
  SimLayout off = layout(1, 1, 0);
  off.micro_batch = 2;
  off.seq_len = 64;
  const OpCounts plain = step_op_counts(model.config, off);
  EXPECT_GT(plain.ops, 20 * model.config.num_layers);
  EXPECT_GT(plain.nodes, 20 * model.config.num_layers);
  // Independent of the widths and of the sequence beyond the narrow copy's.
  SimLayout longer = off;
  longer.seq_len = 2048;
  EXPECT_EQ(step_op_counts(model.config, longer).ops, plain.ops);
  // Full recomputation runs every layer's forward again inside its checkpoint node.
  SimLayout full = off;
  full.activation_checkpointing = true;
  const OpCounts recomputed = step_op_counts(model.config, full);
  EXPECT_GT(recomputed.ops, plain.ops + 20 * model.config.num_layers);
  EXPECT_GE(recomputed.nodes, plain.nodes + model.config.num_layers);
  // More layers, more ops: the narrow copy keeps the depth.
  auto deeper = model.config;
  deeper.num_layers += 2;
  EXPECT_GT(step_op_counts(deeper, off).ops, plain.ops);

  // Priced: counted ops and nodes x the measured cost of one, the hand-listed ops then at their bytes only.
  Calibration cal = two_rank_calibration();
  cal.compute.elementwise_forward = cal.compute.elementwise_forward_grad = {1e-6, 1e10};
  cal.compute.elementwise_forward_backward = {3e-6, 3e9};
  Calibration measured = cal;
  measured.dispatch_op_s = 4e-6;
  auto shape = rank_shape(model.config, build_plan(model.config, 1), 0);
  auto before = estimate_time(model.config, shape, off, cpu_local_cluster(cal, "before"));
  auto after = estimate_time(model.config, shape, off, cpu_local_cluster(measured, "after"));
  EXPECT_DOUBLE_EQ(before.dispatch_s, 0);
  EXPECT_NEAR(after.dispatch_s, (plain.ops + plain.nodes) * 4e-6, 1e-12);
  EXPECT_LT(after.elementwise_s, before.elementwise_s);
  EXPECT_DOUBLE_EQ(after.gemm_s, before.gemm_s);
  EXPECT_NEAR(after.compute_s,
              after.gemm_s + after.elementwise_s + after.dispatch_s + after.overhead_s + after.optimizer_s, 1e-12);

  // In the file: round trip, absent in older files, bad values named.
  json j = measured.to_json();
  EXPECT_DOUBLE_EQ(Calibration::from_json(j, "cal.json").dispatch_op_s.value_or(0), 4e-6);
  j["dispatch_op_s"] = -1;
  EXPECT_NE(test::user_error_of([&] { Calibration::from_json(j, "cal.json"); })
                .find("cal.json: 'dispatch_op_s' must be seconds >= 0"),
            std::string::npos);
  j.erase("dispatch_op_s");
  EXPECT_FALSE(Calibration::from_json(j, "old.json").dispatch_op_s.has_value());
}

}  // namespace
}  // namespace autotp::sim
