#include "autotp/runtime/step_comm_volume.h"

#include <algorithm>

#include "autotp/zero/zero_traffic.h"
#include "autotp/zero/zero_units.h"

namespace autotp {
namespace {

nlohmann::json volume_json(const CollectiveVolume& v) { return {{"calls", v.calls}, {"bytes", v.bytes}}; }

CollectiveVolume difference(int64_t calls_before, int64_t calls_after, int64_t bytes_before, int64_t bytes_after) {
  return {calls_after - calls_before, bytes_after - bytes_before};
}

bool split(const Parameter& p) { return p.entry->role != TpRole::kReplicated; }

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
  auto& params = model.parameters();
  const int t = shape.tp_size, d = shape.dp_size;
  const int stage = config.zero.stage;
  const int64_t G = config.gradient_accumulation_steps;
  const int64_t N = shape.micro_batch * shape.seq_len;  // tokens of one micro-batch
  const int64_t e = static_cast<int64_t>(c10::elementSize(model.dtype()));
  const int64_t activation = N * mc.hidden_size * e;  // one [B, T, hidden] activation
  // Gradients are reduced in the model dtype, or from the fp32 accumulator with
  // 16-bit gradient accumulation at stages 0-1 (ZeroOptimizer).
  const bool fp32_accumulation = model.dtype() != torch::kFloat32 && G > 1;
  const int64_t grad_e = fp32_accumulation && stage <= 1 ? 4 : e;

  // Which decoder layers recompute in the backward (full activation checkpointing).
  std::vector<bool> recompute(mc.num_layers, false);
  if (config.activation_checkpointing.enabled && config.activation_checkpointing.mode != "selective") {
    for (int64_t l = 0; l < mc.num_layers; ++l)
      if (config.activation_checkpointing.layers.empty()) recompute[l] = true;
    for (int64_t l : config.activation_checkpointing.layers) recompute[l] = true;
  }
  // Per layer: its row-parallel linears (one all-reduce each in the forward;
  // their blocks' column inputs give one all-reduce each in the backward, copy_to_tp).
  std::vector<int64_t> row_linears(mc.num_layers, 0);
  CollectiveVolume shared_slices;
  for (auto& p : params) {
    if (const int64_t l = decoder_layer_of(p.name()); l >= 0) {
      const ParamKind kind = p.entry->desc.kind;
      if (p.entry->role == TpRole::kRow && (kind == ParamKind::kLinear || kind == ParamKind::kConv1D))
        ++row_linears[l];
    }
    // sum_shared_slices: one all-reduce of the whole tensor, at the step (stages
    // 0-1) or with each micro-batch's reduction (stages 2-3).
    if (!p.spec().is_replicated() && p.spec().has_overlap()) {
      int64_t global = 1;
      for (int64_t s : p.spec().global_shape()) global *= s;
      const int64_t times = stage >= 2 ? G : 1;
      shared_slices.add(times, times * global * grad_e);
    }
  }

  if (t > 1) {
    GroupVolume& tp = v.tp;
    tp.all_reduce.add(1, 16);  // Trainer::check_tp_consistency: the batch hash (2 x int64)
    const bool embedding_split = split(params.front());
    const Parameter& head = mc.tie_word_embeddings ? params.front() : params.back();
    const bool head_split = split(head);
    CollectiveVolume per_micro_batch;
    if (embedding_split) per_micro_batch.add(1, activation);  // vocab_parallel_embedding: reduce_from_tp
    for (int64_t l = 0; l < mc.num_layers; ++l) {
      const int64_t forwards = recompute[l] ? 2 : 1;  // CheckpointedLayer re-runs the forward collectives
      per_micro_batch.add(row_linears[l] * (forwards + 1), row_linears[l] * (forwards + 1) * activation);
    }
    if (head_split) {
      // vocab_parallel_cross_entropy: max [N] and (sum-exp, target logit) [2, N] in fp32;
      // lm_head_logits: copy_to_tp, whose backward all-reduces the hidden-state gradient.
      per_micro_batch.add(2, N * 4 + 2 * N * 4);
      per_micro_batch.add(1, activation);
    }
    tp.all_reduce.add(G * per_micro_batch.calls, G * per_micro_batch.bytes);
    tp.all_reduce.add(shared_slices.calls, shared_slices.bytes);
  }

  if (d > 1) {
    GroupVolume& dp = v.dp;
    dp.all_reduce.add(1, 16);  // Trainer: target tokens of the global batch (2 x double)
    dp.all_reduce.add(1, 8);   // Trainer: loss sum (1 double)
    ZeroStepShape zs;
    zs.num_layers = mc.num_layers;
    zs.gradient_accumulation_steps = G;
    zs.element_bytes = e;
    zs.fp32_accumulation = fp32_accumulation;
    zs.tied_embeddings = mc.tie_word_embeddings;
    zs.reduce_bucket_size = config.zero.reduce_bucket_size;
    zs.allgather_bucket_size = config.zero.allgather_bucket_size;
    const FlatLayout layout =
        zero_layout(model.plan(), shape.tp_rank, d, stage, config.zero.stage3_param_persistence_threshold);
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
