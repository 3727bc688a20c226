// ScenarioSpec: a scenario file (scenarios/*.json, schema in scenarios/README.md)
// parsed, validated and expanded into the list of variants to run. Parsing is
// strict like TrainConfig's: unknown keys are UserErrors with a "did you mean",
// every message names the file and the key. Each variant's DeepSpeed config is
// validated by TrainConfig::from_json + resolve_batch and its tp size by
// TpPlan::build, so a scenario that parses runs configs `autotp train` accepts.
// Sweep combinations that cannot run are skipped with a reason; an explicit
// variant that cannot run is an error. A kind "simulate" variant is a simulated
// layout (simulated_layout.h, the schema of simulate-only scenario files),
// checked against its model and cluster. Plain values.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "autotp/arch/model_config.h"
#include "autotp/runtime/hf_trainer_config.h"
#include "autotp/runtime/train_config.h"
#include "scenario/simulated_layout.h"

namespace autotp::scenario {

// One model of the scenario: a preset or an HF directory, with optional
// config.json overrides (a JSON merge patch; the runner writes the changed
// model to OUT/models/KEY with the scenario's seed).
struct ModelSpec {
  std::string key;                                     // "" for the single "model", else the key in "models"
  std::string source;                                  // "preset:NAME" or a directory (resolved against the file)
  nlohmann::json overrides = nlohmann::json::object();  // merged into config.json
  ModelConfig config;                                  // after overrides
  std::string tokenizer;  // train --tokenizer for this model: "bytes" or a directory (the scenario's "tokenizer")
  bool needs_dir() const { return !overrides.empty(); }
};

// One run of the scenario: a layout of the scenario's world (kind train), or a
// simulated layout (kind simulate: only name, kind and `simulated` are set; no baseline).
struct VariantSpec {
  std::string name;
  std::string kind = "train";  // train: `autotp train` on world_size ranks; simulate: the simulator on `simulated`
  std::string model;           // ModelSpec key
  int tp = 1;
  int zero_stage = 3;
  std::string dtype = "fp32";      // fp32 | bf16 | fp16
  int64_t micro_batch = 0;         // train_micro_batch_size_per_gpu; 0 = derived from the base config
  std::string recompute = "off";   // activation checkpointing: off | selective | full
  nlohmann::json overrides = nlohmann::json::object();  // merge patch on the variant's DeepSpeed config
  SimulatedLayout simulated;                            // kind simulate: the layout (simulated_layout.h)
  bool is_baseline = false;
  std::string baseline;      // the baseline variant this one is compared with (its own name for a baseline)
  nlohmann::json ds_config;  // the DeepSpeed config `autotp train` gets
  TrainConfig config;        // ds_config parsed and resolved for the world size
};

struct SkippedVariant {
  std::string name;
  std::string reason;
};

// One check of the scenario. Fields that a type does not use stay at their defaults.
struct CheckSpec {
  std::string type;  // loss_agreement | ratio (alias memory_ratio) | model_states_analytic | no_failed_runs | loss_decreases
  std::vector<std::string> variants;  // loss_agreement, model_states_analytic, loss_decreases: empty = all
  std::string metric = "loss";        // loss_agreement: loss | grad_norm; ratio: see kRatioMetrics
  double max_rel_diff = 1e-4;         // loss_agreement: max over steps of |v - b| / |b|
  std::string variant, of;            // ratio: metric(variant) / metric(of)
  std::string rank = "max";           // ratio: max (over ranks) | rank0
  double min = -std::numeric_limits<double>::infinity();  // ratio bounds
  double max = std::numeric_limits<double>::infinity();
  double min_drop = 0.0;  // loss_decreases: final loss <= first loss * (1 - min_drop)
  nlohmann::json json;    // the check as written (copied into results.json)
};

// Metrics a ratio check may name (per rank; step_time / tokens_per_s are medians).
const std::vector<std::string>& ratio_metrics();

struct ScenarioSpec {
  std::string file;      // path as given ("" for JSON given directly)
  std::string base_dir;  // relative paths (data, model dirs) resolve against this
  std::string name;
  std::string description;
  std::map<std::string, ModelSpec> models;
  std::string data;         // resolved path
  int64_t steps = 10;
  int64_t seq_len = 0;      // 0 only for .json token arrays
  std::string tokenizer = "auto";  // auto | bytes | a directory (docs/data.md)
  std::string prompt_template = "alpaca";  // instruction records: alpaca | plain | a file (resolved)
  std::string chat_template;       // chat records: a template file (resolved); "" = the model directory's
  std::string chat_loss = "assistant";  // assistant | all
  HfTrainingArguments training_arguments;  // fill the config's HF-Trainer "auto" values per variant
  uint64_t seed = 1;
  int world_size = 0;
  std::string backend = "gloo";  // gloo | nccl (CUDA tensors; nccl needs device cuda)
  std::string device = "cpu";    // cpu | cuda: where every variant trains
  bool shuffle = true;
  int threads = 0;           // per rank; 0 = cores / world
  double timeout_s = 300;
  nlohmann::json base_config = nlohmann::json::object();
  std::vector<VariantSpec> variants;  // baselines first
  std::vector<SkippedVariant> skipped;
  std::vector<CheckSpec> checks;

  static ScenarioSpec from_json(const nlohmann::json& json, const std::string& file, const std::string& base_dir);
  static ScenarioSpec from_file(const std::string& path);

  const VariantSpec& variant(const std::string& name) const;
  // Keeps the named variants and the baselines they compare with; UserError on an unknown name.
  void select(const std::vector<std::string>& names);
  // Steps for every variant (--steps); re-validates the schedule-independent parts.
  void set_steps(int64_t steps);
};

// JSON merge patch (RFC 7386) of `patch` onto `target`, returned.
nlohmann::json merged(nlohmann::json target, const nlohmann::json& patch);

}  // namespace autotp::scenario
