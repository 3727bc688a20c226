#include "cli/lora_flags.h"

#include <sstream>

#include "autotp/base/error.h"
#include "autotp/base/log.h"
#include "autotp/lora/lora_plan.h"
#include "autotp/lora/lora_weights.h"

namespace autotp::cli {

void add_lora_flags(CLI::App& command, LoraFlags& flags, LoraFlagSet set) {
  command.add_option("--adapter", flags.adapter,
                     set == LoraFlagSet::kTrain ? "Start LoRA from this PEFT adapter directory (adapter_config.json + "
                                                  "adapter_model.safetensors); replaces the config's lora section"
                     : set == LoraFlagSet::kPlan ? "Show the plan with this PEFT adapter's LoRA factors"
                                                 : "Evaluate the model with this PEFT adapter directory applied");
  if (set == LoraFlagSet::kEval) return;
  command.add_option("--lora-r", flags.r, "LoRA rank r (turns LoRA on; overrides lora.r)")->check(CLI::PositiveNumber);
  command.add_option("--lora-alpha", flags.alpha, "LoRA lora_alpha (overrides lora.lora_alpha)");
  command.add_option("--lora-dropout", flags.dropout, "LoRA lora_dropout (overrides lora.lora_dropout)");
  command.add_option("--lora-target-modules", flags.target_modules,
                     "LoRA target_modules: comma-separated names (q_proj,v_proj), all-linear, or one regex "
                     "(overrides lora.target_modules)");
  command.add_flag("--use-rslora", flags.use_rslora, "LoRA scaling lora_alpha / sqrt(r) (overrides lora.use_rslora)");
  if (set == LoraFlagSet::kPlan) return;
  command.add_option("--save-adapter", flags.save_adapter, "At the end, write the PEFT adapter here");
  command.add_flag("--merge-lora", flags.merge_lora,
                   "With --export-hf under LoRA: write the base model with the adapters merged in");
}

LoraConfig resolve_lora(const LoraConfig& from_config, const LoraFlags& flags) {
  const bool field_flags = flags.r || flags.alpha || flags.dropout || !flags.target_modules.empty() || flags.use_rslora;
  if (!flags.adapter.empty()) {
    AUTOTP_USER_CHECK(!field_flags, "--adapter {} takes r, lora_alpha, target_modules and the rest from its "
                                    "adapter_config.json (allowed: no --lora-* flags with --adapter)",
                      flags.adapter);
    if (from_config.enabled)
      log().warn("--adapter {}: its adapter_config.json replaces the config's lora section", flags.adapter);
    return read_adapter_config(flags.adapter);
  }
  LoraConfig lora = from_config;
  if (!field_flags) return lora;
  lora.enabled = true;
  if (flags.r) lora.r = *flags.r;
  if (flags.alpha) {
    AUTOTP_USER_CHECK(*flags.alpha > 0, "--lora-alpha {} (allowed: > 0)", *flags.alpha);
    lora.lora_alpha = *flags.alpha;
  }
  if (flags.dropout) {
    AUTOTP_USER_CHECK(*flags.dropout >= 0 && *flags.dropout < 1, "--lora-dropout {} (allowed: [0, 1))", *flags.dropout);
    lora.lora_dropout = *flags.dropout;
  }
  if (flags.use_rslora) lora.use_rslora = true;
  if (!flags.target_modules.empty()) {
    lora.target_modules.clear();
    lora.target_regex.clear();
    lora.all_linear = flags.target_modules == "all-linear";
    if (!lora.all_linear) {
      const bool regex = flags.target_modules.find_first_of("*[]()|\\^$+?") != std::string::npos;
      if (regex) {
        lora.target_regex = flags.target_modules;
      } else {
        std::stringstream names(flags.target_modules);
        for (std::string name; std::getline(names, name, ',');)
          if (!name.empty()) lora.target_modules.push_back(name);
      }
    }
  }
  return lora;
}

TpPlan apply_lora_plan(TpPlan plan, const LoraConfig& lora) {
  return lora.enabled ? with_lora(std::move(plan), lora) : plan;
}

void prepare_lora_model(CausalLM& model, const LoraConfig& lora, const LoraFlags& flags, uint64_t seed) {
  if (!lora.enabled) return;
  init_lora_weights(model, lora, seed);  // also sets the scaling
  if (!flags.adapter.empty()) load_adapter_weights(model, flags.adapter);
  int64_t trained = 0, total = 0;
  for (const auto& e : model.plan().entries()) {
    int64_t n = 1;
    for (int64_t d : e.desc.shape) n *= d;
    total += n;
    if (!e.frozen) trained += n;
  }
  log().info("LoRA r {} alpha {} (scaling {}) on {} modules: {} trained parameters of {} ({:.3f}%)", lora.r,
             lora.lora_alpha, lora.scaling(), adapted_modules(model).size(), trained, total,
             100.0 * static_cast<double>(trained) / static_cast<double>(total));
}

}  // namespace autotp::cli
