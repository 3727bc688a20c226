// Expert parallelism: the "expert_parallel" section (DeepSpeed AutoEP's keys),
// which routed experts each expert-parallel rank holds, and the plan of one rank
// (the other ranks' experts marked remote). The ep group is cut from the dp
// dimension (comm/topology.h); within an expert the tp group splits it as
// without ep. docs/architecture.md "Expert parallelism".
#pragma once
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "autotp/arch/model_config.h"
#include "autotp/base/strict_json.h"
#include "autotp/tp/tp_plan.h"

namespace autotp {

struct ExpertParallelConfig {
  bool enabled = false;
  int autoep_size = 1;                   // ranks an expert layer's experts are cut over; divides world / tp, <= experts
  int expert_tensor_parallel_size = 0;   // tp inside an expert: 0 = autotp_size (the only value supported)

  int size() const { return enabled ? autoep_size : 1; }
  // UserError (exit 2) naming the key and the allowed values unless the layout
  // fits: ep divides the dp size and is at most the expert count, the model has experts, and
  // expert_tensor_parallel_size equals autotp_size.
  void validate(const ModelConfig& model, int world_size, int tp_size) const;

  static ExpertParallelConfig read(const JsonSection& top);  // top["expert_parallel"]
  nlohmann::json to_json() const;
};

// Contiguous expert ranges differing by at most one: ep rank r holds E / ep
// experts, one more for r < E % ep (the first ranks take the rest, as uneven
// heads and sequence shards do). Every rank holds at least one (ep <= E).
struct ExpertPlacement {
  int ep_size = 1, ep_rank = 0;
  int64_t num_experts = 0;

  int64_t count(int rank) const { return num_experts / ep_size + (rank < num_experts % ep_size ? 1 : 0); }
  int64_t first(int rank) const { return rank * (num_experts / ep_size) + std::min<int64_t>(rank, num_experts % ep_size); }
  int64_t per_rank() const { return count(ep_rank); }
  int64_t max_per_rank() const { return count(0); }
  int64_t first() const { return first(ep_rank); }
  int owner(int64_t expert) const {
    int r = 0;
    while (r + 1 < ep_size && expert >= first(r + 1)) ++r;
    return r;
  }
  bool owns(int64_t expert) const { return owner(expert) == ep_rank; }
};

// `plan` with the routed experts other ep ranks hold marked remote (no tensor here).
TpPlan place_experts(TpPlan plan, const ExpertPlacement& placement);

// The table `autotp plan --ep N` prints: each ep rank's experts, their shard
// shapes per tp rank and the expert bytes per rank, against ep 1.
std::string expert_placement_table(const TpPlan& plan, const ModelConfig& config, int ep_size);

}  // namespace autotp
