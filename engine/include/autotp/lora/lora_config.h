// LoraConfig: the "lora" section of a training config, in PEFT's LoraConfig
// field names, and the same fields read from a PEFT adapter_config.json.
// Unsupported PEFT features (DoRA, other PEFT types, per-module rank or alpha
// patterns, layer selection, MoE expert parameters) are a UserError naming the
// key and the allowed values (docs/lora.md).
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "autotp/base/strict_json.h"

namespace autotp {

struct LoraConfig {
  bool enabled = false;      // a "lora" section (or --lora-r / --adapter) is present
  int64_t r = 8;
  double lora_alpha = 8;
  double lora_dropout = 0;
  // target_modules as PEFT reads it: a list of names (a module matches when its
  // path equals a name or ends with "." + name), one regex (full match of the
  // path), or "all-linear" (every linear layer but the output head).
  std::vector<std::string> target_modules;
  std::string target_regex;  // set when target_modules was one string other than "all-linear"
  bool all_linear = false;
  std::string bias = "none";  // none | all | lora_only
  bool use_rslora = false;
  std::vector<std::string> modules_to_save;
  std::string init_lora_weights = "true";  // "true" (A Kaiming-uniform, B 0) | "gaussian" | "false" (B random too)

  // PEFT's scale of the adapter's output: lora_alpha / r, or / sqrt(r) with rslora.
  double scaling() const;

  // top["lora"] of a training config.
  static LoraConfig read(const JsonSection& top);
  // A PEFT adapter_config.json (`path` for messages).
  static LoraConfig from_adapter_config(const nlohmann::json& json, const std::string& path);
  // PEFT's adapter_config.json for this config (target_modules as resolved module paths).
  nlohmann::json to_adapter_config(const std::vector<std::string>& resolved_targets,
                                   const std::string& base_model) const;
  nlohmann::json to_json() const;  // the "lora" section with every default written out
};

}  // namespace autotp
