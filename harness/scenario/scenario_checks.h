// The checks of a scenario, evaluated on the variants' results (the "variants"
// array of results.json). Each outcome is a JSON object: the check as written,
// "passed", and per variant the measured value and the limit, so a report can
// show why a check failed.
#pragma once
#include <nlohmann/json.hpp>

#include <vector>

#include "scenario/scenario_spec.h"

namespace autotp::scenario {

// `variants`: results.json's variant objects (name, status, loss, memory...).
nlohmann::json evaluate_check(const CheckSpec& check, const nlohmann::json& variants, const ScenarioSpec& spec);

// The value of a ratio metric for one variant result: max over ranks, or rank 0.
double variant_metric(const nlohmann::json& variant, const std::string& metric, const std::string& rank);

}  // namespace autotp::scenario
