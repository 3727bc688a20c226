#include "scenario/scenario_checks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <fmt/ranges.h>

namespace autotp::scenario {
namespace {

using nlohmann::json;

const json* find_variant(const json& variants, const std::string& name) {
  for (const auto& v : variants)
    if (v["name"] == name) return &v;
  return nullptr;
}

std::string skip_reason(const ScenarioSpec& spec, const std::string& name) {
  for (const auto& s : spec.skipped)
    if (s.name == name) return "skipped: " + s.reason;
  return "";
}

// The variants a check covers: the listed ones, or every non-baseline train variant.
std::vector<std::string> covered(const CheckSpec& check, const json& variants, bool include_baselines) {
  if (!check.variants.empty()) return check.variants;
  std::vector<std::string> names;
  for (const auto& v : variants)
    if (v["kind"] == "train" && (include_baselines || !v["is_baseline"].get<bool>()))
      names.push_back(v["name"]);
  return names;
}

// One entry of a check: {"variant", "passed", ...}; a variant that did not run fails unless --only left it out.
json unavailable(const std::string& name, const json* v, const ScenarioSpec& spec) {
  json e = {{"variant", name}, {"passed", false}};
  if (!v) {
    std::string reason = skip_reason(spec, name);
    e["detail"] = reason.empty() ? "not selected (--only)" : reason;
    if (reason.empty()) e["passed"] = nullptr;  // not evaluated
  } else {
    e["detail"] = fmt::format("variant {}: {}", v->value("status", std::string()), v->value("error", std::string()));
  }
  return e;
}

// Entries with "passed": null were not evaluated (variants left out by --only).
bool all_passed(const json& entries) {
  for (const auto& e : entries)
    if (!e["passed"].is_null() && !e["passed"].get<bool>()) return false;
  return true;
}

bool any_evaluated(const json& entries) {
  return std::any_of(entries.begin(), entries.end(), [](const json& e) { return !e["passed"].is_null(); });
}

json loss_agreement(const CheckSpec& check, const json& variants, const ScenarioSpec& spec) {
  json entries = json::array();
  for (const auto& name : covered(check, variants, false)) {
    const json* v = find_variant(variants, name);
    const json* b = v ? find_variant(variants, (*v)["baseline"].get<std::string>()) : nullptr;
    if (!v || (*v)["status"] != "ok") {
      entries.push_back(unavailable(name, v, spec));
      continue;
    }
    if (!b || (*b)["status"] != "ok") {
      entries.push_back(unavailable((*v)["baseline"], b, spec));
      entries.back()["variant"] = name;
      continue;
    }
    const json& x = (*v)[check.metric];
    const json& y = (*b)[check.metric];
    double worst = 0;
    int64_t worst_step = 0;
    for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
      double rel = std::fabs(x[i].get<double>() - y[i].get<double>()) / std::max(std::fabs(y[i].get<double>()), 1e-30);
      if (rel > worst || i == 0) worst = rel, worst_step = static_cast<int64_t>(i + 1);
    }
    entries.push_back({{"variant", name},
                       {"baseline", (*v)["baseline"]},
                       {"value", worst},
                       {"step", worst_step},
                       {"limit", check.max_rel_diff},
                       {"passed", worst <= check.max_rel_diff},
                       {"detail", fmt::format("max relative {} difference {:.3g} at step {} (limit {:.3g})",
                                              check.metric, worst, worst_step, check.max_rel_diff)}});
  }
  return entries;
}

json ratio(const CheckSpec& check, const json& variants, const ScenarioSpec& spec) {
  json entries = json::array();
  const json* v = find_variant(variants, check.variant);
  const json* of = find_variant(variants, check.of);
  for (auto [name, p] : {std::pair{check.variant, v}, std::pair{check.of, of}}) {
    if (!p || (*p)["status"] != "ok") {
      entries.push_back(unavailable(name, p, spec));
      return entries;
    }
  }
  double num = variant_metric(*v, check.metric, check.rank), den = variant_metric(*of, check.metric, check.rank);
  double r = den != 0 ? num / den : std::numeric_limits<double>::infinity();
  bool ok = r >= check.min && r <= check.max;
  std::string bounds = std::isfinite(check.min) && std::isfinite(check.max)
                           ? fmt::format("in [{:.3g}, {:.3g}]", check.min, check.max)
                           : std::isfinite(check.max) ? fmt::format("<= {:.3g}", check.max)
                                                      : fmt::format(">= {:.3g}", check.min);
  entries.push_back({{"variant", check.variant},
                     {"of", check.of},
                     {"metric", check.metric},
                     {"numerator", num},
                     {"denominator", den},
                     {"value", r},
                     {"passed", ok},
                     {"detail", fmt::format("{} ({}) of {} / {} = {:.4g} / {:.4g} = {:.4g}, required {}", check.metric,
                                            check.rank, check.variant, check.of, num, den, r, bounds)}});
  return entries;
}

json model_states_analytic(const CheckSpec& check, const json& variants, const ScenarioSpec& spec) {
  json entries = json::array();
  for (const auto& name : covered(check, variants, true)) {
    const json* v = find_variant(variants, name);
    if (!v || (*v)["status"] != "ok") {
      entries.push_back(unavailable(name, v, spec));
      continue;
    }
    std::vector<std::string> mismatches;
    for (const auto& r : (*v)["memory"]["ranks"])
      // offload_buffers and host appear with ZeRO-Offload only (absent = 0).
      for (const char* kind : {"params", "grads", "master_weights", "optimizer_states", "offload_buffers", "host"}) {
        const int64_t measured = r["model_states"].value(kind, int64_t{0});
        const int64_t analytic = r["analytic"].value(kind, int64_t{0});
        if (measured != analytic)
          mismatches.push_back(
              fmt::format("rank {} {}: measured {} != analytic {}", r["rank"].get<int>(), kind, measured, analytic));
      }
    // The trainer's own formula for rank 0 must agree with ours.
    const json& reported = (*v)["memory"]["rank0_reported_analytic"];
    if (reported.is_object() && !(*v)["memory"]["ranks"].empty() &&
        reported.value("total", int64_t{-1}) != (*v)["memory"]["ranks"][0]["analytic"]["total"].get<int64_t>())
      mismatches.push_back("rank 0: the trainer's analytic total differs from the scenario's");
    const size_t ranks = (*v)["memory"]["ranks"].size();
    entries.push_back({{"variant", name},
                       {"passed", mismatches.empty() && ranks > 0},
                       {"detail", mismatches.empty()
                                      ? fmt::format("{} ranks: model-state bytes equal the formula", ranks)
                                      : fmt::format("{}", fmt::join(mismatches, "; "))}});
  }
  return entries;
}

json loss_decreases(const CheckSpec& check, const json& variants, const ScenarioSpec& spec) {
  json entries = json::array();
  for (const auto& name : covered(check, variants, true)) {
    const json* v = find_variant(variants, name);
    if (!v || (*v)["status"] != "ok" || (*v)["loss"].empty()) {
      entries.push_back(unavailable(name, v, spec));
      continue;
    }
    double first = (*v)["loss"].front(), last = (*v)["loss"].back();
    double limit = first * (1 - check.min_drop);
    entries.push_back({{"variant", name},
                       {"value", last},
                       {"limit", limit},
                       {"passed", last <= limit},
                       {"detail", fmt::format("loss {:.4f} -> {:.4f} (required <= {:.4f})", first, last, limit)}});
  }
  return entries;
}

json no_failed_runs(const json& variants) {
  json entries = json::array();
  for (const auto& v : variants)
    entries.push_back({{"variant", v["name"]},
                       {"passed", v["status"] == "ok"},
                       {"detail", v["status"] == "ok" ? std::string("ok")
                                                      : v["status"].get<std::string>() + ": " +
                                                            v.value("error", std::string())}});
  return entries;
}

}  // namespace

double variant_metric(const json& variant, const std::string& metric, const std::string& rank) {
  if (metric == "step_time_s") return variant["step_time"]["median_s"].get<double>();
  if (metric == "tokens_per_s") return variant["tokens_per_s_median"].get<double>();
  double best = 0;
  for (const auto& r : variant["memory"]["ranks"]) {
    double value = 0;
    if (metric.rfind("model_states.", 0) == 0)
      value = r["model_states"][metric.substr(std::string("model_states.").size())].get<double>();
    else
      value = r[metric].get<double>();
    if (rank == "rank0") return value;
    best = std::max(best, value);
  }
  return best;
}

json evaluate_check(const CheckSpec& check, const json& variants, const ScenarioSpec& spec) {
  json entries;
  if (check.type == "loss_agreement") entries = loss_agreement(check, variants, spec);
  if (check.type == "ratio") entries = ratio(check, variants, spec);
  if (check.type == "model_states_analytic") entries = model_states_analytic(check, variants, spec);
  if (check.type == "loss_decreases") entries = loss_decreases(check, variants, spec);
  if (check.type == "no_failed_runs") entries = no_failed_runs(variants);
  json outcome = check.json;
  outcome["type"] = check.type;
  outcome["results"] = entries;
  outcome["evaluated"] = any_evaluated(entries) || check.type == "no_failed_runs";
  outcome["passed"] = all_passed(entries);
  return outcome;
}

}  // namespace autotp::scenario
