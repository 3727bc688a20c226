// Activation recomputation's settings: the "activation_checkpointing" section
// (docs/config.md). The trainer turns them into CausalLM's per-layer choices.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "autotp/base/strict_json.h"

namespace autotp {

struct ActivationCheckpointingConfig {
  bool enabled = false;         // recompute something in the backward pass (mode says what)
  std::string mode = "off";     // "off", "full" (whole layers) or "selective" (the attention core)
  std::vector<int64_t> layers;  // full mode: which decoder layers; empty = every layer

  static ActivationCheckpointingConfig read(const JsonSection& top);  // top["activation_checkpointing"]
  nlohmann::json to_json() const;
};

}  // namespace autotp
