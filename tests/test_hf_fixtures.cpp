// autotp against HF transformers' own modeling code: every supported architecture,
// saved by transformers 4.57.6 and by 5.25.0 (tests/data/hf_models, made by its
// make_fixtures.py), loaded at tp 1-4; the logits, loss (load-balancing term
// included) and every weight gradient equal the ones HF computed, in fp32.
#include <gtest/gtest.h>

#include <regex>

#include "autotp/io/safetensors.h"
#include "autotp/model/presets.h"
#include "support/checks.h"
#include "support/model_fixtures.h"
#include "support/multiprocess.h"

namespace autotp {
namespace {

const std::string kFixtures = AUTOTP_SOURCE_DIR "/tests/data/hf_models/";
constexpr double kTolerance = 1e-5;  // relative to the largest magnitude of each compared tensor

struct Comparison {
  double loss = 0, logits = 0, worst_grad = 0;
  std::string worst_grad_name;
};

// HF's causal LM loss on labels = input_ids: every position predicts the next id,
// the mean over the B x (T - 1) predictions, plus router_aux_loss_coef x the
// load-balancing loss for mixtures of experts. Compares with reference.safetensors.
Comparison compare_with_hf(CausalLM& model, const std::string& reference_dir, int tp_rank) {
  auto reference = io::SafetensorsFile::open(reference_dir + "/reference.safetensors");
  const torch::Tensor ids = reference->read("input_ids");
  auto targets = torch::full_like(ids, -100);
  targets.narrow(1, 0, ids.size(1) - 1).copy_(ids.narrow(1, 1, ids.size(1) - 1));
  auto losses = model.token_losses(ids, targets);
  auto loss = losses.sum() / (targets != -100).sum();
  const double coef = model.config().router_aux_loss_enabled() ? model.config().router_aux_loss_coef : 0;
  const double aux = model.router_aux_loss(coef);
  loss.backward();
  model.sync_shared_grads();
  Comparison c;
  const double hf_loss = reference->read("loss").item<double>();
  c.loss = std::abs(loss.item<double>() + coef * aux - hf_loss) / std::abs(hf_loss);
  c.logits = test::relative_max_diff(model.full_logits(ids), reference->read("logits"));
  const std::string prefix = model.config().base_prefix();
  for (auto& p : model.parameters()) {
    std::string stored = "grad." + p.name();
    if (!reference->contains(stored)) stored = "grad." + p.name().substr(prefix.size());
    const torch::Tensor grad = model.gather_grad(p);
    if (tp_rank != 0) continue;
    if (!reference->contains(stored)) throw std::runtime_error("reference.safetensors has no " + stored);
    const double diff = test::relative_max_diff(grad, reference->read(stored));
    if (diff >= c.worst_grad) c.worst_grad = diff, c.worst_grad_name = p.name();
  }
  return c;
}

std::string describe(const Comparison& c) {
  char text[512];
  std::snprintf(text, sizeof text, "loss %.2e, logits %.2e, worst gradient %.2e (%s)", c.loss, c.logits, c.worst_grad,
                c.worst_grad_name.c_str());
  return text;
}

// args: the model directory, and the fixture whose reference it must match (default: itself).
AUTOTP_WORKER(hf_fixture_parity) {
  const std::string dir = ctx.args.at(0);
  const std::string reference_dir = ctx.args.size() > 1 ? ctx.args[1] : dir;
  auto topo = ctx.topology(ctx.env.world_size);
  auto source = resolve_model(dir);
  TpPlanOptions options;
  options.tp_size = topo->tp_size();
  auto model = load_model(source, TpPlan::build(source.config, options), topo->tp(), torch::kFloat32, 0);
  const Comparison c = compare_with_hf(*model, reference_dir, topo->tp_rank());
  if (topo->rank() != 0) return;
  std::fprintf(stderr, "%s at tp %d: %s\n", dir.c_str(), topo->tp_size(), describe(c).c_str());
  WORKER_CHECK(c.loss < kTolerance && c.logits < kTolerance && c.worst_grad < kTolerance, "against HF: ",
               describe(c));
}

const std::vector<std::string>& architectures() {
  static const std::vector<std::string> names = {"llama",   "mistral", "qwen2",     "qwen3",     "phi3", "gemma2",
                                                 "gemma3",  "mixtral", "qwen2_moe", "qwen3_moe", "gpt2"};
  return names;
}

std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  for (const auto& arch : architectures())
    for (const char* generation : {"v4", "v5"}) names.push_back(arch + "_" + generation);
  return names;
}

class HfFixture : public ::testing::TestWithParam<std::string> {};

// tp 1 in this process.
TEST_P(HfFixture, SingleRankMatchesHfModelingCode) {
  const std::string dir = kFixtures + GetParam();
  auto source = resolve_model(dir);
  Comm self;
  auto model = load_model(source, TpPlan::build(source.config, {}), self, torch::kFloat32, 0);
  const Comparison c = compare_with_hf(*model, dir, 0);
  std::fprintf(stderr, "%s at tp 1: %s\n", GetParam().c_str(), describe(c).c_str());
  EXPECT_LT(c.loss, kTolerance) << describe(c);
  EXPECT_LT(c.logits, kTolerance) << describe(c);
  EXPECT_LT(c.worst_grad, kTolerance) << describe(c);
}

INSTANTIATE_TEST_SUITE_P(Generations, HfFixture, ::testing::ValuesIn(fixture_names()),
                         [](const auto& info) { return info.param; });

struct TpCase {
  std::string fixture;
  int tp;
};
void PrintTo(const TpCase& c, std::ostream* os) { *os << c.fixture << "_tp" << c.tp; }

class HfFixtureTp : public ::testing::TestWithParam<TpCase> {};

TEST_P(HfFixtureTp, ShardedMatchesHfModelingCode) {
  auto result = test::run_workers("hf_fixture_parity", GetParam().tp, {kFixtures + GetParam().fixture});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

// Each fixture at one of tp 2, 3, 4 in turn, so an architecture's two generations
// run at different sizes (6 query heads, 2 kv heads, intermediate 32 and 96-entry
// vocabularies split unevenly at 4).
std::vector<TpCase> tp_cases() {
  std::vector<TpCase> cases;
  int next = 0;
  for (const auto& name : fixture_names()) cases.push_back({name, 2 + next++ % 3});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Generations, HfFixtureTp, ::testing::ValuesIn(tp_cases()), [](const auto& info) {
  return info.param.fixture + "_tp" + std::to_string(info.param.tp);
});

// A fixture rewritten in transformers 5's in-memory layout (save_original_format=False):
// each layer's experts fused into mlp.experts.gate_up_proj / down_proj, Mixtral's
// block_sparse_moe renamed mlp. The same weights, so HF's reference still holds.
std::string fused_copy(const std::string& fixture) {
  const std::string from = kFixtures + fixture;
  const std::string dir = test::make_temp_dir("fused_" + fixture);
  auto file = io::SafetensorsFile::open(from + "/model.safetensors");
  static const std::regex expert(R"(^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$)");
  std::map<std::string, std::map<int64_t, torch::Tensor>> gates, ups, downs;  // by layer prefix, then expert
  io::NamedTensors tensors;
  for (const auto& info : file->tensors()) {
    std::smatch m;
    const std::string name = info.name;
    if (std::regex_match(name, m, expert)) {
      const std::string proj = m[3];
      auto& into = proj == "w1" || proj == "gate_proj" ? gates : proj == "w3" || proj == "up_proj" ? ups : downs;
      into[m[1]][std::stoll(m[2])] = file->read(name);
      continue;
    }
    std::string renamed = name;
    const size_t at = renamed.find(".block_sparse_moe.");
    if (at != std::string::npos) renamed.replace(at, 18, ".mlp.");
    tensors.emplace_back(renamed, file->read(name));
  }
  for (const auto& [layer, experts] : gates) {
    std::vector<torch::Tensor> gate_up, down;
    for (const auto& [e, gate] : experts) {
      gate_up.push_back(torch::cat({gate, ups[layer][e]}, 0));
      down.push_back(downs[layer][e]);
    }
    tensors.emplace_back(layer + ".mlp.experts.gate_up_proj", torch::stack(gate_up));
    tensors.emplace_back(layer + ".mlp.experts.down_proj", torch::stack(down));
  }
  io::write_checkpoint(dir, tensors);
  std::filesystem::copy_file(from + "/config.json", dir + "/config.json");
  return dir;
}

TEST(HfFixtureFusedExperts, Transformers5InMemoryLayoutReadsAsPerExpert) {
  for (const char* fixture : {"mixtral_v5", "qwen2_moe_v5", "qwen3_moe_v5"}) {
    const std::string dir = fused_copy(fixture);
    auto source = resolve_model(dir);
    Comm self;
    auto model = load_model(source, TpPlan::build(source.config, {}), self, torch::kFloat32, 0);
    const Comparison c = compare_with_hf(*model, kFixtures + fixture, 0);
    std::fprintf(stderr, "%s fused at tp 1: %s\n", fixture, describe(c).c_str());
    EXPECT_LT(c.loss, kTolerance) << fixture << ": " << describe(c);
    EXPECT_LT(c.logits, kTolerance) << fixture << ": " << describe(c);
    EXPECT_LT(c.worst_grad, kTolerance) << fixture << ": " << describe(c);
  }
  // Sharded: each rank reads its slice of every expert from the fused tensors.
  auto result = test::run_workers("hf_fixture_parity", 3, {fused_copy("mixtral_v5"), kFixtures + "mixtral_v5"});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

}  // namespace
}  // namespace autotp
