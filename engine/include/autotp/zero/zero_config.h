// ZeRO's settings: DeepSpeed's "zero_optimization" section (docs/config.md).
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>

#include "autotp/base/strict_json.h"

namespace autotp {

struct ZeroConfig {
  int stage = 0;                                    // 0 (plain data parallel) .. 3
  int64_t reduce_bucket_size = 500000000;           // elements per gradient reduction (all-reduce / reduce-scatter)
  int64_t allgather_bucket_size = 500000000;        // elements per parameter all-gather
  // dp collectives on a background lane, waited before use (docs/memory.md);
  // unset: on when training on CUDA, off on CPU (there the lane competes with
  // compute for the same cores and gains nothing).
  std::optional<bool> overlap_comm;
  bool overlaps(bool cuda) const { return overlap_comm.value_or(cuda); }
  bool contiguous_gradients = true;                 // accepted; buckets are always contiguous copies
  int64_t stage3_prefetch_bucket_size = 50000000;   // > 0: stage 3 gathers the next layer ahead (one use); 0: off
  int64_t stage3_param_persistence_threshold = 100000;  // stage 3: tensors below this many elements stay whole
  bool gather_16bit_weights_on_model_save = false;  // stage 3: also save gathered 16-bit weights
  // Stage 3: at most this many parameters gathered at once (DeepSpeed's default 1e9):
  // the next layer is prefetched only while the gathered ones and it stay within it.
  // The layer in use is always gathered, whatever its size.
  int64_t stage3_max_live_parameters = 1000000000;
  // Accepted with DeepSpeed's meaning and no effect here (docs/config.md says why):
  int64_t stage3_max_reuse_distance = 1000000000;  // autotp never keeps a gathered layer for reuse
  int64_t sub_group_size = 1000000000;             // autotp's update runs tensor by tensor
  bool allgather_partitions = true;                // the gather is always an all-gather
  bool reduce_scatter = true;                      // stages 2-3 always reduce-scatter
  bool round_robin_gradients = false;              // gradients are partitioned in flat-buffer order
  // ZeRO-Offload (zero/optimizer_offload.h): "none" or "cpu" ("nvme" is refused).
  // offload_optimizer applies at stages 1-3 (at stage 0 it is ignored with a
  // warning, as offload_param is below stage 3); offload_param at stage 3 needs
  // offload_optimizer too. pin_memory: page-locked host buffers (CUDA only).
  std::string offload_optimizer_device = "none";
  std::string offload_param_device = "none";
  bool offload_optimizer_pin_memory = false;
  bool offload_param_pin_memory = false;
  bool offloads() const { return offload_optimizer_device != "none" || offload_param_device != "none"; }
  bool offloads_optimizer() const { return offload_optimizer_device == "cpu" && stage >= 1; }
  bool offloads_params() const { return offload_param_device == "cpu" && stage == 3; }

  static ZeroConfig read(const JsonSection& top);  // top["zero_optimization"]
  nlohmann::json to_json() const;                  // overlap_comm only when set
};

}  // namespace autotp
