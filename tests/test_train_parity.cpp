// Training parity on real Gloo ranks: every tp x ZeRO-stage layout trains the
// same model as one rank with the whole global batch (tp 1, dp 1, stage 0):
// per-step losses and grad norms, and the final gathered weights.
#include <gtest/gtest.h>

#include "autotp/model/presets.h"
#include "autotp/runtime/trainer.h"
#include "support/model_fixtures.h"
#include "support/multiprocess.h"
#include "support/reference_models.h"

namespace autotp {
namespace {

using nlohmann::json;

constexpr int kSteps = 5;
constexpr int64_t kSeq = 12;
// Stage 3 keeps tensors below this many elements whole (the norms here); the matrices are partitioned.
constexpr int64_t kPersistenceThreshold = 1000;

json train_config(int tp, int stage, int64_t micro, int64_t gas, const std::string& optimizer,
                  const std::string& recompute = "off", bool sequence_parallel = false, bool overlap = false) {
  // eps 1e-6: Adam then damps elements whose gradient is at roundoff level instead of
  // turning their noise into full-size steps (which no two summation orders agree on).
  json params = {{"lr", 5e-4}, {"weight_decay", 0.1}};
  if (optimizer != "SGD") params["eps"] = 1e-6;
  return {{"train_micro_batch_size_per_gpu", micro},
          {"gradient_accumulation_steps", gas},
          {"optimizer", {{"type", optimizer}, {"params", params}}},
          {"gradient_clipping", 1.0},  // below the grad norms here, so clipping is active every step
          {"zero_optimization",
           {{"stage", stage},
            {"reduce_bucket_size", 4096},  // many buckets per step
            {"allgather_bucket_size", 2048},
            {"stage3_param_persistence_threshold", kPersistenceThreshold}}},
          {"tensor_parallel",
           {{"autotp_size", tp}, {"sequence_parallel", sequence_parallel}, {"tp_overlap_comm", overlap}}},
          {"activation_checkpointing", {{"mode", recompute}}}};
}

Batch rows_to_batch(const torch::Tensor& rows) {
  const int64_t seq = rows.size(1) - 1;
  auto labels = rows.narrow(1, 1, seq).clone();
  labels.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, 2)}, kIgnoreLabel);  // masked prompts
  return {rows.narrow(1, 0, seq).contiguous(), labels};
}

AUTOTP_WORKER(train_parity) {
  const std::string dir = ctx.args.at(0);
  const int tp = std::stoi(ctx.args.at(1)), stage = std::stoi(ctx.args.at(2));
  const int64_t gas = std::stoll(ctx.args.at(3));
  const std::string optimizer = ctx.args.at(4);
  const std::string recompute = ctx.args.at(5);
  // "sp", "overlap" (tp_overlap_comm), "m1" (one sequence per micro-batch), joined by '+'.
  const std::string layout = ctx.args.at(6);
  const bool sequence_parallel = layout.find("sp") != std::string::npos;
  const bool overlap = layout.find("overlap") != std::string::npos;
  const int64_t micro = layout.find("m1") != std::string::npos ? 1 : 2;
  auto topo = ctx.topology(tp);
  const int dp = topo->dp_size();
  const int64_t global = micro * gas * dp;

  auto source = resolve_model(dir);
  auto config =
      TrainConfig::from_json(train_config(tp, stage, micro, gas, optimizer, recompute, sequence_parallel, overlap),
                             "test");
  config.resolve_batch(topo->world_size());
  Trainer trainer(config, topo,
                  load_model(source, TpPlan::build(source.config, config.tensor_parallel.plan_options()), topo->tp(),
                             torch::kFloat32, 0),
                  nullptr, false);

  // The load-balancing loss of a mixture of experts is HF's per forward: the single
  // rank runs the same micro-batches (as accumulation steps) to compute the same one.
  const bool same_micro_batches = source.config.router_aux_loss_enabled();
  const int64_t ref_micro = same_micro_batches ? micro : global;
  auto single_topo = Topology::single();
  auto ref_config = TrainConfig::from_json(train_config(1, 0, ref_micro, global / ref_micro, optimizer), "reference");
  ref_config.resolve_batch(1);
  Trainer reference(ref_config, single_topo,
                    load_model(source, TpPlan::build(source.config, {}), single_topo->tp(), torch::kFloat32, 0),
                    nullptr, false);

  torch::manual_seed(5);
  const int64_t seq = sequence_parallel ? kSeq - 1 : kSeq;  // 11 splits unevenly over 2, 3 and 4 ranks
  auto data = torch::randint(0, source.config.vocab_size, {kSteps * global, seq + 1}, torch::kLong);
  for (int step = 0; step < kSteps; ++step) {
    auto rows = data.narrow(0, step * global, global);
    std::vector<Batch> mine;
    for (int64_t j = 0; j < gas; ++j)
      mine.push_back(rows_to_batch(rows.narrow(0, (j * dp + topo->dp_rank()) * micro, micro)));
    auto got = trainer.train_step(mine);
    std::vector<Batch> whole;
    for (int64_t j = 0; j < global / ref_micro; ++j)
      whole.push_back(rows_to_batch(rows.narrow(0, j * ref_micro, ref_micro)));
    auto want = reference.train_step(whole);
    if (same_micro_batches) {
      WORKER_CHECK(want.router_aux_loss > 0, "no load-balancing loss measured");
      WORKER_CHECK(std::abs(got.router_aux_loss - want.router_aux_loss) <= 1e-5 * want.router_aux_loss,
                   "step ", step + 1, ": load-balancing loss ", got.router_aux_loss, " vs ", want.router_aux_loss);
    }
    double loss_rel = std::abs(got.loss - want.loss) / want.loss;
    double norm_rel = std::abs(got.grad_norm - want.grad_norm) / want.grad_norm;
    WORKER_CHECK(loss_rel < 1e-5, "step ", step + 1, ": loss ", got.loss, " vs single rank ", want.loss);
    WORKER_CHECK(norm_rel < 1e-5, "step ", step + 1, ": grad norm ", got.grad_norm, " vs ", want.grad_norm);
    WORKER_CHECK(want.grad_norm > 1.0, "clipping must be active (norm ", want.grad_norm, ")");
    // Model states are exactly the formula of the layout.
    WORKER_CHECK(got.model_states.total() == got.model_states_analytic.total(), "model-state bytes ",
                 got.model_states.to_json().dump(), " vs formula ", got.model_states_analytic.to_json().dump());
    if (stage == 3)  // between steps no rank holds a whole parameter (but the persistent ones), only its partition
      for (auto& p : trainer.model().parameters()) {
        const bool persistent = c10::multiply_integers(p.spec().global_shape()) < kPersistenceThreshold;
        WORKER_CHECK(persistent || p.tensor.storage().nbytes() == 0, p.name(), " is still gathered after step ",
                     step + 1);
        WORKER_CHECK(!persistent || p.tensor.storage().nbytes() > 0, p.name(), " is persistent but released");
      }
    // The counting allocator sees at least the model states, and activations come and go within the step.
    WORKER_CHECK(got.allocated_bytes >= got.model_states.total(), "allocated ", got.allocated_bytes, " < model states ",
                 got.model_states.total());
    WORKER_CHECK(got.activations_peak_bytes > 0, "no activation peak measured");
    if (topo->rank() == 0)
      std::fprintf(stderr, "step %d: loss %.6f (rel diff %.2g), grad norm %.5f (rel diff %.2g)\n", step + 1,
                   got.loss, loss_rel, got.grad_norm, norm_rel);
  }
  trainer.optimizer().gather_all_params();  // stage 3: make the parameters whole to compare them
  double worst = 0;
  std::string worst_name;
  for (auto& p : trainer.model().parameters()) {
    auto full = trainer.model().gather(p);
    auto ref = reference.model().parameter(p.name()).tensor.detach();
    if (p.name().find("attn.c_attn.bias") != std::string::npos) {
      // The key bias has an exactly zero gradient (softmax ignores a shift shared by all keys),
      // so its Adam direction is pure roundoff in any implementation: compare q and v only.
      const int64_t h = source.config.hidden_size;
      full = torch::cat({full.narrow(0, 0, h), full.narrow(0, 2 * h, h)});
      ref = torch::cat({ref.narrow(0, 0, h), ref.narrow(0, 2 * h, h)});
    }
    // Adam turns gradients at roundoff level into full-size steps of either sign, so a
    // handful of elements may differ by ~lr; the tensor-wide relative error stays tiny.
    double diff = (full - ref).norm().item<double>() / ref.norm().item<double>();
    if (diff > worst) worst = diff, worst_name = p.name();
  }
  WORKER_CHECK(worst < 1e-5, "final weights of ", worst_name, " differ: relative L2 error ", worst);
  if (topo->rank() == 0) std::fprintf(stderr, "final weights: worst relative L2 error %.2g (%s)\n", worst, worst_name.c_str());
}

struct TrainCase {
  std::string preset;
  int world, tp, stage;
  int64_t gas;
  std::string optimizer = "AdamW";
  std::string recompute = "off";  // activation_checkpointing.mode
  json overrides = json::object();  // merged into the preset's config.json
  bool sequence_parallel = false;
  bool overlap = false;       // tp_overlap_comm
  bool one_sequence = false;  // micro-batches of one sequence (overlap cuts the sequence)
  std::string layout() const {
    return std::string(sequence_parallel ? "sp" : "tp") + (overlap ? "+overlap" : "") + (one_sequence ? "+m1" : "");
  }
  std::string name() const {
    std::string p = preset;
    for (auto& ch : p)
      if (ch == '-') ch = '_';
    return p + "_w" + std::to_string(world) + "_tp" + std::to_string(tp) + "_z" + std::to_string(stage) + "_gas" +
           std::to_string(gas) + "_" + optimizer + (recompute == "full" ? "_ckpt" : recompute == "selective" ? "_sel" : "") +
           (overrides.empty() ? "" : "_dropout") + (sequence_parallel ? "_sp" : "") + (overlap ? "_overlap" : "") +
           (one_sequence ? "_m1" : "");
  }
};
void PrintTo(const TrainCase& c, std::ostream* os) { *os << c.name(); }

class TrainParity : public ::testing::TestWithParam<TrainCase> {};

TEST_P(TrainParity, LossesAndWeightsMatchSingleRank) {
  const auto& c = GetParam();
  json config = test::preset_config(c.preset, c.overrides);
  std::string dir =
      test::write_model_dir(test::make_temp_dir("train"), config, test::reference_random_weights(config, 21));
  auto result = test::run_workers("train_parity", c.world,
                                  {dir, std::to_string(c.tp), std::to_string(c.stage), std::to_string(c.gas), c.optimizer,
                                   c.recompute, c.layout()});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

std::vector<TrainCase> train_cases() {
  std::vector<TrainCase> cases;
  for (int tp : {1, 2, 4})
    for (int stage : {0, 1, 2, 3}) cases.push_back({"llama-tiny", 4, tp, stage, tp == 2 ? 2 : 1});
  for (int stage : {0, 3}) cases.push_back({"llama-tiny", 3, 3, stage, 1});
  cases.push_back({"llama-tiny", 3, 1, 2, 2});
  cases.push_back({"gpt2-tiny", 4, 2, 1, 1});
  cases.push_back({"gpt2-tiny", 4, 2, 3, 2});
  cases.push_back({"llama-tiny-tied", 4, 4, 2, 1});
  // Qwen3's q/k norms (gradients summed over tp) at every stage, tp 2-4.
  cases.push_back({"qwen3-tiny", 4, 2, 0, 2});
  cases.push_back({"qwen3-tiny", 4, 2, 1, 1});
  cases.push_back({"qwen3-tiny", 4, 4, 2, 1});
  cases.push_back({"qwen3-tiny", 3, 3, 3, 1});
  // Phi-3's fused projections.
  cases.push_back({"phi3-tiny", 4, 4, 1, 1});
  cases.push_back({"phi3-tiny", 3, 3, 2, 1});
  cases.push_back({"phi3-tiny", 4, 2, 3, 2});
  // Gemma 2 (softcapping, sandwich norms) and Gemma 3 (q/k norms, local rope).
  cases.push_back({"gemma2-tiny", 4, 2, 1, 2});
  cases.push_back({"gemma3-tiny", 3, 3, 3, 1});
  // Mixtures of experts with their load-balancing loss: experts split, ZeRO partitions them.
  cases.push_back({"mixtral-tiny", 4, 2, 1, 2});
  cases.push_back({"mixtral-tiny", 3, 3, 3, 1, "AdamW", "full"});
  cases.push_back({"qwen2-moe-tiny", 4, 4, 2, 1});
  cases.push_back({"qwen3-moe-tiny", 4, 2, 0, 1});
  cases.push_back({"qwen3-moe-tiny", 4, 4, 3, 2});
  // Dropout: masks drawn from global coordinates, so every layout trains as one rank
  // does; recomputation draws the same masks again.
  const json gpt2_dropout = {{"attn_pdrop", 0.1}, {"resid_pdrop", 0.2}, {"embd_pdrop", 0.3}};
  cases.push_back({"gpt2-tiny", 4, 2, 1, 2, "AdamW", "off", gpt2_dropout});
  cases.push_back({"gpt2-tiny", 3, 3, 3, 1, "AdamW", "full", gpt2_dropout});
  cases.push_back({"llama-tiny", 4, 4, 2, 1, "AdamW", "selective", {{"attention_dropout", 0.2}}});
  cases.push_back({"phi3-tiny", 4, 2, 0, 1, "AdamW", "off", {{"attention_dropout", 0.1}, {"resid_pdrop", 0.2}}});
  cases.push_back({"llama-tiny", 2, 2, 0, 1, "SGD"});
  cases.push_back({"llama-tiny", 4, 1, 1, 1, "SGD"});
  cases.push_back({"llama-tiny", 4, 2, 1, 1, "Adam"});
  cases.push_back({"llama-tiny", 4, 2, 3, 2, "AdamW", "full"});
  cases.push_back({"gpt2-tiny", 2, 2, 0, 1, "AdamW", "full"});
  // Stage 3 with tied embeddings (the head gathers the embedding unit), selective recomputation.
  cases.push_back({"llama-tiny-tied", 4, 1, 3, 1});
  cases.push_back({"llama-tiny", 4, 2, 2, 1, "AdamW", "selective"});
  cases.push_back({"gpt2-tiny", 4, 1, 3, 2, "AdamW", "selective"});
  // Sequence parallelism (11 tokens: uneven shards at tp 2, 3 and 4): every ZeRO stage,
  // recompute, dropout in the sequence-parallel region (Phi-3's resid_pdrop).
  const json none = json::object();
  for (int stage : {0, 1, 2, 3}) cases.push_back({"llama-tiny", 4, 2, stage, stage == 2 ? 2 : 1, "AdamW", "off", none, true});
  cases.push_back({"llama-tiny", 3, 3, 3, 1, "AdamW", "full", none, true});
  cases.push_back({"llama-tiny", 4, 4, 1, 1, "AdamW", "selective", {{"attention_dropout", 0.2}}, true});
  cases.push_back({"llama-tiny-tied", 4, 4, 2, 1, "AdamW", "off", none, true});
  cases.push_back({"qwen3-tiny", 4, 4, 3, 2, "AdamW", "off", none, true});
  cases.push_back({"phi3-tiny", 3, 3, 2, 1, "AdamW", "off", {{"resid_pdrop", 0.2}}, true});
  cases.push_back({"gemma2-tiny", 4, 2, 1, 2, "AdamW", "full", none, true});
  cases.push_back({"gpt2-tiny", 4, 2, 3, 1, "AdamW", "off", {{"attn_pdrop", 0.1}, {"resid_pdrop", 0.2}, {"embd_pdrop", 0.3}}, true});
  cases.push_back({"mixtral-tiny", 3, 3, 1, 1, "AdamW", "off", none, true});
  cases.push_back({"qwen2-moe-tiny", 4, 2, 2, 1, "AdamW", "off", none, true});
  // tp_overlap_comm: halves of each micro-batch (of its sequence with one sequence),
  // dropout masks following the pieces, with and without sequence parallelism.
  const json phi3_dropout = {{"attention_dropout", 0.1}, {"resid_pdrop", 0.2}};
  cases.push_back({"llama-tiny", 4, 2, 1, 2, "AdamW", "off", none, false, true});
  cases.push_back({"phi3-tiny", 4, 4, 3, 1, "AdamW", "full", phi3_dropout, true, true});
  cases.push_back({"gpt2-tiny", 3, 3, 2, 2, "AdamW", "selective", {{"attn_pdrop", 0.1}, {"resid_pdrop", 0.2}},
                   false, true, true});
  cases.push_back({"mixtral-tiny", 4, 2, 0, 1, "AdamW", "off", none, true, true});
  cases.push_back({"gemma2-tiny", 4, 4, 1, 1, "AdamW", "off", none, false, true, true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Layouts, TrainParity, ::testing::ValuesIn(train_cases()),
                         [](const auto& info) { return info.param.name(); });

}  // namespace
}  // namespace autotp
