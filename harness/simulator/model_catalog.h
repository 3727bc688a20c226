// Model shapes the simulator knows by name: the exact config.json values of
// well-known HF checkpoints (no weights), plus resolving a --model argument
// (catalog name, preset, HF directory or config.json file) to a ModelConfig.
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "autotp/arch/model_config.h"

namespace autotp::sim {

struct CatalogModel {
  std::string name;        // "llama2-7b"
  std::string hf_id;       // "meta-llama/Llama-2-7b-hf": where the config values come from
  int64_t parameters = 0;  // published parameter count (tests check count_parameters against it)
  nlohmann::json config;   // HF config.json (the keys the engine reads)
};

const std::vector<CatalogModel>& catalog_models();

struct ResolvedModel {
  ModelConfig config;
  std::string label;  // "llama2-7b", "preset:llama-tiny", or the path
};

// NAME (catalog), preset:NAME, an HF model directory or a config.json file.
// Keys that change neither memory nor FLOPs (rope_scaling, sliding windows) are
// dropped before parsing, so e.g. Llama-3.1 configs simulate. UserError lists
// the catalog names when nothing matches.
ResolvedModel resolve_sim_model(const std::string& arg);

}  // namespace autotp::sim
