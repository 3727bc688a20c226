// The communication of one training step (Trainer::train_step with its
// ZeroOptimizer) as a closed form of the layout, per group and collective, in
// the units CommStats counts (calls; bytes of the tensor passed, of the
// gathered output for all-gather). bench-step compares it with what the Comms
// counted. The formula, term by term, is in bench/README.md; each term names
// the code that issues the collective.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>

#include "autotp/comm/comm.h"
#include "autotp/model/causal_lm.h"
#include "autotp/runtime/train_config.h"

namespace autotp {

struct CollectiveVolume {
  int64_t calls = 0, bytes = 0;
  void add(int64_t n_calls, int64_t n_bytes) { calls += n_calls, bytes += n_bytes; }
  bool operator==(const CollectiveVolume& o) const { return calls == o.calls && bytes == o.bytes; }
};

struct GroupVolume {
  CollectiveVolume all_reduce, all_gather, reduce_scatter, broadcast;
  bool operator==(const GroupVolume& o) const {
    return all_reduce == o.all_reduce && all_gather == o.all_gather && reduce_scatter == o.reduce_scatter &&
           broadcast == o.broadcast;
  }
  // What a Comm counted between two snapshots of its stats.
  static GroupVolume between(const CommStats& before, const CommStats& after);
  nlohmann::json to_json() const;
};

struct StepCommVolume {
  GroupVolume tp, dp, world;
  bool operator==(const StepCommVolume& o) const { return tp == o.tp && dp == o.dp && world == o.world; }
  nlohmann::json to_json() const;
};

struct StepShape {
  int tp_size = 1, dp_size = 1, tp_rank = 0;
  int64_t micro_batch = 1;  // sequences per micro-batch
  int64_t seq_len = 1;      // input tokens per sequence
};

// `model` is this rank's model (its plan gives the roles and shard sizes);
// `config` the resolved training config (ZeRO stage, buckets, accumulation,
// activation checkpointing).
StepCommVolume analytic_step_comm_volume(CausalLM& model, const TrainConfig& config, const StepShape& shape);

}  // namespace autotp
