#include "cli/hf_training_flags.h"

#include <algorithm>
#include <cctype>

#include "autotp/base/error.h"

namespace autotp::cli {
namespace {

// HF's argparse reads booleans with strtobool: a bare flag is true.
std::optional<bool> parse_bool_flag(const CLI::Option* option, std::string value, const char* name) {
  if (option == nullptr || option->count() == 0) return std::nullopt;
  std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::tolower(c); });
  if (value.empty() || value == "true" || value == "1" || value == "yes" || value == "y" || value == "t" || value == "on")
    return true;
  if (value == "false" || value == "0" || value == "no" || value == "n" || value == "f" || value == "off") return false;
  throw_user_error("{} {}: not a boolean (allowed: True, False, or the bare flag for True)", name, value);
}

// "--learning_rate,--learning-rate"
std::string both_spellings(std::string name) {
  std::string dashed = name;
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  return "--" + name + ",--" + dashed;
}

}  // namespace

HfTrainingArguments HfTrainingFlags::resolved() const {
  HfTrainingArguments a = args;
  a.bf16 = parse_bool_flag(bf16_option, bf16, "--bf16");
  a.fp16 = parse_bool_flag(fp16_option, fp16, "--fp16");
  return a;
}

void add_hf_training_flags(CLI::App& command, HfTrainingFlags& flags) {
  auto& a = flags.args;
  const char* group = "HF TrainingArguments (fill the config's \"auto\" values; docs/config.md)";
  command.add_option(both_spellings("learning_rate"), a.learning_rate, "optimizer lr / warmup_max_lr (HF default 5e-5)")
      ->group(group);
  command.add_option(both_spellings("per_device_train_batch_size"), a.per_device_train_batch_size,
                     "train_micro_batch_size_per_gpu (HF default 8)")
      ->check(CLI::PositiveNumber)
      ->group(group);
  command.add_option(both_spellings("gradient_accumulation_steps"), a.gradient_accumulation_steps,
                     "gradient_accumulation_steps (HF default 1)")
      ->check(CLI::PositiveNumber)
      ->group(group);
  command.add_option(both_spellings("warmup_steps"), a.warmup_steps,
                     "scheduler warmup_num_steps; below 1 a ratio of the steps, as in transformers 5 (default 0)")
      ->check(CLI::NonNegativeNumber)
      ->group(group);
  command.add_option(both_spellings("warmup_ratio"), a.warmup_ratio,
                     "warmup_num_steps = ceil(ratio x steps) when --warmup_steps is 0 (transformers 4.x)")
      ->check(CLI::Range(0.0, 1.0))
      ->group(group);
  command.add_option(both_spellings("weight_decay"), a.weight_decay, "optimizer weight_decay (HF default 0)")
      ->check(CLI::NonNegativeNumber)
      ->group(group);
  command.add_option(both_spellings("max_grad_norm"), a.max_grad_norm, "gradient_clipping (HF default 1.0)")
      ->check(CLI::NonNegativeNumber)
      ->group(group);
  command.add_option(both_spellings("adam_beta1"), a.adam_beta1, "optimizer betas[0] (HF default 0.9)")->group(group);
  command.add_option(both_spellings("adam_beta2"), a.adam_beta2, "optimizer betas[1] (HF default 0.999)")->group(group);
  command.add_option(both_spellings("adam_epsilon"), a.adam_epsilon, "optimizer eps (HF default 1e-8)")->group(group);
  flags.bf16_option = command.add_option("--bf16", flags.bf16, "bf16.enabled: --bf16, --bf16 True or --bf16 False")
                          ->expected(0, 1)
                          ->group(group);
  flags.fp16_option = command.add_option("--fp16", flags.fp16, "fp16.enabled: --fp16, --fp16 True or --fp16 False")
                          ->expected(0, 1)
                          ->group(group);
}

}  // namespace autotp::cli
