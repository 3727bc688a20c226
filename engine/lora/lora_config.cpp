#include "autotp/lora/lora_config.h"

#include <fmt/ranges.h>

#include <cmath>

namespace autotp {
namespace {

using nlohmann::json;

const std::vector<std::string> kFields = {"r",         "lora_alpha",      "lora_dropout",      "target_modules",
                                          "bias",      "use_rslora",      "modules_to_save",   "init_lora_weights",
                                          "task_type", "peft_type",       "use_dora",          "fan_in_fan_out"};

// PEFT fields autotp does not implement, with the value that means "off".
bool is_off(const json& v) {
  return v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_object() && v.empty()) ||
         (v.is_array() && v.empty());
}

void read_fields(LoraConfig& c, const JsonSection& s) {
  c.enabled = true;
  c.r = s.integer("r", c.r);
  s.check(c.r >= 1, "r", "an integer >= 1");
  c.lora_alpha = s.number("lora_alpha", c.lora_alpha);
  s.check(c.lora_alpha > 0, "lora_alpha", "a number > 0");
  c.lora_dropout = s.number("lora_dropout", c.lora_dropout);
  s.check(c.lora_dropout >= 0 && c.lora_dropout < 1, "lora_dropout", "a number in [0, 1)");
  if (s.has("target_modules") && !s.at("target_modules").is_null()) {
    const json& t = s.at("target_modules");
    if (t.is_string()) {
      if (t.get<std::string>() == "all-linear")
        c.all_linear = true;
      else
        c.target_regex = t.get<std::string>();
    } else {
      bool ok = t.is_array() && !t.empty();
      for (size_t i = 0; ok && i < t.size(); ++i) ok = t[i].is_string() && !t[i].get<std::string>().empty();
      s.check(ok, "target_modules", "a non-empty list of module names, one regex string, or \"all-linear\"");
      for (const auto& name : t) c.target_modules.push_back(name.get<std::string>());
    }
  }
  c.bias = s.string("bias", c.bias);
  s.check(c.bias == "none" || c.bias == "all" || c.bias == "lora_only", "bias", "\"none\", \"all\", \"lora_only\"");
  c.use_rslora = s.boolean("use_rslora", c.use_rslora);
  if (s.has("modules_to_save") && !s.at("modules_to_save").is_null()) {
    const json& m = s.at("modules_to_save");
    bool ok = m.is_array();
    for (size_t i = 0; ok && i < m.size(); ++i) ok = m[i].is_string();
    s.check(ok, "modules_to_save", "a list of module names (e.g. [\"lm_head\"]) or null");
    for (const auto& name : m) c.modules_to_save.push_back(name.get<std::string>());
  }
  if (s.has("init_lora_weights")) {
    const json& i = s.at("init_lora_weights");
    if (i.is_boolean())
      c.init_lora_weights = i.get<bool>() ? "true" : "false";
    else if (i.is_string())
      c.init_lora_weights = i.get<std::string>();
    else
      s.check(false, "init_lora_weights", "true, false or \"gaussian\"");
    s.check(c.init_lora_weights == "true" || c.init_lora_weights == "false" || c.init_lora_weights == "gaussian",
            "init_lora_weights", "true, false or \"gaussian\" (PiSSA, OLoRA, LoftQ, EVA, CorDA initialisations are not supported)");
  }
  // PEFT writes null when a LoraConfig was made without a task type (its keys are the same).
  const std::string task = s.has("task_type") && s.at("task_type").is_null() ? "CAUSAL_LM" : s.string("task_type", "CAUSAL_LM");
  s.check(task == "CAUSAL_LM", "task_type", "\"CAUSAL_LM\"");
  const std::string type = s.string("peft_type", "LORA");
  s.check(type == "LORA", "peft_type",
          "\"LORA\" (other PEFT methods such as LoHa, LoKr, AdaLoRA, IA3 and prompt tuning are not supported)");
  s.check(!s.boolean("use_dora", false), "use_dora", "false (DoRA is not supported)");
  s.check(!s.boolean("fan_in_fan_out", false), "fan_in_fan_out",
          "false (GPT-2's Conv1D layers are not LoRA targets in autotp)");
}

}  // namespace

double LoraConfig::scaling() const {
  return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r)) : lora_alpha / static_cast<double>(r);
}

LoraConfig LoraConfig::read(const JsonSection& top) {
  LoraConfig c;
  if (!top.has("lora") || top.at("lora").is_null()) return c;
  read_fields(c, top.section("lora", kFields));
  return c;
}

LoraConfig LoraConfig::from_adapter_config(const json& j, const std::string& path) {
  // PEFT writes ~40 fields; the ones autotp implements are read strictly, the
  // others must hold their "off" value.
  if (!j.is_object()) throw UserError(fmt::format("{}: not a JSON object", path));
  static const std::vector<std::string> kIgnored = {
      "base_model_name_or_path", "revision", "inference_mode", "peft_version", "auto_mapping", "megatron_core",
      "qalora_group_size", "ensure_weight_tying", "lora_bias", "layers_pattern"};
  static const std::vector<std::string> kUnsupported = {
      "alpha_pattern", "rank_pattern", "layers_to_transform", "exclude_modules", "layer_replication",
      "target_parameters", "trainable_token_indices", "megatron_config", "loftq_config", "eva_config",
      "corda_config", "use_qalora", "alora_invocation_tokens", "arrow_config", "kasa_config", "lora_ga_config",
      "monteclora_config", "use_bdlora", "velora_config"};
  json known = json::object();
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    if (std::find(kFields.begin(), kFields.end(), key) != kFields.end()) {
      known[key] = it.value();
    } else if (std::find(kUnsupported.begin(), kUnsupported.end(), key) != kUnsupported.end()) {
      if (!is_off(it.value()))
        throw UserError(fmt::format("{}: {} is {} (allowed: its default; autotp does not support it)", path, key,
                                    it.value().dump()));
    } else if (key == "lora_bias" && !is_off(it.value())) {
      throw UserError(fmt::format("{}: lora_bias is true (allowed: false)", path));
    } else if (std::find(kIgnored.begin(), kIgnored.end(), key) == kIgnored.end()) {
      throw UserError(fmt::format("{}: unknown key '{}' for a LoRA adapter (PEFT LoraConfig fields: {})", path, key,
                                  fmt::join(kFields, ", ")));
    }
  }
  LoraConfig c;
  read_fields(c, JsonSection(known, "", path, kFields));
  return c;
}

json LoraConfig::to_json() const {
  json j = {{"r", r},
            {"lora_alpha", lora_alpha},
            {"lora_dropout", lora_dropout},
            {"bias", bias},
            {"use_rslora", use_rslora},
            {"modules_to_save", modules_to_save},
            {"task_type", "CAUSAL_LM"},
            {"peft_type", "LORA"}};
  if (all_linear)
    j["target_modules"] = "all-linear";
  else if (!target_regex.empty())
    j["target_modules"] = target_regex;
  else if (!target_modules.empty())
    j["target_modules"] = target_modules;
  else
    j["target_modules"] = nullptr;  // PEFT's default for the architecture
  if (init_lora_weights == "gaussian")
    j["init_lora_weights"] = "gaussian";
  else
    j["init_lora_weights"] = init_lora_weights == "true";
  return j;
}

json LoraConfig::to_adapter_config(const std::vector<std::string>& resolved_targets,
                                   const std::string& base_model) const {
  json j = to_json();
  j["target_modules"] = resolved_targets;  // PEFT writes all-linear expanded to module paths, too
  if (modules_to_save.empty()) j["modules_to_save"] = nullptr;
  j["base_model_name_or_path"] = base_model;
  j["fan_in_fan_out"] = false;
  j["use_dora"] = false;
  j["inference_mode"] = true;
  j["revision"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["rank_pattern"] = json::object();
  j["alpha_pattern"] = json::object();
  return j;
}

}  // namespace autotp
