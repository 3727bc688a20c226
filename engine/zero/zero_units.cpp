#include "autotp/zero/zero_units.h"

#include <regex>

namespace autotp {

int64_t decoder_layer_of(const std::string& name) {
  static const std::regex layer_name(R"((^|\.)(layers|h)\.([0-9]+)\.)");
  std::smatch match;
  if (!std::regex_search(name, match, layer_name)) return -1;
  return std::stoll(match[3].str());
}

std::vector<int> zero_unit_ids(const TpPlan& plan, int stage, int64_t persistence_threshold) {
  int64_t layers = 0;
  for (const auto& e : plan.entries()) layers = std::max(layers, decoder_layer_of(e.desc.name) + 1);
  const ZeroUnits units{layers};
  std::vector<int> ids;
  ids.reserve(plan.entries().size());
  for (const auto& e : plan.entries()) {
    int64_t numel = 1;
    for (int64_t d : e.desc.shape) numel *= d;
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
  int64_t layers = 0;
  for (const auto& e : plan.entries()) layers = std::max(layers, decoder_layer_of(e.desc.name) + 1);
  if (stage == 3 && ZeroUnits{layers}.persistent() < static_cast<int>(layout.units.size()))
    layout.whole_unit = ZeroUnits{layers}.persistent();
  return layout;
}

}  // namespace autotp
