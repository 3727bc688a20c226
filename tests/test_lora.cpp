// LoRA: PEFT's adapters on tensor-parallel shards with every ZeRO stage.
//  - PEFT's own outputs (tests/data/peft_adapters, made by make_adapters.py with
//    peft 0.21.2): an adapter PEFT saved loads into autotp at tp 1-4 with PEFT's
//    logits, loss and adapter gradients;
//  - every tp x ZeRO layout (uneven heads, SP, tp overlap) trains LoRA as one rank
//    does: losses, grad norms and the final adapters within 1e-5, the frozen base
//    unchanged and without gradients, model-state bytes equal to the formula;
//  - B = 0 starts at the base model's loss; bad configs are UserErrors naming the key.
#include <gtest/gtest.h>

#include <filesystem>

#include "autotp/io/safetensors.h"
#include "autotp/lora/lora_plan.h"
#include "autotp/lora/lora_weights.h"
#include "autotp/model/presets.h"
#include "autotp/runtime/trainer.h"
#include "support/checks.h"
#include "support/model_fixtures.h"
#include "support/multiprocess.h"
#include "support/reference_models.h"

namespace autotp {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

const std::string kModels = AUTOTP_SOURCE_DIR "/tests/data/hf_models/";
const std::string kAdapters = AUTOTP_SOURCE_DIR "/tests/data/peft_adapters/";
constexpr double kTolerance = 1e-5;

std::string base_of(const std::string& adapter) {
  return kModels + json::parse(io::read_text_file(kAdapters + adapter + "/expected.json")).at("base").get<std::string>().substr(
                       std::string("tests/data/hf_models/").size());
}

// A model with the adapter of tests/data/peft_adapters/<name> on this rank's shards.
std::unique_ptr<CausalLM> load_with_adapter(const std::string& name, Comm& tp) {
  auto source = resolve_model(base_of(name));
  const LoraConfig lora = read_adapter_config(kAdapters + name);
  TpPlanOptions options;
  options.tp_size = tp.size();
  auto model = load_model(source, with_lora(TpPlan::build(source.config, options), lora), tp, torch::kFloat32, 0);
  init_lora_weights(*model, lora, 0);
  load_adapter_weights(*model, kAdapters + name);
  return model;
}

struct PeftComparison {
  double loss = 0, logits = 0, worst_grad = 0;
  std::string worst_grad_name;
  int grads = 0;
  std::string describe() const {
    char text[512];
    std::snprintf(text, sizeof text, "loss %.2e, logits %.2e, worst of %d adapter gradients %.2e (%s)", loss, logits,
                  grads, worst_grad, worst_grad_name.c_str());
    return text;
  }
};

// HF's loss on labels = input_ids, backward, then the trained tensors' gradients against PEFT's.
PeftComparison compare_with_peft(CausalLM& model, const std::string& name, int tp_rank) {
  auto reference = io::SafetensorsFile::open(kAdapters + name + "/reference.safetensors");
  const torch::Tensor ids = reference->read("input_ids");
  auto targets = torch::full_like(ids, -100);
  targets.narrow(1, 0, ids.size(1) - 1).copy_(ids.narrow(1, 1, ids.size(1) - 1));
  auto loss = model.token_losses(ids, targets).sum() / (targets != -100).sum();
  loss.backward();
  model.sync_shared_grads();
  PeftComparison c;
  c.loss = std::abs(loss.item<double>() - reference->read("loss").item<double>()) / reference->read("loss").item<double>();
  c.logits = test::relative_max_diff(model.full_logits(ids), reference->read("logits"));
  for (auto& p : model.parameters()) {
    if (!p.trains()) {
      if (p.tensor.grad().defined()) throw std::runtime_error("frozen " + p.name() + " has a gradient");
      continue;
    }
    const torch::Tensor grad = model.gather_grad(p);
    const std::string stored = "grad." + peft_key(model, p.name());
    if (tp_rank != 0) continue;
    if (!reference->contains(stored)) throw std::runtime_error("reference.safetensors has no " + stored);
    const double diff = test::relative_max_diff(grad, reference->read(stored));
    ++c.grads;
    if (diff >= c.worst_grad) c.worst_grad = diff, c.worst_grad_name = p.name();
  }
  return c;
}

const std::vector<std::string>& adapter_names() {
  static const std::vector<std::string> names = {"llama_qkvo", "llama_all_linear_rslora", "qwen3_all_linear",
                                                 "gemma3_qv", "phi3_all_linear", "llama_modules_to_save",
                                                 "qwen2_bias_all"};
  return names;
}

class PeftAdapter : public ::testing::TestWithParam<std::string> {};

TEST_P(PeftAdapter, LoadsWithPeftsLogitsLossAndGradients) {
  Comm self;
  auto model = load_with_adapter(GetParam(), self);
  const PeftComparison c = compare_with_peft(*model, GetParam(), 0);
  std::fprintf(stderr, "%s at tp 1: %s\n", GetParam().c_str(), c.describe().c_str());
  EXPECT_GT(c.grads, 0);
  EXPECT_LT(c.loss, kTolerance) << c.describe();
  EXPECT_LT(c.logits, kTolerance) << c.describe();
  EXPECT_LT(c.worst_grad, kTolerance) << c.describe();
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PeftAdapter, ::testing::ValuesIn(adapter_names()),
                         [](const auto& info) { return info.param; });

AUTOTP_WORKER(peft_adapter_parity) {
  auto topo = ctx.topology(ctx.env.world_size);
  auto model = load_with_adapter(ctx.args.at(0), topo->tp());
  const PeftComparison c = compare_with_peft(*model, ctx.args.at(0), topo->tp_rank());
  if (topo->rank() != 0) return;
  std::fprintf(stderr, "%s at tp %d: %s\n", ctx.args.at(0).c_str(), topo->tp_size(), c.describe().c_str());
  WORKER_CHECK(c.loss < kTolerance && c.logits < kTolerance && c.worst_grad < kTolerance, "against PEFT: ",
               c.describe());
}

struct AdapterTpCase {
  std::string adapter;
  int tp;
};
void PrintTo(const AdapterTpCase& c, std::ostream* os) { *os << c.adapter << "_tp" << c.tp; }
class PeftAdapterTp : public ::testing::TestWithParam<AdapterTpCase> {};

TEST_P(PeftAdapterTp, ShardedLoadsWithPeftsLogitsLossAndGradients) {
  auto result = test::run_workers("peft_adapter_parity", GetParam().tp, {GetParam().adapter});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

// Each adapter at one of tp 2, 3, 4 (6 query heads, 2 kv heads: shared kv slices at 3 and 4).
std::vector<AdapterTpCase> adapter_tp_cases() {
  std::vector<AdapterTpCase> cases;
  int next = 0;
  for (const auto& name : adapter_names()) cases.push_back({name, 2 + next++ % 3});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PeftAdapterTp, ::testing::ValuesIn(adapter_tp_cases()),
                         [](const auto& info) { return info.param.adapter + "_tp" + std::to_string(info.param.tp); });

// --- training parity -------------------------------------------------------

constexpr int kSteps = 4;
constexpr int64_t kSeq = 12;

json lora_train_config(int tp, int stage, int64_t micro, int64_t gas, const std::string& layout) {
  return {{"train_micro_batch_size_per_gpu", micro},
          {"gradient_accumulation_steps", gas},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 2e-3}, {"weight_decay", 0.1}, {"eps", 1e-6}}}}},
          {"gradient_clipping", 0.5},
          {"zero_optimization",
           {{"stage", stage},
            {"reduce_bucket_size", 512},
            {"allgather_bucket_size", 256},
            {"stage3_param_persistence_threshold", 100}}},
          {"tensor_parallel",
           {{"autotp_size", tp},
            {"sequence_parallel", layout.find("sp") != std::string::npos},
            {"tp_overlap_comm", layout.find("overlap") != std::string::npos}}},
          {"activation_checkpointing", {{"mode", layout.find("ckpt") != std::string::npos ? "full" : "off"}}},
          // B random too (init_lora_weights false): both factors get gradients from step 1.
          {"lora",
           {{"r", 4},
            {"lora_alpha", 8},
            {"target_modules", "all-linear"},
            {"init_lora_weights", false},
            {"lora_dropout", layout.find("drop") != std::string::npos ? 0.1 : 0.0},
            {"modules_to_save", layout.find("save") != std::string::npos ? json::array({"lm_head"}) : json::array()}}}};
}

Batch rows_to_batch(const torch::Tensor& rows) {
  const int64_t seq = rows.size(1) - 1;
  return {rows.narrow(1, 0, seq).contiguous(), rows.narrow(1, 1, seq).clone()};
}

std::unique_ptr<CausalLM> lora_model(const ModelSource& source, const TrainConfig& config, Comm& tp,
                                     torch::ScalarType dtype = torch::kFloat32) {
  auto model = load_model(source, with_lora(TpPlan::build(source.config, config.tensor_parallel.plan_options()),
                                            config.lora),
                          tp, dtype, 0);
  init_lora_weights(*model, config.lora, 7);
  return model;
}

// An HF directory of the llama-tiny preset with seeded random weights.
ModelSource llama_tiny(const std::string& tag, uint64_t seed) {
  json config = test::preset_config("llama-tiny");
  return resolve_model(
      test::write_model_dir(test::make_temp_dir(tag), config, test::reference_random_weights(config, seed)));
}

AUTOTP_WORKER(lora_train_parity) {
  const std::string dir = ctx.args.at(0);
  const int tp = std::stoi(ctx.args.at(1)), stage = std::stoi(ctx.args.at(2));
  const int64_t gas = std::stoll(ctx.args.at(3));
  const std::string layout = ctx.args.at(4);
  auto topo = ctx.topology(tp);
  const int dp = topo->dp_size();
  const int64_t micro = 2, global = micro * gas * dp;
  auto source = resolve_model(dir);
  auto config = TrainConfig::from_json(lora_train_config(tp, stage, micro, gas, layout), "test");
  config.resolve_batch(topo->world_size());
  Trainer trainer(config, topo, lora_model(source, config, topo->tp()), nullptr, false);
  // The frozen base as loaded, to check that it never moves.
  std::map<std::string, torch::Tensor> base;
  trainer.optimizer().gather_all_params();
  for (auto& p : trainer.model().parameters())
    if (!p.trains()) base[p.name()] = trainer.model().gather(p);

  auto single = Topology::single();
  // The same adapters and lora_dropout on one rank with the whole global batch.
  std::string ref_layout = "tp";
  for (const char* option : {"drop", "save"})
    if (layout.find(option) != std::string::npos) ref_layout += std::string("+") + option;
  auto ref_config = TrainConfig::from_json(lora_train_config(1, 0, global, 1, ref_layout), "reference");
  ref_config.resolve_batch(1);
  Trainer reference(ref_config, single, lora_model(source, ref_config, single->tp()), nullptr, false);

  torch::manual_seed(5);
  const int64_t seq = layout.find("sp") != std::string::npos ? kSeq - 1 : kSeq;  // 11: uneven over 2-4 ranks
  auto data = torch::randint(0, source.config.vocab_size, {kSteps * global, seq + 1}, torch::kLong);
  for (int step = 0; step < kSteps; ++step) {
    auto rows = data.narrow(0, step * global, global);
    std::vector<Batch> mine;
    for (int64_t j = 0; j < gas; ++j)
      mine.push_back(rows_to_batch(rows.narrow(0, (j * dp + topo->dp_rank()) * micro, micro)));
    auto got = trainer.train_step(mine);
    auto want = reference.train_step({rows_to_batch(rows)});
    const double loss_rel = std::abs(got.loss - want.loss) / want.loss;
    const double norm_rel = std::abs(got.grad_norm - want.grad_norm) / want.grad_norm;
    WORKER_CHECK(loss_rel < kTolerance, "step ", step + 1, ": loss ", got.loss, " vs single rank ", want.loss);
    WORKER_CHECK(norm_rel < kTolerance, "step ", step + 1, ": grad norm ", got.grad_norm, " vs ", want.grad_norm);
    WORKER_CHECK(want.grad_norm > 0.5, "clipping must be active (norm ", want.grad_norm, ")");
    WORKER_CHECK(got.model_states.total() == got.model_states_analytic.total(), "model-state bytes ",
                 got.model_states.to_json().dump(), " vs formula ", got.model_states_analytic.to_json().dump());
    WORKER_CHECK(got.model_states.frozen_params > 0, "no frozen base counted");
    for (auto& p : trainer.model().parameters())
      WORKER_CHECK(p.trains() || !p.tensor.grad().defined(), "frozen ", p.name(), " has a gradient");
    if (topo->rank() == 0)
      std::fprintf(stderr, "step %d: loss %.6f (rel diff %.2g), grad norm %.5f (rel diff %.2g)\n", step + 1, got.loss,
                   loss_rel, got.grad_norm, norm_rel);
  }
  trainer.optimizer().gather_all_params();
  double worst = 0;
  std::string worst_name;
  int adapters = 0;
  for (auto& p : trainer.model().parameters()) {
    auto full = trainer.model().gather(p);
    if (!p.trains()) {
      WORKER_CHECK(torch::equal(full, base.at(p.name())), "frozen ", p.name(), " changed");
      continue;
    }
    ++adapters;
    auto ref = reference.model().parameter(p.name()).tensor.detach();
    const double diff = (full - ref).norm().item<double>() / ref.norm().item<double>();
    if (diff > worst) worst = diff, worst_name = p.name();
  }
  WORKER_CHECK(adapters > 0, "nothing trained");
  WORKER_CHECK(worst < kTolerance, "final adapter ", worst_name, " differs: relative L2 error ", worst);
  if (topo->rank() == 0)
    std::fprintf(stderr, "final adapters (%d): worst relative L2 error %.2g (%s)\n", adapters, worst, worst_name.c_str());
}

struct LoraCase {
  std::string preset;
  int world, tp, stage;
  int64_t gas;
  std::string layout = "tp";  // "sp", "overlap", "ckpt" (full recompute), "drop" (lora_dropout),
                              // "save" (modules_to_save lm_head), joined by '+'
  std::string name() const {
    std::string p = preset;
    for (auto& ch : p)
      if (ch == '-') ch = '_';
    std::string l = layout;
    for (auto& ch : l)
      if (ch == '+') ch = '_';
    return p + "_w" + std::to_string(world) + "_tp" + std::to_string(tp) + "_z" + std::to_string(stage) + "_gas" +
           std::to_string(gas) + "_" + l;
  }
};
void PrintTo(const LoraCase& c, std::ostream* os) { *os << c.name(); }

class LoraTrainParity : public ::testing::TestWithParam<LoraCase> {};

TEST_P(LoraTrainParity, MatchesSingleRankLora) {
  const auto& c = GetParam();
  json config = test::preset_config(c.preset);
  std::string dir =
      test::write_model_dir(test::make_temp_dir("lora"), config, test::reference_random_weights(config, 21));
  auto result = test::run_workers("lora_train_parity", c.world,
                                  {dir, std::to_string(c.tp), std::to_string(c.stage), std::to_string(c.gas), c.layout});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

// tp 1-4 x ZeRO 0-3 sampled: every stage at tp 2, uneven tp 3 and 4, SP and overlap,
// Qwen3 (q/k norms), Gemma 3 and Phi-3 (fused qkv / gate_up).
std::vector<LoraCase> lora_cases() {
  return {{"llama-tiny", 4, 2, 0, 2},          {"llama-tiny", 4, 2, 1, 1},
          {"llama-tiny", 4, 2, 2, 1, "overlap"}, {"llama-tiny", 4, 2, 3, 2, "sp+ckpt"},
          {"llama-tiny", 2, 1, 3, 1},          {"llama-tiny", 3, 3, 2, 1, "sp+overlap"},
          {"qwen3-tiny", 4, 4, 1, 1, "sp"},    {"gemma3-tiny", 3, 3, 3, 1, "ckpt"},
          {"phi3-tiny", 4, 4, 2, 1},           {"phi3-tiny", 4, 2, 0, 1, "sp"},
          // lora_dropout: masks from global coordinates, so every layout drops what one rank drops.
          {"llama-tiny", 4, 2, 1, 2, "drop+sp+overlap"}, {"qwen3-tiny", 3, 3, 3, 1, "drop+ckpt"},
          {"llama-tiny", 4, 4, 2, 1, "drop+overlap"},
          // modules_to_save: the vocab-parallel LM head trains in full beside the adapters.
          {"llama-tiny", 4, 2, 3, 1, "save+sp"}, {"llama-tiny", 3, 3, 1, 1, "save"}};
}

INSTANTIATE_TEST_SUITE_P(Layouts, LoraTrainParity, ::testing::ValuesIn(lora_cases()),
                         [](const auto& info) { return info.param.name(); });

// --- single-process checks ---------------------------------------------------

TEST(Lora, ZeroBStartsAtTheBaseModelsLoss) {
  auto source = llama_tiny("lora_b0", 3);
  json train = lora_train_config(1, 0, 2, 1, "tp");
  train["lora"]["init_lora_weights"] = true;  // PEFT's default: B = 0
  auto config = TrainConfig::from_json(train, "test");
  config.resolve_batch(1);
  auto single = Topology::single();
  Trainer lora(config, single, lora_model(source, config, single->tp()), nullptr, false);
  json plain_json = train;
  plain_json.erase("lora");
  auto plain_config = TrainConfig::from_json(plain_json, "test");
  plain_config.resolve_batch(1);
  Trainer plain(plain_config, single, load_model(source, TpPlan::build(source.config, {}), single->tp(), torch::kFloat32, 0),
                nullptr, false);
  torch::manual_seed(1);
  auto rows = torch::randint(0, source.config.vocab_size, {2, kSeq + 1}, torch::kLong);
  const double with_lora = lora.train_step({rows_to_batch(rows)}).loss;
  const double base = plain.train_step({rows_to_batch(rows)}).loss;
  EXPECT_EQ(with_lora, base);
  // After one step B moved, so the adapter changes the loss.
  EXPECT_NE(lora.train_step({rows_to_batch(rows)}).loss, plain.train_step({rows_to_batch(rows)}).loss);
}

// bf16: the base stays bf16 and frozen; adapters and modules_to_save train in fp32
// (cast to bf16 where the forward reads them); model states equal the formula.
TEST(Lora, Bf16TrainsModulesToSaveInFp32BesideTheFrozenBase) {
  auto source = llama_tiny("lora_bf16", 4);
  json train = lora_train_config(1, 3, 2, 1, "save");
  train["bf16"] = {{"enabled", true}};
  auto config = TrainConfig::from_json(train, "test");
  config.resolve_batch(1);
  auto single = Topology::single();
  Trainer trainer(config, single, lora_model(source, config, single->tp(), torch::kBFloat16), nullptr, false);
  trainer.optimizer().gather_all_params();
  const torch::Tensor head0 = trainer.model().parameter("lm_head.weight").tensor.detach().clone();
  const torch::Tensor q0 = trainer.model().parameter("model.layers.0.self_attn.q_proj.weight").tensor.detach().clone();
  EXPECT_EQ(head0.scalar_type(), torch::kFloat32);
  EXPECT_EQ(q0.scalar_type(), torch::kBFloat16);
  torch::manual_seed(2);
  for (int step = 0; step < 2; ++step) {
    auto rows = torch::randint(0, source.config.vocab_size, {2, kSeq + 1}, torch::kLong);
    auto m = trainer.train_step({rows_to_batch(rows)});
    EXPECT_TRUE(std::isfinite(m.loss));
    EXPECT_EQ(m.model_states.total(), m.model_states_analytic.total())
        << m.model_states.to_json().dump() << " vs " << m.model_states_analytic.to_json().dump();
    EXPECT_EQ(m.model_states.master_weights, 0);  // fp32 trained tensors are their own master
  }
  trainer.optimizer().gather_all_params();
  EXPECT_FALSE(torch::equal(trainer.model().parameter("lm_head.weight").tensor.detach(), head0));
  EXPECT_TRUE(torch::equal(trainer.model().parameter("model.layers.0.self_attn.q_proj.weight").tensor.detach(), q0));
}

TEST(Lora, PlanPlacesFactorsByTheBaseRole) {
  auto source = resolve_model("preset:llama-tiny");
  TpPlanOptions options;
  options.tp_size = 3;
  LoraConfig lora;
  lora.enabled = true;
  lora.r = 4;
  lora.all_linear = true;
  const TpPlan plan = with_lora(TpPlan::build(source.config, options), lora);
  const auto& q = plan.entry("model.layers.0.self_attn.q_proj.weight");
  const auto& qa = plan.entry("model.layers.0.self_attn.q_proj.lora_A.weight");
  const auto& qb = plan.entry("model.layers.0.self_attn.q_proj.lora_B.weight");
  EXPECT_TRUE(q.frozen);
  EXPECT_TRUE(qa.spec.is_replicated());
  EXPECT_TRUE(qa.partial_grad);
  EXPECT_EQ(qb.spec.dim(), 0);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(qb.spec.segments(r), q.spec.segments(r));
  const auto& o = plan.entry("model.layers.0.self_attn.o_proj.weight");
  const auto& oa = plan.entry("model.layers.0.self_attn.o_proj.lora_A.weight");
  const auto& ob = plan.entry("model.layers.0.self_attn.o_proj.lora_B.weight");
  EXPECT_EQ(oa.spec.dim(), 1);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(oa.spec.segments(r), o.spec.segments(r));
  EXPECT_TRUE(ob.spec.is_replicated());
  EXPECT_TRUE(ob.partial_grad);
  EXPECT_FALSE(plan.contains("lm_head.lora_A.weight"));  // all-linear leaves the output head out
  EXPECT_NE(plan.table().find("LoRA: split like the base's input"), std::string::npos);
}

TEST(Lora, BadConfigsNameTheKeyAndTheAllowedValues) {
  auto source = resolve_model("preset:llama-tiny");
  const TpPlan plan = TpPlan::build(source.config, {});
  auto config = [](json lora) { return TrainConfig::from_json({{"lora", lora}}, "c.json").lora; };
  LoraConfig nothing = config({{"target_modules", {"c_attn"}}});
  std::string e = test::user_error_of([&] { with_lora(plan, nothing); });
  EXPECT_NE(e.find("matches no linear layer"), std::string::npos) << e;
  EXPECT_NE(e.find("model.layers.0.self_attn.q_proj"), std::string::npos) << e;
  e = test::user_error_of([&] { config({{"r", 0}}); });
  EXPECT_NE(e.find("lora.r"), std::string::npos) << e;
  e = test::user_error_of([&] { config({{"use_dora", true}}); });
  EXPECT_NE(e.find("DoRA"), std::string::npos) << e;
  e = test::user_error_of([&] { config({{"peft_type", "LOHA"}}); });
  EXPECT_NE(e.find("peft_type"), std::string::npos) << e;
  e = test::user_error_of([&] { config({{"bias", "some"}}); });
  EXPECT_NE(e.find("lora_only"), std::string::npos) << e;
  e = test::user_error_of([&] { with_lora(plan, config({{"target_modules", {"lm_head"}}})); });
  EXPECT_NE(e.find("output head"), std::string::npos) << e;
  auto moe = resolve_model("preset:mixtral-tiny");
  e = test::user_error_of([&] { with_lora(TpPlan::build(moe.config, {}), config({{"target_modules", {"w1"}}})); });
  EXPECT_NE(e.find("mixture-of-experts"), std::string::npos) << e;
  // An adapter for another architecture: Phi-3's (fused qkv_proj, gate_up_proj) on a Llama of the same widths.
  Comm self;
  e = test::user_error_of([&] {
    auto llama = resolve_model(kModels + "llama_v5");
    auto m = load_model(llama, with_lora(TpPlan::build(llama.config, {}), read_adapter_config(kAdapters + "phi3_all_linear")),
                        self, torch::kFloat32, 0);
    load_adapter_weights(*m, kAdapters + "phi3_all_linear");
  });
  EXPECT_NE(e.find("not trained parameters"), std::string::npos) << e;
  EXPECT_NE(e.find("qkv_proj"), std::string::npos) << e;
  // An adapter whose shapes do not fit (Llama's adapter on a model with other widths).
  auto wide_source = resolve_model("preset:llama-tiny");
  e = test::user_error_of([&] {
    auto m = load_model(wide_source, with_lora(TpPlan::build(wide_source.config, {}),
                                               read_adapter_config(kAdapters + "llama_qkvo")),
                        self, torch::kFloat32, 0);
    load_adapter_weights(*m, kAdapters + "llama_qkvo");
  });
  EXPECT_NE(e.find("do not fit"), std::string::npos) << e;
}

}  // namespace
}  // namespace autotp
