// The tensor-parallel plan: roles from structural rules, names and user
// patterns; shard math for uneven heads, replicated kv heads and fused qkv.
#include <gtest/gtest.h>

#include "autotp/model/presets.h"
#include "autotp/base/error.h"
#include "autotp/tp/tp_plan.h"
#include "autotp/tp/tp_traffic.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

using nlohmann::json;

ModelConfig config_of(const std::string& preset, json overrides = json::object()) {
  return ModelConfig::from_json(test::preset_config(preset, overrides), "preset:" + preset);
}

TpPlan plan_of(const ModelConfig& c, int tp, PlanRules rules = PlanRules::kAuto, std::vector<LayerSpec> specs = {}) {
  TpPlanOptions options;
  options.tp_size = tp;
  options.rules = rules;
  options.layer_specs = std::move(specs);
  return TpPlan::build(c, options);
}

TEST(ShardMath, SplitEvenlyPutsTheRemainderFirst) {
  EXPECT_EQ(split_evenly(6, 4), (std::vector<int64_t>{2, 2, 1, 1}));
  EXPECT_EQ(split_evenly(259, 4), (std::vector<int64_t>{65, 65, 65, 64}));
  EXPECT_EQ(split_evenly(8, 2), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(split_evenly(5, 1), (std::vector<int64_t>{5}));
}

TEST(ShardMath, QueryHeadsSplitUnevenlyAndKvHeadsFollowThem) {
  auto c = config_of("llama-tiny");  // 6 heads, 2 kv heads, head_dim 16
  auto q = axis_partition(c, Axis::kHeads, 4);
  ASSERT_EQ(q.size(), 4u);
  EXPECT_EQ(q[0], (std::vector<Segment>{{0, 32}}));
  EXPECT_EQ(q[1], (std::vector<Segment>{{32, 32}}));
  EXPECT_EQ(q[2], (std::vector<Segment>{{64, 16}}));
  EXPECT_EQ(q[3], (std::vector<Segment>{{80, 16}}));
  // Query heads 0-2 read kv head 0, heads 3-5 kv head 1. Rank 1 holds q heads 2, 3: both kv heads.
  auto kv = axis_partition(c, Axis::kKvHeads, 4);
  EXPECT_EQ(kv[0], (std::vector<Segment>{{0, 16}}));
  EXPECT_EQ(kv[1], (std::vector<Segment>{{0, 32}}));
  EXPECT_EQ(kv[2], (std::vector<Segment>{{16, 16}}));
  EXPECT_EQ(kv[3], (std::vector<Segment>{{16, 16}}));
  auto heads = local_heads(c, ShardSpec::split({96, 96}, 0, q), 1);
  EXPECT_EQ(heads.first, 2);
  EXPECT_EQ(heads.count, 2);
  EXPECT_EQ(heads.kv_index, (std::vector<int64_t>{0, 1}));
}

TEST(ShardMath, FusedQkvSplitsEachPartByHeads) {
  auto c = config_of("gpt2-tiny");  // 6 heads x 16
  auto parts = axis_partition(c, Axis::kQkv, 4);
  EXPECT_EQ(parts[2], (std::vector<Segment>{{64, 16}, {96 + 64, 16}, {192 + 64, 16}}));
  EXPECT_EQ(parts[0], (std::vector<Segment>{{0, 32}, {96, 32}, {192, 32}}));
}

// Phi-3 (6 heads, 2 kv heads of 16, intermediate 202) at tp 4: q by query heads
// 2/2/1/1, k and v by the kv heads those read (rank 1 reads both), gate and up
// each 51/51/50/50.
TEST(ShardMath, Phi3FusedPartsSplitOnTheirOwn) {
  auto c = config_of("phi3-tiny");
  ASSERT_TRUE(c.fused_projections);
  const int64_t q = 96, kv = 32;
  auto qkv = axis_partition(c, Axis::kQkv, 4);
  EXPECT_EQ(qkv[0], (std::vector<Segment>{{0, 32}, {q, 16}, {q + kv, 16}}));
  EXPECT_EQ(qkv[1], (std::vector<Segment>{{32, 32}, {q, 32}, {q + kv, 32}}));
  EXPECT_EQ(qkv[3], (std::vector<Segment>{{80, 16}, {q + 16, 16}, {q + kv + 16, 16}}));
  auto gate_up = axis_partition(c, Axis::kGateUp, 4);
  EXPECT_EQ(gate_up[0], (std::vector<Segment>{{0, 51}, {202, 51}}));
  EXPECT_EQ(gate_up[3], (std::vector<Segment>{{152, 50}, {202 + 152, 50}}));
  const TpPlan plan = plan_of(c, 4);
  const PlanEntry& fused = plan.entry("model.layers.0.mlp.gate_up_proj.weight");
  EXPECT_EQ(fused.role, TpRole::kColumn);
  EXPECT_EQ(fused.spec.local_shape(2), (std::vector<int64_t>{100, 96}));
  EXPECT_TRUE(plan.entry("model.layers.1.self_attn.qkv_proj.weight").spec.has_overlap());
  EXPECT_EQ(plan.entry("model.layers.1.self_attn.o_proj.weight").role, TpRole::kRow);
  // A user shape that is not [intermediate, intermediate] is refused.
  EXPECT_THROW(plan_of(c, 2, PlanRules::kAuto, {{{".*gate_up_proj\\.weight"}, TpRole::kColumn, {101, 303}}}), UserError);
  EXPECT_NO_THROW(plan_of(c, 2, PlanRules::kAuto, {{{".*gate_up_proj\\.weight"}, TpRole::kColumn, {202, 202}}}));
  // DeepSpeed's per-dim form: [2, -1] (two equal parts) and [[q, k, v], -1].
  auto ds_plan = [&](const std::string& pattern, const char* shape, int tp) {
    const json spec = {{"layer_specs", {{{"patterns", {pattern}}, {"partition_type", "column"},
                                         {"shape", json::parse(shape)}, {"partition_dim", 0}}}}};
    return plan_of(c, tp, PlanRules::kAuto, parse_partition_config(spec));
  };
  EXPECT_EQ(ds_plan(".*gate_up_proj\\.weight", "[2, -1]", 4).entry("model.layers.0.mlp.gate_up_proj.weight").spec,
            fused.spec);
  const std::string qkv_name = "model.layers.1.self_attn.qkv_proj.weight";
  EXPECT_EQ(ds_plan(".*qkv_proj\\.weight", "[[96, 32, 32], -1]", 4).entry(qkv_name).spec, plan.entry(qkv_name).spec);
  auto message = [&](const std::string& pattern, const char* shape) {
    try {
      ds_plan(pattern, shape, 2);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  // Sizes that are not Phi-3's GQA [96, 32, 32]; 202 x 2 has no 3 equal parts.
  EXPECT_NE(message(".*qkv_proj\\.weight", "[[64, 48, 48], -1]").find("does not match the layout"), std::string::npos);
  EXPECT_NE(message(".*gate_up_proj\\.weight", "[3, -1]").find("3 equal parts of dim 0 (size 404)"), std::string::npos);
  EXPECT_NE(message(".*gate_up_proj\\.weight", "[[202, 202], 96]").find("the dim that is not split must be -1"),
            std::string::npos);
  EXPECT_NE(message(".*gate_up_proj\\.weight", "[0, -1]").find("0 is not a positive integer"), std::string::npos);
}

TEST(ShardSpec, SliceAndPlaceRoundTripWithOverlap) {
  auto c = config_of("llama-tiny");
  auto spec = ShardSpec::split({32, 5}, 0, axis_partition(c, Axis::kKvHeads, 4));
  EXPECT_TRUE(spec.has_overlap());
  auto full = torch::arange(32 * 5, torch::kFloat32).view({32, 5});
  auto rebuilt = torch::zeros_like(full);
  auto counted = torch::zeros_like(full);
  for (int r = 0; r < 4; ++r) {
    auto local = spec.slice(full, r);
    EXPECT_EQ(local.sizes().vec(), spec.local_shape(r));
    spec.place(rebuilt, local, r);
    // owned_local covers every element exactly once across ranks
    auto ones = torch::zeros(spec.local_shape(r));
    for (const auto& seg : spec.owned_local(r)) ones.narrow(0, seg.start, seg.length).fill_(1);
    spec.place(counted, ones, r, /*accumulate=*/true);
  }
  EXPECT_TRUE(torch::equal(rebuilt, full));
  EXPECT_TRUE(torch::equal(counted, torch::ones_like(full)));
  EXPECT_EQ(ShardSpec::from_json(spec.to_json()), spec);
}

TEST(TpPlan, StructuralRulesAgreeWithNameRulesOnEveryArchitecture) {
  for (const auto& preset :
       {"llama-tiny", "llama-tiny-tied", "qwen2-tiny", "qwen3-tiny", "phi3-tiny", "mistral-tiny", "gpt2-tiny"}) {
    auto c = config_of(preset);
    for (int tp : {1, 2, 3, 4}) {
      if (tp > c.num_heads) continue;
      auto structural = plan_of(c, tp, PlanRules::kStructural);
      auto names = plan_of(c, tp, PlanRules::kNames);
      ASSERT_EQ(structural.entries().size(), names.entries().size());
      for (size_t i = 0; i < structural.entries().size(); ++i) {
        const auto& a = structural.entries()[i];
        const auto& b = names.entries()[i];
        EXPECT_EQ(a.role, b.role) << preset << " tp " << tp << " " << a.desc.name << ": " << a.source << " vs "
                                  << b.source;
        EXPECT_EQ(a.spec, b.spec) << preset << " " << a.desc.name;
        EXPECT_EQ(a.partial_grad, b.partial_grad) << preset << " " << a.desc.name;
      }
    }
  }
}

TEST(TpPlan, RolesOfALlamaLayer) {
  auto plan = plan_of(config_of("llama-tiny"), 2);
  EXPECT_EQ(plan.entry("model.embed_tokens.weight").role, TpRole::kVocab);
  EXPECT_EQ(plan.entry("model.layers.0.self_attn.q_proj.weight").role, TpRole::kColumn);
  EXPECT_EQ(plan.entry("model.layers.0.self_attn.o_proj.weight").role, TpRole::kRow);
  EXPECT_EQ(plan.entry("model.layers.0.self_attn.o_proj.weight").spec.dim(), 1);
  EXPECT_EQ(plan.entry("model.layers.1.mlp.down_proj.weight").role, TpRole::kRow);
  EXPECT_EQ(plan.entry("model.norm.weight").role, TpRole::kReplicated);
  EXPECT_EQ(plan.entry("lm_head.weight").role, TpRole::kVocab);
  // vocab 259 and intermediate 202 do not divide by 2 or 4: uneven shards, no empty rank
  auto plan4 = plan_of(config_of("llama-tiny"), 4);
  EXPECT_EQ(plan4.entry("lm_head.weight").spec.local_shape(3), (std::vector<int64_t>{64, 96}));
  EXPECT_EQ(plan4.entry("model.layers.0.mlp.up_proj.weight").spec.local_shape(0), (std::vector<int64_t>{51, 96}));
  EXPECT_EQ(plan4.entry("model.layers.0.mlp.up_proj.weight").spec.local_shape(3), (std::vector<int64_t>{50, 96}));
}

TEST(TpPlan, GptBiasesFollowTheirLayer) {
  auto plan = plan_of(config_of("gpt2-tiny"), 3);
  EXPECT_EQ(plan.entry("transformer.h.0.attn.c_attn.weight").spec.dim(), 1);  // Conv1D [in, out]
  EXPECT_EQ(plan.entry("transformer.h.0.attn.c_attn.bias").role, TpRole::kColumn);
  EXPECT_EQ(plan.entry("transformer.h.0.attn.c_proj.weight").spec.dim(), 0);
  EXPECT_EQ(plan.entry("transformer.h.0.attn.c_proj.bias").role, TpRole::kReplicated);
  EXPECT_EQ(plan.entry("transformer.wpe.weight").role, TpRole::kReplicated);
}

TEST(TpPlan, UserPatternsOverrideAndAreValidated) {
  auto c = config_of("llama-tiny");
  auto plan = plan_of(c, 2, PlanRules::kAuto,
                      {LayerSpec{{R"(.*layers\.1\.mlp\..*)"}, TpRole::kReplicated, {}},
                       LayerSpec{{"lm_head.weight"}, TpRole::kReplicated, {}}});
  EXPECT_EQ(plan.entry("model.layers.1.mlp.down_proj.weight").role, TpRole::kReplicated);
  EXPECT_EQ(plan.entry("model.layers.1.mlp.up_proj.weight").role, TpRole::kReplicated);
  EXPECT_EQ(plan.entry("model.layers.0.mlp.up_proj.weight").role, TpRole::kColumn);
  EXPECT_EQ(plan.entry("lm_head.weight").role, TpRole::kReplicated);
  EXPECT_NE(plan.entry("lm_head.weight").source.find("user pattern"), std::string::npos);
  // a half-replicated block, a role that splits the hidden stream, a pattern matching nothing
  EXPECT_THROW(plan_of(c, 2, PlanRules::kAuto, {LayerSpec{{".*layers.0.mlp.up_proj.*"}, TpRole::kReplicated, {}}}),
               UserError);
  EXPECT_THROW(plan_of(c, 2, PlanRules::kAuto, {LayerSpec{{".*o_proj.*"}, TpRole::kColumn, {}}}), UserError);
  EXPECT_THROW(plan_of(c, 2, PlanRules::kAuto, {LayerSpec{{"nothing.*"}, TpRole::kRow, {}}}), UserError);
  EXPECT_THROW(plan_of(c, 2, PlanRules::kAuto, {LayerSpec{{".*norm.*"}, TpRole::kColumn, {}}}), UserError);
  // a fused layout must match the weight
  auto g = config_of("gpt2-tiny");
  EXPECT_NO_THROW(plan_of(g, 2, PlanRules::kAuto, {LayerSpec{{".*c_attn.weight"}, TpRole::kColumn, {96, 96, 96}}}));
  EXPECT_THROW(plan_of(g, 2, PlanRules::kAuto, {LayerSpec{{".*c_attn.weight"}, TpRole::kColumn, {144, 144}}}),
               UserError);
}

// A config.json base_model_tp_plan in transformers 4.5x and 5 style names gives
// the structural layout, says where each role came from, and refuses what autotp
// does not do with the style named.
TEST(TpPlan, HfPlanStylesOfBothTransformersGenerations) {
  auto with_plan = [](const std::string& preset, json plan) {
    return config_of(preset, {{"base_model_tp_plan", plan}});
  };
  // Phi-3's plan in transformers 4.5x; Qwen3's in 5 (gather_output head, norms with summed gradients).
  const json phi3_plan = {{"layers.*.self_attn.qkv_proj", "colwise_rep"}, {"layers.*.self_attn.o_proj", "rowwise_rep"},
                          {"layers.*.mlp.gate_up_proj", "colwise_rep"},  {"layers.*.mlp.down_proj", "rowwise_rep"},
                          {"embed_tokens", "embedding_rowwise"},         {"lm_head", "colwise_gather_output"}};
  const json qwen3_plan = {{"layers.*.self_attn.q_proj", "colwise"},
                           {"layers.*.self_attn.k_proj", "colwise"},
                           {"layers.*.self_attn.v_proj", "local_colwise"},
                           {"layers.*.self_attn.q_norm", "replicated_with_grad_allreduce"},
                           {"layers.*.self_attn.k_norm", "replicated_with_grad_allreduce"},
                           {"layers.*.self_attn.o_proj", "rowwise_split_input"},
                           {"layers.*.mlp.gate_proj", "colwise"},
                           {"layers.*.mlp.up_proj", "packed_colwise"},
                           {"layers.*.mlp.down_proj", "local_rowwise"},
                           {"embed_tokens", "vocab"}};
  for (const auto& [preset, hf] : {std::pair{"phi3-tiny", phi3_plan}, std::pair{"qwen3-tiny", qwen3_plan}}) {
    const auto c = with_plan(preset, hf);
    const TpPlan plan = plan_of(c, 3), structural = plan_of(c, 3, PlanRules::kStructural);
    for (size_t i = 0; i < plan.entries().size(); ++i) {
      const auto& a = plan.entries()[i];
      EXPECT_EQ(a.spec, structural.entries()[i].spec) << preset << " " << a.desc.name << ": " << a.source;
      EXPECT_EQ(a.partial_grad, structural.entries()[i].partial_grad) << a.desc.name;
    }
  }
  const TpPlan qwen3 = plan_of(with_plan("qwen3-tiny", qwen3_plan), 2);
  EXPECT_EQ(qwen3.entry("model.layers.0.self_attn.o_proj.weight").source,
            "HF plan (config.json) 'layers.*.self_attn.o_proj': rowwise_split_input");
  EXPECT_NE(plan_of(config_of("qwen3-tiny"), 2, PlanRules::kNames).entry("model.norm.weight").source.find(
                "built-in HF-style plan"),
            std::string::npos);
  // Styles autotp does not do: one error naming the key and the style.
  auto error_of = [&](const std::string& style) {
    try {
      plan_of(with_plan("llama-tiny", {{"layers.*.mlp.down_proj", style}, {"layers.*.mlp.up_proj", "colwise"},
                                       {"layers.*.mlp.gate_proj", "colwise"}}),
              2);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of("sequence_parallel").find("base_model_tp_plan['layers.*.mlp.down_proj'] = 'sequence_parallel': "
                                               "sequence_parallel applies to norms only"),
            std::string::npos)
      << error_of("sequence_parallel");
  EXPECT_NE(error_of("moe_tp_experts").find("no expert parallelism"), std::string::npos);
  EXPECT_NE(error_of("grouped_gemm").find("expert-parallel style"), std::string::npos);
  const std::string unknown = error_of("diagonal");
  EXPECT_NE(unknown.find("'diagonal' is not a tensor-parallel style autotp knows (allowed: colwise, colwise_rep"),
            std::string::npos)
      << unknown;
  EXPECT_NE(unknown.find("replicated_with_grad_allreduce"), std::string::npos);
  EXPECT_NE(error_of("embedding_colwise").find("embedding_rowwise"), std::string::npos);
}

TEST(TpPlan, PartitionConfigParsing) {
  auto specs = parse_partition_config(
      json::parse(R"({"layer_specs": [{"patterns": [".*q_proj.*"], "partition_type": "column"}]})"));
  ASSERT_EQ(specs.size(), 1u);
  EXPECT_EQ(specs[0].role, TpRole::kColumn);
  EXPECT_THROW(parse_partition_config(json::parse(R"({"layer_spec": []})")), UserError);
  EXPECT_THROW(
      parse_partition_config(json::parse(R"({"layer_specs": [{"patterns": ["("], "partition_type": "row"}]})")),
      UserError);
  try {
    parse_partition_config(json::parse(R"({"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]})"));
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("allowed: column, row, vocab, replicated"), std::string::npos);
  }
}

TEST(TpPlan, HfTpPlanInConfigIsHonouredAndUnsupportedStylesRejected) {
  json plan = {{"layers.*.self_attn.q_proj", "colwise"}, {"layers.*.self_attn.k_proj", "colwise"},
               {"layers.*.self_attn.v_proj", "colwise"}, {"layers.*.self_attn.o_proj", "rowwise"}};
  auto c = config_of("llama-tiny", {{"base_model_tp_plan", plan}});
  auto p = plan_of(c, 2);
  EXPECT_EQ(p.entry("model.layers.0.self_attn.q_proj.weight").role, TpRole::kColumn);
  EXPECT_EQ(p.entry("model.layers.0.mlp.up_proj.weight").role, TpRole::kReplicated);  // not listed
  plan["layers.*.mlp.up_proj"] = "sequence_parallel";
  EXPECT_THROW(plan_of(config_of("llama-tiny", {{"base_model_tp_plan", plan}}), 2), UserError);
}

// Sequence parallelism: each rank's norms and row biases see only its tokens, so
// their gradients become partial sums over tp; per-head norms stay as they were.
TEST(TpPlan, SequenceParallelMarksNormAndRowBiasGradientsPartial) {
  auto c = config_of("qwen3-tiny", {{"attention_bias", true}});
  TpPlanOptions options;
  options.tp_size = 2;
  options.sequence_parallel = true;
  const TpPlan sp = TpPlan::build(c, options);
  EXPECT_TRUE(sp.sequence_parallel());
  const TpPlan plain = plan_of(c, 2);
  EXPECT_FALSE(plain.sequence_parallel());
  for (const char* name : {"model.norm.weight", "model.layers.0.input_layernorm.weight",
                           "model.layers.1.post_attention_layernorm.weight", "model.layers.0.self_attn.o_proj.bias"}) {
    EXPECT_TRUE(sp.entry(name).partial_grad) << name;
    EXPECT_FALSE(plain.entry(name).partial_grad) << name;
    EXPECT_NE(sp.entry(name).source.find("sequence parallel"), std::string::npos) << sp.entry(name).source;
  }
  for (const char* name : {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"})
    EXPECT_TRUE(sp.entry(name).partial_grad && plain.entry(name).partial_grad) << name;
  for (const char* name : {"model.layers.0.self_attn.q_proj.bias", "model.embed_tokens.weight"})  // tied head
    EXPECT_FALSE(sp.entry(name).partial_grad) << name;
  // tp 1 has no sequence to split.
  options.tp_size = 1;
  EXPECT_FALSE(TpPlan::build(c, options).sequence_parallel());
  // GPT-2: LayerNorm biases, the row biases and the position embedding (added to
  // each rank's tokens after the embedding's reduce-scatter) too.
  options.tp_size = 2;
  const TpPlan gpt2 = TpPlan::build(config_of("gpt2-tiny"), options);
  for (const char* name : {"transformer.h.0.ln_1.bias", "transformer.h.1.ln_2.weight", "transformer.ln_f.bias",
                           "transformer.h.0.attn.c_proj.bias", "transformer.h.0.mlp.c_proj.bias",
                           "transformer.wpe.weight"})
    EXPECT_TRUE(gpt2.entry(name).partial_grad) << name;
  for (const char* name : {"transformer.h.0.attn.c_attn.bias", "transformer.wte.weight"})
    EXPECT_FALSE(gpt2.entry(name).partial_grad) << name;
  // HF's sequence_parallel style on a norm keeps it whole.
  json hf = {{"layers.*.self_attn.q_proj", "colwise"}, {"layers.*.self_attn.k_proj", "colwise"},
             {"layers.*.self_attn.v_proj", "colwise"}, {"layers.*.self_attn.o_proj", "rowwise"},
             {"layers.*.input_layernorm", "sequence_parallel"}, {"norm", "sequence_parallel"}};
  const TpPlan from_hf = plan_of(config_of("llama-tiny", {{"base_model_tp_plan", hf}}), 2);
  EXPECT_EQ(from_hf.entry("model.layers.0.input_layernorm.weight").role, TpRole::kReplicated);
  EXPECT_EQ(from_hf.entry("model.norm.weight").role, TpRole::kReplicated);
}

TEST(TpPlan, TpLargerThanHeadsIsRejected) {
  try {
    plan_of(config_of("llama-tiny"), 7);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("autotp_size 7 exceeds num_attention_heads 6"), std::string::npos)
        << e.what();
  }
}

// Qwen3's per-head q/k norms stay whole on every rank; under split attention each
// rank's gradient covers only its heads, so the plan marks them for a tp sum
// (one whole all-reduce each per step), and only then.
TEST(TpPlan, Qwen3HeadNormsAreReplicatedWithSummedGradients) {
  const auto c = config_of("qwen3-tiny");
  ASSERT_TRUE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 20);
  const std::string q_norm = "model.layers.1.self_attn.q_norm.weight", k_norm = "model.layers.0.self_attn.k_norm.weight";
  const TpPlan three = plan_of(c, 3);
  for (const auto& name : {q_norm, k_norm}) {
    const PlanEntry& e = three.entry(name);
    EXPECT_EQ(e.role, TpRole::kReplicated) << name;
    EXPECT_EQ(e.desc.shape, (std::vector<int64_t>{20})) << name;
    EXPECT_TRUE(e.partial_grad) << name;
    EXPECT_NE(e.source.find("gradient summed over tp"), std::string::npos) << e.source;
  }
  EXPECT_FALSE(three.entry("model.layers.0.input_layernorm.weight").partial_grad);
  EXPECT_FALSE(plan_of(c, 1).entry(q_norm).partial_grad);
  // Attention of layer 0 kept whole by the user: its norms see every head.
  const TpPlan whole = plan_of(c, 2, PlanRules::kAuto,
                               {{{"model\\.layers\\.0\\.self_attn\\..*_proj\\.weight"}, TpRole::kReplicated, {}}});
  EXPECT_FALSE(whole.entry("model.layers.0.self_attn.q_norm.weight").partial_grad);
  EXPECT_TRUE(whole.entry(q_norm).partial_grad);
  // 2 layers x 2 norms of 20 elements (tp 2: 3 query heads per rank read one kv head, nothing else shared).
  EXPECT_EQ(tp_step_shape(plan_of(c, 2), c.num_layers).shared_numel, (std::vector<int64_t>(4, 20)));
}

TEST(TpPlan, RankBytesSumOverShards) {
  auto c = config_of("llama-tiny");
  auto bytes = plan_of(c, 3).rank_bytes(4);
  ASSERT_EQ(bytes.size(), 3u);
  int64_t total = 0;
  for (auto b : bytes) total += b;
  // Sharded tensors add up to the model; replicated ones (norms, shared kv rows) count on every rank.
  EXPECT_GT(total, count_parameters(c) * 4);
  EXPECT_LT(bytes[0], count_parameters(c) * 4 / 2);
}

// The step's tp collectives (tp_traffic.h), by hand for llama-tiny (hidden 96, 2
// layers, 6 heads, 2 kv heads) with micro-batches of N = 32 tokens.
TEST(TpTraffic, StepCollectivesByHand) {
  struct Sums {
    int64_t calls = 0, bytes = 0, step_calls = 0, step_bytes = 0;
  };
  auto sums = [](const TpStepShape& shape) {
    Sums s;
    for (const auto& c : tp_step_collectives(shape)) {
      EXPECT_GT(c.calls, 0) << c.what;
      (c.per_micro_batch ? s.calls : s.step_calls) += c.calls;
      (c.per_micro_batch ? s.bytes : s.step_bytes) += c.bytes;
    }
    return s;
  };
  auto run = [](TpStepShape s, int64_t element_bytes) {
    s.tokens = 32;
    s.hidden = 96;
    s.element_bytes = element_bytes;
    return s;
  };
  const auto c = config_of("llama-tiny");
  const int64_t N = 32, A = N * 96 * 4;  // one fp32 activation

  // tp 2: no kv head is shared (3 query heads per rank read one kv head); the
  // norms are replicated, whole on every rank, and never summed.
  const TpStepShape two = tp_step_shape(plan_of(c, 2), c.num_layers);
  EXPECT_EQ(two.tp_size, 2);
  EXPECT_EQ(two.row_linears, (std::vector<int64_t>{2, 2}));  // o_proj, down_proj
  EXPECT_TRUE(two.embedding_split);
  EXPECT_TRUE(two.head_split);
  EXPECT_TRUE(two.shared_numel.empty());
  // Per micro-batch: embedding 1 + 2 layers x 2 row linears x (forward + backward)
  // + cross-entropy 2 (4N and 8N bytes) + the LM head input's gradient 1; per step the batch hash.
  Sums s = sums(run(two, 4));
  EXPECT_EQ(s.calls, 12);
  EXPECT_EQ(s.bytes, 10 * A + 12 * N);
  EXPECT_EQ(s.step_calls, 1);
  EXPECT_EQ(s.step_bytes, 16);
  // Recomputing layer 1 repeats its two forward all-reduces.
  TpStepShape recomputed = run(two, 4);
  recomputed.recompute = {false, true};
  EXPECT_EQ(sums(recomputed).calls, 14);
  // 16-bit activations: half the bytes, unless counted as the fp32 a Gloo reduction moves.
  TpStepShape half = run(two, 2);
  EXPECT_EQ(sums(half).bytes, 10 * A / 2 + 12 * N);
  half.reduce_16bit_as_fp32 = true;
  EXPECT_EQ(sums(half).bytes, 10 * A + 12 * N);

  // A replicated embedding has no all-reduce; the vocab-parallel head keeps its three.
  const TpStepShape head_only =
      tp_step_shape(plan_of(c, 2, PlanRules::kAuto, {{{"model\\.embed_tokens\\.weight"}, TpRole::kReplicated, {}}}),
                    c.num_layers);
  EXPECT_FALSE(head_only.embedding_split);
  EXPECT_TRUE(head_only.head_split);
  EXPECT_EQ(sums(run(head_only, 4)).calls, 11);
  // Tied: the embedding is the head.
  const auto tied = config_of("llama-tiny-tied");
  const TpStepShape tied_two = tp_step_shape(plan_of(tied, 2), tied.num_layers);
  EXPECT_TRUE(tied_two.embedding_split);
  EXPECT_TRUE(tied_two.head_split);

  // tp 4: query heads 2/2/1/1, so rank 1 reads both kv heads and k_proj / v_proj
  // (32 x 96 each) are shared: one all-reduce of each whole gradient.
  const TpStepShape four = tp_step_shape(plan_of(c, 4), c.num_layers);
  EXPECT_EQ(four.shared_numel, (std::vector<int64_t>(4, 32 * 96)));
  TpStepShape at_step = run(four, 2);  // bf16, stage 1, fp32 accumulation: summed once, in fp32
  at_step.zero_stage = 1;
  at_step.fp32_accumulation = true;
  s = sums(at_step);
  EXPECT_EQ(s.step_calls, 1 + 4);
  EXPECT_EQ(s.step_bytes, 16 + 4 * 32 * 96 * 4);
  TpStepShape each_micro_batch = at_step;  // stage 2: with every micro-batch's reduction, in bf16
  each_micro_batch.zero_stage = 2;
  const Sums e = sums(each_micro_batch);
  EXPECT_EQ(e.step_calls, 1);
  EXPECT_EQ(e.calls, s.calls + 4);
  EXPECT_EQ(e.bytes, s.bytes + 4 * 32 * 96 * 2);

  // A group of one communicates nothing.
  EXPECT_TRUE(tp_step_collectives(run(tp_step_shape(plan_of(c, 1), c.num_layers), 4)).empty());
}

}  // namespace
}  // namespace autotp
