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
  using Behind = ZeroCollective::Behind;
  auto add = [&](ZeroCollective::Op op, int unit, int64_t times, int64_t element, const std::string& what,
                 bool layer = false, Behind behind = Behind::kNothing) {
    const int64_t bucket = op == ZeroCollective::Op::kAllGather ? shape.allgather_bucket_size : shape.reduce_bucket_size;
    const int64_t calls = times * unit_calls(unit, bucket);
    if (calls == 0) return;
    // A unit gathered in several buckets is gathered synchronously.
    if (op == ZeroCollective::Op::kAllGather && calls > times) behind = Behind::kNothing;
    out.push_back({op, calls, times * layout.units[unit].length * element, layer, what, behind});
  };
  // Stages 2-3 reduce a decoder layer or an untied head behind the next unit's
  // backward; layer 0 has only the embeddings' backward after it; a tied head,
  // the embeddings and persistent tensors are reduced at the backward's end.
  auto reduced_behind = [&](int u) {
    const bool at_end = u == ZeroUnits::kEmbedding || u == layout.whole_unit || u == ids.layer(0) ||
                        (u == ids.head() && shape.tied_embeddings);
    return at_end ? Behind::kNothing : Behind::kBackward;
  };
  int last_unit = -1;  // the last unit with a slice: its gather has no update after it
  for (int u = 0; u < units; ++u)
    if (layout.units[u].length / d > 0) last_unit = u;
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
    for (int u = 0; u < units; ++u)
      add(rs, u, stage == 1 ? 1 : G, grad_e, "gradients, unit by unit", false,
          stage == 1 ? Behind::kNothing : reduced_behind(u));
    for (int u = 0; u < units; ++u)
      add(ag, u, 1, e, "updated partitions, unit by unit (step)", false,
          u == last_unit ? Behind::kNothing : Behind::kUpdate);
    return out;
  }
  for (int u = 0; u < units; ++u) add(rs, u, G, e, "gradients, unit by unit (backward)", false, reduced_behind(u));
  auto gather = [&](int u, int64_t times, const std::string& what, bool layer, Behind behind) {
    if (u == layout.whole_unit) return;
    add(ag, u, times, e, what, layer, behind);
  };
  // Forward: embeddings, every layer, the head (with tied embeddings); backward: every layer and the head.
  // Prefetched behind the previous use: every forward gather but the
  // embeddings', every layer's backward gather; the head's backward begins it.
  gather(ZeroUnits::kEmbedding, G, "embeddings (forward)", false, Behind::kNothing);
  for (int64_t l = 0; l < shape.num_layers; ++l) {
    gather(ids.layer(l), G, "decoder layer (forward)", true, Behind::kForward);
    gather(ids.layer(l), G, "decoder layer (backward)", true, Behind::kBackward);
  }
  gather(ids.head(), G, "head (forward)", false, Behind::kForward);
  gather(ids.head(), G, "head (backward)", false, Behind::kNothing);
  if (shape.tied_embeddings) {
    gather(ZeroUnits::kEmbedding, G, "tied embeddings (head forward)", false, Behind::kForward);
    gather(ZeroUnits::kEmbedding, G, "tied embeddings (head backward)", false, Behind::kNothing);
  }
  if (layout.whole_unit >= 0) add(ag, layout.whole_unit, 1, e, "persistent tensors (step)");
  return out;
}

}  // namespace autotp
