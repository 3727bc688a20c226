// ZeRO's settings: DeepSpeed's "zero_optimization" section (docs/config.md).
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>

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

  static ZeroConfig read(const JsonSection& top);  // top["zero_optimization"]
  nlohmann::json to_json() const;                  // overlap_comm only when set
};

}  // namespace autotp
