// The HF TrainingArguments flags of `train` (and scenarios' runs), spelled as HF
// spells them so an HF command line carries over: they fill a DeepSpeed config's
// "auto" values (autotp/runtime/hf_trainer_config.h).
#pragma once
#include <CLI/CLI.hpp>

#include <string>

#include "autotp/runtime/hf_trainer_config.h"

namespace autotp::cli {

struct HfTrainingFlags {
  HfTrainingArguments args;
  std::string bf16, fp16;  // "--bf16", "--bf16 True", "--bf16=false"
  CLI::Option* bf16_option = nullptr;
  CLI::Option* fp16_option = nullptr;
  // The arguments with --bf16 / --fp16 read (UserError for a value that is not a boolean).
  HfTrainingArguments resolved() const;
};

// Adds --learning_rate, --per_device_train_batch_size, --gradient_accumulation_steps,
// --warmup_steps, --warmup_ratio, --weight_decay, --max_grad_norm, --adam_beta1,
// --adam_beta2, --adam_epsilon, --bf16 and --fp16 (each also with dashes).
void add_hf_training_flags(CLI::App& command, HfTrainingFlags& flags);

}  // namespace autotp::cli
