// Single-rank model correctness: the engine's logits against the independent
// reference implementation of the HF definitions, and HF-directory loading rules.
#include <gtest/gtest.h>

#include "autotp/io/safetensors.h"
#include "autotp/model/attention.h"
#include "autotp/model/presets.h"
#include "autotp/base/error.h"
#include "support/model_fixtures.h"
#include "support/reference_models.h"

namespace autotp {
namespace {

using nlohmann::json;

struct LogitsCase {
  std::string name;
  std::string preset;
  json overrides;
};

// Test names in ctest listings show the case name, not raw bytes.
void PrintTo(const LogitsCase& c, std::ostream* os) { *os << c.name; }

std::unique_ptr<CausalLM> load_single(const std::string& dir, Comm& self) {
  auto source = resolve_model(dir);
  return load_model(source, TpPlan::build(source.config, {}), self, torch::kFloat32, 0);
}

class ModelLogits : public ::testing::TestWithParam<LogitsCase> {};

TEST_P(ModelLogits, MatchesReferenceImplementation) {
  const auto& c = GetParam();
  json config = test::preset_config(c.preset, c.overrides);
  auto weights = test::reference_random_weights(config, 1234);
  std::string dir = test::write_model_dir(test::make_temp_dir("logits"), config, weights);
  Comm self;
  auto model = load_single(dir, self);
  torch::manual_seed(7);
  auto ids = torch::randint(0, config["vocab_size"].get<int64_t>(), {2, 11}, torch::kLong);
  auto expected = test::reference_logits(config, weights, ids);
  torch::NoGradGuard no_grad;
  auto actual = model->full_logits(ids);
  ASSERT_EQ(actual.sizes(), expected.sizes());
  double max_diff = (actual - expected).abs().max().item<double>();
  EXPECT_LT(max_diff, 1e-5) << c.name;
  // The loss path (vocab-parallel cross-entropy on one rank) equals the reference loss.
  auto losses = model->token_losses(ids.narrow(1, 0, 10), ids.narrow(1, 1, 10));
  double loss = losses.mean().item<double>();
  double ref_loss = test::reference_next_token_loss(expected, ids).item<double>();
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss)) << c.name;
}

INSTANTIATE_TEST_SUITE_P(
    Architectures, ModelLogits,
    ::testing::Values(LogitsCase{"llama_gqa_uneven", "llama-tiny", json::object()},
                      LogitsCase{"llama_tied", "llama-tiny-tied", json::object()},
                      LogitsCase{"llama_attention_and_mlp_bias", "llama-tiny",
                                 {{"attention_bias", true}, {"mlp_bias", true}}},
                      LogitsCase{"llama_explicit_head_dim", "llama-tiny", {{"head_dim", 24}}},
                      LogitsCase{"llama_rope_theta", "llama-tiny", {{"rope_theta", 500000.0}}},
                      // rope_scaling types, with contexts short enough that positions 0-10 feel them.
                      LogitsCase{"llama3_rope", "llama-tiny",
                                 {{"rope_scaling",
                                   {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                                    {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 16}}}}},
                      LogitsCase{"linear_rope", "llama-tiny", {{"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}}}},
                      LogitsCase{"dynamic_rope_beyond_context", "llama-tiny",
                                 {{"max_position_embeddings", 8},
                                  {"rope_scaling", {{"rope_type", "dynamic"}, {"factor", 2.0}}}}},
                      LogitsCase{"yarn_rope", "llama-tiny",
                                 {{"rope_theta", 100.0},
                                  {"rope_scaling",
                                   {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 64},
                                    {"beta_fast", 32}, {"beta_slow", 1}, {"attention_factor", nullptr}}}}},
                      LogitsCase{"yarn_rope_mscale", "qwen2-tiny",
                                 {{"rope_scaling",
                                   {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 16},
                                    {"mscale", 0.707}, {"mscale_all_dim", 1.0}, {"truncate", false}}}}},
                      LogitsCase{"mistral", "mistral-tiny", json::object()},
                      LogitsCase{"mistral_sliding_window", "mistral-tiny", {{"sliding_window", 4}}},
                      LogitsCase{"qwen2_sliding_from_layer_1", "qwen2-tiny",
                                 {{"use_sliding_window", true}, {"sliding_window", 3}, {"max_window_layers", 1}}},
                      LogitsCase{"qwen2_layer_types", "qwen2-tiny",
                                 {{"use_sliding_window", true},
                                  {"sliding_window", 5},
                                  {"layer_types", {"sliding_attention", "full_attention"}}}},
                      LogitsCase{"qwen2_qkv_bias", "qwen2-tiny", json::object()},
                      LogitsCase{"qwen3_head_norms", "qwen3-tiny", json::object()},
                      LogitsCase{"phi3_fused", "phi3-tiny", json::object()},
                      // longrope past its pre-training context (long factors) and within it (short ones).
                      LogitsCase{"phi3_longrope_long", "phi3-tiny",
                                 {{"original_max_position_embeddings", 4},
                                  {"rope_scaling",
                                   {{"type", "longrope"},
                                    {"short_factor", {1.0, 1.1, 1.3, 1.7, 2.0, 2.5, 3.0, 4.0}},
                                    {"long_factor", {1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0}}}}}},
                      LogitsCase{"phi3_longrope_short", "phi3-tiny",
                                 {{"original_max_position_embeddings", 64},
                                  {"max_position_embeddings", 256},
                                  {"rope_scaling",
                                   {{"rope_type", "longrope"},
                                    {"short_factor", {1.0, 1.1, 1.3, 1.7, 2.0, 2.5, 3.0, 4.0}},
                                    {"long_factor", {1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0}}}}}},
                      LogitsCase{"phi3_sliding_window", "phi3-tiny", {{"sliding_window", 3}}},
                      LogitsCase{"qwen3_biases_sliding", "qwen3-tiny",
                                 {{"attention_bias", true},
                                  {"use_sliding_window", true},
                                  {"sliding_window", 3},
                                  {"max_window_layers", 1}}},
                      LogitsCase{"gemma2", "gemma2-tiny", json::object()},
                      // Caps small enough to bend the scores and the logits.
                      LogitsCase{"gemma2_tight_softcaps", "gemma2-tiny",
                                 {{"attn_logit_softcapping", 0.05}, {"final_logit_softcapping", 0.5}}},
                      LogitsCase{"gemma3", "gemma3-tiny", json::object()},
                      LogitsCase{"gemma3_linear_rope_on_global_layers", "gemma3-tiny",
                                 {{"rope_scaling", {{"rope_type", "linear"}, {"factor", 4.0}}}}},
                      LogitsCase{"mixtral", "mixtral-tiny", json::object()},
                      LogitsCase{"mixtral_sliding_window", "mixtral-tiny", {{"sliding_window", 4}}},
                      LogitsCase{"qwen2_moe_shared_expert", "qwen2-moe-tiny", json::object()},
                      LogitsCase{"qwen3_moe", "qwen3-moe-tiny", json::object()},
                      LogitsCase{"qwen3_moe_unnormalised_top_k", "qwen3-moe-tiny",
                                 {{"norm_topk_prob", false}, {"decoder_sparse_step", 1}}},
                      LogitsCase{"gpt2", "gpt2-tiny", json::object()}),
    [](const auto& info) { return info.param.name; });

// The fused attention (scaled_dot_product_attention) against the eager form, values
// and the gradients of q, k and v, for the kv layouts the engine produces: one kv
// head per query head, grouped (GQA), and an uneven tp shard's mapping; with and
// without a sliding window.
TEST(Attention, FusedMatchesEagerValuesAndGradients) {
  const std::vector<std::pair<int64_t, std::vector<int64_t>>> layouts = {
      {4, {0, 1, 2, 3}}, {2, {0, 0, 1, 1}}, {2, {0, 1, 1}}};
  for (int64_t window : {0, 2, 5})  // (a window of 1 reads only itself: q and k get no gradient)
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const double tolerance = dtype == torch::kFloat32 ? 1e-5 : 2e-2;
    for (const auto& [kv_heads, kv_index] : layouts) {
      torch::manual_seed(3);
      const int64_t B = 2, H = static_cast<int64_t>(kv_index.size()), T = 37, D = 16;
      auto q = torch::randn({B, H, T, D}).to(dtype).requires_grad_(true);
      auto k = torch::randn({B, kv_heads, T, D}).to(dtype).requires_grad_(true);
      auto v = torch::randn({B, kv_heads, T, D}).to(dtype).requires_grad_(true);
      auto weights = torch::randn({B, T, H * D});
      auto fused = causal_attention(q, k, v, kv_index, 0.25, window);
      auto fused_grads = torch::autograd::grad({(fused.to(torch::kFloat32) * weights).sum()}, {q, k, v});
      auto eager = causal_attention_eager(q, k, v, kv_index, 0.25, window);
      auto eager_grads = torch::autograd::grad({(eager.to(torch::kFloat32) * weights).sum()}, {q, k, v});
      auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
        return (a.to(torch::kFloat32) - b.to(torch::kFloat32)).abs().max().item<double>() /
               b.to(torch::kFloat32).abs().max().item<double>();
      };
      const std::string where = std::string(dtype == torch::kFloat32 ? "fp32" : "bf16") + " kv heads " +
                                std::to_string(kv_heads) + " for " + std::to_string(H) + " query heads, window " +
                                std::to_string(window);
      EXPECT_EQ(fused.sizes(), eager.sizes()) << where;
      EXPECT_LT(rel(fused, eager), tolerance) << where;
      for (int i = 0; i < 3; ++i) EXPECT_LT(rel(fused_grads[i], eager_grads[i]), tolerance) << where << " grad " << i;
    }
  }
}

// Dropout acts only while a context is set, draws from its key, and the same
// context draws the same masks (what the layout-parity cases rely on).
TEST(Dropout, AppliesOnlyInTrainingAndFollowsItsKey) {
  for (const auto& [preset, overrides] :
       {std::pair<std::string, json>{"gpt2-tiny", {{"attn_pdrop", 0.1}, {"resid_pdrop", 0.2}, {"embd_pdrop", 0.3}}},
        std::pair<std::string, json>{"llama-tiny", {{"attention_dropout", 0.2}}},
        std::pair<std::string, json>{"phi3-tiny", {{"resid_pdrop", 0.2}}}}) {
    json config = test::preset_config(preset, overrides);
    std::string dir = test::write_model_dir(test::make_temp_dir("dropout"), config,
                                            test::reference_random_weights(config, 5));
    Comm self;
    auto model = load_single(dir, self);
    torch::NoGradGuard no_grad;
    torch::manual_seed(3);
    auto ids = torch::randint(0, 259, {2, 9}, torch::kLong);
    auto eval = model->full_logits(ids);
    model->set_dropout(DropoutContext{42, 3, 0, 2});
    auto train = model->full_logits(ids), again = model->full_logits(ids);
    model->set_dropout(DropoutContext{42, 4, 0, 2});
    auto next_step = model->full_logits(ids);
    model->set_dropout(std::nullopt);
    EXPECT_GT((train - eval).abs().max().item<double>(), 1e-3) << preset;
    EXPECT_TRUE(torch::equal(train, again)) << preset;
    EXPECT_GT((next_step - train).abs().max().item<double>(), 1e-3) << preset;
    EXPECT_TRUE(torch::equal(model->full_logits(ids), eval)) << preset;
  }
}

// bf16 through Gemma's soft-capping (eager attention with capped scores, capped
// logits) and (1 + w) norms: the bf16 model stays within bf16 rounding of the
// fp32 reference, with caps tight enough to bend both.
TEST(ModelLogits, Bf16GemmaSoftcapsStayCloseToFp32) {
  for (const std::string preset : {"gemma2-tiny", "gemma3-tiny"}) {
    json config = test::preset_config(preset, {{"attn_logit_softcapping", 0.05}, {"final_logit_softcapping", 0.5}});
    auto weights = test::reference_random_weights(config, 4321);
    std::string dir = test::write_model_dir(test::make_temp_dir("bf16"), config, weights);
    Comm self;
    auto source = resolve_model(dir);
    auto model = load_model(source, TpPlan::build(source.config, {}), self, torch::kBFloat16, 0);
    torch::manual_seed(9);
    auto ids = torch::randint(0, config["vocab_size"].get<int64_t>(), {2, 11}, torch::kLong);
    auto expected = test::reference_logits(config, weights, ids);
    torch::NoGradGuard no_grad;
    auto actual = model->full_logits(ids).to(torch::kFloat32);
    EXPECT_LE(actual.abs().max().item<double>(), 0.5 + 1e-6) << preset;  // capped
    const double worst = (actual - expected).abs().max().item<double>();
    EXPECT_LT(worst, 0.02) << preset;  // bf16 keeps 8 bits: ~4e-3 of 0.5 per rounding
    EXPECT_GT(worst, 0) << preset;     // it did run in bf16
    // The loss path in bf16 as well.
    auto losses = model->token_losses(ids.narrow(1, 0, 10), ids.narrow(1, 1, 10));
    const double ref_loss = test::reference_next_token_loss(expected, ids).item<double>();
    EXPECT_NEAR(losses.mean().item<double>(), ref_loss, 1e-2 * ref_loss) << preset;
  }
}

TEST(ModelLoading, AcceptsCheckpointWithoutBasePrefixAndSkipsBuffers) {
  json config = test::preset_config("gpt2-tiny");
  auto weights = test::reference_random_weights(config, 5);
  std::map<std::string, torch::Tensor> stripped;
  for (auto& [name, t] : weights) stripped[name.substr(std::string("transformer.").size())] = t;
  stripped["h.0.attn.bias"] = torch::ones({1, 1, 4, 4});
  stripped["h.0.attn.masked_bias"] = torch::tensor(-1e4);
  std::string dir = test::write_model_dir(test::make_temp_dir("noprefix"), config, stripped);
  Comm self;
  auto model = load_single(dir, self);
  auto ids = torch::randint(0, 259, {1, 9}, torch::kLong);
  auto expected = test::reference_logits(config, weights, ids);
  EXPECT_LT((model->full_logits(ids) - expected).abs().max().item<double>(), 1e-5);
}

TEST(ModelLoading, MissingAndUnexpectedTensorsAreNamed) {
  json config = test::preset_config("llama-tiny");
  auto weights = test::reference_random_weights(config, 5);
  weights.erase("model.layers.1.mlp.up_proj.weight");
  weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch::ones({8});  // skipped like HF
  std::string dir = test::write_model_dir(test::make_temp_dir("missing"), config, weights);
  Comm self;
  try {
    load_single(dir, self);
    FAIL() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << e.what();
  }
  weights = test::reference_random_weights(config, 5);
  weights["model.layers.0.extra.weight"] = torch::ones({3});
  dir = test::write_model_dir(test::make_temp_dir("unexpected"), config, weights);
  try {
    load_single(dir, self);
    FAIL() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.extra.weight"), std::string::npos) << e.what();
  }
}

TEST(ModelLoading, ShapeMismatchIsAnError) {
  json config = test::preset_config("llama-tiny");
  auto weights = test::reference_random_weights(config, 5);
  weights["model.norm.weight"] = torch::ones({95});
  std::string dir = test::write_model_dir(test::make_temp_dir("shape"), config, weights);
  Comm self;
  EXPECT_THROW(load_single(dir, self), UserError);
}

// Which layers get a window, as MistralConfig and Qwen2Config decide (4096 when the key is absent).
TEST(ModelConfigParsing, SlidingWindowsPerLayer) {
  auto windows = [](const std::string& preset, json overrides) {
    json config = test::preset_config(preset, overrides);
    // (preset_config merges like a JSON merge patch: a null there would delete the key)
    if (overrides.contains("sliding_window") && overrides["sliding_window"] == "absent") config.erase("sliding_window");
    if (overrides.contains("sliding_window") && overrides["sliding_window"] == "null") config["sliding_window"] = nullptr;
    return ModelConfig::from_json(config, "config.json").layer_sliding_window;
  };
  using W = std::vector<int64_t>;
  EXPECT_EQ(windows("mistral-tiny", {{"sliding_window", 7}}), (W{7, 7}));
  EXPECT_EQ(windows("mistral-tiny", {{"sliding_window", "absent"}}), (W{4096, 4096}));
  EXPECT_EQ(windows("mistral-tiny", {{"sliding_window", "null"}}), W{});
  EXPECT_EQ(windows("qwen2-tiny", {{"sliding_window", 7}}), W{});  // use_sliding_window false
  EXPECT_EQ(windows("qwen2-tiny", {{"use_sliding_window", true}, {"sliding_window", 7}, {"max_window_layers", 1}}),
            (W{0, 7}));
  EXPECT_EQ(windows("qwen2-tiny", {{"use_sliding_window", true}, {"sliding_window", "absent"}, {"max_window_layers", 0}}),
            (W{4096, 4096}));
  EXPECT_EQ(windows("llama-tiny", {{"sliding_window", 7}}), W{});  // HF's Llama has none
  // Phi3Config: none unless set, then every layer (Phi-3-mini-4k sets 2047).
  EXPECT_EQ(windows("phi3-tiny", json::object()), W{});
  EXPECT_EQ(windows("phi3-tiny", {{"sliding_window", 2047}}), (W{2047, 2047}));
  // Qwen3 as Qwen2.
  EXPECT_EQ(windows("qwen3-tiny", {{"use_sliding_window", true}, {"sliding_window", 5}, {"max_window_layers", 1}}),
            (W{0, 5}));
  EXPECT_THROW(windows("mistral-tiny", {{"sliding_window", 0}}), UserError);
  EXPECT_THROW(windows("qwen2-tiny", {{"use_sliding_window", true}, {"sliding_window", 7}, {"layer_types", {"full_attention"}}}),
               UserError);
}

TEST(ModelConfigParsing, RejectsWhatIsNotImplemented) {
  auto parse = [](json overrides, const std::string& preset = "llama-tiny") {
    return ModelConfig::from_json(test::preset_config(preset, overrides), "config.json");
  };
  EXPECT_THROW(parse({{"rope_scaling", {{"type", "longrope"}, {"factor", 2.0}}}}), UserError);  // no factor lists
  EXPECT_THROW(parse({{"rope_scaling",
                       {{"type", "longrope"}, {"short_factor", {1.0, 1.0}}, {"long_factor", {1.0, 1.0}}}}},
                     "phi3-tiny"),
               UserError);  // 2 factors for head_dim 16
  EXPECT_THROW(parse({{"partial_rotary_factor", 0.75}}, "phi3-tiny"), UserError);
  EXPECT_THROW(parse({{"hidden_act", "gelu"}}), UserError);
  EXPECT_THROW(parse({{"architectures", {"BertModel"}}}), UserError);
  EXPECT_THROW(parse({{"num_key_value_heads", 4}}), UserError);  // 6 heads not a multiple of 4
  EXPECT_THROW(parse({{"activation_function", "relu"}}, "gpt2-tiny"), UserError);
  EXPECT_NO_THROW(parse({{"rope_scaling", nullptr}}));
  auto c = parse(json::object());
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.kv_group_size(), 3);
  // Qwen3Config's head_dim defaults to 128 whatever hidden / heads is.
  json qwen3 = test::preset_config("qwen3-tiny");
  qwen3.erase("head_dim");
  EXPECT_EQ(ModelConfig::from_json(qwen3, "config.json").head_dim, 128);
  EXPECT_TRUE(parse(json::object(), "qwen3-tiny").qk_norm);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_TRUE(parse(json::object(), "phi3-tiny").fused_projections);
}

TEST(Presets, ParameterCountsMatchTheLayout) {
  auto c = ModelConfig::from_json(test::preset_config("llama-tiny"), "preset");
  // embed + head + 2 layers x (2 norms + q,k,v,o + gate,up,down) + final norm
  int64_t layer = 2 * 96 + 96 * 96 + 2 * 32 * 96 + 96 * 96 + 3 * 96 * 202;
  EXPECT_EQ(count_parameters(c), 2 * 259 * 96 + 2 * layer + 96);
  auto tied = ModelConfig::from_json(test::preset_config("llama-tiny-tied"), "preset");
  EXPECT_EQ(count_parameters(tied), count_parameters(c) - 259 * 96);
  // Phi-3: the same shapes fused (qkv [96 + 2 x 32, 96], gate_up [2 x 202, 96]).
  auto phi3 = ModelConfig::from_json(test::preset_config("phi3-tiny"), "preset");
  EXPECT_EQ(count_parameters(phi3), count_parameters(c));
  // Qwen3: head_dim 20, per-head norms.
  auto qwen3 = ModelConfig::from_json(test::preset_config("qwen3-tiny"), "preset");
  const int64_t qwen3_layer = 2 * 64 + 64 * 120 + 2 * 40 * 64 + 120 * 64 + 2 * 20 + 3 * 64 * 150;
  EXPECT_EQ(count_parameters(qwen3), 259 * 64 + 2 * qwen3_layer + 64);
}

}  // namespace
}  // namespace autotp
