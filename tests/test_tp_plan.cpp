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
  for (const auto& preset : {"llama-tiny", "llama-tiny-tied", "qwen2-tiny", "mistral-tiny", "gpt2-tiny"}) {
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

TEST(TpPlan, TpLargerThanHeadsIsRejected) {
  try {
    plan_of(config_of("llama-tiny"), 7);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("autotp_size 7 exceeds num_attention_heads 6"), std::string::npos)
        << e.what();
  }
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
