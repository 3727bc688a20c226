// Runs a ScenarioSpec: every train variant as a real multi-process job
// (`autotp train` on world_size ranks started by the launcher), collecting its
// metrics JSONL into results.json; simulate variants run the simulator on their
// simulated layout in this process and keep its JSON (what `autotp simulate
// ... --json` prints). Then evaluates the checks (scenario_checks.h) and
// writes OUT/results.json (format in scenarios/README.md). One run at a time
// per process (the launcher installs signal handlers for its duration).
#pragma once
#include <nlohmann/json.hpp>

#include <string>

#include "scenario/scenario_spec.h"

namespace autotp::scenario {

struct RunOptions {
  std::string out_dir;      // results.json, per-variant configs / metrics / logs, models
  bool keep_going = false;  // run the remaining variants after one fails
  std::string executable;   // the autotp binary (default: this process's executable)
  int max_restarts = 0;     // a variant whose rank fails runs again from its first step, at most this often
};

struct RunOutcome {
  nlohmann::json results;  // what results.json holds
  bool passed = false;     // every variant ran and every check passed
};

RunOutcome run_scenario(const ScenarioSpec& spec, const RunOptions& options);

// Per-variant summaries computed from its metrics lines (exposed for tests):
// step time median / p90 skip step 1 (start-up) when there are 3 or more steps.
nlohmann::json summarize_metrics(const std::vector<nlohmann::json>& lines);

}  // namespace autotp::scenario
