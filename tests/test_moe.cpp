// Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) on one rank: config
// parsing with the HF classes' defaults, the plan (experts split like MLPs, the
// router whole), gradients of the loss with the load-balancing term against
// autograd of the independent reference, and the closed forms MFU and the tp
// traffic model use. Multi-rank parity is in test_tp_model_parity and
// test_train_parity.
#include <gtest/gtest.h>

#include "autotp/arch/model_flops.h"
#include "autotp/base/error.h"
#include "autotp/model/presets.h"
#include "autotp/tp/tp_plan.h"
#include "autotp/tp/tp_traffic.h"
#include "support/checks.h"
#include "support/model_fixtures.h"
#include "support/reference_models.h"

namespace autotp {
namespace {

using nlohmann::json;

ModelConfig parse(const std::string& preset, const json& overrides = json::object()) {
  return ModelConfig::from_json(test::preset_config(preset, overrides), "config.json");
}

TEST(MoeConfig, ClassDefaultsAndSparseLayers) {
  // Keys absent: the config classes' defaults.
  json mixtral = test::preset_config("mixtral-tiny");
  for (const char* key : {"num_local_experts", "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef",
                          "rms_norm_eps", "rope_theta", "sliding_window", "max_position_embeddings"})
    mixtral.erase(key);
  const ModelConfig m = ModelConfig::from_json(mixtral, "config.json");
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.experts_per_token, 2);
  EXPECT_FALSE(m.output_router_logits);
  EXPECT_DOUBLE_EQ(m.router_aux_loss_coef, 0.001);
  EXPECT_FALSE(m.router_aux_loss_enabled());
  EXPECT_TRUE(m.norm_topk_prob);  // Mixtral always renormalises
  EXPECT_EQ(m.expert_intermediate_size, m.intermediate_size);
  EXPECT_DOUBLE_EQ(m.norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(m.rope_theta, 1e6);
  EXPECT_EQ(m.sliding_window_of(0), 0);  // MixtralConfig: no window unless set
  EXPECT_EQ(m.max_positions, 131072);     // 4096 * 32
  EXPECT_EQ(m.expert_module(1, 3, 1), "model.layers.1.block_sparse_moe.experts.3.w3");

  json qwen2 = test::preset_config("qwen2-moe-tiny");
  for (const char* key : {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                          "max_position_embeddings"})
    qwen2.erase(key);
  const ModelConfig q2 = ModelConfig::from_json(qwen2, "config.json");
  EXPECT_EQ(q2.num_experts, 60);
  EXPECT_EQ(q2.experts_per_token, 4);
  EXPECT_EQ(q2.expert_intermediate_size, 1408);
  EXPECT_EQ(q2.shared_expert_intermediate_size, 5632);
  EXPECT_FALSE(q2.norm_topk_prob);
  EXPECT_TRUE(q2.qkv_bias);
  EXPECT_EQ(q2.sparse_layers, std::vector<bool>({true, true, true}));
  EXPECT_EQ(q2.max_positions, 32768);
  EXPECT_EQ(parse("llama-tiny", {{"max_position_embeddings", nullptr}}).max_positions, 2048);
  EXPECT_EQ(q2.expert_module(0, 2, 2), "model.layers.0.mlp.experts.2.down_proj");

  // Sparse on every decoder_sparse_step-th layer that mlp_only_layers does not list.
  EXPECT_EQ(parse("qwen2-moe-tiny").sparse_layers, std::vector<bool>({true, false, true}));
  EXPECT_EQ(parse("qwen3-moe-tiny").sparse_layers, std::vector<bool>({false, true}));
  EXPECT_EQ(parse("qwen3-moe-tiny", {{"num_hidden_layers", 6}, {"decoder_sparse_step", 3}, {"mlp_only_layers", {5}}})
                .sparse_layers,
            std::vector<bool>({false, false, true, false, false, false}));
  EXPECT_EQ(parse("qwen3-moe-tiny", {{"num_experts", 0}}).sparse_layers, std::vector<bool>({false, false}));
  const ModelConfig q3 = parse("qwen3-moe-tiny");
  EXPECT_TRUE(q3.qk_norm);
  EXPECT_TRUE(q3.norm_topk_prob);
  EXPECT_TRUE(q3.router_aux_loss_enabled());
}

TEST(MoeConfig, BadValuesNameTheKey) {
  EXPECT_NE(test::user_error_of([] { parse("mixtral-tiny", {{"router_jitter_noise", 0.01}}); }).find("router_jitter_noise"),
            std::string::npos);
  const std::string top_k = test::user_error_of([] { parse("qwen3-moe-tiny", {{"num_experts_per_tok", 6}}); });
  EXPECT_NE(top_k.find("num_experts_per_tok 6 must be in 1..5"), std::string::npos) << top_k;
  EXPECT_NE(test::user_error_of([] { parse("qwen3-moe-tiny", {{"decoder_sparse_step", 0}}); }).find("decoder_sparse_step"),
            std::string::npos);
  // Which layers of a Qwen MoE slide differs between transformers releases: refused, not guessed.
  const std::string sliding =
      test::user_error_of([] { parse("qwen2-moe-tiny", {{"use_sliding_window", true}, {"sliding_window", 4}}); });
  EXPECT_NE(sliding.find("use_sliding_window is not supported for Qwen2MoeForCausalLM"), std::string::npos) << sliding;
  EXPECT_NE(test::user_error_of([] { parse("qwen2-moe-tiny", {{"head_dim", 32}}); }).find("head_dim 32"), std::string::npos);
  EXPECT_NE(test::user_error_of([] { parse("qwen2-moe-tiny", {{"qkv_bias", false}}); }).find("qkv_bias false"),
            std::string::npos);
}

TpPlan plan_of(const ModelConfig& config, int tp, std::vector<LayerSpec> specs = {},
               PlanRules rules = PlanRules::kAuto) {
  TpPlanOptions options;
  options.tp_size = tp;
  options.layer_specs = std::move(specs);
  options.rules = rules;
  return TpPlan::build(config, options);
}

TEST(MoePlan, ExpertsSplitLikeMlpsAndTheRouterStaysWhole) {
  const ModelConfig c = parse("qwen2-moe-tiny");
  for (PlanRules rules : {PlanRules::kStructural, PlanRules::kNames}) {
    const TpPlan plan = plan_of(c, 3, {}, rules);
    const auto& router = plan.entry("model.layers.0.mlp.gate.weight");
    EXPECT_EQ(router.role, TpRole::kReplicated);
    EXPECT_TRUE(router.partial_grad) << router.source;
    EXPECT_TRUE(plan.entry("model.layers.0.mlp.shared_expert_gate.weight").partial_grad);
    // Expert width 38 over 3 ranks: 13, 13, 12; the shared expert's 58: 20, 19, 19.
    const auto& up = plan.entry("model.layers.2.mlp.experts.5.up_proj.weight");
    EXPECT_EQ(up.role, TpRole::kColumn);
    EXPECT_EQ(up.spec.local_shape(2), std::vector<int64_t>({12, 64}));
    const auto& down = plan.entry("model.layers.0.mlp.shared_expert.down_proj.weight");
    EXPECT_EQ(down.role, TpRole::kRow);
    EXPECT_EQ(down.spec.local_shape(0), std::vector<int64_t>({64, 20}));
    // The dense layer 1 is an ordinary MLP.
    EXPECT_EQ(plan.entry("model.layers.1.mlp.gate_proj.weight").role, TpRole::kColumn);
    EXPECT_FALSE(plan.contains("model.layers.1.mlp.gate.weight"));
  }
  // One rank: nothing to sum.
  EXPECT_FALSE(plan_of(c, 1).entry("model.layers.0.mlp.gate.weight").partial_grad);
}

TEST(MoePlan, RouterSplitsAndHalfSplitExpertsAreRefused) {
  const ModelConfig c = parse("mixtral-tiny");
  const std::string router = test::user_error_of([&] {
    plan_of(c, 2, {LayerSpec{{R"(.*block_sparse_moe\.gate\.weight)"}, TpRole::kColumn, {}}});
  });
  EXPECT_NE(router.find("a router must be replicated"), std::string::npos) << router;
  const std::string half = test::user_error_of([&] {
    plan_of(c, 2, {LayerSpec{{R"(.*experts\.0\.w[123]\.weight)"}, TpRole::kReplicated, {}}});
  });
  EXPECT_NE(half.find("experts of 'model.layers.0.block_sparse_moe' are split in part"), std::string::npos) << half;
  // Every expert whole: the block is replicated and its router needs no sum.
  const TpPlan whole = plan_of(c, 2, {LayerSpec{{R"(.*experts\..*)"}, TpRole::kReplicated, {}}});
  EXPECT_FALSE(whole.entry("model.layers.0.block_sparse_moe.gate.weight").partial_grad);
  // HF's plan for Mixtral gathers the router's output (colwise_rep): the same as whole.
  json with_plan = test::preset_config("mixtral-tiny");
  with_plan["base_model_tp_plan"] = {{"layers.*.self_attn.q_proj", "colwise"},
                                     {"layers.*.self_attn.k_proj", "colwise"},
                                     {"layers.*.self_attn.v_proj", "colwise"},
                                     {"layers.*.self_attn.o_proj", "rowwise"},
                                     {"layers.*.block_sparse_moe.gate", "colwise_rep"},
                                     {"layers.*.block_sparse_moe.experts.*.w1", "colwise"},
                                     {"layers.*.block_sparse_moe.experts.*.w2", "rowwise"},
                                     {"layers.*.block_sparse_moe.experts.*.w3", "colwise"}};
  const TpPlan hf = plan_of(ModelConfig::from_json(with_plan, "config.json"), 2);
  const auto& gate = hf.entry("model.layers.1.block_sparse_moe.gate.weight");
  EXPECT_EQ(gate.role, TpRole::kReplicated);
  EXPECT_TRUE(gate.partial_grad);
  EXPECT_EQ(hf.entry("model.layers.1.block_sparse_moe.experts.4.w2.weight").role, TpRole::kRow);
  with_plan["base_model_tp_plan"]["layers.*.block_sparse_moe.gate"] = "ep_router";
  const std::string ep = test::user_error_of([&] { plan_of(ModelConfig::from_json(with_plan, "config.json"), 2); });
  EXPECT_NE(ep.find("no expert parallelism"), std::string::npos) << ep;
}

TEST(MoePlan, OneReductionPerSparseBlockAndRouterGradientsSummed) {
  const ModelConfig c = parse("qwen2-moe-tiny");
  const TpStepShape shape = tp_step_shape(plan_of(c, 2), c.num_layers);
  // Attention's o_proj and the block (experts + shared expert) or the dense MLP.
  EXPECT_EQ(shape.row_linears, std::vector<int64_t>({2, 2, 2}));
  // Two sparse layers, each with a router [6, 64] and a shared-expert gate [1, 64].
  EXPECT_EQ(shape.shared_numel, std::vector<int64_t>({6 * 64, 64, 6 * 64, 64}));
}

TEST(MoeFlops, ExpertsCountAtTheirShareOfTokens) {
  const ModelConfig dense = parse("qwen3-moe-tiny", {{"num_experts", 0}});
  const ModelConfig sparse = parse("qwen3-moe-tiny");
  // Layer 1's MLP (3 x 64 x 150) becomes a router (5 x 64) and 5 experts (3 x 64 x 42)
  // of which each token uses 3.
  const double difference = 6.0 * (5 * 64 + 3.0 / 5.0 * 5 * 3 * 64 * 42 - 3 * 64 * 150);
  EXPECT_NEAR(model_flops_per_token(sparse, 16) - model_flops_per_token(dense, 16), difference, 1e-6);
}

// The engine's gradient of mean cross-entropy + coef x load-balancing loss, on one
// rank, equals autograd through the reference's forward (both terms).
class MoeGradients : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeGradients, LossAndLoadBalancingGradientsMatchTheReference) {
  json config = test::preset_config(GetParam());
  auto weights = test::reference_random_weights(config, 77);
  const std::string dir = test::write_model_dir(test::make_temp_dir("moe"), config, weights);
  Comm self;
  auto source = resolve_model(dir);
  auto model = load_model(source, TpPlan::build(source.config, {}), self, torch::kFloat32, 0);
  const double coef = source.config.router_aux_loss_coef;

  torch::manual_seed(3);
  auto ids = torch::randint(0, source.config.vocab_size, {2, 12}, torch::kLong);
  auto losses = model->token_losses(ids.narrow(1, 0, 11), ids.narrow(1, 1, 11));
  const double aux = model->router_aux_loss(coef);
  losses.mean().backward();

  std::map<std::string, torch::Tensor> leaves;
  for (auto& [name, w] : weights) leaves[name] = w.clone().requires_grad_(true);
  auto ref = test::reference_moe_forward(config, leaves, ids.narrow(1, 0, 11));
  auto ref_ce = torch::nn::functional::cross_entropy(ref.logits.reshape({-1, ref.logits.size(-1)}),
                                                     ids.narrow(1, 1, 11).reshape({-1}));
  (ref_ce + coef * ref.aux_loss).backward();
  EXPECT_NEAR(aux, ref.aux_loss.item<double>(), 1e-6 * ref.aux_loss.item<double>());
  // E x sum_e f_e P_e is top-k for a perfectly balanced router; routers favour their top choices.
  EXPECT_GT(aux, static_cast<double>(source.config.experts_per_token));

  double worst = 0;
  std::string worst_name;
  for (auto& p : model->parameters()) {
    // An expert no token chose: HF skips it (no gradient), autotp runs it on no tokens (zero).
    const auto expected = leaves.at(p.name()).grad().defined() ? leaves.at(p.name()).grad()
                                                                 : torch::zeros_like(p.tensor);
    const double scale = std::max(expected.abs().max().item<double>(), 1e-12);
    const double diff = (p.tensor.grad() - expected).abs().max().item<double>() / scale;
    if (diff > worst) worst = diff, worst_name = p.name();
  }
  EXPECT_LT(worst, 1e-5) << worst_name;
  std::fprintf(stderr, "%s: load-balancing loss %.6f (reference %.6f), worst gradient %.2g (%s)\n",
               GetParam().c_str(), aux, ref.aux_loss.item<double>(), worst, worst_name.c_str());
  // The load-balancing term reaches the router: without it the router's gradient differs.
  const std::string router = source.config.moe_module(source.config.is_sparse(0) ? 0 : 1) + ".gate.weight";
  for (auto& [name, leaf] : leaves) leaf.mutable_grad() = torch::Tensor();
  auto again = test::reference_moe_forward(config, leaves, ids.narrow(1, 0, 11));
  torch::nn::functional::cross_entropy(again.logits.reshape({-1, again.logits.size(-1)}),
                                       ids.narrow(1, 1, 11).reshape({-1}))
      .backward();
  const auto with_aux = model->parameter(router).tensor.grad();
  EXPECT_GT((with_aux - leaves.at(router).grad()).abs().max().item<double>(), 1e-4 * with_aux.abs().max().item<double>());
}

INSTANTIATE_TEST_SUITE_P(Presets, MoeGradients,
                         ::testing::Values("mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (auto& ch : name)
                             if (ch == '-') ch = '_';
                           return name;
                         });

}  // namespace
}  // namespace autotp
