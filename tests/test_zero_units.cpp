// ZeRO's units: the flat layout that cuts every unit over the dp ranks, the
// memory-lean RMSNorm, and on real Gloo ranks the ZeRO-3 step's traffic and
// peak memory against their closed forms.
#include <gtest/gtest.h>

#include <array>

#include "autotp/model/presets.h"
#include "autotp/model/rms_norm.h"
#include "autotp/base/memory_counter.h"
#include "autotp/runtime/trainer.h"
#include "autotp/zero/flat_layout.h"
#include "autotp/zero/zero_units.h"
#include "support/model_fixtures.h"
#include "support/checks.h"
#include "support/multiprocess.h"

namespace autotp {
namespace {

using nlohmann::json;

TEST(FlatLayout, EveryUnitIsCutOverEveryRank) {
  // Parameters of 3, 5 | 4 | 1 elements in units 0, 0, 1, 2 over dp 2: units of 8, 4, 1 -> padded 8, 4, 2.
  const FlatLayout l = FlatLayout::build({3, 5, 4, 1}, {0, 0, 1, 2}, 2, 1);
  EXPECT_EQ(l.offsets, (std::vector<int64_t>{0, 3, 8, 12}));
  ASSERT_EQ(l.units.size(), 3u);
  EXPECT_EQ(l.units[2].begin, 12);
  EXPECT_EQ(l.units[2].length, 2);
  EXPECT_EQ(l.padded, 14);
  EXPECT_EQ(l.part, 7);
  // Rank 1 owns the second half of every unit, back to back in its partition.
  const auto pieces = l.pieces(1);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].flat_begin, 4);
  EXPECT_EQ(pieces[0].part_begin, 0);
  EXPECT_EQ(pieces[1].flat_begin, 10);
  EXPECT_EQ(pieces[1].part_begin, 4);
  EXPECT_EQ(pieces[2].flat_begin, 13);
  EXPECT_EQ(pieces[2].part_begin, 6);
  // Rank 0: flat [8, 10) of unit 1 is its partition [4, 6) (flat 9 -> 5).
  const auto first = l.pieces(0);
  ASSERT_EQ(first.size(), 3u);
  EXPECT_EQ(first[1].flat_begin, 8);
  EXPECT_EQ(first[1].part_begin, 4);
  EXPECT_EQ(first[1].length, 2);
  // Gathering parameter 1 (flat [3, 8)): rank 0 holds 1 element of it, rank 1 four.
  EXPECT_EQ(l.range_shares(3, 8), (std::vector<int64_t>{1, 4}));
  // Stage 0: one piece, the whole buffer; no unit ids: one unit (checkpoint format 1).
  EXPECT_EQ(FlatLayout::build({3, 5, 4, 1}, {0, 0, 1, 2}, 2, 0).pieces(1).size(), 1u);
  EXPECT_EQ(FlatLayout::build({7}, {}, 4, 3).range_shares(1, 7), (std::vector<int64_t>{1, 2, 2, 1}));
}

TEST(ZeroUnits, LayersEmbeddingsHeadAndPersistentTensors) {
  const auto config = ModelConfig::from_json(test::preset_config("llama-tiny"), "llama-tiny");
  const TpPlan plan = TpPlan::build(config, {});
  const ZeroUnits ids{config.num_layers};
  const auto at3 = zero_unit_ids(plan, 3, 1000), at1 = zero_unit_ids(plan, 1, 1000);
  for (size_t i = 0; i < plan.entries().size(); ++i) {
    const auto& e = plan.entries()[i];
    const int64_t layer = decoder_layer_of(e.desc.name);
    const int natural = layer >= 0                                ? ids.layer(layer)
                        : e.desc.kind == ParamKind::kEmbedding ? ZeroUnits::kEmbedding
                                                                  : ids.head();
    EXPECT_EQ(at1[i], natural) << e.desc.name;  // no persistent unit below stage 3
    const bool small = e.desc.kind == ParamKind::kNorm;  // [96] < 1000; every matrix is larger
    EXPECT_EQ(at3[i], small ? ids.persistent() : natural) << e.desc.name;
  }
  EXPECT_EQ(decoder_layer_of("transformer.h.11.attn.c_attn.weight"), 11);
  EXPECT_EQ(decoder_layer_of("model.norm.weight"), -1);
  EXPECT_EQ(zero_layout(plan, 0, 2, 3, 1000).whole_unit, ids.persistent());
  EXPECT_EQ(zero_layout(plan, 0, 2, 3, 0).whole_unit, -1);
}

// Autograd on HF's plain ops, the reference the fused function must equal.
torch::Tensor plain_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto h = x.to(torch::kFloat32);
  h = h * torch::rsqrt(h.pow(2).mean(-1, true) + eps);
  return weight * h.to(x.scalar_type());
}

TEST(RmsNorm, EqualsAutogradOnThePlainOpsBitForBit) {
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    torch::manual_seed(4);
    auto x = torch::randn({3, 5, 64}).to(dtype);
    auto w = (1 + 0.1 * torch::randn({64})).to(dtype);
    auto g = torch::randn({3, 5, 64}).to(dtype);
    auto x1 = x.clone().requires_grad_(true), w1 = w.clone().requires_grad_(true);
    auto x2 = x.clone().requires_grad_(true), w2 = w.clone().requires_grad_(true);
    auto y1 = rms_norm(x1, w1, 1e-6), y2 = plain_rms_norm(x2, w2, 1e-6);
    y1.backward(g);
    y2.backward(g);
    EXPECT_TRUE(torch::equal(y1, y2)) << dtype;
    EXPECT_TRUE(torch::equal(x1.grad(), x2.grad())) << dtype << " max diff "
                                                    << (x1.grad() - x2.grad()).abs().max().item<double>();
    EXPECT_TRUE(torch::equal(w1.grad(), w2.grad())) << dtype;
  }
}

// ZeRO-3 over 4 dp ranks with every tensor partitioned: one step moves, per
// rank, (dp - 1) / dp of 3 x the model bytes (gather forward, gather backward,
// reduce-scatter) less the embeddings' backward gather (their backward reads
// no weight); the step's peak stays within model states + the activations a
// stage-0 step needs + two gathered layers + two reduction buckets, and with
// overlap_comm one more layer's gradients and one more bucket: the unit whose
// reduce-scatter runs behind the next layer's backward, and the lane's copy of
// the column bucket it is reducing, whenever the lane runs it (the next
// layer's prefetch is one of the two gathered layers).
AUTOTP_WORKER(zero3_traffic_and_peak) {
  install_memory_counter();
  const bool bf16 = ctx.args.at(0) == "bf16";
  const int64_t gas = std::stoll(ctx.args.at(1));
  const bool overlap = ctx.args.at(2) == "overlap";
  auto topo = ctx.topology(1);
  const int dp = topo->dp_size();
  auto source = resolve_model("preset:llama-small");
  const TpPlan plan = TpPlan::build(source.config, {});
  constexpr int64_t kBucket = 1 << 20;
  auto make = [&](int stage) {
    json j = {{"train_micro_batch_size_per_gpu", 1},
              {"gradient_accumulation_steps", gas},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
              {"gradient_clipping", 1.0},
              {"bf16", {{"enabled", bf16}}},
              {"zero_optimization",
               {{"stage", stage},
                {"reduce_bucket_size", kBucket},
                {"stage3_param_persistence_threshold", 0},
                {"overlap_comm", overlap}}}};
    auto config = TrainConfig::from_json(j, "test");
    config.resolve_batch(topo->world_size());
    return std::make_unique<Trainer>(config, topo, load_model(source, plan, topo->tp(), training_dtype(config), 1),
                                     nullptr, false);
  };
  torch::manual_seed(7 + topo->dp_rank());
  std::vector<Batch> batches;
  for (int64_t i = 0; i < gas; ++i) {
    auto rows = torch::randint(0, source.config.vocab_size, {1, 65}, torch::kLong);
    batches.push_back({rows.narrow(1, 0, 64).contiguous(), rows.narrow(1, 1, 64).contiguous()});
  }
  const int64_t e = bf16 ? 2 : 4;
  int64_t stage0_activations = 0;
  {
    auto t0 = make(0);
    t0->train_step(batches);
    stage0_activations = t0->train_step(batches).activations_peak_bytes;
  }
  auto t3 = make(3);
  t3->train_step(batches);  // warm-up: buffers sized
  const CommStats before = topo->dp().stats();
  const StepMetrics m = t3->train_step(batches);
  const CommStats after = topo->dp().stats();

  const FlatLayout& layout = t3->optimizer().layout();
  const ZeroUnits ids{source.config.num_layers};
  const int64_t model = layout.padded, embed = layout.units[ZeroUnits::kEmbedding].length;
  int64_t largest_layer = 0;
  for (int64_t l = 0; l < source.config.num_layers; ++l)
    largest_layer = std::max(largest_layer, layout.units[ids.layer(l)].length);
  const int64_t gathered = after.all_gather_bytes - before.all_gather_bytes;
  const int64_t reduced = after.reduce_scatter_bytes - before.reduce_scatter_bytes;
  WORKER_CHECK(reduced == gas * e * model, "reduce-scatter bytes ", reduced, " vs ", gas * e * model);
  WORKER_CHECK(gathered == gas * e * (2 * model - embed), "all-gather bytes ", gathered, " vs ",
               gas * e * (2 * model - embed));
  const double wire = (dp - 1.0) / dp * static_cast<double>(gathered + reduced);
  const double expected = (dp - 1.0) / dp * gas * e * (3 * model - embed);
  WORKER_CHECK(wire == expected, "per-rank traffic ", wire, " vs ", expected);

  const int64_t states = m.model_states.total();
  const int64_t in_flight = overlap ? e * (largest_layer + kBucket) : 0;
  const int64_t bound = states + stage0_activations + 2 * e * largest_layer + 2 * e * kBucket + in_flight;
  WORKER_CHECK(m.peak_allocated_bytes <= bound, "ZeRO-3 peak ", m.peak_allocated_bytes, " > states ", states,
               " + stage-0 activations ", stage0_activations, " + 2 layers ", 2 * e * largest_layer,
               " + 2 buckets ", 2 * e * kBucket, " + gradients in flight ", in_flight);
  WORKER_CHECK((after.async_seconds > before.async_seconds) == overlap, "overlap_comm ", overlap,
               " but the lane ran for ", after.async_seconds - before.async_seconds, " s");
  if (topo->rank() == 0)
    std::fprintf(stderr,
                 "%s gas %ld %s: %.1f MB per rank on the wire (3 x %.1f MB model - embeddings); peak %.1f MB <= %.1f MB "
                 "(states %.1f, stage-0 activations %.1f)\n",
                 bf16 ? "bf16" : "fp32", static_cast<long>(gas), overlap ? "overlap" : "synchronous", wire / 1e6,
                 e * model / 1e6,
                 m.peak_allocated_bytes / 1e6, bound / 1e6, states / 1e6, stage0_activations / 1e6);
}

// overlap_comm on (collectives on the dp lane, stage-3 prefetch) and off run the
// same collectives in the same order: losses, gradient norms and every weight
// bit-identical, the same traffic, and only the overlapped run uses the lane.
AUTOTP_WORKER(overlap_equals_synchronous) {
  const int tp = std::stoi(ctx.args.at(0));
  const int stage = std::stoi(ctx.args.at(1));
  const bool bf16 = ctx.args.at(2) == "bf16";
  const int64_t gas = std::stoll(ctx.args.at(3));
  auto topo = ctx.topology(tp);
  auto source = resolve_model("preset:llama-tiny");
  TpPlanOptions plan_options;
  plan_options.tp_size = tp;
  const TpPlan plan = TpPlan::build(source.config, plan_options);
  auto make = [&](bool overlap) {
    json j = {{"train_micro_batch_size_per_gpu", 2},
              {"gradient_accumulation_steps", gas},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}},
              {"gradient_clipping", 1.0},
              {"bf16", {{"enabled", bf16}}},
              // Small buckets: units go in several reduce-scatters; persistent tensors stay whole.
              {"zero_optimization", {{"stage", stage}, {"overlap_comm", overlap}, {"reduce_bucket_size", 1000}}}};
    auto config = TrainConfig::from_json(j, "test");
    config.resolve_batch(topo->world_size());
    return std::make_unique<Trainer>(config, topo, load_model(source, plan, topo->tp(), training_dtype(config), 1),
                                     nullptr, false);
  };
  torch::manual_seed(11 + topo->dp_rank());
  std::vector<std::vector<Batch>> steps(3);
  for (auto& batches : steps)
    for (int64_t i = 0; i < gas; ++i) {
      auto rows = torch::randint(0, source.config.vocab_size, {2, 17}, torch::kLong);
      batches.push_back({rows.narrow(1, 0, 16).contiguous(), rows.narrow(1, 1, 16).contiguous()});
    }
  struct Run {
    std::vector<double> losses, norms;
    std::vector<torch::Tensor> weights;
    CommStats dp;
  };
  auto run = [&](bool overlap) {
    Run out;
    auto trainer = make(overlap);
    const CommStats before = topo->dp().stats();
    for (const auto& batches : steps) {
      const StepMetrics m = trainer->train_step(batches);
      out.losses.push_back(m.loss);
      out.norms.push_back(m.grad_norm);
    }
    const CommStats after = topo->dp().stats();
    out.dp = after;
    out.dp.all_gather_bytes -= before.all_gather_bytes;
    out.dp.reduce_scatter_bytes -= before.reduce_scatter_bytes;
    out.dp.all_reduce_bytes -= before.all_reduce_bytes;
    out.dp.async_seconds -= before.async_seconds;
    trainer->optimizer().gather_all_params();
    for (auto& p : trainer->model().parameters()) out.weights.push_back(p.tensor.detach().clone());
    return out;
  };
  const Run sync = run(false), overlapped = run(true);
  for (size_t s = 0; s < sync.losses.size(); ++s) {
    WORKER_CHECK(sync.losses[s] == overlapped.losses[s], "step ", s + 1, " loss ", overlapped.losses[s], " vs ",
                 sync.losses[s]);
    WORKER_CHECK(sync.norms[s] == overlapped.norms[s], "step ", s + 1, " norm ", overlapped.norms[s], " vs ",
                 sync.norms[s]);
  }
  for (size_t i = 0; i < sync.weights.size(); ++i)
    WORKER_CHECK(torch::equal(sync.weights[i], overlapped.weights[i]), "parameter ", i, " differs");
  WORKER_CHECK(sync.dp.all_gather_bytes == overlapped.dp.all_gather_bytes &&
                   sync.dp.reduce_scatter_bytes == overlapped.dp.reduce_scatter_bytes &&
                   sync.dp.all_reduce_bytes == overlapped.dp.all_reduce_bytes,
               "traffic differs: gather ", overlapped.dp.all_gather_bytes, " vs ", sync.dp.all_gather_bytes,
               ", reduce-scatter ", overlapped.dp.reduce_scatter_bytes, " vs ", sync.dp.reduce_scatter_bytes);
  WORKER_CHECK(sync.dp.async_seconds == 0, "overlap_comm false still used the lane");
  if (stage >= 1 && topo->dp_size() > 1)
    WORKER_CHECK(overlapped.dp.async_seconds > 0, "overlap_comm true never used the lane at stage ", stage);
}

TEST(ZeroOverlap, ResultsAreBitIdenticalToSynchronous) {
  // world 4: tp 1 (dp 4, the dp group is the world's) and tp 2 (dp 2); stage 0 has nothing started.
  for (const char* tp : {"1", "2"})
    for (const char* stage : {"1", "2", "3"}) {
      const char* dtype = std::string(stage) == "2" ? "fp32" : "bf16";
      const char* gas = std::string(tp) == "1" ? "2" : "1";
      auto result = test::run_workers("overlap_equals_synchronous", 4, {tp, stage, dtype, gas});
      ASSERT_EQ(result.exit_code, 0) << "tp " << tp << " stage " << stage << ": " << result.summary;
    }
}

TEST(ZeroThree, StepTrafficAndPeakMatchTheClosedForms) {
  // overlap x dtype x gas: the four cases that hold every pair of two factors' values,
  // and the other four with AUTOTP_TEST_FULL=1 (tools/test --full).
  std::vector<std::array<const char*, 3>> cases = {{"synchronous", "fp32", "1"},
                                                   {"synchronous", "bf16", "2"},
                                                   {"overlap", "fp32", "2"},
                                                   {"overlap", "bf16", "1"}};
  if (test::full_products())
    cases.insert(cases.end(), {{"synchronous", "fp32", "2"},
                               {"synchronous", "bf16", "1"},
                               {"overlap", "fp32", "1"},
                               {"overlap", "bf16", "2"}});
  for (const auto& [overlap, dtype, gas] : cases) {
    auto result = test::run_workers("zero3_traffic_and_peak", 4, {dtype, gas, overlap});
    ASSERT_EQ(result.exit_code, 0) << dtype << " gas " << gas << " " << overlap << ": " << result.summary;
  }
}

}  // namespace
}  // namespace autotp
