#include "autotp/runtime/step_comm_volume.h"

#include <algorithm>

#include "autotp/tp/tp_traffic.h"
#include "autotp/zero/zero_traffic.h"
#include "autotp/zero/zero_units.h"

namespace autotp {
namespace {

nlohmann::json volume_json(const CollectiveVolume& v) { return {{"calls", v.calls}, {"bytes", v.bytes}}; }

CollectiveVolume difference(int64_t calls_before, int64_t calls_after, int64_t bytes_before, int64_t bytes_after) {
  return {calls_after - calls_before, bytes_after - bytes_before};
}

}  // namespace

GroupVolume GroupVolume::between(const CommStats& a, const CommStats& b) {
  GroupVolume v;
  v.all_reduce = difference(a.all_reduce_calls, b.all_reduce_calls, a.all_reduce_bytes, b.all_reduce_bytes);
  v.all_gather = difference(a.all_gather_calls, b.all_gather_calls, a.all_gather_bytes, b.all_gather_bytes);
  v.reduce_scatter =
      difference(a.reduce_scatter_calls, b.reduce_scatter_calls, a.reduce_scatter_bytes, b.reduce_scatter_bytes);
  v.broadcast = difference(a.broadcast_calls, b.broadcast_calls, a.broadcast_bytes, b.broadcast_bytes);
  return v;
}

nlohmann::json GroupVolume::to_json() const {
  return {{"all_reduce", volume_json(all_reduce)},
          {"all_gather", volume_json(all_gather)},
          {"reduce_scatter", volume_json(reduce_scatter)},
          {"broadcast", volume_json(broadcast)}};
}

nlohmann::json StepCommVolume::to_json() const {
  return {{"tp", tp.to_json()}, {"dp", dp.to_json()}, {"world", world.to_json()}};
}

StepCommVolume analytic_step_comm_volume(CausalLM& model, const TrainConfig& config, const StepShape& shape) {
  StepCommVolume v;
  const ModelConfig& mc = model.config();
  const int t = shape.tp_size, d = shape.dp_size;
  const int stage = config.zero.stage;
  const int64_t G = config.gradient_accumulation_steps;
  const int64_t N = shape.micro_batch * shape.seq_len;  // tokens of one micro-batch
  const int64_t e = static_cast<int64_t>(c10::elementSize(model.dtype()));
  // Gradients are reduced in the model dtype, or from the fp32 accumulator with
  // 16-bit gradient accumulation at stages 0-1 (ZeroOptimizer).
  const bool fp32_accumulation = model.dtype() != torch::kFloat32 && G > 1;

  if (t > 1) {
    TpStepShape ts = tp_step_shape(model.plan(), mc.num_layers);
    // Which decoder layers recompute in the backward (full activation checkpointing).
    ts.recompute.assign(mc.num_layers, false);
    if (config.activation_checkpointing.enabled && config.activation_checkpointing.mode != "selective") {
      for (int64_t l = 0; l < mc.num_layers; ++l)
        if (config.activation_checkpointing.layers.empty()) ts.recompute[l] = true;
      for (int64_t l : config.activation_checkpointing.layers) ts.recompute[l] = true;
    }
    ts.tokens = N;
    ts.micro_batch = shape.micro_batch;
    ts.sequence_parallel = model.plan().sequence_parallel();
    ts.overlap = model.plan().overlap_comm();
    ts.hidden = mc.hidden_size;
    ts.zero_stage = stage;
    ts.element_bytes = e;
    ts.fp32_accumulation = fp32_accumulation;
    for (const auto& c : tp_step_collectives(ts)) {
      const int64_t times = c.per_micro_batch ? G : 1;
      CollectiveVolume& into = c.op == TpOp::kAllGather       ? v.tp.all_gather
                               : c.op == TpOp::kReduceScatter ? v.tp.reduce_scatter
                                                              : v.tp.all_reduce;
      into.add(times * c.calls, times * c.bytes);
    }
  }

  if (d > 1) {
    GroupVolume& dp = v.dp;
    dp.all_reduce.add(1, 16);  // Trainer: target tokens of the global batch (2 x double)
    // Trainer: loss and load-balancing loss sums (2 x double), and a mixture of
    // experts' routing counts (sparse layers x experts doubles).
    int64_t sparse = 0;
    for (int64_t l = 0; l < mc.num_layers; ++l) sparse += mc.is_sparse(l) ? 1 : 0;
    dp.all_reduce.add(1, 16 + 8 * sparse * mc.num_experts);
    ZeroStepShape zs;
    zs.num_layers = mc.num_layers;
    zs.gradient_accumulation_steps = G;
    zs.element_bytes = e;
    zs.fp32_accumulation = fp32_accumulation;
    zs.tied_embeddings = mc.tie_word_embeddings;
    zs.reduce_bucket_size = config.zero.reduce_bucket_size;
    zs.allgather_bucket_size = config.zero.allgather_bucket_size;
    // Under expert parallelism the routed experts are reduced over the edp group
    // (another Comm, not in this volume): dp carries the other tensors.
    std::vector<const PlanEntry*> over_dp;
    for (const auto& e : model.plan().entries())
      if (config.expert_parallel.size() == 1 || e.expert < 0) over_dp.push_back(&e);
    const FlatLayout layout = zero_layout(over_dp, ZeroUnits{mc.num_layers}, shape.tp_rank, d, stage,
                                          config.zero.stage3_param_persistence_threshold);
    for (const auto& c : zero_step_collectives(layout, zs)) {
      CollectiveVolume& target = c.op == ZeroCollective::Op::kAllReduce  ? dp.all_reduce
                                 : c.op == ZeroCollective::Op::kAllGather ? dp.all_gather
                                                                          : dp.reduce_scatter;
      target.add(c.calls, c.bytes);
    }
  }
  if (t * d > 1) v.world.all_reduce.add(1, 8);  // ZeroOptimizer::step: global gradient norm (1 double)
  return v;
}

}  // namespace autotp
