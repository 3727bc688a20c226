// The LoRA flags of `train` and `eval` (docs/lora.md): the common LoraConfig
// fields (--lora-r, --lora-alpha, --lora-dropout, --lora-target-modules,
// --use-rslora) over the config's "lora" section, a PEFT adapter to start from
// (--adapter DIR), and what to write at the end (--save-adapter DIR, --merge-lora).
#pragma once
#include <CLI/CLI.hpp>

#include <optional>
#include <string>

#include "autotp/lora/lora_config.h"
#include "autotp/model/causal_lm.h"
#include "autotp/tp/tp_plan.h"

namespace autotp::cli {

struct LoraFlags {
  std::optional<int64_t> r;
  std::optional<double> alpha, dropout;
  std::string target_modules;  // comma-separated names, "all-linear", or one regex
  bool use_rslora = false;
  std::string adapter, save_adapter;
  bool merge_lora = false;
};

// Which flags a command takes: eval --adapter only; plan --adapter and the
// LoraConfig fields; train also --save-adapter and --merge-lora.
enum class LoraFlagSet { kEval, kPlan, kTrain };
void add_lora_flags(CLI::App& command, LoraFlags& flags, LoraFlagSet set);

// The run's LoRA config: --adapter's adapter_config.json (which replaces a
// "lora" section, with a warning), else the config's section with the flags on
// top; disabled when none of them is given.
LoraConfig resolve_lora(const LoraConfig& from_config, const LoraFlags& flags);

// The plan with the adapters (no-op when LoRA is off).
TpPlan apply_lora_plan(TpPlan plan, const LoraConfig& lora);
// After the base is loaded: the adapter read from --adapter, or PEFT's initialisation.
void prepare_lora_model(CausalLM& model, const LoraConfig& lora, const LoraFlags& flags, uint64_t seed);

}  // namespace autotp::cli
