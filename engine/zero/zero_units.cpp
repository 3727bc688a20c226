#include "autotp/zero/zero_units.h"

#include <c10/util/accumulate.h>

#include "autotp/arch/layer_names.h"

namespace autotp {
namespace {
ZeroUnits plan_units(const TpPlan& plan) {
  int64_t layers = 0;
  for (const auto& e : plan.entries()) layers = std::max(layers, decoder_layer_of(e.desc.name) + 1);
  return ZeroUnits{layers};
}
}  // namespace

std::vector<int> zero_unit_ids(const TpPlan& plan, int stage, int64_t persistence_threshold) {
  const ZeroUnits units = plan_units(plan);
  std::vector<int> ids;
  ids.reserve(plan.entries().size());
  for (const auto& e : plan.entries()) {
    const int64_t numel = c10::multiply_integers(e.desc.shape);
    const int64_t layer = decoder_layer_of(e.desc.name);
    if (stage == 3 && numel < persistence_threshold)
      ids.push_back(units.persistent());
    else if (layer >= 0)
      ids.push_back(units.layer(layer));
    else if (e.desc.kind == ParamKind::kEmbedding || e.desc.kind == ParamKind::kPositionEmbedding)
      ids.push_back(ZeroUnits::kEmbedding);
    else
      ids.push_back(units.head());
  }
  return ids;
}

FlatLayout zero_layout(const TpPlan& plan, int tp_rank, int dp, int stage, int64_t persistence_threshold) {
  std::vector<const ShardSpec*> specs;
  for (const auto& e : plan.entries()) specs.push_back(&e.spec);
  const std::vector<int> ids = zero_unit_ids(plan, stage, persistence_threshold);
  FlatLayout layout = FlatLayout::build(specs, ids, tp_rank, dp, stage);
  const int persistent = plan_units(plan).persistent();
  if (stage == 3 && persistent < static_cast<int>(layout.units.size())) layout.whole_unit = persistent;
  return layout;
}

}  // namespace autotp
