// GPU tests (ctest label "gpu"; tools/gpu-check runs them on a GPU machine).
// Each skips with a message where this process sees no GPU (cuda_unavailable_reason()).
//  - the same model and data trained 20 steps on CUDA and on CPU give the same
//    losses (fp32: 1e-5 relative, bf16: 1e-3), and GPU memory comes from the
//    caching allocator;
//  - two ranks sharing one GPU (Gloo moving CUDA tensors: NCCL takes one rank per
//    GPU) at tp 2 and at ZeRO-3 over dp 2 match one CPU rank with the whole batch;
//  - an NCCL process group of one rank reduces CUDA tensors while CPU tensors of
//    the same group go through Gloo;
//  - a checkpoint saved from GPU training resumes on the CPU and continues exactly
//    as the GPU run does.
#include <gtest/gtest.h>

#include <filesystem>

#include "autotp/base/cuda_runtime.h"
#include "autotp/comm/process_group.h"
#include "autotp/model/presets.h"
#include "autotp/checkpoint/checkpointing.h"
#include "autotp/base/device.h"
#include "autotp/runtime/trainer.h"
#include "support/model_fixtures.h"
#include "support/multiprocess.h"

namespace autotp {
namespace {

using nlohmann::json;

constexpr int64_t kSeq = 32;

#define SKIP_WITHOUT_GPU()                                                                 \
  if (autotp::cuda_device_count() == 0) GTEST_SKIP() << "no GPU here (" << autotp::cuda_unavailable_reason() << ")"

json train_config(int tp, int stage, int64_t micro, bool bf16) {
  return {{"train_micro_batch_size_per_gpu", micro},
          {"gradient_accumulation_steps", 1},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"weight_decay", 0.01}, {"eps", 1e-6}}}}},
          {"gradient_clipping", 1.0},
          {"bf16", {{"enabled", bf16}}},
          {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 4096}}},
          {"tensor_parallel", {{"autotp_size", tp}}}};
}

std::unique_ptr<Trainer> make_trainer(const json& j, std::shared_ptr<Topology> topo, torch::Device device) {
  auto config = TrainConfig::from_json(j, "test");
  config.resolve_batch(topo->world_size());
  auto source = resolve_model("preset:llama-tiny");
  TpPlanOptions plan_options;
  plan_options.tp_size = config.tensor_parallel.autotp_size;
  auto model = load_model(source, TpPlan::build(source.config, plan_options), topo->tp(), training_dtype(config), 7,
                          nullptr, device);
  return std::make_unique<Trainer>(config, topo, std::move(model), nullptr, false);
}

// `steps` global batches of `rows` sequences (inputs and labels), the same on every rank.
std::vector<Batch> make_data(int steps, int64_t rows) {
  torch::manual_seed(5);
  auto ids = torch::randint(0, 259, {steps * rows, kSeq + 1}, torch::kLong);
  std::vector<Batch> batches;
  for (int s = 0; s < steps; ++s) {
    auto r = ids.narrow(0, s * rows, rows);
    batches.push_back({r.narrow(1, 0, kSeq).contiguous(), r.narrow(1, 1, kSeq).contiguous()});
  }
  return batches;
}

Batch rows_of(const Batch& b, int64_t first, int64_t count) {
  return {b.input_ids.narrow(0, first, count), b.labels.narrow(0, first, count)};
}

double relative(double got, double want) { return std::abs(got - want) / std::abs(want); }

void expect_cuda_matches_cpu(bool bf16, double tolerance) {
  constexpr int kSteps = 20;
  const auto data = make_data(kSteps, 4);
  auto cpu = make_trainer(train_config(1, 1, 4, bf16), Topology::single(), torch::kCPU);
  auto gpu = make_trainer(train_config(1, 1, 4, bf16), Topology::single(), torch::Device(torch::kCUDA, 0));
  double worst = 0;
  for (int s = 0; s < kSteps; ++s) {
    auto want = cpu->train_step({data[s]});
    auto got = gpu->train_step({data[s]});
    worst = std::max(worst, relative(got.loss, want.loss));
    EXPECT_LE(relative(got.loss, want.loss), tolerance)
        << "step " << s + 1 << ": CUDA loss " << got.loss << " vs CPU " << want.loss;
    EXPECT_EQ(got.memory_device, "cuda");
    EXPECT_GE(got.allocated_bytes, got.model_states.total());
    EXPECT_GT(got.activations_peak_bytes, 0);
    EXPECT_GE(got.peak_reserved_bytes, got.peak_allocated_bytes);
    EXPECT_GT(got.step_time_s, 0);
  }
  std::fprintf(stderr, "%s: worst relative loss difference CUDA vs CPU over %d steps: %.3g\n",
               bf16 ? "bf16" : "fp32", kSteps, worst);
}

TEST(GpuTraining, Fp32OnCudaMatchesCpu) {
  SKIP_WITHOUT_GPU();
  expect_cuda_matches_cpu(false, 1e-5);
}

TEST(GpuTraining, Bf16OnCudaMatchesCpu) {
  SKIP_WITHOUT_GPU();
  expect_cuda_matches_cpu(true, 1e-3);
}

// args: tp, ZeRO stage. Two ranks on one GPU over Gloo, against one CPU rank.
AUTOTP_WORKER(gpu_shared_parity) {
  const int tp = std::stoi(ctx.args.at(0)), stage = std::stoi(ctx.args.at(1));
  const torch::Device device =
      bind_device(DeviceKind::kCuda, ctx.env.local_rank, ctx.env.local_world_size, /*shared=*/true);
  auto topo = ctx.topology(tp);
  const int dp = topo->dp_size();
  const int64_t micro = 4 / dp;
  auto trainer = make_trainer(train_config(tp, stage, micro, false), topo, device);
  auto reference = make_trainer(train_config(1, 0, 4, false), Topology::single(), torch::kCPU);
  const auto data = make_data(5, 4);
  for (int s = 0; s < 5; ++s) {
    auto got = trainer->train_step({rows_of(data[s], topo->dp_rank() * micro, micro)});
    auto want = reference->train_step({data[s]});
    WORKER_CHECK(relative(got.loss, want.loss) < 1e-5, "step ", s + 1, ": loss ", got.loss, " vs CPU ", want.loss);
    WORKER_CHECK(relative(got.grad_norm, want.grad_norm) < 1e-5, "step ", s + 1, ": grad norm ", got.grad_norm,
                 " vs CPU ", want.grad_norm);
  }
}

TEST(GpuTraining, TwoRanksSharingOneGpuOverGlooMatchOneCpuRank) {
  SKIP_WITHOUT_GPU();
  for (auto [tp, stage] : {std::pair{2, 1}, std::pair{1, 3}}) {
    auto result = test::run_workers("gpu_shared_parity", 2, {std::to_string(tp), std::to_string(stage)});
    ASSERT_EQ(result.exit_code, 0) << "tp " << tp << " stage " << stage << ": " << result.summary;
  }
}

TEST(GpuComm, NcclGroupReducesCudaTensorsAndGlooTheCpuOnes) {
  SKIP_WITHOUT_GPU();
  const auto path = std::filesystem::temp_directory_path() / ("autotp_nccl_" + std::to_string(getpid()));
  std::filesystem::remove(path);  // a store file left by an earlier run would hold its keys
  // 20 s: under ctest's 45 s, so a stuck rendezvous or collective reports itself.
  auto group = create_process_group(Backend::kNccl, create_file_store(path.string(), 1), 0, 1,
                                     std::chrono::seconds(20));
  auto on_gpu = torch::arange(6, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA));
  std::vector<at::Tensor> gpu_tensors{on_gpu};
  group->allreduce(gpu_tensors)->wait();
  auto on_cpu = torch::arange(6, torch::kFloat32);
  std::vector<at::Tensor> cpu_tensors{on_cpu};
  group->allreduce(cpu_tensors)->wait();
  EXPECT_TRUE(torch::equal(on_gpu.cpu(), torch::arange(6, torch::kFloat32)));
  EXPECT_TRUE(torch::equal(on_cpu, torch::arange(6, torch::kFloat32)));
  EXPECT_EQ(group->getBackend(c10::DeviceType::CUDA)->getBackendName(), "nccl");
  EXPECT_EQ(group->getBackend(c10::DeviceType::CPU)->getBackendName(), "gloo");
  std::filesystem::remove(path);
}

TEST(GpuCheckpoint, SavedOnGpuResumesOnCpu) {
  SKIP_WITHOUT_GPU();
  const auto data = make_data(4, 4);
  const json j = train_config(1, 1, 4, false);
  auto gpu = make_trainer(j, Topology::single(), torch::Device(torch::kCUDA, 0));
  for (int s = 0; s < 2; ++s) gpu->train_step({data[s]});
  const std::string root = test::make_temp_dir("gpu_ckpt");
  save_checkpoint(*gpu, root);
  auto cpu = make_trainer(j, Topology::single(), torch::kCPU);
  ASSERT_EQ(load_checkpoint(*cpu, root), 2);
  for (int s = 2; s < 4; ++s) {
    auto want = gpu->train_step({data[s]});
    auto got = cpu->train_step({data[s]});
    EXPECT_LE(relative(got.loss, want.loss), 1e-5) << "step " << s + 1 << ": CPU after resume " << got.loss
                                                    << " vs GPU " << want.loss;
  }
}

}  // namespace
}  // namespace autotp
