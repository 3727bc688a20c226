#include "autotp/zero/zero_units.h"

#include <c10/util/accumulate.h>

#include "autotp/arch/layer_names.h"

namespace autotp {
namespace {
std::vector<const PlanEntry*> plan_entries(const TpPlan& plan) {
  std::vector<const PlanEntry*> out;
  for (const auto& e : plan.entries()) out.push_back(&e);
  return out;
}

ZeroUnits plan_units(const TpPlan& plan) {
  int64_t layers = 0;
  for (const auto& e : plan.entries()) layers = std::max(layers, decoder_layer_of(e.desc.name) + 1);
  return ZeroUnits{layers};
}
}  // namespace

std::vector<int> zero_unit_ids(const std::vector<const PlanEntry*>& entries, const ZeroUnits& units, int stage,
                               int64_t persistence_threshold) {
  std::vector<int> ids;
  ids.reserve(entries.size());
  for (const PlanEntry* e : entries) {
    const int64_t numel = c10::multiply_integers(e->desc.shape);
    const int64_t layer = decoder_layer_of(e->desc.name);
    if (stage == 3 && numel < persistence_threshold)
      ids.push_back(units.persistent());
    else if (layer >= 0)
      ids.push_back(units.layer(layer));
    else if (e->desc.kind == ParamKind::kEmbedding || e->desc.kind == ParamKind::kPositionEmbedding)
      ids.push_back(ZeroUnits::kEmbedding);
    else
      ids.push_back(units.head());
  }
  return ids;
}

std::vector<int> zero_unit_ids(const TpPlan& plan, int stage, int64_t persistence_threshold) {
  return zero_unit_ids(plan_entries(plan), plan_units(plan), stage, persistence_threshold);
}

FlatLayout zero_layout(const std::vector<const PlanEntry*>& entries, const ZeroUnits& units, int tp_rank, int dp,
                       int stage, int64_t persistence_threshold) {
  std::vector<const ShardSpec*> specs;
  for (const PlanEntry* e : entries) specs.push_back(&e->spec);
  const std::vector<int> ids = zero_unit_ids(entries, units, stage, persistence_threshold);
  // Every unit through the head exists, even where these entries leave it empty.
  FlatLayout layout = FlatLayout::build(specs, ids, tp_rank, dp, stage, units.head() + 1);
  if (stage == 3 && units.persistent() < static_cast<int>(layout.units.size())) layout.whole_unit = units.persistent();
  return layout;
}

FlatLayout zero_layout(const TpPlan& plan, int tp_rank, int dp, int stage, int64_t persistence_threshold) {
  return zero_layout(plan_entries(plan), plan_units(plan), tp_rank, dp, stage, persistence_threshold);
}

std::vector<const PlanEntry*> plan_entries(const TpPlan& plan, bool frozen) {
  std::vector<const PlanEntry*> out;
  for (const auto& e : plan.entries())
    if (e.frozen == frozen) out.push_back(&e);
  return out;
}

}  // namespace autotp
