// Whole-model tensor-parallel parity on real Gloo ranks: logits, loss and every
// (gathered) parameter gradient at tp = N equal the single-rank model's.
#include <gtest/gtest.h>

#include "autotp/model/presets.h"
#include "support/model_fixtures.h"
#include "support/multiprocess.h"
#include "support/reference_models.h"

namespace autotp {
namespace {

using nlohmann::json;

double relative_max_diff(const torch::Tensor& actual, const torch::Tensor& expected) {
  double scale = std::max(expected.abs().max().item<double>(), 1e-30);
  return (actual - expected).abs().max().item<double>() / scale;
}

struct StepResult {
  torch::Tensor loss, logits;
};

StepResult forward_backward(CausalLM& model, const torch::Tensor& ids, const torch::Tensor& targets) {
  auto losses = model.token_losses(ids, targets);
  auto count = (targets != -100).sum();
  auto loss = losses.sum() / count;
  // Mixture of experts: HF adds router_aux_loss_coef x the load-balancing loss.
  const double coef = model.config().router_aux_loss_enabled() ? model.config().router_aux_loss_coef : 0;
  const double aux = model.router_aux_loss(coef);
  loss.backward();
  model.sync_shared_grads();
  return {loss.detach() + coef * aux, model.full_logits(ids)};
}

AUTOTP_WORKER(model_parity) {
  const std::string dir = ctx.args.at(0);
  auto topo = ctx.topology(ctx.env.world_size);
  auto source = resolve_model(dir);
  TpPlanOptions options;
  options.tp_size = topo->tp_size();
  options.sequence_parallel = ctx.args.at(1).find("sp") != std::string::npos;
  options.overlap_comm = ctx.args.at(1).find("overlap") != std::string::npos;
  auto model = load_model(source, TpPlan::build(source.config, options), topo->tp(), torch::kFloat32, 0);
  Comm self;
  auto reference = load_model(source, TpPlan::build(source.config, {}), self, torch::kFloat32, 0);

  torch::manual_seed(11);
  // Sequence parallel: 11 tokens, uneven over 2, 3 and 4 ranks. "b1": one sequence
  // (tp_overlap_comm then cuts the sequence instead of the batch).
  const int64_t T = options.sequence_parallel ? 11 : 12;
  const int64_t B = ctx.args.at(1).find("b1") != std::string::npos ? 1 : 3;
  auto tokens = torch::randint(0, source.config.vocab_size, {B, T + 1}, torch::kLong);
  auto ids = tokens.narrow(1, 0, T).contiguous();
  auto targets = tokens.narrow(1, 1, T).clone();
  targets.index_put_({0, torch::indexing::Slice(0, 4)}, -100);  // a masked prompt

  auto sharded = forward_backward(*model, ids, targets);
  auto single = forward_backward(*reference, ids, targets);
  double loss_diff = std::abs(sharded.loss.item<double>() - single.loss.item<double>()) /
                     std::abs(single.loss.item<double>());
  WORKER_CHECK(loss_diff < 1e-6, "loss ", sharded.loss.item<double>(), " vs ", single.loss.item<double>());
  double logits_diff = relative_max_diff(sharded.logits, single.logits);
  WORKER_CHECK(logits_diff < 1e-5, "logits relative max diff ", logits_diff);
  double worst = 0;
  std::string worst_name;
  for (auto& p : model->parameters()) {
    auto& ref = reference->parameter(p.name());
    test::worker_expect_equal(model->gather(p), ref.tensor.detach(), "weights of " + p.name());
    double diff = relative_max_diff(model->gather_grad(p), ref.tensor.grad());
    if (diff > worst) worst = diff, worst_name = p.name();
  }
  WORKER_CHECK(worst < 1e-5, "gradient of ", worst_name, " differs: relative max diff ", worst);
  if (options.overlap_comm) {  // against the same layout without overlap: only summation orders differ
    TpPlanOptions plain = options;
    plain.overlap_comm = false;
    auto blocking = load_model(source, TpPlan::build(source.config, plain), topo->tp(), torch::kFloat32, 0);
    auto want = forward_backward(*blocking, ids, targets);
    WORKER_CHECK(relative_max_diff(sharded.logits, want.logits) < 1e-6, "overlapped logits vs blocking ",
                 relative_max_diff(sharded.logits, want.logits));
    double worst_overlap = 0;
    for (auto& p : model->parameters())
      worst_overlap = std::max(worst_overlap, relative_max_diff(model->gather_grad(p),
                                                                blocking->gather_grad(blocking->parameter(p.name()))));
    WORKER_CHECK(worst_overlap < 1e-6, "overlapped gradients vs blocking: relative max diff ", worst_overlap);
    if (topo->rank() == 0) std::fprintf(stderr, "overlap vs blocking: worst grad %.3g\n", worst_overlap);
  }
  if (topo->rank() == 0)
    std::fprintf(stderr, "tp %d %s: loss rel diff %.3g, logits %.3g, worst grad %.3g (%s)\n", topo->tp_size(),
                 ctx.args.at(1).c_str(), loss_diff, logits_diff, worst, worst_name.c_str());
}

struct ParityCase {
  std::string name;
  std::string preset;
  json overrides;
  int tp;
  bool sequence_parallel = false;
  bool overlap = false;  // tp_overlap_comm
  bool one_sequence = false;  // a batch of one sequence
};

// Test names in ctest listings show the case name, not raw bytes.
void PrintTo(const ParityCase& c, std::ostream* os) { *os << c.name; }

class TpModelParity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(TpModelParity, LogitsLossAndGradientsMatchSingleRank) {
  const auto& c = GetParam();
  json config = test::preset_config(c.preset, c.overrides);
  std::string dir =
      test::write_model_dir(test::make_temp_dir("parity"), config, test::reference_random_weights(config, 99));
  auto result = test::run_workers("model_parity", c.tp, {dir, std::string(c.sequence_parallel ? "sp" : "tp") + (c.overlap ? "+overlap" : "") +
                                                           (c.one_sequence ? "+b1" : "")});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

std::vector<ParityCase> parity_cases() {
  std::vector<ParityCase> cases;
  for (int tp : {2, 3, 4}) {
    cases.push_back({"llama_gqa_uneven_tp" + std::to_string(tp), "llama-tiny", json::object(), tp});
    cases.push_back({"llama_tied_tp" + std::to_string(tp), "llama-tiny-tied", json::object(), tp});
    cases.push_back({"gpt2_tp" + std::to_string(tp), "gpt2-tiny", json::object(), tp});
    // Per-head q/k norms: replicated, their gradients summed over tp.
    cases.push_back({"qwen3_head_norms_tp" + std::to_string(tp), "qwen3-tiny", json::object(), tp});
    // Fused qkv_proj / gate_up_proj, each part split on its own.
    cases.push_back({"phi3_fused_tp" + std::to_string(tp), "phi3-tiny", json::object(), tp});
    // Sandwich norms, softcapping, alternating windows; Gemma 3's q/k norms and local rope.
    cases.push_back({"gemma2_tp" + std::to_string(tp), "gemma2-tiny",
                     {{"attn_logit_softcapping", 0.05}, {"final_logit_softcapping", 0.5}}, tp});
    cases.push_back({"gemma3_tp" + std::to_string(tp), "gemma3-tiny", json::object(), tp});
    // Experts split like MLPs, the router replicated (its gradient summed over tp),
    // with the load-balancing loss.
    cases.push_back({"mixtral_tp" + std::to_string(tp), "mixtral-tiny", json::object(), tp});
    cases.push_back({"qwen2_moe_shared_expert_tp" + std::to_string(tp), "qwen2-moe-tiny", json::object(), tp});
    cases.push_back({"qwen3_moe_tp" + std::to_string(tp), "qwen3-moe-tiny", json::object(), tp});
  }
  // Sequence parallelism: norms and residuals on each rank's tokens (11: uneven),
  // norm and row-bias gradients summed over tp.
  for (int tp : {2, 3, 4}) cases.push_back({"llama_sp_tp" + std::to_string(tp), "llama-tiny", json::object(), tp, true});
  cases.push_back({"llama_tied_sp_tp3", "llama-tiny-tied", json::object(), 3, true});
  cases.push_back({"llama_biases_sp_tp3", "llama-tiny", {{"attention_bias", true}, {"mlp_bias", true}}, 3, true});
  cases.push_back({"qwen3_sp_tp4", "qwen3-tiny", json::object(), 4, true});
  cases.push_back({"phi3_sp_tp3", "phi3-tiny", json::object(), 3, true});
  cases.push_back({"gpt2_sp_tp3", "gpt2-tiny", json::object(), 3, true});
  // tp_overlap_comm: asynchronous tp collectives, the micro-batch split in two (3 sequences: uneven halves).
  cases.push_back({"llama_overlap_tp3", "llama-tiny", json::object(), 3, false, true});
  cases.push_back({"llama_sp_overlap_tp4", "llama-tiny", json::object(), 4, true, true});
  cases.push_back({"gpt2_overlap_tp2", "gpt2-tiny", json::object(), 2, false, true});
  cases.push_back({"phi3_sp_overlap_tp2", "phi3-tiny", json::object(), 2, true, true});
  cases.push_back({"qwen2_moe_sp_overlap_tp3", "qwen2-moe-tiny", json::object(), 3, true, true});
  cases.push_back({"gemma2_overlap_tp2", "gemma2-tiny", json::object(), 2, false, true});
  cases.push_back({"llama_overlap_one_sequence_tp3", "llama-tiny", json::object(), 3, false, true, true});
  cases.push_back({"mixtral_overlap_tp2", "mixtral-tiny", json::object(), 2, false, true});
  cases.push_back({"qwen3_sp_overlap_tp3", "qwen3-tiny", json::object(), 3, true, true});
  cases.push_back({"gemma3_sp_overlap_tp2", "gemma3-tiny", json::object(), 2, true, true});
  cases.push_back({"mistral_overlap_tp4", "mistral-tiny", json::object(), 4, false, true});
  cases.push_back({"qwen3_moe_overlap_one_sequence_tp2", "qwen3-moe-tiny", json::object(), 2, false, true, true});
  cases.push_back({"gpt2_sp_overlap_tp4", "gpt2-tiny", json::object(), 4, true, true});
  cases.push_back({"mixtral_sp_tp2", "mixtral-tiny", json::object(), 2, true});
  cases.push_back({"qwen2_moe_sp_tp3", "qwen2-moe-tiny", json::object(), 3, true});
  cases.push_back({"qwen3_moe_sp_tp4", "qwen3-moe-tiny", json::object(), 4, true});
  cases.push_back({"gemma2_sp_tp2", "gemma2-tiny", {{"attn_logit_softcapping", 0.05}, {"final_logit_softcapping", 0.5}},
                   2, true});
  cases.push_back({"qwen2_bias_tp3", "qwen2-tiny", json::object(), 3});
  cases.push_back({"llama_biases_tp3", "llama-tiny", {{"attention_bias", true}, {"mlp_bias", true}}, 3});
  cases.push_back({"mistral_tp4", "mistral-tiny", json::object(), 4});
  // Sliding windows shorter than the sequences, on every layer (Mistral) and on
  // some (Qwen2, layer_types), with kv heads split unevenly.
  cases.push_back({"mistral_sliding_window_tp3", "mistral-tiny", {{"sliding_window", 3}}, 3});
  cases.push_back({"qwen2_sliding_layers_tp3", "qwen2-tiny",
                   {{"use_sliding_window", true},
                    {"sliding_window", 4},
                    {"layer_types", {"full_attention", "sliding_attention"}}},
                   3});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Models, TpModelParity, ::testing::ValuesIn(parity_cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace autotp
