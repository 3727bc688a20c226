// Tensor parallelism's settings: the "tensor_parallel" section (docs/config.md).
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "autotp/base/strict_json.h"
#include "autotp/tp/tp_plan.h"

namespace autotp {

// Every key of DeepSpeed's AutoTP training section (TPTrainingConfig) is read:
// those autotp has a meaning for are applied, the rest are exit-2 errors that say
// what DeepSpeed does with them and what autotp offers (docs/config.md has the table).
struct TensorParallelConfig {
  int autotp_size = 1;                 // ranks per tensor-parallel group; divides the world size (0 = 1: off)
  std::vector<LayerSpec> layer_specs;  // partition_config, via parse_partition_config (tp_plan.h)
  std::string dtype;                   // "dtype" as given ("" when absent): must agree with bf16 / fp16
  bool sequence_parallel = false;      // norms, residuals and dropout on 1/tp of the sequence (tp > 1)
  bool overlap_comm = false;           // tp_overlap_comm: tp collectives behind compute (tp > 1)

  TpPlanOptions plan_options() const;  // tp size, user layer specs and sequence parallelism

  static TensorParallelConfig read(const JsonSection& top);  // top["tensor_parallel"]
  nlohmann::json to_json() const;
};

}  // namespace autotp
