#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdlib>
#include <iostream>

#include "autotp/base/error.h"
#include "cli/cli.h"
#include "launcher/launcher.h"
#include "scenario/scenario_runner.h"
#include "scenario/scenario_spec.h"

namespace autotp::cli {
namespace {

bool is_file(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// tools/report next to the build directory (build/autotp -> tools/report), or $AUTOTP_REPORT.
std::string report_script() {
  if (const char* env = std::getenv("AUTOTP_REPORT")) return env;
  std::string exe = launcher::self_executable();
  std::string dir = exe.substr(0, exe.find_last_of('/'));
  for (const std::string& candidate : {dir + "/../tools/report", dir + "/../../tools/report"})
    if (is_file(candidate)) return candidate;
  return "";
}

void list_variants(const scenario::ScenarioSpec& spec) {
  std::cout << fmt::format("scenario {} ({}): world {}, {} steps, device {}, backend {}\n", spec.name, spec.file,
                           spec.world_size, spec.steps, spec.device, spec.backend);
  for (const auto& v : spec.variants) {
    if (v.kind == "simulate") {
      const auto& l = v.simulated;
      std::cout << fmt::format("  {:<20} simulate {} on {}: {} GPUs tp {} dp {} ZeRO-{} {}{} micro-batch {} x gas {} "
                               "seq-len {}\n",
                               v.name, l.model, l.cluster, l.gpus, l.tp, l.gpus / l.tp, l.zero_stage, l.dtype,
                               l.recompute == "off" ? "" : " +" + l.recompute, l.micro_batch, l.gas, l.seq_len);
      continue;
    }
    std::cout << fmt::format("  {:<20} {} tp {} dp {} ZeRO-{} {}{}{} micro-batch {} x gas {} (global {}){}\n", v.name,
                             v.kind, v.config.tensor_parallel.autotp_size,
                             spec.world_size / v.config.tensor_parallel.autotp_size, v.config.zero.stage,
                             v.config.bf16 ? "bf16" : v.config.fp16.enabled ? "fp16" : "fp32",
                             v.config.activation_checkpointing.enabled ? " +" + v.config.activation_checkpointing.mode : "",
                             v.config.lora.enabled ? fmt::format(" LoRA r {}", v.config.lora.r) : std::string(),
                             v.config.train_micro_batch_size_per_gpu, v.config.gradient_accumulation_steps,
                             v.config.train_batch_size, v.is_baseline ? " [baseline]" : " vs " + v.baseline);
  }
  for (const auto& s : spec.skipped) std::cout << fmt::format("  {:<20} skipped: {}\n", s.name, s.reason);
  for (const auto& c : spec.checks) std::cout << fmt::format("  check {}\n", c.json.dump());
}

void print_summary(const nlohmann::json& results) {
  for (const auto& v : results["variants"]) {
    std::string line = fmt::format("scenario: {:<16} {:<7}", v["name"].get<std::string>(), v["status"].get<std::string>());
    if (v["status"] == "ok" && v["kind"] == "simulate") {
      const auto& sim = v["simulate"];
      line += fmt::format(" simulated peak {:.2f} GiB per GPU{}  step {:.3f}s  {:.0f} tok/s",
                          sim["memory"]["total"].get<double>() / 1073741824.0,
                          sim["fits"].get<bool>() ? "" : " (does not fit)", sim["time"]["step_s"].get<double>(),
                          sim["tokens_per_s"].get<double>());
    }
    if (v["status"] == "ok" && v["kind"] == "train") {
      line += fmt::format(" final loss {:.4f}  step {:.3f}s  {:.0f} tok/s", v["loss"].back().get<double>(),
                          v["step_time"]["median_s"].get<double>(), v["tokens_per_s_median"].get<double>());
      const auto& c = v["comparison"];
      if (!v["is_baseline"].get<bool>() && c.contains("max_loss_rel_diff"))
        line += fmt::format("  max rel loss diff vs {} {:.2e}", c["baseline"].get<std::string>(),
                            c["max_loss_rel_diff"].get<double>());
    }
    std::cout << line << "\n";
  }
  for (const auto& s : results["skipped"])
    std::cout << fmt::format("scenario: {:<16} skipped ({})\n", s["name"].get<std::string>(),
                             s["reason"].get<std::string>());
  for (const auto& c : results["checks"]) {
    std::string verdict = !c["evaluated"].get<bool>() ? "n/a " : c["passed"].get<bool>() ? "PASS" : "FAIL";
    std::cout << fmt::format("check {} {}\n", verdict, c["type"].get<std::string>());
    for (const auto& e : c["results"])
      if (!e["passed"].is_boolean() || !e["passed"].get<bool>() || c["type"] != "no_failed_runs")
        std::cout << fmt::format("  {} {}: {}\n",
                                 e["passed"].is_null() ? "n/a " : e["passed"].get<bool>() ? "ok  " : "FAIL",
                                 e["variant"].get<std::string>(), e.value("detail", std::string()));
  }
}

}  // namespace

void register_scenario(CLI::App& app) {
  struct Args {
    std::string file, out, device;
    std::vector<std::string> only;
    int64_t steps = 0;
    int max_restarts = 0;
    bool keep_going = false, list = false, no_report = false;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand(
      "scenario", "Run every variant of a scenario file against its baseline; write results.json and a report");
  cmd->add_option("file", args->file, "Scenario file (scenarios/*.json; schema in scenarios/README.md)")->required();
  cmd->add_option("--out", args->out, "Output directory (default reports/NAME)");
  cmd->add_option("--only", args->only, "Run only these variants (and their baselines)");
  cmd->add_option("--steps", args->steps, "Steps for every variant (overrides the file's steps)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--keep-going", args->keep_going, "Run the remaining variants after one fails");
  cmd->add_option("--max-restarts", args->max_restarts,
                  "When a rank of a variant fails, run the variant again from its first step, at most N times "
                  "(default 0)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--list", args->list, "Print the expanded variants, skipped combinations and checks; run nothing");
  cmd->add_flag("--no-report", args->no_report, "Do not run tools/report at the end");
  cmd->add_option("--device", args->device, "Train every variant on cpu or cuda (overrides the file's \"device\")")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->callback([args] {
    auto spec = scenario::ScenarioSpec::from_file(args->file);
    spec.select(args->only);
    if (args->steps > 0) spec.set_steps(args->steps);
    if (!args->device.empty()) {
      spec.device = args->device;
      AUTOTP_USER_CHECK(spec.device == "cuda" || spec.backend != "nccl",
                        "--device cpu: {} uses backend nccl, which needs device cuda", spec.file);
    }
    if (args->list) {
      list_variants(spec);
      return;
    }
    for (const auto& s : spec.skipped)
      std::cerr << fmt::format("scenario: skipping {}: {}\n", s.name, s.reason);
    scenario::RunOptions options;
    options.out_dir = args->out.empty() ? "reports/" + spec.name : args->out;
    options.keep_going = args->keep_going;
    options.max_restarts = args->max_restarts;
    if (args->out.empty()) ::mkdir("reports", 0755);
    auto outcome = scenario::run_scenario(spec, options);
    print_summary(outcome.results);
    bool report_ok = true;
    if (!args->no_report) {
      std::string script = report_script();
      if (script.empty()) {
        std::cerr << "scenario: tools/report not found next to the build directory (set AUTOTP_REPORT); run "
                     "tools/report "
                  << options.out_dir << " yourself\n";
        report_ok = false;
      } else {
        std::string command = "/usr/bin/python3 '" + script + "' '" + options.out_dir + "'";
        int status = std::system(command.c_str());
        report_ok = status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!report_ok) std::cerr << "scenario: " << command << " failed\n";
      }
    }
    std::cout << fmt::format("scenario: {} -> {}/results.json{}\n", outcome.passed ? "passed" : "FAILED",
                             options.out_dir, args->no_report ? "" : ", " + options.out_dir + "/report.md");
    if (!outcome.passed || !report_ok) exit_with(1);
  });
}

}  // namespace autotp::cli
