// Expert parallelism: the ep / edp groups, the placement of experts, the
// all-to-all on every CPU transport, the token exchange against the ep-1 loop,
// and training at ep 2-4 x tp 1-2 x ZeRO 0-3 against one rank (fp32).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "autotp/base/error.h"
#include "autotp/checkpoint/checkpointing.h"
#include "autotp/comm/autograd_collectives.h"
#include "autotp/model/expert_dispatch.h"
#include "autotp/io/safetensors.h"
#include "autotp/model/presets.h"
#include "autotp/runtime/trainer.h"
#include "support/checks.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"
#include "support/multiprocess.h"
#include "support/reference_models.h"

namespace autotp {
namespace {

using nlohmann::json;
using test::user_error_of;

TEST(ExpertTopology, EpGroupsAreContiguousDpRanksAndEdpGroupsTheirStride) {
  // world 8 = dp 4 x tp 2, ep 2: rank 5 is dp rank 2, tp rank 1.
  EXPECT_EQ(Topology::ep_group_ranks(5, 8, 2, 2), (std::vector<int>{5, 7}));
  EXPECT_EQ(Topology::edp_group_ranks(5, 8, 2, 2), (std::vector<int>{1, 5}));
  EXPECT_EQ(Topology::ep_group_ranks(2, 8, 2, 4), (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(Topology::edp_group_ranks(2, 8, 2, 4), (std::vector<int>{2}));
  EXPECT_EQ(Topology::ep_group_ranks(3, 4, 1, 1), (std::vector<int>{3}));
  EXPECT_EQ(Topology::edp_group_ranks(3, 4, 1, 1), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_NE(user_error_of([] { Topology::validate_ep(8, 2, 3); })
                .find("autoep_size 3 does not divide world size / autotp_size = 4 (allowed: 1, 2, 4)"),
            std::string::npos);
}

TEST(ExpertPlacementRanges, UnevenRangesHoldEveryExpertOnceTheFirstRanksTakingTheRest) {
  const ExpertPlacement five_over_two{2, 0, 5};
  EXPECT_EQ(five_over_two.count(0), 3);
  EXPECT_EQ(five_over_two.count(1), 2);
  EXPECT_EQ(five_over_two.first(1), 3);
  const ExpertPlacement five_over_four{4, 0, 5};
  std::vector<int> owners;
  for (int64_t e = 0; e < 5; ++e) owners.push_back(five_over_four.owner(e));
  EXPECT_EQ(owners, (std::vector<int>{0, 0, 1, 2, 3}));
  EXPECT_EQ(five_over_four.max_per_rank(), 2);
  EXPECT_EQ(five_over_four.first(3), 4);
}

TEST(ExpertParallelConfigRead, BadInputNamesTheKeyAndTheAllowedValues) {
  const ModelConfig mixtral = ModelConfig::from_json(test::preset_config("mixtral-tiny"), "mixtral");
  const ModelConfig llama = ModelConfig::from_json(test::preset_config("llama-tiny"), "llama");
  auto read = [](const json& section) {
    const json top = {{"expert_parallel", section}};
    return ExpertParallelConfig::read(JsonSection(top, "", "test.json", {"expert_parallel"}));
  };
  const auto on = read({{"enabled", true}, {"autoep_size", 2}});
  EXPECT_EQ(on.size(), 2);
  EXPECT_EQ(read({{"autoep_size", 4}}).size(), 4);  // a size alone turns it on
  EXPECT_EQ(read({{"enabled", false}, {"autoep_size", 4}}).size(), 1);
  EXPECT_NE(user_error_of([&] { on.validate(llama, 4, 1); }).find("expert_parallel.enabled: LlamaForCausalLM is a dense model"),
            std::string::npos);
  EXPECT_NE(user_error_of([&] { read({{"autoep_size", 3}}).validate(mixtral, 4, 1); })
                .find("autoep_size 3 must divide world size / autotp_size = 4 and be at most the 5 experts (allowed: 1, 2, 4)"),
            std::string::npos);
  EXPECT_NE(user_error_of([&] { read({{"autoep_size", 8}}).validate(mixtral, 8, 1); }).find("(allowed: 1, 2, 4)"),
            std::string::npos);
  EXPECT_NE(user_error_of([&] {
              read({{"autoep_size", 2}, {"expert_tensor_parallel_size", 1}}).validate(mixtral, 4, 2);
            }).find("expert_tensor_parallel_size 1"),
            std::string::npos);
  EXPECT_NE(user_error_of([&] { read({{"autoep_size", 2}, {"capacity_factor", 1.0}}); }).find("capacity_factor"),
            std::string::npos);
  EXPECT_NE(user_error_of([&] { read({{"autoep_size", 0}}); }).find("expert_parallel.autoep_size"), std::string::npos);
  EXPECT_NO_THROW(read({{"autoep_size", 2}, {"expert_tensor_parallel_size", 2}}).validate(mixtral, 4, 2));
}

TEST(ExpertPlanPlacement, OtherRanksExpertsAreRemoteAndNotAllocated) {
  const ModelConfig config = ModelConfig::from_json(test::preset_config("qwen2-moe-tiny"), "qwen2-moe");
  const TpPlan plan = place_experts(TpPlan::build(config, {}), ExpertPlacement{4, 1, config.num_experts});
  int held = 0, remote = 0;
  for (const auto& e : plan.entries()) {
    if (e.expert < 0) {
      EXPECT_FALSE(e.remote) << e.desc.name;  // the shared expert and the router stay on every rank
      continue;
    }
    (e.remote ? remote : held) += 1;
    EXPECT_EQ(e.remote, e.expert != 2 && e.expert != 3) << e.desc.name;  // 6 experts over 4: 2, 2, 1, 1
  }
  int sparse = 0;
  for (int64_t l = 0; l < config.num_layers; ++l) sparse += config.is_sparse(l) ? 1 : 0;
  EXPECT_EQ(sparse, 2);
  EXPECT_EQ(held, 2 * 3 * sparse);  // two experts of three projections per sparse layer
  EXPECT_EQ(remote, 4 * 3 * sparse);
  auto topo = Topology::single();
  CausalLM model(config, plan, topo->tp());
  for (auto& p : model.parameters()) EXPECT_FALSE(p.entry->remote) << p.name();
  EXPECT_EQ(model.parameters().size(), plan.entries().size() - static_cast<size_t>(remote));
}

// Rank r sends (r + j) % 3 rows of [r, j, i, ...] to rank j (none for some pairs),
// `width` features per row; checks the rows received and the gradient sent back.
AUTOTP_WORKER(all_to_all_rows) {
  const int64_t width = std::stoll(ctx.args.at(0));
  const auto dtype = ctx.args.at(1) == "bf16" ? torch::kBFloat16 : torch::kFloat32;
  auto topo = ctx.topology(1);
  Comm& world = topo->world();
  const int n = world.size(), me = world.rank();
  auto rows_from = [&](int from, int to) { return static_cast<int64_t>((from + to) % 3); };
  auto row = [&](int from, int to, int64_t i) {
    return torch::arange(width, torch::kFloat32).add_(static_cast<double>(1000 * from + 100 * to + 10 * i)).remainder_(251).to(dtype);
  };
  std::vector<torch::Tensor> sent;
  std::vector<int64_t> send, recv;
  for (int j = 0; j < n; ++j) {
    send.push_back(rows_from(me, j));
    recv.push_back(rows_from(j, me));
    for (int64_t i = 0; i < rows_from(me, j); ++i) sent.push_back(row(me, j, i));
  }
  auto input = (sent.empty() ? torch::empty({0, width}, dtype) : torch::stack(sent)).requires_grad_(dtype == torch::kFloat32);
  auto got = all_to_all_rows(input, world, send, recv);
  std::vector<torch::Tensor> want;
  for (int j = 0; j < n; ++j)
    for (int64_t i = 0; i < rows_from(j, me); ++i) want.push_back(row(j, me, i));
  test::worker_expect_equal(got.detach(), want.empty() ? torch::empty({0, width}, dtype) : torch::stack(want),
                            "received rows");
  WORKER_CHECK(world.stats().all_to_all_calls == 1, "all_to_all_calls ", world.stats().all_to_all_calls);
  if (dtype != torch::kFloat32) return;
  // The gradient of sum(out * (me + 1)) goes back to the senders: rank j's rows for me get me + 1.
  (got * static_cast<double>(me + 1)).sum().backward();
  std::vector<torch::Tensor> grad_want;
  for (int j = 0; j < n; ++j) grad_want.push_back(torch::full({rows_from(me, j), width}, static_cast<double>(j + 1)));
  test::worker_expect_equal(input.grad(), torch::cat(grad_want), "gradient routed back");
}

struct AllToAllCase {
  int world;
  int64_t width;
  std::string dtype;
  bool shared_memory;
};
void PrintTo(const AllToAllCase& c, std::ostream* os) {
  *os << "w" << c.world << "_width" << c.width << "_" << c.dtype << (c.shared_memory ? "_shm" : "_gloo");
}
class AllToAll : public ::testing::TestWithParam<AllToAllCase> {};
TEST_P(AllToAll, RowsArriveInRankOrderAndGradientsGoBack) {
  const auto& c = GetParam();
  std::map<std::string, std::string> env;
  if (!c.shared_memory) env["AUTOTP_SHARED_MEMORY"] = "0";
  auto result = test::run_workers("all_to_all_rows", c.world, {std::to_string(c.width), c.dtype}, env);
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}
// 300000 floats a row pair pass the shared-memory sub-slot (4 MiB / 4 members): several rounds.
INSTANTIATE_TEST_SUITE_P(Transports, AllToAll,
                         ::testing::Values(AllToAllCase{4, 5, "f32", true}, AllToAllCase{4, 5, "f32", false},
                                           AllToAllCase{3, 7, "bf16", true}, AllToAllCase{4, 150000, "f32", true},
                                           AllToAllCase{2, 3, "bf16", false}),
                         [](const auto& info) {
                           std::ostringstream s;
                           PrintTo(info.param, &s);
                           return s.str();
                         });

// The exchange against the ep-1 loop on crafted routings: rank 0 picks only
// experts 0 and 1 (other ranks' experts get nothing from it), the others pick at
// random; 5 experts over the ep group (uneven). Outputs, input gradients and the
// local experts' weight gradients (summed over ranks in the reference) agree.
AUTOTP_WORKER(dispatch_matches_ep1) {
  auto topo = ctx.topology(1, ctx.env.world_size);
  Comm& ep = topo->ep();
  const int64_t experts = 5, hidden = 6, tokens = 9, k = 2;
  const ExpertPlacement placement{ep.size(), ep.rank(), experts};
  torch::manual_seed(100);
  std::vector<torch::Tensor> w;
  for (int64_t e = 0; e < experts; ++e) w.push_back(torch::randn({hidden, hidden}).requires_grad_());
  torch::manual_seed(7 + ep.rank());
  auto x = torch::randn({tokens, hidden}).requires_grad_();
  auto scores = torch::rand({tokens, experts});
  if (ep.rank() == 0) scores.narrow(1, 2, experts - 2).fill_(-1);
  auto [weights, selected] = scores.topk(k, -1);
  auto expert = [&](int64_t e, const torch::Tensor& rows) { return torch::tanh(rows.matmul(w[e])); };
  auto got = dispatch_to_experts(x, selected, weights, placement, ep,
                                 [&](int64_t local, const torch::Tensor& rows) { return expert(placement.first() + local, rows); });
  auto x_ref = x.detach().clone().requires_grad_();
  auto want = torch::zeros_like(x_ref);
  for (int64_t e = 0; e < experts; ++e) {
    const auto where = (selected == e).nonzero();
    const auto t = where.select(1, 0), s = where.select(1, 1);
    want = want.index_add(0, t, expert(e, x_ref.index_select(0, t)) * weights.index({t, s}).unsqueeze(-1));
  }
  test::worker_expect_close(got.detach(), want.detach(), 1e-6, 1e-6, "dispatched output");
  auto target = torch::randn({tokens, hidden});
  std::vector<torch::Tensor> ref_grads;
  for (int64_t e = 0; e < experts; ++e) ref_grads.push_back(torch::autograd::grad({(want * target).sum()}, {w[e]}, {}, true)[0].clone());
  (got * target).sum().backward();
  auto x_ref_grad = torch::autograd::grad({(want * target).sum()}, {x_ref})[0];
  test::worker_expect_close(x.grad(), x_ref_grad, 1e-6, 1e-6, "input gradient");
  for (int64_t e = 0; e < experts; ++e) {
    ep.all_reduce(ref_grads[e]);  // every rank's tokens reach expert e
    if (!placement.owns(e)) continue;
    WORKER_CHECK(w[e].grad().defined(), "expert ", e, " has no gradient on its owner");
    test::worker_expect_close(w[e].grad(), ref_grads[e], 1e-5, 1e-6, "weight gradient of expert " + std::to_string(e));
  }
}

class ExpertDispatch : public ::testing::TestWithParam<int> {};
AUTOTP_WORKER_TEST_P(ExpertDispatch, MatchesTheEp1LoopWithEmptyExpertsAndUnevenRanges, dispatch_matches_ep1)
INSTANTIATE_TEST_SUITE_P(EpSizes, ExpertDispatch, ::testing::Values(2, 4));

// Training at ep > 1 against one rank holding every expert (fp32): losses, the
// load-balancing loss, grad norms, model states against their formula, and the
// final weights of every tensor this rank holds.
json ep_train_config(int tp, int ep, int stage, int64_t gas, const std::string& recompute) {
  return {{"train_micro_batch_size_per_gpu", 2},
          {"gradient_accumulation_steps", gas},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 5e-4}, {"weight_decay", 0.1}, {"eps", 1e-6}}}}},
          {"gradient_clipping", 1.0},
          {"zero_optimization",
           {{"stage", stage},
            {"reduce_bucket_size", 4096},
            {"allgather_bucket_size", 2048},
            {"stage3_param_persistence_threshold", 1000}}},
          {"tensor_parallel", {{"autotp_size", tp}}},
          {"expert_parallel", {{"enabled", ep > 1}, {"autoep_size", ep}}},
          {"activation_checkpointing", {{"mode", recompute}}}};
}

AUTOTP_WORKER(ep_train_parity) {
  const std::string dir = ctx.args.at(0);
  const int tp = std::stoi(ctx.args.at(1)), ep = std::stoi(ctx.args.at(2)), stage = std::stoi(ctx.args.at(3));
  const int64_t gas = std::stoll(ctx.args.at(4));
  const std::string recompute = ctx.args.at(5);
  auto topo = ctx.topology(tp, ep);
  const int dp = topo->dp_size();
  const int64_t micro = 2, global = micro * gas * dp, seq = 12;
  auto source = resolve_model(dir);
  auto config = TrainConfig::from_json(ep_train_config(tp, ep, stage, gas, recompute), "test");
  config.resolve_batch(topo->world_size());
  config.expert_parallel.validate(source.config, topo->world_size(), tp);
  const ExpertPlacement placement{ep, topo->ep_rank(), source.config.num_experts};
  auto model = load_model(source, place_experts(TpPlan::build(source.config, config.tensor_parallel.plan_options()), placement),
                          topo->tp(), torch::kFloat32, 0);
  model->set_expert_parallel(placement, topo->ep());
  Trainer trainer(config, topo, std::move(model), nullptr, false);
  WORKER_CHECK((trainer.optimizer().experts() != nullptr) == (ep > 1), "expert optimizer present at ep ", ep);

  auto single = Topology::single();
  auto ref_config = TrainConfig::from_json(ep_train_config(1, 1, 0, global / micro, "off"), "reference");
  ref_config.resolve_batch(1);
  Trainer reference(ref_config, single, load_model(source, TpPlan::build(source.config, {}), single->tp(), torch::kFloat32, 0),
                    nullptr, false);

  torch::manual_seed(5);
  auto data = torch::randint(0, source.config.vocab_size, {3 * global, seq + 1}, torch::kLong);
  {
    // Logits before training: each rank routes its own sequences (rank-dependent, so the
    // ep group exchanges uneven token counts), compared with the one-rank model's.
    torch::NoGradGuard no_grad;
    auto ids = torch::randint(0, source.config.vocab_size, {1 + topo->dp_rank() % 2, seq}, torch::kLong);
    for (int r = 0; r <= topo->dp_rank(); ++r) ids = torch::randint(0, source.config.vocab_size, ids.sizes(), torch::kLong);
    test::worker_expect_close(trainer.model().full_logits(ids), reference.model().full_logits(ids), 1e-5, 1e-5,
                              "logits at ep " + std::to_string(ep));
  }
  auto batch = [&](const torch::Tensor& rows) {
    return Batch{rows.narrow(1, 0, seq).contiguous(), rows.narrow(1, 1, seq).contiguous()};
  };
  for (int step = 0; step < 3; ++step) {
    auto rows = data.narrow(0, step * global, global);
    std::vector<Batch> mine, whole;
    for (int64_t j = 0; j < gas; ++j) mine.push_back(batch(rows.narrow(0, (j * dp + topo->dp_rank()) * micro, micro)));
    for (int64_t j = 0; j < global / micro; ++j) whole.push_back(batch(rows.narrow(0, j * micro, micro)));
    auto got = trainer.train_step(mine);
    auto want = reference.train_step(whole);
    WORKER_CHECK(std::abs(got.loss - want.loss) <= 1e-5 * want.loss, "step ", step + 1, ": loss ", got.loss, " vs ", want.loss);
    WORKER_CHECK(std::abs(got.grad_norm - want.grad_norm) <= 1e-5 * want.grad_norm, "step ", step + 1, ": grad norm ",
                 got.grad_norm, " vs ", want.grad_norm);
    WORKER_CHECK(want.grad_norm > 1.0, "clipping must be active (norm ", want.grad_norm, ")");
    if (source.config.router_aux_loss_enabled())
      WORKER_CHECK(std::abs(got.router_aux_loss - want.router_aux_loss) <= 1e-5 * want.router_aux_loss, "step ",
                   step + 1, ": load-balancing loss ", got.router_aux_loss, " vs ", want.router_aux_loss);
    WORKER_CHECK(got.model_states.total() == got.model_states_analytic.total(), "model states ",
                 got.model_states.to_json().dump(), " vs formula ", got.model_states_analytic.to_json().dump());
  }
  trainer.optimizer().gather_all_params();
  double worst = 0;
  std::string worst_name;
  int64_t experts_held = 0;
  for (auto& p : trainer.model().parameters()) {
    if (p.entry->expert >= 0) {
      WORKER_CHECK(placement.owns(p.entry->expert), p.name(), " is held by ep rank ", placement.ep_rank);
      ++experts_held;
    }
    auto full = trainer.model().gather(p);
    auto ref = reference.model().parameter(p.name()).tensor.detach();
    const double diff = (full - ref).norm().item<double>() / ref.norm().item<double>();
    if (diff > worst) worst = diff, worst_name = p.name();
  }
  const int64_t projections = 3;
  int64_t sparse = 0;
  for (int64_t l = 0; l < source.config.num_layers; ++l) sparse += source.config.is_sparse(l) ? 1 : 0;
  WORKER_CHECK(experts_held == placement.per_rank() * projections * sparse, "holds ", experts_held, " expert tensors");
  WORKER_CHECK(worst < 1e-5, "final weights of ", worst_name, " differ: relative L2 error ", worst);
  if (topo->rank() == 0) std::fprintf(stderr, "final weights: worst relative L2 error %.2g (%s)\n", worst, worst_name.c_str());
}

struct EpCase {
  std::string preset;
  int world, tp, ep, stage;
  int64_t gas = 1;
  std::string recompute = "off";
};
void PrintTo(const EpCase& c, std::ostream* os) {
  std::string p = c.preset;
  for (auto& ch : p)
    if (ch == '-') ch = '_';
  *os << p << "_w" << c.world << "_tp" << c.tp << "_ep" << c.ep << "_z" << c.stage << "_gas" << c.gas
      << (c.recompute == "full" ? "_ckpt" : "");
}
class ExpertParallelTraining : public ::testing::TestWithParam<EpCase> {};
TEST_P(ExpertParallelTraining, LossesNormsAndWeightsMatchOneRank) {
  const auto& c = GetParam();
  json config = test::preset_config(c.preset);
  std::string dir = test::write_model_dir(test::make_temp_dir("ep"), config, test::reference_random_weights(config, 21));
  auto result = test::run_workers("ep_train_parity", c.world,
                                  {dir, std::to_string(c.tp), std::to_string(c.ep), std::to_string(c.stage),
                                   std::to_string(c.gas), c.recompute});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}
// Pairwise over preset x ep x tp x stage: every stage with ep 2 and 4, tp 1 and
// 2, an expert-data-parallel group of 2 (w4 ep2 tp1), uneven expert ranges (5
// and 6 experts), recompute, and accumulation.
INSTANTIATE_TEST_SUITE_P(Layouts, ExpertParallelTraining,
                         ::testing::Values(EpCase{"mixtral-tiny", 2, 1, 2, 0}, EpCase{"mixtral-tiny", 4, 1, 4, 2},
                                           EpCase{"mixtral-tiny", 4, 2, 2, 3, 2},
                                           EpCase{"qwen2-moe-tiny", 4, 1, 2, 1},
                                           EpCase{"qwen2-moe-tiny", 4, 2, 2, 2},
                                           EpCase{"qwen2-moe-tiny", 4, 1, 4, 0, 1, "full"},
                                           EpCase{"qwen3-moe-tiny", 4, 1, 4, 3},
                                           EpCase{"qwen3-moe-tiny", 4, 1, 2, 2, 2, "full"}),
                         [](const auto& info) {
                           std::ostringstream s;
                           PrintTo(info.param, &s);
                           return s.str();
                         });

// Checkpoints across expert-parallel layouts, on 4 ranks: an uninterrupted run
// of 6 steps at ep 4 (tp 1, ZeRO 1); the same run saved after step 2 and resumed
// at the same layout continues bit for bit; resumed at ep 2 (ZeRO 2) and, after a
// second save, at ep 1 with tp-split experts (tp 2, ZeRO 3), it continues with the
// uninterrupted losses. The HF export of the ep-2 trainer and of its checkpoint
// hold the same tensors.
AUTOTP_WORKER(ep_checkpoints) {
  const std::string dir = ctx.args.at(0), root = ctx.args.at(1);
  auto source = resolve_model(dir);
  const int64_t seq = 12, global = 8, micro = 2;
  torch::manual_seed(5);
  auto data = torch::randint(0, source.config.vocab_size, {6 * global, seq + 1}, torch::kLong);
  struct Run {
    std::shared_ptr<Topology> topo;
    std::unique_ptr<Trainer> trainer;
  };
  auto start = [&](int tp, int ep, int stage) {
    Run run;
    run.topo = ctx.topology(tp, ep);
    const int dp = run.topo->dp_size();
    auto config = TrainConfig::from_json(ep_train_config(tp, ep, stage, global / micro / dp, "off"), "test");
    config.resolve_batch(run.topo->world_size());
    const ExpertPlacement placement{ep, run.topo->ep_rank(), source.config.num_experts};
    auto model = load_model(
        source, place_experts(TpPlan::build(source.config, config.tensor_parallel.plan_options()), placement),
        run.topo->tp(), torch::kFloat32, 0);
    if (ep > 1) model->set_expert_parallel(placement, run.topo->ep());
    run.trainer = std::make_unique<Trainer>(config, run.topo, std::move(model), nullptr, false);
    return run;
  };
  auto step = [&](Run& run, int64_t k) {  // step k (0-based) of the data
    const int dp = run.topo->dp_size();
    auto rows = data.narrow(0, k * global, global);
    std::vector<Batch> mine;
    for (int64_t j = 0; j < global / micro / dp; ++j) {
      auto r = rows.narrow(0, (j * dp + run.topo->dp_rank()) * micro, micro);
      mine.push_back(Batch{r.narrow(1, 0, seq).contiguous(), r.narrow(1, 1, seq).contiguous()});
    }
    return run.trainer->train_step(mine).loss;
  };
  std::vector<double> uninterrupted;
  {
    Run a = start(1, 4, 1);
    for (int64_t k = 0; k < 6; ++k) uninterrupted.push_back(step(a, k));
  }
  std::string first_save;
  {
    Run a = start(1, 4, 1);
    for (int64_t k = 0; k < 2; ++k) WORKER_CHECK(step(a, k) == uninterrupted[k], "rerun step ", k + 1, " differs");
    first_save = save_checkpoint(*a.trainer, root + "/a");
  }
  WORKER_CHECK(std::filesystem::exists(first_save + "/experts_ep3/metadata.json"), "no expert part in ", first_save);
  {
    Run same = start(1, 4, 1);
    WORKER_CHECK(load_checkpoint(*same.trainer, first_save) == 2, "resumed at the wrong step");
    for (int64_t k = 2; k < 6; ++k) {
      const double loss = step(same, k);
      WORKER_CHECK(loss == uninterrupted[k], "step ", k + 1, " after a resume at the same layout: ", loss, " vs ",
                   uninterrupted[k], " (must be bit for bit)");
    }
  }
  double worst = 0;
  std::string second_save;
  {
    Run b = start(1, 2, 2);
    load_checkpoint(*b.trainer, first_save);
    for (int64_t k = 2; k < 4; ++k) worst = std::max(worst, std::abs(step(b, k) - uninterrupted[k]) / uninterrupted[k]);
    second_save = save_checkpoint(*b.trainer, root + "/b");
    export_hf(*b.trainer, root + "/live_export");
  }
  if (ctx.env.rank == 0) {
    export_hf(io::SavedCheckpoint::open(second_save), root + "/checkpoint_export");
    auto live = io::CheckpointReader::open(root + "/live_export"), saved = io::CheckpointReader::open(root + "/checkpoint_export");
    WORKER_CHECK(live.names() == saved.names() && live.names().size() > 10, "exports list different tensors");
    for (const auto& name : live.names()) test::worker_expect_equal(live.read(name), saved.read(name), "exported " + name);
  }
  {
    Run c = start(2, 1, 3);  // the experts split over tp, every rank holding every expert
    load_checkpoint(*c.trainer, second_save);
    for (int64_t k = 4; k < 6; ++k) worst = std::max(worst, std::abs(step(c, k) - uninterrupted[k]) / uninterrupted[k]);
  }
  WORKER_CHECK(worst < 1e-7, "losses after resharding ep 4 -> ep 2 -> tp-split experts differ by ", worst, " (relative)");
  if (ctx.env.rank == 0) std::fprintf(stderr, "resharded losses: worst relative difference %.2g\n", worst);
}

TEST(ExpertParallelCheckpoints, ResumeBitForBitAndReshardAcrossEpAndTp) {
  json config = test::preset_config("qwen2-moe-tiny");
  const std::string dir = test::make_temp_dir("epckpt");
  test::write_model_dir(dir + "/model", config, test::reference_random_weights(config, 21));
  auto result = test::run_workers("ep_checkpoints", 4, {dir + "/model", dir});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

TEST(ExpertParallelCli, PlanShowsWhichRankHoldsWhichExperts) {
  auto r = test::run_cli("plan --model preset:qwen2-moe-tiny --tp 2 --ep 4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("expert parallelism: ep 4 x tp 2; 6 experts per sparse layer, 1-2 per ep rank"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("0        0-1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("3        5 "), std::string::npos) << r.output;
  auto bad = test::run_cli("plan --model preset:llama-tiny --ep 2");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("expert_parallel.enabled: LlamaForCausalLM is a dense model"), std::string::npos) << bad.output;
}

TEST(ExpertParallelCli, TrainsAndRefusesWhatItCannotDo) {
  const std::string dir = test::make_temp_dir("epcli");
  const std::string corpus = test::write_line_corpus(dir + "/corpus.txt", 40);
  const json config = {{"train_micro_batch_size_per_gpu", 2},
                       {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                       {"zero_optimization", {{"stage", 1}}}};
  std::ofstream(dir + "/ds.json") << config.dump();
  const std::string base = "train --config " + dir + "/ds.json --model preset:mixtral-tiny --data " + corpus +
                           " --seq-len 16 --steps 2 --nproc 2";
  auto ok = test::run_cli(base + " --ep 2 --metrics " + dir + "/m.jsonl");
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("(experts: ep 2 x edp 1, 3 experts per rank)"), std::string::npos) << ok.output;
  const auto lines = test::read_json_lines(dir + "/m.jsonl");
  ASSERT_EQ(lines.size(), 2u);
  // mixtral-tiny: 2 sparse layers of 5 experts, top-2 over 2 ranks x 2 sequences x 16 tokens.
  const json& tokens = lines[0].at("expert_tokens");
  ASSERT_EQ(tokens.at("mean").size(), 2u);
  EXPECT_DOUBLE_EQ(tokens.at("mean")[0].get<double>(), 2.0 * 2 * 2 * 16 / 5);
  EXPECT_GE(tokens.at("max")[1].get<double>(), tokens.at("mean")[1].get<double>());
  auto three = test::run_cli(base + " --ep 3");
  EXPECT_EQ(three.exit_code, 2) << three.output;
  EXPECT_NE(three.output.find("autoep_size 3 must divide world size / autotp_size = 2"), std::string::npos) << three.output;
  auto save = test::run_cli(base + " --ep 2 --save " + dir + "/ckpt --export-hf " + dir + "/hf");
  ASSERT_EQ(save.exit_code, 0) << save.output;
  EXPECT_TRUE(std::filesystem::exists(dir + "/ckpt/step_2/experts_ep1/metadata.json"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/hf/model.safetensors"));
  auto resumed = test::run_cli(base.substr(0, base.find(" --steps")) + " --steps 3 --nproc 2 --ep 2 --resume " + dir + "/ckpt");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  // Offline: the export of the ep-2 checkpoint is the live export; a reshard to ep 1 (tp 2) resumes at ep 1.
  auto exported = test::run_cli("export --checkpoint " + dir + "/ckpt/step_2 --out " + dir + "/hf_offline");
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  {
    auto live = io::CheckpointReader::open(dir + "/hf"), offline = io::CheckpointReader::open(dir + "/hf_offline");
    ASSERT_EQ(live.names(), offline.names());
    for (const auto& name : live.names()) EXPECT_TRUE(torch::equal(live.read(name), offline.read(name))) << name;
  }
  auto resharded = test::run_cli("reshard --checkpoint " + dir + "/ckpt/step_2 --tp 2 --dp 1 --out " + dir + "/tp2");
  ASSERT_EQ(resharded.exit_code, 0) << resharded.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/tp2/step_2/experts_ep0"));
  const json tp2 = {{"train_micro_batch_size_per_gpu", 4},
                    {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                    {"zero_optimization", {{"stage", 1}}},
                    {"tensor_parallel", {{"autotp_size", 2}}}};
  std::ofstream(dir + "/tp2.json") << tp2.dump();
  auto at_tp2 = test::run_cli("train --config " + dir + "/tp2.json --model preset:mixtral-tiny --data " + corpus +
                              " --seq-len 16 --steps 3 --nproc 2 --resume " + dir + "/tp2");
  ASSERT_EQ(at_tp2.exit_code, 0) << at_tp2.output;
  const json lora = {{"train_micro_batch_size_per_gpu", 2},
                     {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                     {"lora", {{"r", 4}, {"target_modules", "all-linear"}}}};
  std::ofstream(dir + "/lora.json") << lora.dump();
  auto refused = test::run_cli("train --config " + dir + "/lora.json --model preset:mixtral-tiny --data " + corpus +
                               " --seq-len 16 --steps 2 --nproc 2 --ep 2 --save " + dir + "/lora_ckpt");
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("with LoRA is not supported yet"), std::string::npos) << refused.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/lora_ckpt"));
}

}  // namespace
}  // namespace autotp
