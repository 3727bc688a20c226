// DeepSpeed configs written for the HF Trainer: their "auto" values are filled
// from TrainingArguments-style flags the way transformers' DeepSpeed integration
// fills them (HfTrainerDeepSpeedConfig's trainer_config_process and
// trainer_config_finalize, transformers 4.57 / 5.25), so such a file runs
// unchanged. Resolution happens once, on the JSON, before TrainConfig reads it:
// everything downstream sees numbers only (docs/config.md#hf-trainer-configs).
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace autotp {

// The TrainingArguments an HF command line gives, by HF's names. Unset: not on the
// command line; an "auto" then takes TrainingArguments' default (in brackets).
struct HfTrainingArguments {
  std::optional<double> learning_rate;                 // [5e-5]
  std::optional<int64_t> per_device_train_batch_size;  // [8]
  std::optional<int64_t> gradient_accumulation_steps;  // [1]
  std::optional<double> warmup_steps;   // [0]; below 1: a ratio of the steps, as transformers 5 reads it
  std::optional<double> warmup_ratio;   // [0] (transformers 4.x; used when warmup_steps is 0)
  std::optional<double> weight_decay;   // [0]
  std::optional<double> max_grad_norm;  // [1.0]
  std::optional<double> adam_beta1;     // [0.9]
  std::optional<double> adam_beta2;     // [0.999]
  std::optional<double> adam_epsilon;   // [1e-8]
  std::optional<bool> bf16;             // [false]
  std::optional<bool> fp16;             // [false]
  std::optional<int64_t> max_steps;     // the run's optimizer steps (no default: autotp has no epochs)
  // Given as HF's --max_steps: a total_num_steps number must then equal it. autotp's
  // --steps (train until step N, resumed steps included) only fills an "auto".
  bool max_steps_from_hf_flag = false;
};

struct HfResolveContext {
  int world_size = 1;       // data-parallel ranks = world_size / tensor_parallel.autotp_size
  int64_t hidden_size = 0;  // the model's, for the bucket sizes
};

struct ResolvedTrainConfig {
  nlohmann::json config;             // the input with every "auto" replaced
  std::vector<std::string> filled;   // one line per replaced value: key, value and where it came from
};

// Fills every "auto" of `config` (UserError naming `source`, the key and the flag
// for an "auto" nothing fills) and checks the numbers the config gives against the
// flags given (a contradiction is a UserError listing each one, as HF raises).
// A flag whose key the config lacks sets that key. Does not change a config
// without "auto" and without flags.
ResolvedTrainConfig resolve_hf_trainer_config(const nlohmann::json& config, const HfTrainingArguments& args,
                                              const HfResolveContext& context, const std::string& source);

}  // namespace autotp
