#include "autotp/tp/tp_traffic.h"

#include "autotp/arch/layer_names.h"

#include <set>
#include <string>

namespace autotp {

TpStepShape tp_step_shape(const TpPlan& plan, int64_t num_layers) {
  TpStepShape s;
  s.tp_size = plan.tp_size();
  s.row_linears.assign(num_layers, 0);
  const PlanEntry* embedding = nullptr;
  const PlanEntry* head = nullptr;
  // A sparse block reduces its experts' (and shared expert's) summed outputs once.
  std::vector<std::set<std::string>> reductions(num_layers);
  for (const auto& e : plan.entries()) {
    const ParamKind kind = e.desc.kind;
    if (const int64_t l = decoder_layer_of(e.desc.name); l >= 0)
      if (e.role == TpRole::kRow && (kind == ParamKind::kLinear || kind == ParamKind::kConv1D)) {
        std::string block = e.desc.module;
        for (const char* part : {".experts.", ".shared_expert."})
          if (const auto at = e.desc.module.find(part); at != std::string::npos) block = e.desc.module.substr(0, at);
        if (reductions[l].insert(block).second) ++s.row_linears[l];
      }
    if (kind == ParamKind::kEmbedding && !embedding) embedding = &e;
    if (kind == ParamKind::kLmHead) head = &e;
    // sum_partial_grads (tp/parallel_layers.h) sums these; other replicated tensors' gradients are whole on
    // every rank.
    if (e.partial_grad || (!e.spec.is_replicated() && e.spec.has_overlap())) {
      int64_t global = 1;
      for (int64_t d : e.spec.global_shape()) global *= d;
      s.shared_numel.push_back(global);
    }
  }
  if (!head) head = embedding;  // tied: the embedding serves as the head
  s.embedding_split = embedding && embedding->role != TpRole::kReplicated;
  s.head_split = head && head->role != TpRole::kReplicated;
  return s;
}

std::vector<TpCollective> tp_step_collectives(const TpStepShape& shape) {
  std::vector<TpCollective> out;
  if (shape.tp_size <= 1) return out;
  auto counted = [&](int64_t element) { return shape.reduce_16bit_as_fp32 && element == 2 ? int64_t{4} : element; };
  const int64_t N = shape.tokens;
  const int64_t activation = N * shape.hidden * counted(shape.element_bytes);  // one [B, T, hidden] activation
  auto add = [&](int64_t calls, int64_t bytes_per_call, bool per_micro_batch, const std::string& what) {
    if (calls > 0) out.push_back({calls, calls * bytes_per_call, per_micro_batch, what});
  };
  add(1, 16, false, "batch hash, 2 x int64 (Trainer::check_tp_consistency)");
  if (shape.embedding_split) add(1, activation, true, "vocab-parallel embedding output (reduce_from_tp, forward)");
  // Per layer: one all-reduce per row-parallel linear in the forward (again when
  // the layer is recomputed: CheckpointedLayer re-runs the forward collectives),
  // and one per block's column-parallel input in the backward (copy_to_tp); every
  // block has one row-parallel exit and one column-parallel entry.
  int64_t forward = 0, recomputed = 0, backward = 0;
  for (size_t l = 0; l < shape.row_linears.size(); ++l) {
    const int64_t rows = shape.row_linears[l];
    forward += rows;
    backward += rows;
    if (l < shape.recompute.size() && shape.recompute[l]) recomputed += rows;
  }
  add(forward, activation, true, "row-parallel linear outputs (reduce_from_tp, forward)");
  add(recomputed, activation, true, "row-parallel linear outputs of recomputed layers (forward again)");
  add(backward, activation, true, "column-parallel block inputs' gradients (copy_to_tp, backward)");
  if (shape.head_split) {
    // vocab_parallel_cross_entropy: max [N], then (sum-exp, target logit) [2, N], in fp32.
    add(1, N * 4, true, "cross-entropy max, fp32 (vocab_parallel_cross_entropy)");
    add(1, 2 * N * 4, true, "cross-entropy sum-exp and target logit, fp32 (vocab_parallel_cross_entropy)");
    add(1, activation, true, "LM head input's gradient (lm_head_logits: copy_to_tp, backward)");
  }
  // sum_partial_grads: one all-reduce of the whole gradient, at the step from the
  // accumulated gradients (stages 0-1; fp32 with fp32 accumulation), or with each
  // micro-batch's reduction in the model dtype (stages 2-3).
  const bool each_micro_batch = shape.zero_stage >= 2;
  const int64_t gradient = counted(shape.fp32_accumulation && !each_micro_batch ? 4 : shape.element_bytes);
  for (int64_t numel : shape.shared_numel)
    add(1, numel * gradient, each_micro_batch, "shared kv slices' or per-head norms' gradient, whole tensor (sum_partial_grads)");
  return out;
}

}  // namespace autotp
