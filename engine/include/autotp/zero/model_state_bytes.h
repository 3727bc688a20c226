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
  // ZeRO-Offload: the host copy of the reduced gradient partition and the staged
  // updated parameters (16-bit training) — zero without offload.
  int64_t offload_buffers = 0;
  int64_t host = 0;  // of total(), the bytes in host memory (ZeRO-Offload); the rest is on the rank's device
  int64_t total() const { return params + grads + master_weights + optimizer_states + frozen_params + offload_buffers; }
  ModelStateBytes& operator+=(const ModelStateBytes& o) {
    params += o.params, grads += o.grads, master_weights += o.master_weights;
    optimizer_states += o.optimizer_states, frozen_params += o.frozen_params;
    offload_buffers += o.offload_buffers, host += o.host;
    return *this;
  }
  nlohmann::json to_json() const;
};

// What ZeRO-Offload moves to host memory (ZeroConfig::offloads_optimizer / offloads_params).
struct OffloadPlacement {
  bool optimizer = false;  // master, optimizer states, gradient copy, staging (stages 1-3)
  bool params = false;     // the stage-3 parameter partition (the persistent unit stays)
};

// Optimizer states per element (Adam's two, SGD's momentum buffer or none).
int64_t optimizer_state_count(const OptimizerConfig& optimizer);

// The formula for the held parameters of `layout` in `dtype`.
// `fp32_grad_accumulation`: 16-bit training with gradient accumulation.
ModelStateBytes analytic_model_state_bytes(const FlatLayout& layout, torch::ScalarType dtype,
                                           const OptimizerConfig& optimizer, bool fp32_grad_accumulation,
                                           OffloadPlacement offload = {});
// Bytes of frozen parameters (LoRA's base) in `dtype`: `layout` (stage 3: the
// partition plus the persistent unit; else every element, unpadded).
int64_t analytic_frozen_bytes(const FlatLayout& layout, torch::ScalarType dtype);
// Of those, the bytes offload_param keeps in host memory (the stage-3 partition).
int64_t analytic_frozen_host_bytes(const FlatLayout& layout, torch::ScalarType dtype, OffloadPlacement offload);

}  // namespace autotp
