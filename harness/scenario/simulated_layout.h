// One schema for a simulated layout (a model on a cluster, the layout `autotp
// simulate` predicts memory and step time for), read by one strict reader
// (JsonSection, base/strict_json.h: unknown keys with a "did you mean", wrong
// types and values out of range named by file and key). It serves both places a
// simulated scenario is described (schema in scenarios/README.md):
//   - simulate-only scenario files (`autotp simulate --scenario FILE`,
//     scenarios/llama2_7b_8gpu.json): "simulate": true, the layout keys at the
//     top level for every variant, each variant its "name", "tp" and "zero_stage";
//   - kind "simulate" variants of a training scenario (`autotp scenario FILE`):
//     every layout key in the variant.
// Both run the simulator on the parsed struct (simulate_layout); simulate_args()
// gives the single-layout `autotp simulate` command that prints the same JSON.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "autotp/base/strict_json.h"
#include "simulator/simulator.h"

namespace autotp::scenario {

struct SimulatedLayout {
  std::string model;        // catalog name, preset:NAME, or an HF directory / config.json (against the file's directory)
  std::string cluster;      // one of sim::cluster_names()
  std::string calibration;  // cpu-local: calibration file (against the file's directory); "" = the default
  int gpus = 0;             // 0: not given (required)
  int tp = 0;               // 0: not given (required)
  int zero_stage = -1;      // -1: not given (required)
  int64_t seq_len = 0;      // 0: not given (required)
  int64_t micro_batch = 1;
  int64_t gas = 1;
  std::string dtype = "bf16";        // fp32 | bf16 | fp16
  std::string recompute = "off";     // "activation_checkpointing": off | selective | full (true = full)
  std::optional<bool> overlap_comm;  // unset: as the engine (on for the GPU clusters, off on cpu-local)
  int64_t lora_r = 0;                // LoRA rank (0: full fine-tuning); docs/lora.md
  std::string lora_targets = "all-linear";  // LoRA target_modules: all-linear or comma-separated names
  bool offload_optimizer = false;  // ZeRO-Offload of master weights and optimizer states (stages 1-3)
  bool offload_param = false;      // ZeRO-Offload of the stage-3 parameter partition (with offload_optimizer)

  // The simulator's layout on `cluster` (unset overlap_comm follows the cluster, as the engine does).
  sim::SimLayout sim_layout(const sim::ClusterSpec& cluster) const;
  // The arguments after `autotp simulate` that simulate this one layout (add --json for the JSON).
  std::vector<std::string> simulate_args() const;
  // The layout's keys as a file writes them (only the keys that are set).
  nlohmann::json to_json() const;
};

// Every key of a simulated layout: model, cluster, calibration, gpus, tp, zero_stage,
// seq_len, micro_batch, gas, dtype, activation_checkpointing, overlap_comm, lora_r, lora_targets,
// offload_optimizer, offload_param.
const std::vector<std::string>& simulated_layout_keys();

// Reads the layout keys `o` gives over `defaults`: types, ranges, the cluster's
// name; model and calibration paths are taken against `base_dir`.
SimulatedLayout read_simulated_layout(const JsonSection& o, SimulatedLayout defaults, const std::string& base_dir);

// A scenario's "activation_checkpointing": "off" | "selective" | "full", or true
// (= "full") / false (= "off"); `fallback` when absent. Training layouts and
// simulated ones read it alike.
std::string read_recompute_mode(const JsonSection& o, const std::string& fallback);

// Before anything runs: the required keys (model, cluster, gpus, seq_len, tp,
// zero_stage) are set, the model resolves, and the layout fits model and cluster
// (tp divides the GPUs and is at most the heads, seq_len within the positions,
// whole nodes, ...). Errors name o's source and the key; `where` is o's path
// ("variants[2]"). A cpu-local calibration file is read when the layout runs.
void check_simulated_layout(const JsonSection& o, const std::string& where, const SimulatedLayout& l);

// The simulator on this layout (UserError when the cluster cannot be built, e.g. no calibration file).
sim::SimResult simulate_layout(const SimulatedLayout& l);

// A simulate-only scenario file: "simulate": true, optional "name" and
// "assumptions", the layout keys for every variant (the sweep runs over them
// too), "variants": [{"name", "tp", "zero_stage"}] (tp / zero_stage may also be
// given once at the top level).
struct SimulateScenario {
  struct Variant {
    std::string name;
    SimulatedLayout layout;  // base + the variant's tp and zero_stage
  };
  std::string file;
  std::string name;         // "" when the file gives none
  std::string assumptions;  // "" when the file gives none
  SimulatedLayout base;     // the top level
  std::vector<Variant> variants;

  static SimulateScenario from_json(const nlohmann::json& j, const std::string& file, const std::string& base_dir);
  static SimulateScenario from_file(const std::string& path);
};

}  // namespace autotp::scenario
