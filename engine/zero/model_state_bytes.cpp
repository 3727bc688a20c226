#include "autotp/zero/model_state_bytes.h"

namespace autotp {

nlohmann::json ModelStateBytes::to_json() const {
  nlohmann::json j = {{"params", params},
                      {"grads", grads},
                      {"master_weights", master_weights},
                      {"optimizer_states", optimizer_states},
                      {"total", total()}};
  if (frozen_params > 0) j["frozen_params"] = frozen_params;  // LoRA runs only
  if (offload_buffers > 0) j["offload_buffers"] = offload_buffers;  // ZeRO-Offload only
  if (host > 0) {
    j["host"] = host;
    j["device"] = total() - host;
  }
  return j;
}

int64_t analytic_frozen_bytes(const FlatLayout& layout, torch::ScalarType dtype) {
  const int64_t low = static_cast<int64_t>(c10::elementSize(dtype));
  if (layout.stage != 3) return layout.local_numel * low;
  const int64_t whole = layout.whole_unit >= 0 ? layout.units[layout.whole_unit].length : 0;
  return (layout.part + whole) * low;
}

int64_t analytic_frozen_host_bytes(const FlatLayout& layout, torch::ScalarType dtype, OffloadPlacement offload) {
  if (!offload.params || layout.stage != 3) return 0;
  return layout.part * static_cast<int64_t>(c10::elementSize(dtype));
}

int64_t optimizer_state_count(const OptimizerConfig& o) {
  if (o.type == "SGD") return o.momentum != 0 ? 1 : 0;
  return 2;
}

ModelStateBytes analytic_model_state_bytes(const FlatLayout& layout, torch::ScalarType dtype,
                                           const OptimizerConfig& optimizer, bool fp32_grad_accumulation,
                                           OffloadPlacement offload) {
  const int64_t padded = layout.padded, part = layout.part;
  const int64_t low = static_cast<int64_t>(c10::elementSize(dtype));
  const bool mixed = dtype != torch::kFloat32;
  const bool accumulate32 = mixed && fp32_grad_accumulation;
  ModelStateBytes b;
  if (layout.stage == 3) {
    // The partition, plus the persistent unit held whole.
    const int64_t whole = layout.whole_unit >= 0 ? layout.units[layout.whole_unit].length : 0;
    b.params = (part + whole) * low;
  } else {
    b.params = padded * low;
  }
  if (layout.stage <= 1)
    b.grads = padded * low + (accumulate32 ? padded * 4 : 0);
  else
    b.grads = part * (accumulate32 ? 4 : low);
  const bool offloaded = offload.optimizer && layout.stage >= 1;
  b.master_weights = mixed || offloaded ? part * 4 : 0;  // offloaded: a host master also in fp32
  b.optimizer_states = optimizer_state_count(optimizer) * part * 4;
  if (offloaded) {
    // The gradient copy, and the staging of updated parameters bound for the device.
    const bool staged = mixed && !(offload.params && layout.stage == 3);
    b.offload_buffers = part * (accumulate32 ? 4 : low) + (staged ? part * low : 0);
    b.host = b.master_weights + b.optimizer_states + b.offload_buffers;
  }
  if (offload.params && layout.stage == 3) b.host += part * low;
  return b;
}

}  // namespace autotp
