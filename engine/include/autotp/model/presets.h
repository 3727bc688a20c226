// Built-in model presets (HF config.json contents) with seeded random weights,
// for tests, demos and benchmarks; and resolving a --model argument.
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "autotp/model/causal_lm.h"

namespace autotp {

struct Preset {
  std::string name;         // "llama-tiny"
  std::string description;  // what it is for
  nlohmann::json config;    // HF config.json
};

const std::vector<Preset>& presets();
// UserError listing the preset names when unknown.
const Preset& find_preset(const std::string& name);
// Number of logical parameters of a config (tied weights once).
int64_t count_parameters(const ModelConfig& config);

// A --model argument: "preset:NAME", a bare preset name, or an HF directory.
struct ModelSource {
  ModelConfig config;
  std::optional<std::string> dir;  // set for a directory
  std::string label;               // for messages
};
ModelSource resolve_model(const std::string& arg);

// Builds this rank's shards: reads them from the directory, or draws the
// preset's seeded random weights.
std::unique_ptr<CausalLM> load_model(const ModelSource& source, const TpPlan& plan, Comm& tp,
                                     torch::ScalarType dtype, uint64_t seed, LoadReport* report = nullptr,
                                     torch::Device device = torch::kCPU);

// Writes an HF model directory (config.json with torch_dtype, model.safetensors
// with HF names; tied heads not stored) holding the source's weights: a preset's
// seeded random weights, or a directory's own. Used by `autotp init` and scenarios.
void write_model_dir(const ModelSource& source, const std::string& dir, torch::ScalarType dtype, uint64_t seed);

// "f32" | "fp32" | "float32" | "bf16" | "bfloat16" | "f16" | "fp16" | "float16".
torch::ScalarType parse_dtype(const std::string& name);
std::string hf_dtype_name(torch::ScalarType dtype);  // "float32", "bfloat16", "float16"

}  // namespace autotp
