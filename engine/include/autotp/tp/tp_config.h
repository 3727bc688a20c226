// Tensor parallelism's settings: the "tensor_parallel" section (docs/config.md).
#pragma once
#include <nlohmann/json.hpp>

#include <vector>

#include "autotp/base/strict_json.h"
#include "autotp/tp/tp_plan.h"

namespace autotp {

struct TensorParallelConfig {
  int autotp_size = 1;                 // ranks per tensor-parallel group; divides the world size
  std::vector<LayerSpec> layer_specs;  // partition_config, via parse_partition_config (tp_plan.h)

  static TensorParallelConfig read(const JsonSection& top);  // top["tensor_parallel"]
  nlohmann::json to_json() const;
};

}  // namespace autotp
