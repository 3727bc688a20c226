// ZeRO units: the groups of parameters ZeRO gathers, reduces and partitions as
// wholes (FlatLayout cuts every unit over the dp ranks). Unit ids, in
// flat-buffer order:
//   0            the embeddings (token, and GPT-2's positions)
//   1 + l        decoder layer l
//   L + 1        the head: final norm and an untied LM head
//   L + 2        stage 3 only: the persistent tensors, those whose whole
//                tensor has fewer elements than stage3_param_persistence_threshold;
//                they stay gathered for the whole run (DeepSpeed's rule)
// The ids are the same on every tp rank (the threshold reads the whole tensor).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "autotp/arch/layer_names.h"  // decoder_layer_of: which unit a parameter's layer is
#include "autotp/tp/tp_plan.h"
#include "autotp/zero/flat_layout.h"

namespace autotp {

struct ZeroUnits {
  int64_t num_layers = 0;
  static constexpr int kEmbedding = 0;
  int layer(int64_t l) const { return static_cast<int>(1 + l); }
  int head() const { return static_cast<int>(num_layers + 1); }
  int persistent() const { return static_cast<int>(num_layers + 2); }
  int count() const { return static_cast<int>(num_layers + 3); }
};

// Unit id of every plan entry, in plan order.
std::vector<int> zero_unit_ids(const TpPlan& plan, int stage, int64_t persistence_threshold);
// Unit ids of some entries of a model with `units.num_layers` layers.
std::vector<int> zero_unit_ids(const std::vector<const PlanEntry*>& entries, const ZeroUnits& units, int stage,
                               int64_t persistence_threshold);

// The flat layout of tp rank `tp_rank` that ZeroOptimizer builds for `plan`
// (every entry) or for some of its entries (what trains, or the frozen base).
FlatLayout zero_layout(const TpPlan& plan, int tp_rank, int dp, int stage, int64_t persistence_threshold);
FlatLayout zero_layout(const std::vector<const PlanEntry*>& entries, const ZeroUnits& units, int tp_rank, int dp,
                       int stage, int64_t persistence_threshold);
// The entries of `plan` that train (frozen == false) or not.
std::vector<const PlanEntry*> plan_entries(const TpPlan& plan, bool frozen);

}  // namespace autotp
