// Training numerics on real Gloo ranks: fp16 overflow handling (skipped step on
// every rank, weights untouched, loss scale halved, schedule held), bf16 tracking
// fp32, the tensor-parallel data-consistency check, and the reported gradient
// norm against a single-rank model's gradient computed directly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "autotp/base/error.h"
#include "autotp/model/presets.h"
#include "autotp/optim/lr_schedule.h"
#include "autotp/runtime/trainer.h"
#include "support/multiprocess.h"

namespace autotp {
namespace {

using nlohmann::json;

json base_config(int tp, int stage, int64_t micro, int64_t gas, double lr) {
  return {{"train_micro_batch_size_per_gpu", micro},
          {"gradient_accumulation_steps", gas},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", lr}, {"weight_decay", 0.01}}}}},
          {"gradient_clipping", 1.0},
          {"zero_optimization", {{"stage", stage}}},
          {"tensor_parallel", {{"autotp_size", tp}}}};
}

std::unique_ptr<CausalLM> preset_model(const std::string& preset, Topology& topo, torch::ScalarType dtype) {
  auto source = resolve_model("preset:" + preset);
  TpPlanOptions plan_options;
  plan_options.tp_size = topo.tp_size();
  return load_model(source, TpPlan::build(source.config, plan_options), topo.tp(), dtype, /*seed=*/7);
}

std::shared_ptr<Trainer> make_trainer(const json& config_json, const std::shared_ptr<Topology>& topo,
                                      const std::string& preset = "llama-tiny") {
  auto config = TrainConfig::from_json(config_json, "test");
  config.resolve_batch(topo->world_size());
  auto model = preset_model(preset, *topo, training_dtype(config));
  return std::make_shared<Trainer>(config, topo, std::move(model), nullptr, false);
}

// Rows of `len` tokens that follow a learnable rule (arithmetic progressions mod 50).
torch::Tensor pattern_rows(int64_t n, int64_t len, uint64_t seed) {
  torch::manual_seed(seed);
  auto start = torch::randint(0, 50, {n, 1}, torch::kLong);
  auto stride = torch::randint(1, 4, {n, 1}, torch::kLong);
  return (start + stride * torch::arange(len, torch::kLong).view({1, -1})) % 50;
}

Batch rows_to_batch(const torch::Tensor& rows, int64_t masked_prefix = 0) {
  const int64_t seq = rows.size(1) - 1;
  auto labels = rows.narrow(1, 1, seq).clone();
  if (masked_prefix > 0)
    labels.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, masked_prefix)}, kIgnoreLabel);
  return {rows.narrow(1, 0, seq).contiguous(), labels};
}

// Every parameter gathered over the tp group, in fp32.
std::vector<torch::Tensor> gathered_weights(Trainer& trainer) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> out;
  for (auto& p : trainer.model().parameters()) out.push_back(trainer.model().gather(p).to(torch::kFloat32).clone());
  return out;
}

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

// --- fp16 overflow ---------------------------------------------------------------

// Dynamic loss scaling (2^8, hysteresis 1) with step 2's gradients made infinite on
// rank 0 only (an autograd hook on one parameter): step 2 must be skipped on every
// rank, leave the weights untouched, halve the scale for step 3 and not advance the
// learning-rate schedule. args: the model dtype ("float16", or "float32" to drive
// the same loss-scaling path with fp32 weights).
AUTOTP_WORKER(fp16_overflow) {
  const torch::ScalarType dtype = parse_dtype(ctx.args.at(0));
  auto topo = ctx.topology(2);
  json config_json = base_config(2, 1, 2, 1, 1e-3);
  config_json["fp16"] = {{"enabled", true}, {"loss_scale", 0}, {"initial_scale_power", 8}, {"hysteresis", 1}};
  config_json["scheduler"] = {{"type", "WarmupLR"},
                              {"params",
                               {{"warmup_min_lr", 1e-4},
                                {"warmup_max_lr", 1e-3},
                                {"warmup_num_steps", 10},
                                {"warmup_type", "linear"}}}};
  auto config = TrainConfig::from_json(config_json, "test");
  config.resolve_batch(topo->world_size());
  Trainer trainer(config, topo, preset_model("llama-tiny", *topo, dtype), nullptr, false);
  const auto& schedule = trainer.config().scheduler;
  const double base_lr = trainer.config().optimizer.lr;

  constexpr int kOverflowStep = 2;
  int step = 0;
  auto& victim = trainer.model().parameter("model.layers.0.mlp.down_proj.weight");
  if (topo->rank() == 0)
    victim.tensor.register_hook([&step](torch::Tensor grad) {
      if (step != kOverflowStep) return grad;
      auto poisoned = grad.clone();
      poisoned.view({-1})[0] = std::numeric_limits<float>::infinity();
      return poisoned;
    });

  auto rows = pattern_rows(4 * 2, 17, 3);
  const double initial_scale = 256;
  const std::vector<double> expected_scale = {initial_scale, initial_scale, initial_scale / 2, initial_scale / 2};
  const std::vector<int64_t> applied_before = {0, 1, 1, 2};  // applied steps before each step
  for (step = 1; step <= 4; ++step) {
    auto before = gathered_weights(trainer);
    auto m = trainer.train_step({rows_to_batch(rows.narrow(0, (step - 1) * 2, 2))});
    auto after = gathered_weights(trainer);

    // Every rank reports the same verdict, although only rank 0 saw the infinity.
    auto flags = topo->world().all_gather(torch::tensor({m.skipped ? int64_t{1} : int64_t{0}}, torch::kLong), 0);
    const bool overflow = step == kOverflowStep;
    WORKER_CHECK(flags.min().item<int64_t>() == overflow && flags.max().item<int64_t>() == overflow, "step ", step,
                 ": skipped flags of the ranks ", flags, ", expected all ", overflow);
    WORKER_CHECK(m.loss_scale == expected_scale[step - 1], "step ", step, ": loss scale ", m.loss_scale,
                 ", expected ", expected_scale[step - 1]);
    // The schedule advances only on applied steps: step 3 uses the lr step 2 would have used.
    const double expected_lr = learning_rate(schedule, base_lr, applied_before[step - 1]);
    WORKER_CHECK(m.lr == expected_lr, "step ", step, ": lr ", m.lr, ", expected ", expected_lr);
    WORKER_CHECK(std::isfinite(m.loss), "step ", step, " loss ", m.loss);
    if (overflow) {
      WORKER_CHECK(!std::isfinite(m.grad_norm), "overflow step has a finite grad norm ", m.grad_norm);
      WORKER_CHECK(all_equal(before, after), "step ", step, " was skipped but the weights changed");
    } else {
      WORKER_CHECK(std::isfinite(m.grad_norm), "step ", step, " grad norm ", m.grad_norm);
      WORKER_CHECK(!all_equal(before, after), "step ", step, " was applied but no weight changed");
    }
    if (topo->rank() == 0)
      std::fprintf(stderr, "step %d: skipped %d loss_scale %g lr %.4g grad_norm %g loss %.5f\n", step,
                   m.skipped ? 1 : 0, m.loss_scale, m.lr, m.grad_norm, m.loss);
  }
  // The lr checks can tell a held schedule from one that advanced on the skipped step.
  WORKER_CHECK(learning_rate(schedule, base_lr, 1) != learning_rate(schedule, base_lr, 2) &&
                   learning_rate(schedule, base_lr, 2) != learning_rate(schedule, base_lr, 3),
               "the schedule does not distinguish steps 1..3");
}

// The error of a llama-tiny forward in `dtype` in this process (which, like the
// CLI, runs with the counting CPU allocator installed), or "" when it works.
std::string forward_error(torch::ScalarType dtype) {
  try {
    auto single = Topology::single();
    auto model = preset_model("llama-tiny", *single, dtype);
    auto ids = torch::zeros({1, 4}, torch::kLong);
    model->token_losses(ids, ids);
    return "";
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
}

TEST(TrainNumerics, Fp16ModelsTrainOnCpuWithDynamicLossScaling) {
  // LibTorch 2.11 has float16 kernels on CPU: the fp16 path runs end to end here.
  auto config = TrainConfig::from_json({{"train_micro_batch_size_per_gpu", 1}, {"fp16", {{"enabled", true}}}}, "test");
  EXPECT_EQ(training_dtype(config), torch::kFloat16);
  ASSERT_EQ(forward_error(torch::kFloat16), "");
  auto result = test::run_workers("fp16_overflow", 2, {"float16"});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

TEST(TrainNumerics, Fp16LossScalingSkipsAnOverflowStepWithFp32Weights) {
  auto result = test::run_workers("fp16_overflow", 2, {"float32"});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

// --- bf16 against fp32 ---------------------------------------------------------

AUTOTP_WORKER(bf16_tracks_fp32) {
  constexpr int kSteps = 20;
  constexpr int64_t kMicro = 4;
  json fp32_config = base_config(2, 1, kMicro, 1, 2e-3);
  json bf16_config = fp32_config;
  bf16_config["bf16"] = {{"enabled", true}};
  auto bf16 = make_trainer(bf16_config, ctx.topology(2));
  auto fp32 = make_trainer(fp32_config, ctx.topology(2));
  WORKER_CHECK(bf16->model().dtype() == torch::kBFloat16, "bf16 model dtype ", bf16->model().dtype());

  // Persistent bytes by hand: dp 1, so no padding; stage 1 mixed precision keeps bf16
  // parameters and gradients (no fp32 accumulator with one micro-batch per step),
  // fp32 master weights and Adam's two fp32 moments.
  int64_t n = 0;
  for (auto& p : bf16->model().parameters()) n += p.tensor.numel();

  auto rows = pattern_rows(kSteps * kMicro, 17, 11);
  double worst = 0, first_loss = 0, last_loss = 0;
  for (int step = 0; step < kSteps; ++step) {
    auto batch = rows_to_batch(rows.narrow(0, step * kMicro, kMicro));
    auto b = bf16->train_step({batch});
    auto f = fp32->train_step({batch});
    const double rel = std::abs(b.loss - f.loss) / f.loss;
    worst = std::max(worst, rel);
    WORKER_CHECK(rel < 2e-2, "step ", step + 1, ": bf16 loss ", b.loss, " vs fp32 ", f.loss, " (rel ", rel, ")");
    WORKER_CHECK(!b.skipped, "bf16 step ", step + 1, " skipped");
    const auto& s = b.model_states;
    const auto& a = b.model_states_analytic;
    WORKER_CHECK(s.params == a.params && s.grads == a.grads && s.master_weights == a.master_weights &&
                     s.optimizer_states == a.optimizer_states,
                 "bf16 model states ", s.to_json().dump(), " vs formula ", a.to_json().dump());
    // One micro-batch per step: gradients stay in bf16 (2 + 2 + 12 bytes per element at stage 0).
    WORKER_CHECK(s.params == 2 * n && s.grads == 2 * n && s.master_weights == 4 * n &&
                     s.optimizer_states == 8 * n,
                 "bf16 model states ", s.to_json().dump(), " for ", n, " local elements");
    if (step == 0) first_loss = f.loss;
    last_loss = f.loss;
    if (ctx.env.rank == 0)
      std::fprintf(stderr, "step %d: bf16 %.6f fp32 %.6f rel %.2e\n", step + 1, b.loss, f.loss, rel);
  }
  // The comparison means something only if training moved the loss.
  WORKER_CHECK(last_loss < 0.8 * first_loss, "fp32 loss went from ", first_loss, " to ", last_loss);
  if (ctx.env.rank == 0)
    std::fprintf(stderr, "bf16 vs fp32 over %d steps: worst relative loss difference %.3e (fp32 %.4f -> %.4f)\n",
                 kSteps, worst, first_loss, last_loss);
}

TEST(TrainNumerics, Bf16TracksFp32AndItsModelStatesMatchTheFormula) {
  ASSERT_EQ(forward_error(torch::kBFloat16), "");
  auto result = test::run_workers("bf16_tracks_fp32", 2);
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

// --- tensor-parallel data consistency --------------------------------------------

AUTOTP_WORKER(tp_data_mismatch) {
  auto topo = ctx.topology(2);
  auto trainer = make_trainer(base_config(2, 0, 2, 1, 1e-3), topo);
  auto rows = pattern_rows(2, 13, 5);
  const std::string expected = "data differs within tensor-parallel group at step 1";

  auto expect_rejected = [&](Batch batch, const std::string& what) {
    std::string message;
    try {
      trainer->train_step({batch});
    } catch (const std::exception& e) {
      message = e.what();
    }
    WORKER_CHECK(!message.empty(), what, ": the step was accepted on rank ", topo->rank());
    WORKER_CHECK(message.find(expected) != std::string::npos, what, ": unexpected error: ", message);
  };
  // Rank 1 differs in one input token.
  Batch input_differs = rows_to_batch(rows);
  if (topo->tp_rank() == 1) input_differs.input_ids[1][4] = (input_differs.input_ids[1][4].item<int64_t>() + 1) % 50;
  expect_rejected(input_differs, "one input token differs");
  // Rank 1 differs in one label.
  Batch label_differs = rows_to_batch(rows);
  if (topo->tp_rank() == 1) label_differs.labels[0][7] = kIgnoreLabel;
  expect_rejected(label_differs, "one label differs");
  // The rejected steps did not count: identical data trains as step 1.
  auto m = trainer->train_step({rows_to_batch(rows)});
  WORKER_CHECK(m.step == 1 && std::isfinite(m.loss), "step ", m.step, " loss ", m.loss);
}

TEST(TrainNumerics, DataDifferingWithinATpGroupIsRejectedOnEveryRank) {
  auto result = test::run_workers("tp_data_mismatch", 2);
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

// --- gradient norm ---------------------------------------------------------------

AUTOTP_WORKER(grad_norm_matches_single_rank) {
  const std::string preset = ctx.args.at(0);
  constexpr int64_t kMicro = 2, kGas = 2;
  auto topo = ctx.topology(2);
  const int dp = topo->dp_size();
  const int64_t global = kMicro * kGas * dp;
  auto trainer = make_trainer(base_config(2, 2, kMicro, kGas, 1e-3), topo, preset);

  torch::manual_seed(9);
  auto source = resolve_model("preset:" + preset);
  auto rows = torch::randint(0, source.config.vocab_size, {global, 17}, torch::kLong);
  std::vector<Batch> mine;
  for (int64_t j = 0; j < kGas; ++j)
    mine.push_back(rows_to_batch(rows.narrow(0, (j * dp + topo->dp_rank()) * kMicro, kMicro), 3));
  auto m = trainer->train_step(mine);

  // The single-rank model's gradient of the mean token loss of the whole global batch.
  auto single = Topology::single();
  auto reference = preset_model(preset, *single, torch::kFloat32);
  auto whole = rows_to_batch(rows, 3);
  const double tokens = (whole.labels != kIgnoreLabel).sum().item<double>();
  auto loss = reference->token_losses(whole.input_ids, whole.labels).sum() / tokens;
  loss.backward();
  double sumsq = 0;
  for (auto& p : reference->parameters()) sumsq += p.tensor.grad().to(torch::kFloat64).pow(2).sum().item<double>();
  const double want = std::sqrt(sumsq);
  const double rel = std::abs(m.grad_norm - want) / want;
  WORKER_CHECK(m.tokens == static_cast<int64_t>(tokens), "tokens ", m.tokens, " vs ", tokens);
  WORKER_CHECK(std::abs(m.loss - loss.item<double>()) < 1e-5 * loss.item<double>(), "loss ", m.loss, " vs ",
               loss.item<double>());
  WORKER_CHECK(want > trainer->config().gradient_clipping,
               "the norm must exceed the clipping threshold to show it is taken before clipping (", want, ")");
  WORKER_CHECK(rel < 1e-6, "grad norm ", m.grad_norm, " vs single-rank ", want, " (rel ", rel, ")");
  if (topo->rank() == 0)
    std::fprintf(stderr, "%s: grad norm %.9f, single rank %.9f, rel diff %.2e\n", preset.c_str(), m.grad_norm, want,
                 rel);
}

class TrainNumericsGradNorm : public ::testing::TestWithParam<std::string> {};

TEST_P(TrainNumericsGradNorm, Tp2Dp2Stage2EqualsSingleRankGradientNorm) {
  auto result = test::run_workers("grad_norm_matches_single_rank", 4, {GetParam()});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

INSTANTIATE_TEST_SUITE_P(Presets, TrainNumericsGradNorm, ::testing::Values("llama-tiny", "gpt2-tiny"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (auto& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

}  // namespace
}  // namespace autotp
