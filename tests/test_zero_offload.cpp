// ZeRO-Offload on real Gloo ranks (CPU devices run the offload path with host
// buffers): offload_optimizer at stages 1-3 and offload_param at stage 3 train
// bit for bit as without offload (fp32 and bf16, gradient accumulation, overlap, tp 1-3),
// their model-state bytes equal the formula and move exactly the offloaded
// states to host memory; a checkpoint resumes bit for bit, and reshards between
// offload and no offload at other tp / dp / stage.
#include <gtest/gtest.h>

#include <cmath>

#include "autotp/checkpoint/checkpointing.h"
#include "autotp/model/presets.h"
#include "autotp/runtime/trainer.h"
#include "support/checks.h"
#include "support/model_fixtures.h"
#include "support/multiprocess.h"

namespace autotp {
namespace {

using nlohmann::json;

constexpr int64_t kSeq = 12;
constexpr int64_t kGlobal = 8;  // rows a step, whatever the layout

int64_t micro_batch(int dp, int64_t gas) { return kGlobal / (dp * gas); }

struct OffloadLayout {
  int stage = 1;
  bool optimizer = false, params = false;
  int64_t gas = 1;
  bool bf16 = false, overlap = false;
};

json offload_config(int tp, int dp, const OffloadLayout& l) {
  json zero = {{"stage", l.stage},
               {"reduce_bucket_size", 700},
               {"allgather_bucket_size", 500},
               {"overlap_comm", l.overlap},
               {"stage3_param_persistence_threshold", 100}};
  if (l.optimizer) zero["offload_optimizer"] = {{"device", "cpu"}, {"pin_memory", true}};
  if (l.params) zero["offload_param"] = {{"device", "cpu"}, {"pin_memory", true}};
  return {{"train_micro_batch_size_per_gpu", micro_batch(dp, l.gas)},
          {"gradient_accumulation_steps", l.gas},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.1}}}}},
          {"gradient_clipping", 0.5},
          {"bf16", {{"enabled", l.bf16}}},
          {"zero_optimization", zero},
          {"tensor_parallel", {{"autotp_size", tp}}}};
}

std::unique_ptr<Trainer> make_trainer(const std::shared_ptr<Topology>& topo, const OffloadLayout& l,
                                      uint64_t weight_seed) {
  auto config = TrainConfig::from_json(offload_config(topo->tp_size(), topo->dp_size(), l), "test");
  config.resolve_batch(topo->world_size());
  return std::make_unique<Trainer>(
      config, topo, test::sharded_preset("llama-tiny", *topo, training_dtype(config), weight_seed), nullptr, false);
}

// Step `step`'s micro-batches for this rank: the same global rows whatever the layout.
std::vector<Batch> batches(const Topology& topo, int64_t gas, int step) {
  const int64_t micro = micro_batch(topo.dp_size(), gas);
  torch::manual_seed(100 + step);
  auto rows = torch::randint(0, 259, {kGlobal, kSeq + 1}, torch::kLong);
  std::vector<Batch> mine;
  for (int64_t j = 0; j < gas; ++j) {
    auto r = rows.narrow(0, (j * topo.dp_size() + topo.dp_rank()) * micro, micro);
    mine.push_back({r.narrow(1, 0, kSeq).contiguous(), r.narrow(1, 1, kSeq).clone()});
  }
  return mine;
}

double relative(double got, double want) { return std::abs(got - want) / std::max(std::abs(want), 1e-30); }

OffloadLayout parse_layout(const std::string& text) {
  OffloadLayout l;
  l.stage = text.at(1) - '0';  // "z<stage>[+gas2][+bf16][+overlap]"
  l.gas = text.find("gas2") != std::string::npos ? 2 : 1;
  l.bf16 = text.find("bf16") != std::string::npos;
  l.overlap = text.find("overlap") != std::string::npos;
  return l;
}

// A trains without offload, B with it, on the same ranks, weights and batches.
AUTOTP_WORKER(offload_parity) {
  const int tp = std::stoi(ctx.args.at(0));
  OffloadLayout plain = parse_layout(ctx.args.at(1)), offloaded = plain;
  offloaded.optimizer = true;
  offloaded.params = ctx.args.at(2) == "params";
  auto topo = ctx.topology(tp);
  auto a = make_trainer(topo, plain, 3), b = make_trainer(topo, offloaded, 3);
  for (int step = 0; step < 3; ++step) {
    auto want = a->train_step(batches(*topo, plain.gas, step));
    auto got = b->train_step(batches(*topo, plain.gas, step));
    // The same kernels on the same values (the update on host buffers of a CPU
    // device): bit-identical, tighter than the 1e-6 the path must meet.
    WORKER_CHECK(got.loss == want.loss, "step ", step + 1, ": loss ", got.loss, " with offload vs ", want.loss);
    WORKER_CHECK(got.grad_norm == want.grad_norm, "step ", step + 1, ": grad norm ", got.grad_norm, " vs ",
                 want.grad_norm);
    // The formula holds field by field, and the device keeps what it kept less what went to the host.
    const ModelStateBytes& m = got.model_states;
    WORKER_CHECK(m.to_json() == got.model_states_analytic.to_json(), "model states ", m.to_json().dump(),
                 " vs formula ", got.model_states_analytic.to_json().dump());
    const ModelStateBytes& w = want.model_states;
    const int64_t param_host = m.host - m.master_weights - m.optimizer_states - m.offload_buffers;
    WORKER_CHECK(m.host > 0 && (param_host > 0) == offloaded.params, "host bytes ", m.to_json().dump());
    WORKER_CHECK(m.total() - m.host == w.total() - w.master_weights - w.optimizer_states - param_host,
                 "device bytes with offload ", m.to_json().dump(), " vs without ", w.to_json().dump());
    WORKER_CHECK(m.optimizer_states == w.optimizer_states, "optimizer states differ in size");
  }
  b->optimizer().gather_all_params();
  a->optimizer().gather_all_params();
  for (auto& p : a->model().parameters()) {
    auto want = a->model().gather(p);
    auto got = b->model().gather(b->model().parameter(p.name()));
    WORKER_CHECK(torch::equal(got, want), p.name(), " after 3 steps: relative difference ",
                 test::relative_max_diff(got.to(torch::kFloat32), want.to(torch::kFloat32)));
  }
  if (topo->rank() == 0)
    std::fprintf(stderr, "tp %d %s offload %s: losses, norms and weights bit-identical\n", tp, ctx.args.at(1).c_str(),
                 ctx.args.at(2).c_str());
}

struct ParityCase {
  int world, tp;
  std::string layout, offload;  // offload: "optimizer" or "params"
  std::string name() const {
    std::string l = layout;
    for (auto& ch : l)
      if (ch == '+') ch = '_';
    return "w" + std::to_string(world) + "_tp" + std::to_string(tp) + "_" + l + "_" + offload;
  }
};
void PrintTo(const ParityCase& c, std::ostream* os) { *os << c.name(); }

class OffloadParity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(OffloadParity, TrainsAsWithoutOffload) {
  const auto& c = GetParam();
  auto result = test::run_workers("offload_parity", c.world, {std::to_string(c.tp), c.layout, c.offload});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

// Every stage that offloads, fp32 and bf16, accumulation (fp32 accumulation in
// bf16), overlap, uneven tp 3, dp 1.
INSTANTIATE_TEST_SUITE_P(Layouts, OffloadParity,
                         ::testing::Values(ParityCase{4, 2, "z1", "optimizer"}, ParityCase{4, 1, "z2+gas2", "optimizer"},
                                           ParityCase{4, 2, "z2+bf16+overlap", "optimizer"},
                                           ParityCase{4, 2, "z3+gas2+bf16", "params"},
                                           ParityCase{3, 3, "z3+overlap", "params"},
                                           ParityCase{4, 2, "z1+gas2+bf16", "optimizer"},
                                           ParityCase{2, 2, "z3", "optimizer"}),
                         [](const auto& info) { return info.param.name(); });

void expect_same_states(Trainer& got, Trainer& want, bool bf16) {
  auto pg = got.optimizer().partition_state(), pw = want.optimizer().partition_state();
  test::worker_expect_equal(pg.params, pw.params, "parameter partition");
  if (bf16) test::worker_expect_equal(pg.master_weights, pw.master_weights, "master weights");
  for (size_t k = 0; k < pw.optimizer.size(); ++k)
    test::worker_expect_equal(pg.optimizer[k].second, pw.optimizer[k].second, pw.optimizer[k].first);
  WORKER_CHECK(pg.optimizer_steps == pw.optimizer_steps, "optimizer steps");
}

// A (offload) runs 6 steps; B (offload) runs 3 and saves; C (offload, other
// weights) loads and must repeat A's steps 4-6 bit for bit. D (no offload, tp
// 1 x dp 4, stage 1) loads B's checkpoint; E (offload of both at stage 3,
// tp 2) loads one saved without offload: both continue within 1e-5 of A.
AUTOTP_WORKER(offload_resume) {
  const std::string root = ctx.args.at(0);
  const bool bf16 = ctx.args.at(1) == "bf16";
  auto topo = ctx.topology(2);
  OffloadLayout offloaded{2, true, false, 2, bf16, false};
  auto a = make_trainer(topo, offloaded, 0);
  std::vector<StepMetrics> want;
  for (int s = 0; s < 6; ++s) want.push_back(a->train_step(batches(*topo, 2, s)));
  auto b = make_trainer(topo, offloaded, 0);
  for (int s = 0; s < 3; ++s) b->train_step(batches(*topo, 2, s));
  save_checkpoint(*b, root + "/offloaded");
  auto c = make_trainer(topo, offloaded, 99);
  WORKER_CHECK(load_checkpoint(*c, root + "/offloaded") == 3, "resumed at the wrong step");
  for (int s = 3; s < 6; ++s) {
    auto got = c->train_step(batches(*topo, 2, s));
    WORKER_CHECK(got.loss == want[s].loss && got.grad_norm == want[s].grad_norm, "step ", s + 1, ": loss ", got.loss,
                 " grad norm ", got.grad_norm, " after resume vs ", want[s].loss, " ", want[s].grad_norm);
  }
  expect_same_states(*c, *a, bf16);

  const double tolerance = bf16 ? 1e-3 : 1e-5;  // bf16: other layouts round other sums
  double worst = 0;
  auto check_continues = [&](Trainer& t, const Topology& on, const std::string& what) {
    for (int s = 3; s < 6; ++s) {
      const double got = t.train_step(batches(on, 2, s)).loss;
      worst = std::max(worst, relative(got, want[s].loss));
      WORKER_CHECK(relative(got, want[s].loss) < tolerance, what, " step ", s + 1, ": loss ", got, " vs ",
                   want[s].loss, " (relative ", relative(got, want[s].loss), ")");
    }
  };
  auto dp4 = ctx.topology(1);
  auto d = make_trainer(dp4, OffloadLayout{1, false, false, 2, bf16, false}, 99);
  WORKER_CHECK(load_checkpoint(*d, root + "/offloaded") == 3, "reshard: wrong step");
  check_continues(*d, *dp4, "offloaded tp 2 stage 2 -> plain tp 1 stage 1");

  auto plain = make_trainer(dp4, OffloadLayout{2, false, false, 2, bf16, false}, 0);
  for (int s = 0; s < 3; ++s) plain->train_step(batches(*dp4, 2, s));
  save_checkpoint(*plain, root + "/plain");
  auto e = make_trainer(topo, OffloadLayout{3, true, true, 2, bf16, true}, 99);
  WORKER_CHECK(load_checkpoint(*e, root + "/plain") == 3, "reshard: wrong step");
  check_continues(*e, *topo, "plain tp 1 stage 2 -> offloaded tp 2 stage 3 with parameters");
  if (topo->rank() == 0)
    std::fprintf(stderr, "%s: offload resume bit for bit; reshards to and from offload continue (worst loss %.3g)\n",
                 bf16 ? "bf16" : "fp32", worst);
}

class OffloadResume : public ::testing::TestWithParam<std::string> {};

TEST_P(OffloadResume, ContinuesBitForBitAndReshards) {
  const std::string dir = test::make_temp_dir("offload_resume");
  auto result = test::run_workers("offload_resume", 4, {dir, GetParam()});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, OffloadResume, ::testing::Values("fp32", "bf16"));

// --- configuration ------------------------------------------------------------

TrainConfig read_zero(const json& zero) {
  return TrainConfig::from_json({{"train_micro_batch_size_per_gpu", 1}, {"zero_optimization", zero}}, "ds.json");
}

TEST(OffloadConfig, ParamOffloadNeedsTheOptimizerOffloadedToo) {
  const std::string message = test::user_error_of([] {
    read_zero({{"stage", 3}, {"offload_param", {{"device", "cpu"}}}});
  });
  EXPECT_NE(message.find("zero_optimization.offload_param.device is \"cpu\" but zero_optimization.offload_optimizer."
                         "device is not"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("allowed: offload_optimizer {\"device\": \"cpu\"} as well"), std::string::npos) << message;
}

TEST(OffloadConfig, AppliesWhereDeepSpeedAppliesIt) {
  auto z0 = read_zero({{"stage", 0}, {"offload_optimizer", {{"device", "cpu"}}}}).zero;
  EXPECT_FALSE(z0.offloads_optimizer());  // stage 0: ignored (a warning)
  auto z2 = read_zero({{"stage", 2},
                       {"offload_optimizer", {{"device", "cpu"}, {"pin_memory", true}}},
                       {"offload_param", {{"device", "cpu"}}}})
                .zero;
  EXPECT_TRUE(z2.offloads_optimizer());
  EXPECT_TRUE(z2.offload_optimizer_pin_memory);
  EXPECT_FALSE(z2.offloads_params());  // below stage 3: ignored (a warning)
  auto z3 = read_zero({{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}}}, {"offload_param", {{"device", "cpu"}}}})
                .zero;
  EXPECT_TRUE(z3.offloads_params());
  EXPECT_FALSE(z3.offload_param_pin_memory);  // DeepSpeed's default
  EXPECT_EQ(z3.to_json()["offload_param"], json({{"device", "cpu"}, {"pin_memory", false}}));
}

}  // namespace
}  // namespace autotp
