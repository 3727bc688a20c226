// The simulator against the engine on real Gloo ranks: for tp {1,2,3,4} x ZeRO
// stage {0..3} on the tiny presets, each rank trains four steps and compares
//   - its model-state bytes (measured from the engine's buffers) with the
//     simulator's prediction for its tp rank: exactly equal;
//   - its peak allocated bytes during a step (the counting allocator; the smallest
//     of steps 2-4, see below) with
//     the simulator's predicted peak: within 10%;
// with and without sequence parallelism (":sp", tp > 1). And one layer's saved
// activations against what the engine keeps (below).
#include <gtest/gtest.h>

#include "autotp/model/presets.h"
#include "autotp/base/memory_counter.h"
#include "autotp/runtime/trainer.h"
#include "simulator/memory_model.h"
#include "simulator/rank_shape.h"
#include "support/checks.h"
#include "support/multiprocess.h"

namespace autotp {
namespace {

using nlohmann::json;

constexpr int64_t kMicro = 2, kSeq = 64;

// The layout the workers train: one tp group of `tp` in `gpus` ranks on the CPU.
sim::SimLayout cpu_layout(int gpus, int tp, int64_t micro_batch, int64_t seq_len, torch::ScalarType dtype,
                          bool sequence_parallel) {
  sim::SimLayout layout;
  layout.gpus = gpus;
  layout.tp = tp;
  layout.micro_batch = micro_batch;
  layout.seq_len = seq_len;
  layout.dtype = dtype;
  layout.sequence_parallel = sequence_parallel;
  layout.cuda = false;
  return layout;
}
constexpr double kPeakTolerance = 0.10;

AUTOTP_WORKER(simulator_memory) {
  install_memory_counter();
  const int tp = std::stoi(ctx.args.at(0));
  auto topo = ctx.topology(tp);
  double worst_peak = 0;
  // Every architecture's preset, and with sequence parallelism (":sp", tp > 1).
  for (const char* preset_name :
       {"llama-tiny", "gpt2-tiny", "qwen2-tiny", "llama-tiny:bf16", "mistral-tiny", "qwen3-tiny", "phi3-tiny",
        "gemma2-tiny", "gemma3-tiny", "mixtral-tiny", "qwen2-moe-tiny", "llama-tiny:sp", "gpt2-tiny:sp",
        "qwen3-tiny:sp", "phi3-tiny:sp", "gemma3-tiny:sp", "gemma2-tiny:sp", "mixtral-tiny:sp"}) {
    const std::string name = preset_name;
    const bool bf16 = name.find(":bf16") != std::string::npos;
    const bool sp = name.find(":sp") != std::string::npos;
    const std::string preset = name.substr(0, name.find(':'));
    auto source = resolve_model("preset:" + preset);
    if (tp > source.config.num_heads || (sp && tp == 1)) continue;
    for (int stage = 0; stage <= 3; ++stage) {
      json j = {{"train_micro_batch_size_per_gpu", kMicro},
                {"gradient_accumulation_steps", 1},
                {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"weight_decay", 0.01}}}}},
                {"gradient_clipping", 1.0},
                {"bf16", {{"enabled", bf16}}},
                {"zero_optimization", {{"stage", stage}}},
                {"tensor_parallel", {{"autotp_size", tp}, {"sequence_parallel", sp}}}};
      auto config = TrainConfig::from_json(j, "test");
      config.resolve_batch(topo->world_size());
      const auto dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
      const TpPlan plan = TpPlan::build(source.config, config.tensor_parallel.plan_options());
      StepMetrics last;
      ModelStateBytes measured;
      {
        Trainer trainer(config, topo, load_model(source, plan, topo->tp(), dtype, 1), nullptr, false);
        torch::manual_seed(3 + topo->dp_rank());
        for (int step = 0; step < 4; ++step) {
          auto rows = torch::randint(0, source.config.vocab_size, {kMicro, kSeq + 1}, torch::kLong);
          Batch b{rows.narrow(1, 0, kSeq).contiguous(), rows.narrow(1, 1, kSeq).contiguous()};
          auto m = trainer.train_step({b});
          // Gloo's worker thread may still hold a finished collective's tensors for a moment,
          // which can add a gather's staging blocks to one step's peak: keep the smallest
          // peak of the steps after the first.
          if (step == 1 || (step > 1 && m.peak_allocated_bytes < last.peak_allocated_bytes)) last = m;
        }
        measured = trainer.optimizer().model_state_bytes();
      }
      sim::SimLayout layout = cpu_layout(topo->world_size(), tp, kMicro, kSeq, dtype, sp);
      layout.zero_stage = stage;
      layout.optimizer = config.optimizer;
      layout.overlap_comm = config.zero.overlaps(/*cuda=*/false);  // as the engine trains here
      auto shape = sim::rank_shape(source.config, plan, topo->tp_rank());
      auto predicted = sim::estimate_memory(source.config, shape, layout);
      const std::string where = name + " tp " + std::to_string(tp) + " stage " + std::to_string(stage) + " rank " +
                                std::to_string(topo->rank());
      WORKER_CHECK(measured.to_json() == predicted.states.to_json(), where, ": measured model states ",
                   measured.to_json().dump(), " vs simulated ", predicted.states.to_json().dump());
      const double error = static_cast<double>(predicted.total - last.peak_allocated_bytes) / last.peak_allocated_bytes;
      worst_peak = std::max(worst_peak, std::abs(error));
      std::fprintf(stderr, "%s: peak measured %lld simulated %lld (%+.1f%%, %s), states %lld\n", where.c_str(),
                   static_cast<long long>(last.peak_allocated_bytes), static_cast<long long>(predicted.total),
                   100 * error, predicted.peak_phase.c_str(), static_cast<long long>(measured.total()));
      WORKER_CHECK(std::abs(error) <= kPeakTolerance, where, ": simulated peak ", predicted.total, " vs measured ",
                   last.peak_allocated_bytes, " (", 100 * error, "%)");
    }
  }
  std::fprintf(stderr, "rank %d: worst peak error %.1f%%\n", topo->rank(), 100 * worst_peak);
}

// What one decoder layer keeps for the backward, term by term against the engine:
// the counting allocator's bytes still allocated after a forward of a model of L + 1
// layers less those of L layers (a forward run and released first, so the rotary and
// mask caches exist), against saved_activation_bytes of the same two depths, for this
// rank's shard. Every architecture, fp32 and bf16, with selective recomputation and
// without, and with sequence parallelism, at 128 tokens, and bf16 again at 48 (at most
// 4 x head_dim of the tiny models: on a CPU with native bf16 GEMMs the eager attention
// core, eager_attention_core) at micro-batch 2 and 1: within 2 KiB a layer (of 0.2-2.7 MB), which
// small tensors the model does not list (scalars, Gemma 2's eager core's) take. Not
// with ep: random routing sends each rank's experts a different share of the rows,
// where the model takes the balanced share.
// The 11 architectures x 9 variants x tp 1, 3, 4 in full (args: tp, "full"), or
// ("pairwise") each architecture and variant once, at a tp that rotates with them:
// every pair of two factors' values is still run (sequence parallelism at tp 3 or 4).
AUTOTP_WORKER(simulator_layer_activations) {
  constexpr int64_t kSmallTensors = 2048;
  install_memory_counter();
  const int tp = std::stoi(ctx.args.at(0));
  const bool full = ctx.args.at(1) == "full";
  auto topo = ctx.topology(tp);
  constexpr int64_t kLongT = 128, kShortT = 48;
  constexpr int kTps[] = {1, 3, 4};
  int architecture = -1;
  for (const char* preset : {"llama-tiny", "gpt2-tiny", "qwen2-tiny", "mistral-tiny", "qwen3-tiny", "phi3-tiny",
                             "gemma2-tiny", "gemma3-tiny", "mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny"}) {
    ++architecture;
    // fp32 / bf16 x selective recomputation off / on, fp32 with sequence parallelism,
    // and bf16 at the short length with selective recomputation off / on, micro-batch 2 and 1.
    for (int variant = 0; variant < 9; ++variant) {
      const bool bf16 = variant % 2 == 1 || variant >= 5,
                 selective = variant == 2 || variant == 3 || variant == 6 || variant == 8, sp = variant == 4;
      const int64_t tokens = variant >= 5 ? kShortT : kLongT, batch = variant >= 7 ? 1 : 2;
      if (sp && tp == 1) continue;
      int pairwise_tp = kTps[(architecture + variant) % 3];
      if (sp && pairwise_tp == 1) pairwise_tp = kTps[1 + architecture % 2];
      if (!full && tp != pairwise_tp) continue;
      // The model counts the busiest rank's share of the sequence, which the first ranks
      // hold: the others run the forwards with them (collectives) but are not compared.
      const bool compared = !sp || tokens % tp == 0 || topo->tp_rank() < tokens % tp;
      const auto dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
      int64_t kept[2] = {}, simulated[2] = {};
      for (int deeper = 0; deeper < 2; ++deeper) {
        json raw = find_preset(preset).config;
        const int64_t layers = 3 + deeper;  // Gemma: both depths have local and global layers
        raw[raw.contains("n_layer") ? "n_layer" : "num_hidden_layers"] = layers;
        ModelSource source;
        source.config = ModelConfig::from_json(raw, preset);
        source.label = preset;
        if (tp > source.config.num_heads) continue;
        const TpPlan plan = sim::build_plan(source.config, tp, sp);
        auto model = load_model(source, plan, topo->tp(), dtype, 1);
        model->set_selective_recompute(selective);
        auto rows = torch::randint(0, source.config.vocab_size, {batch, tokens + 1}, torch::kLong);
        auto ids = rows.narrow(1, 0, tokens).contiguous(), targets = rows.narrow(1, 1, tokens).contiguous();
        model->token_losses(ids, targets).sum().backward();
        const int64_t before = memory_counts().current;
        auto loss = model->token_losses(ids, targets).sum();
        kept[deeper] = memory_counts().current - before;
        loss.backward();
        sim::SimLayout layout = cpu_layout(tp, tp, batch, tokens, dtype, sp);
        layout.selective_recompute = selective;
        simulated[deeper] = sim::saved_activation_bytes(
            source.config, sim::rank_shape(source.config, plan, topo->tp_rank()), layout);
      }
      if (kept[0] == 0 || !compared) continue;
      const int64_t measured = kept[1] - kept[0], predicted = simulated[1] - simulated[0];
      const double error = static_cast<double>(predicted - measured) / static_cast<double>(measured);
      const std::string where =
          fmt::format("{} {}{}{} B {} T {} tp {} rank {}", preset, bf16 ? "bf16" : "fp32",
                      selective ? " selective" : "", sp ? " sp" : "", batch, tokens, tp, topo->rank());
      std::fprintf(stderr, "%s: a layer keeps %lld bytes, simulated %lld (%+lld, %+.3f%%)\n", where.c_str(),
                   static_cast<long long>(measured), static_cast<long long>(predicted),
                   static_cast<long long>(predicted - measured), 100 * error);
      WORKER_CHECK(std::abs(predicted - measured) <= kSmallTensors, where, ": a layer keeps ", measured,
                   " bytes, simulated ", predicted);
    }
  }
}

TEST(SimulatorValidation, ALayersSavedActivationsAreWhatTheEngineKeeps) {
  const std::string cases = test::full_products() ? "full" : "pairwise";
  for (const int tp : {1, 3, 4}) {
    auto result = test::run_workers("simulator_layer_activations", tp, {std::to_string(tp), cases});
    ASSERT_EQ(result.exit_code, 0) << "tp " << tp << ": " << result.summary;
  }
}

struct Case {
  int world, tp;
};

class SimulatorValidation : public ::testing::TestWithParam<Case> {};

TEST_P(SimulatorValidation, ModelStatesExactPeakWithinTenPercent) {
  const Case c = GetParam();
  auto result = test::run_workers("simulator_memory", c.world, {std::to_string(c.tp)});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

INSTANTIATE_TEST_SUITE_P(Layouts, SimulatorValidation,
                         ::testing::Values(Case{4, 1}, Case{4, 2}, Case{6, 3}, Case{4, 4}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world) + "_tp" + std::to_string(info.param.tp);
                         });

}  // namespace
}  // namespace autotp
