// Persistent per-rank bytes of model states (what ZeRO partitions), measured
// from the buffers or from the closed form of docs/memory.md.
#pragma once
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "autotp/optim/optim_config.h"
#include "autotp/zero/flat_layout.h"

namespace autotp {

struct ModelStateBytes {
  int64_t params = 0;          // model-dtype parameters held between steps
  int64_t grads = 0;           // gradient buffers held between steps
  int64_t master_weights = 0;  // fp32 master copy (mixed precision only)
  int64_t optimizer_states = 0;
  int64_t frozen_params = 0;   // LoRA: the frozen base held between steps (model dtype; its partition at stage 3)
  int64_t total() const { return params + grads + master_weights + optimizer_states + frozen_params; }
  nlohmann::json to_json() const;
};

// Optimizer states per element (Adam's two, SGD's momentum buffer or none).
int64_t optimizer_state_count(const OptimizerConfig& optimizer);

// The formula for the held parameters of `layout` in `dtype`.
// `fp32_grad_accumulation`: 16-bit training with gradient accumulation.
ModelStateBytes analytic_model_state_bytes(const FlatLayout& layout, torch::ScalarType dtype,
                                           const OptimizerConfig& optimizer, bool fp32_grad_accumulation);
// Bytes of frozen parameters (LoRA's base) in `dtype`: `layout` (stage 3: the
// partition plus the persistent unit; else every element, unpadded).
int64_t analytic_frozen_bytes(const FlatLayout& layout, torch::ScalarType dtype);

}  // namespace autotp
