// The simulator: memory and step time of one layout (or every layout) of a
// model on a cluster, per GPU. Memory is the worst tp rank's (uneven shards
// differ); time is the slowest rank's. `fits` compares the predicted peak with
// the GPU's memory less the reserved part.
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "simulator/cluster_catalog.h"
#include "simulator/memory_model.h"
#include "simulator/model_catalog.h"
#include "simulator/time_model.h"

namespace autotp::sim {

struct SimResult {
  std::string model;         // label
  std::string architecture;
  int64_t parameters = 0;    // logical parameter count (tied once)
  std::string cluster;
  SimLayout layout;
  MemoryEstimate memory;                 // worst tp rank
  std::vector<MemoryEstimate> rank_memory;  // per tp rank
  TimeEstimate time;                     // slowest tp rank
  int64_t capacity_bytes = 0;            // per GPU
  int64_t usable_bytes = 0;              // capacity less reserved
  bool fits = false;
  double tokens_per_s = 0;               // global tokens per second
  double mfu = 0;                        // model FLOP/s over peak of all GPUs
  std::vector<std::string> notes;
  nlohmann::json to_json() const;
};

// Checks the layout against model and cluster (UserError naming the flag and the allowed values).
void validate_layout(const ModelConfig& config, const ClusterSpec& cluster, const SimLayout& layout);

SimResult simulate(const ResolvedModel& model, const ClusterSpec& cluster, const SimLayout& layout);

// Every (tp, stage) for layout.gpus: tp dividing the GPUs and at most the heads, stages 0-3;
// for a mixture of experts also every ep of each dp (allowed_ep) when `every_ep`, else
// base.ep alone (the tp whose dp it divides); sorted by tokens/s (fitting layouts first).
std::vector<SimResult> sweep(const ResolvedModel& model, const ClusterSpec& cluster, const SimLayout& base,
                             bool every_ep = true);

// The expert-parallel sizes a model allows at `dp`: divisors of dp, at most its experts (1 for a dense model).
std::vector<int> allowed_ep(const ModelConfig& config, int dp);

// Human-readable reports.
std::string format_result(const SimResult& r);
std::string format_sweep(const std::vector<SimResult>& results);
std::string markdown_sweep(const std::vector<SimResult>& results);  // a markdown table
std::string format_bytes(double bytes);  // "12.3 GiB"

}  // namespace autotp::sim
