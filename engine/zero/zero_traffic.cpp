#include "autotp/zero/zero_traffic.h"

#include <algorithm>

#include "autotp/zero/zero_units.h"

namespace autotp {

std::vector<ZeroCollective> zero_step_collectives(const FlatLayout& layout, const ZeroStepShape& shape) {
  std::vector<ZeroCollective> out;
  const int d = layout.dp;
  if (d <= 1) return out;
  const int64_t G = shape.gradient_accumulation_steps, e = shape.element_bytes;
  const ZeroUnits ids{shape.num_layers};
  const int units = static_cast<int>(layout.units.size());
  // ZeroOptimizer::reduce_scatter_unit / all_gather_unit: one call per bucket of columns.
  auto unit_calls = [&](int unit, int64_t bucket) {
    const int64_t s = unit < units ? layout.units[unit].length / d : 0;
    if (s == 0) return int64_t{0};
    const int64_t columns = std::clamp<int64_t>(std::max<int64_t>(1, bucket) / d, 1, s);
    return (s + columns - 1) / columns;
  };
  auto add = [&](ZeroCollective::Op op, int unit, int64_t times, int64_t element, const std::string& what,
                 bool layer = false) {
    const int64_t bucket = op == ZeroCollective::Op::kAllGather ? shape.allgather_bucket_size : shape.reduce_bucket_size;
    const int64_t calls = times * unit_calls(unit, bucket);
    if (calls == 0) return;
    out.push_back({op, calls, times * layout.units[unit].length * element, layer, what});
  };
  const auto rs = ZeroCollective::Op::kReduceScatter, ag = ZeroCollective::Op::kAllGather;
  const int stage = layout.stage;
  if (stage == 0) {
    const int64_t bucket = std::max<int64_t>(1, shape.reduce_bucket_size);
    const int64_t grad_e = shape.fp32_accumulation ? 4 : e;
    out.push_back({ZeroCollective::Op::kAllReduce, (layout.padded + bucket - 1) / bucket, layout.padded * grad_e,
                   false, "gradients, bucket by bucket (step)"});
    return out;
  }
  if (stage <= 2) {
    // Stage 1: every unit at the step (fp32 with fp32 accumulation); stage 2:
    // every unit after each micro-batch's backward, in the model dtype.
    const int64_t grad_e = stage == 1 && shape.fp32_accumulation ? 4 : e;
    for (int u = 0; u < units; ++u) add(rs, u, stage == 1 ? 1 : G, grad_e, "gradients, unit by unit");
    for (int u = 0; u < units; ++u) add(ag, u, 1, e, "updated partitions, unit by unit (step)");
    return out;
  }
  for (int u = 0; u < units; ++u) add(rs, u, G, e, "gradients, unit by unit (backward)");
  auto gather = [&](int u, int64_t times, const std::string& what, bool layer) {
    if (u == layout.whole_unit) return;
    add(ag, u, times, e, what, layer);
  };
  // Forward: embeddings, every layer, the head (with tied embeddings); backward: every layer and the head.
  gather(ZeroUnits::kEmbedding, G, "embeddings (forward)", false);
  for (int64_t l = 0; l < shape.num_layers; ++l) gather(ids.layer(l), 2 * G, "decoder layer (forward, backward)", true);
  gather(ids.head(), 2 * G, "head (forward, backward)", false);
  if (shape.tied_embeddings) gather(ZeroUnits::kEmbedding, 2 * G, "tied embeddings (head forward, backward)", false);
  if (layout.whole_unit >= 0) add(ag, layout.whole_unit, 1, e, "persistent tensors (step)");
  return out;
}

}  // namespace autotp
