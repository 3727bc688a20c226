#include "autotp/lora/lora_plan.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <regex>
#include <set>

#include "autotp/base/text.h"
#include "autotp/base/error.h"

namespace autotp {
namespace {

// PEFT's rule for a list entry: the path itself, or a suffix after a dot.
bool name_matches(const std::string& module, const std::string& name) {
  return module == name || ends_with(module, "." + name);
}

bool is_moe(const ParamDesc& d) {
  for (Axis a : d.axes)
    if (a == Axis::kExperts || a == Axis::kExpertIntermediate || a == Axis::kSharedExpertIntermediate ||
        a == Axis::kSharedExpertGate)
      return true;
  return false;
}

// Why a linear-like weight cannot take an adapter ("" when it can).
std::string refusal(const PlanEntry& e) {
  const ParamDesc& d = e.desc;
  if (d.kind == ParamKind::kConv1D) return "a GPT-2 Conv1D layer (not supported as a LoRA target yet)";
  if (d.kind == ParamKind::kLmHead) return "the output head (train it in full with modules_to_save)";
  if (d.kind == ParamKind::kEmbedding || d.kind == ParamKind::kPositionEmbedding)
    return "an embedding (train it in full with modules_to_save)";
  if (is_moe(d))
    return "a mixture-of-experts expert or router (not supported; PEFT targets transformers 5's fused experts "
           "through target_parameters)";
  if (d.kind != ParamKind::kLinear) return "not a linear layer";
  return "";
}

bool is_weight(const PlanEntry& e) { return ends_with(e.desc.name, ".weight") && !e.adapter; }

}  // namespace

std::vector<std::string> lora_target_modules(const TpPlan& plan, const LoraConfig& lora) {
  std::vector<std::string> targets, linear_names;
  std::set<std::string> seen_linear;
  std::regex pattern;
  if (!lora.target_regex.empty()) {
    try {
      pattern = std::regex(lora.target_regex, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw UserError(fmt::format("lora.target_modules: '{}' is not a valid regex ({})", lora.target_regex, e.what()));
    }
  }
  const bool defaults = !lora.all_linear && lora.target_regex.empty() && lora.target_modules.empty();
  // PEFT's defaults for the Llama family (q_proj, v_proj) and Phi-3 (qkv_proj).
  const std::vector<std::string> names = defaults ? std::vector<std::string>{"q_proj", "v_proj", "qkv_proj"}
                                                  : lora.target_modules;
  std::vector<std::string> refused;
  for (const auto& e : plan.entries()) {
    if (!is_weight(e)) continue;
    const std::string& module = e.desc.module;
    const std::string why = refusal(e);
    if (why.empty() && seen_linear.insert(module).second) linear_names.push_back(module);
    bool wanted = false;
    if (lora.all_linear)
      wanted = why.empty();
    else if (!lora.target_regex.empty())
      wanted = std::regex_match(module, pattern);
    else
      wanted = std::any_of(names.begin(), names.end(), [&](const std::string& n) { return name_matches(module, n); });
    if (!wanted) continue;
    if (!why.empty()) {
      if (!lora.all_linear) refused.push_back(fmt::format("{} is {}", module, why));
      continue;
    }
    targets.push_back(module);
  }
  if (!refused.empty())
    throw UserError(fmt::format("lora.target_modules names modules that cannot take a LoRA adapter: {}",
                                fmt::join(refused, "; ")));
  if (targets.empty()) {
    // The linear layer names of one decoder layer, as a user would write them.
    std::vector<std::string> shown;
    for (const auto& m : linear_names)
      if (m.find(".layers.0.") != std::string::npos || m.find(".h.0.") != std::string::npos) shown.push_back(m);
    throw UserError(fmt::format(
        "lora.target_modules {} matches no linear layer of this model (allowed: names such as {}, one regex, or "
        "\"all-linear\")",
        lora.all_linear ? std::string("\"all-linear\"")
                        : !lora.target_regex.empty() ? "'" + lora.target_regex + "'"
                                                     : fmt::format("[{}]", fmt::join(names, ", ")),
        shown.empty() ? std::string("(none: this architecture has no LoRA-capable linear layers)")
                      : fmt::format("{}", fmt::join(shown, ", "))));
  }
  return targets;
}

TpPlan with_lora(TpPlan plan, const LoraConfig& lora) {
  const std::vector<std::string> targets = lora_target_modules(plan, lora);
  const int tp = plan.tp_size();
  const int64_t r = lora.r;
  // Everything freezes, then modules_to_save and the chosen biases train.
  std::vector<std::string> names;
  for (const auto& e : plan.entries()) names.push_back(e.desc.name);
  std::set<std::string> saved_found;
  for (const auto& name : names) {
    const PlanEntry& e = plan.entry(name);
    bool trains = false;
    for (const auto& m : lora.modules_to_save)
      if (name_matches(e.desc.module, m)) trains = true, saved_found.insert(m);
    if (ends_with(name, ".bias")) {
      if (lora.bias == "all") trains = true;
      if (lora.bias == "lora_only" && std::find(targets.begin(), targets.end(), e.desc.module) != targets.end())
        trains = true;
    }
    plan.set_frozen(name, !trains);
  }
  for (const auto& m : lora.modules_to_save) {
    AUTOTP_USER_CHECK(saved_found.count(m), "lora.modules_to_save: '{}' matches no module of this model", m);
    for (const auto& t : targets)
      AUTOTP_USER_CHECK(!name_matches(t, m), "lora.modules_to_save: '{}' is also a LoRA target ({})", m, t);
  }
  for (const auto& module : targets) {
    const PlanEntry& base = plan.entry(module + ".weight");
    const int64_t out = base.desc.shape[0], in = base.desc.shape[1];
    auto factor = [&](const std::string& name, std::vector<int64_t> shape, std::vector<Axis> axes) {
      PlanEntry f;
      f.desc.name = name;
      f.desc.module = name.substr(0, name.size() - std::string(".weight").size());
      f.desc.kind = ParamKind::kLinear;
      f.desc.shape = std::move(shape);
      f.desc.axes = std::move(axes);
      f.adapter = true;
      return f;
    };
    PlanEntry a = factor(lora_a_name(module), {r, in}, {Axis::kLoraRank, base.desc.axes[1]});
    PlanEntry b = factor(lora_b_name(module), {out, r}, {base.desc.axes[0], Axis::kLoraRank});
    std::vector<std::vector<Segment>> segments;
    if (!base.spec.is_replicated())
      for (int rank = 0; rank < tp; ++rank) segments.push_back(base.spec.segments(rank));
    if (base.spec.is_replicated()) {
      a.role = b.role = TpRole::kReplicated;
      a.spec = ShardSpec::replicated(a.desc.shape, tp);
      b.spec = ShardSpec::replicated(b.desc.shape, tp);
      a.source = b.source = "LoRA: replicated, base is replicated";
    } else if (base.role == TpRole::kColumn) {
      a.role = TpRole::kReplicated;
      a.spec = ShardSpec::replicated(a.desc.shape, tp);
      a.partial_grad = tp > 1;
      a.source = "LoRA: replicated, base is column-parallel";
      b.role = TpRole::kColumn;
      b.spec = ShardSpec::split(b.desc.shape, 0, segments);
      b.source = "LoRA: split like the base's output";
    } else if (base.role == TpRole::kRow) {
      a.role = TpRole::kRow;
      a.spec = ShardSpec::split(a.desc.shape, 1, segments);
      a.source = "LoRA: split like the base's input";
      b.role = TpRole::kReplicated;
      b.spec = ShardSpec::replicated(b.desc.shape, tp);
      b.partial_grad = tp > 1;
      b.source = "LoRA: replicated, base is row-parallel";
    } else {
      throw UserError(fmt::format("lora: {} is {}-parallel (allowed targets: column, row or replicated layers)",
                                  module, tp_role_name(base.role)));
    }
    plan.insert_after(module + ".weight", {std::move(a), std::move(b)});
  }
  return plan;
}

}  // namespace autotp
