#include "autotp/tp/tp_traffic.h"

#include "autotp/arch/layer_names.h"

#include <set>
#include <string>

namespace autotp {

TpStepShape tp_step_shape(const TpPlan& plan, int64_t num_layers) {
  TpStepShape s;
  s.tp_size = plan.tp_size();
  s.row_linears.assign(num_layers, 0);
  s.sparse.assign(num_layers, false);
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
          if (const auto at = e.desc.module.find(part); at != std::string::npos) {
            block = e.desc.module.substr(0, at);
            s.sparse[l] = true;
          }
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
    if (calls > 0) out.push_back({TpOp::kAllReduce, calls, calls * bytes_per_call, per_micro_batch, what});
  };
  // Gathers and reduce-scatters of one micro-batch; Gloo moves their bytes as they are.
  const int64_t stream = N * shape.hidden * shape.element_bytes;
  auto add_stream = [&](TpOp op, int64_t calls, const std::string& what) {
    if (calls > 0) out.push_back({op, calls, calls * stream, true, what});
  };
  auto add_blocks = [&](TpOp op, int64_t calls, int64_t bytes, const std::string& what) {
    if (calls > 0) out.push_back({op, calls, bytes, true, what});
  };
  add(1, 16, false, "batch hash, 2 x int64 (Trainer::check_tp_consistency)");
  const bool sp = shape.sequence_parallel;
  if (shape.embedding_split && !sp) add(1, activation, true, "vocab-parallel embedding output (reduce_from_tp, forward)");
  if (shape.embedding_split && sp)
    add_stream(TpOp::kReduceScatter, 1, "vocab-parallel embedding output, each rank's tokens (reduce_scatter_to_sp)");
  if (sp) add_stream(TpOp::kAllGather, 1, "the embedding output's gradient along the sequence (backward)");
  // Per layer, for each split block (one column-parallel entry, one row-parallel
  // exit): without sequence parallelism the exit's all-reduce in the forward (again
  // when the layer is recomputed) and the entry's input-gradient all-reduce in the
  // backward; with it the entry all-gathers the sequence (forward; again in the
  // backward, column_parallel_inputs keeps only its slice) and reduce-scatters the
  // input gradient, the exit reduce-scatters (forward) and all-gathers its
  // gradient. A sparse block enters through gather_from_sp (no second gather).
  // tp_overlap_comm cuts a dense layer in two pieces: along the batch every block
  // collective runs once per piece; along the sequence (one sequence, no sequence
  // parallelism) attention runs whole, so its entry runs once.
  const int64_t cut = !shape.overlap ? 0 : shape.micro_batch >= 2 ? 2 : !sp && N >= 2 ? 1 : 0;  // 2 batch, 1 sequence
  // Calls, and blocks' worth of activation bytes (a piece moves its part of one).
  struct Count {
    int64_t calls = 0, blocks = 0;
    void add(int64_t c, int64_t b) { calls += c, blocks += b; }
  };
  Count forward_exits, forward_entries, backward_exits, backward_entries, regathers;
  for (size_t l = 0; l < shape.row_linears.size(); ++l) {
    const int64_t rows = shape.row_linears[l];
    const bool sparse = l < shape.sparse.size() && shape.sparse[l];
    const bool pieced = cut > 0 && rows == 2 && !sparse;
    const int64_t exits = pieced ? 2 * rows : rows;
    const int64_t entries = !pieced ? rows : cut == 2 ? 2 * rows : 1 + 2;  // sequence cut: attention whole, MLP in two
    const int64_t times = l < shape.recompute.size() && shape.recompute[l] ? 2 : 1;
    forward_exits.add(times * exits, times * rows);
    forward_entries.add(times * entries, times * rows);
    backward_exits.add(exits, rows);
    backward_entries.add(entries, rows);
    regathers.add(sparse ? entries - 1 : entries, sparse ? rows - 1 : rows);  // the sparse block gathers once
  }
  if (!sp) {
    add_blocks(TpOp::kAllReduce, forward_exits.calls, forward_exits.blocks * activation,
               "row-parallel block outputs (reduce_from_tp, forward; again when recomputed)");
    add_blocks(TpOp::kAllReduce, backward_entries.calls, backward_entries.blocks * activation,
               "column-parallel block inputs' gradients (backward)");
  } else {
    add_blocks(TpOp::kAllGather, forward_entries.calls, forward_entries.blocks * stream,
               "block inputs gathered along the sequence (forward; again when recomputed)");
    add_blocks(TpOp::kReduceScatter, forward_exits.calls, forward_exits.blocks * stream,
               "row-parallel block outputs (reduce_scatter_to_sp, forward; again when recomputed)");
    add_blocks(TpOp::kAllGather, regathers.calls, regathers.blocks * stream,
               "block inputs gathered again (column_parallel_inputs, backward)");
    add_blocks(TpOp::kReduceScatter, backward_entries.calls, backward_entries.blocks * stream,
               "block inputs' gradients (backward)");
    add_blocks(TpOp::kAllGather, backward_exits.calls, backward_exits.blocks * stream,
               "row-parallel block outputs' gradients (backward)");
  }
  if (shape.head_split) {
    // vocab_parallel_cross_entropy: max [N], then (sum-exp, target logit) [2, N], in fp32.
    add(1, N * 4, true, "cross-entropy max, fp32 (vocab_parallel_cross_entropy)");
    add(1, 2 * N * 4, true, "cross-entropy sum-exp and target logit, fp32 (vocab_parallel_cross_entropy)");
    if (!sp) {
      add(1, activation, true, "LM head input's gradient (column_parallel_inputs, backward)");
    } else {
      add_stream(TpOp::kAllGather, 2, "LM head input gathered along the sequence (forward, again in the backward)");
      add_stream(TpOp::kReduceScatter, 1, "LM head input's gradient (column_parallel_inputs, backward)");
    }
  } else if (sp) {
    add_stream(TpOp::kAllGather, 1, "replicated LM head's input gathered along the sequence (gather_from_tp)");
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
