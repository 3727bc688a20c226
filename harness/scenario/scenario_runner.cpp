#include "scenario/scenario_runner.h"

#include "autotp/lora/lora_plan.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "autotp/comm/process_group.h"
#include "autotp/io/safetensors.h"
#include "autotp/lora/lora_plan.h"
#include "autotp/model/presets.h"
#include "autotp/base/device.h"
#include "autotp/base/error.h"
#include "autotp/base/quantile.h"
#include "autotp/runtime/trainer.h"
#include "autotp/tp/tp_plan.h"
#include "autotp/zero/zero_optimizer.h"
#include "launcher/launcher.h"
#include "launcher/restarts.h"
#include "scenario/scenario_checks.h"

namespace autotp::scenario {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// mkdir -p.
void make_dir(const std::string& path) {
  for (size_t slash = path.find('/', 1); slash != std::string::npos; slash = path.find('/', slash + 1))
    ::mkdir(path.substr(0, slash).c_str(), 0755);
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST)
    throw_user_error("{}: cannot create directory ({})", path, std::strerror(errno));
}

std::string format_duration(double seconds) {
  int s = static_cast<int>(std::lround(std::max(0.0, seconds)));
  return s >= 3600 ? fmt::format("{}h{:02d}m", s / 3600, s / 60 % 60) : fmt::format("{}m{:02d}s", s / 60, s % 60);
}

std::vector<json> read_lines(const std::string& path) {
  std::vector<json> lines;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    try {
      lines.push_back(json::parse(line));
    } catch (const json::exception&) {
      break;  // a line being written
    }
  }
  return lines;
}

int64_t count_lines(const std::string& path) {
  std::ifstream in(path);
  return std::count(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>(), '\n');
}

json state_bytes(const ModelStateBytes& b) { return b.to_json(); }

// The model-state formula of docs/memory.md for every rank of the variant.
std::vector<ModelStateBytes> analytic_per_rank(const VariantSpec& v, const ModelSpec& model, int world) {
  TpPlan plan = TpPlan::build(model.config, v.config.tensor_parallel.plan_options());
  const bool lora = v.config.lora.enabled;
  if (lora) plan = with_lora(std::move(plan), v.config.lora);
  const int tp = plan.tp_size();
  const torch::ScalarType dtype = training_dtype(v.config);
  // What trains is fp32 under LoRA (the adapters); the frozen base stays in the model dtype.
  const torch::ScalarType trained = lora ? torch::kFloat32 : dtype;
  const bool fp32_accumulation = trained != torch::kFloat32 && v.config.gradient_accumulation_steps > 1;
  const ZeroUnits ids{model.config.num_layers};
  const int stage = v.config.zero.stage;
  const int64_t threshold = v.config.zero.stage3_param_persistence_threshold;
  std::vector<ModelStateBytes> out;
  for (int r = 0; r < world; ++r) {
    const FlatLayout layout = zero_layout(plan_entries(plan, false), ids, r % tp, world / tp, stage, threshold);
    const OffloadPlacement offload{v.config.zero.offloads_optimizer(), v.config.zero.offloads_params()};
    ModelStateBytes b = ZeroOptimizer::analytic_bytes(layout, trained, v.config.optimizer, fp32_accumulation, offload);
    if (lora) {
      const FlatLayout frozen = zero_layout(plan_entries(plan, true), ids, r % tp, world / tp, stage, threshold);
      b.frozen_params = analytic_frozen_bytes(frozen, dtype);
      b.host += analytic_frozen_host_bytes(frozen, dtype, offload);
    }
    out.push_back(b);
  }
  return out;
}

class Runner {
 public:
  Runner(const ScenarioSpec& spec, const RunOptions& options) : spec_(spec), options_(options) {
    exe_ = options.executable.empty() ? launcher::self_executable() : options.executable;
    tty_ = isatty(STDERR_FILENO);
  }

  RunOutcome run() {
    AUTOTP_USER_CHECK(!options_.out_dir.empty(), "scenario: no output directory (--out DIR)");
    check_backend();
    make_dir(options_.out_dir);
    make_dir(options_.out_dir + "/variants");
    auto start = Clock::now();
    prepare_models();

    json variants = json::array();
    bool stop = false;
    int index = 0;
    const int total = static_cast<int>(spec_.variants.size());
    for (const auto& v : spec_.variants) {
      ++index;
      json result = describe(v);
      if (stop) {
        result["status"] = "not_run";
        result["error"] = "not run: an earlier variant failed (use --keep-going to run every variant)";
      } else if (v.kind == "simulate") {
        run_simulate(v, result);
      } else {
        run_train(v, result, index, total);
      }
      if (result["status"] == "failed" && !options_.keep_going) stop = true;
      variants.push_back(std::move(result));
      done_wall_s_ += variants.back().value("wall_s", 0.0);
      ++done_;
    }
    compare_with_baselines(variants);

    json checks = json::array();
    bool passed = true;
    for (const auto& check : spec_.checks) {
      json outcome = evaluate_check(check, variants, spec_);
      passed = passed && outcome.value("passed", false);
      checks.push_back(std::move(outcome));
    }
    for (const auto& v : variants) passed = passed && v["status"] == "ok";

    json skipped = json::array();
    for (const auto& s : spec_.skipped) skipped.push_back({{"name", s.name}, {"reason", s.reason}});
    json results = {
        {"scenario",
         {{"name", spec_.name},
          {"description", spec_.description},
          {"file", spec_.file},
          {"data", spec_.data},
          {"steps", spec_.steps},
          {"seq_len", spec_.seq_len},
          {"seed", spec_.seed},
          {"world_size", spec_.world_size},
          {"backend", spec_.backend},
          {"device", spec_.device},
          {"shuffle", spec_.shuffle},
          {"models", models_json()}}},
        {"variants", variants},
        {"skipped", skipped},
        {"checks", checks},
        {"passed", passed},
        {"wall_s", std::chrono::duration<double>(Clock::now() - start).count()}};
    io::write_text_file_atomic(options_.out_dir + "/results.json", results.dump(2) + "\n");
    return {results, passed};
  }

 private:
  void check_backend() {
    if (spec_.device != "cuda") return;
    const int gpus = cuda_device_count();
    AUTOTP_USER_CHECK(gpus > 0, "{}: device cuda: no GPU is visible here (run it on a GPU machine, or use device cpu)",
                      spec_.file);
    AUTOTP_USER_CHECK(spec_.backend != "nccl" || spec_.world_size <= gpus,
                      "{}: backend nccl takes one rank per GPU: world_size {} but {} GPU(s) here (use backend gloo to "
                      "share GPUs)",
                      spec_.file, spec_.world_size, gpus);
  }

  // Models with config overrides are written once to OUT/models/KEY (same seed, so every variant starts alike).
  void prepare_models() {
    for (const auto& [key, model] : spec_.models) {
      if (!model.needs_dir()) {
        model_arg_[key] = model.source;
        continue;
      }
      make_dir(options_.out_dir + "/models");
      std::string dir = options_.out_dir + "/models/" + (key.empty() ? "model" : key);
      ModelSource source;
      source.config = model.config;
      source.label = model.source + " with overrides";
      std::cerr << fmt::format("scenario: writing {} to {}\n", source.label, dir);
      write_model_dir(source, dir, torch::kFloat32, spec_.seed);
      model_arg_[key] = dir;
    }
  }

  json models_json() const {
    json out = json::object();
    for (const auto& [key, model] : spec_.models)
      out[key.empty() ? "model" : key] = {{"source", model.source},
                                          {"overrides", model.overrides},
                                          {"architecture", model.config.architecture},
                                          {"parameters", count_parameters(model.config)},
                                          {"path", model_arg_.at(key)}};
    return out;
  }

  json describe(const VariantSpec& v) const {
    if (v.kind == "simulate") return describe_simulated(v);
    const int dp = spec_.world_size / v.config.tensor_parallel.autotp_size;
    return {{"name", v.name},
            {"kind", v.kind},
            {"model", v.model.empty() ? "model" : v.model},
            {"baseline", v.baseline},
            {"is_baseline", v.is_baseline},
            {"layout",
             {{"world", spec_.world_size},
              {"tp", v.config.tensor_parallel.autotp_size},
              {"dp", dp},
              {"zero_stage", v.config.zero.stage},
              {"dtype", v.config.bf16 ? "bf16" : v.config.fp16.enabled ? "fp16" : "fp32"},
              {"micro_batch", v.config.train_micro_batch_size_per_gpu},
              {"gradient_accumulation_steps", v.config.gradient_accumulation_steps},
              {"train_batch_size", v.config.train_batch_size},
              {"activation_checkpointing", v.config.activation_checkpointing.mode},
              // "auto": on when the run trains on CUDA
              {"overlap_comm", v.config.zero.overlap_comm ? json(*v.config.zero.overlap_comm) : json("auto")}}},
            {"config", v.ds_config},
            {"status", "not_run"},
            {"error", ""}};
  }

  // A simulate variant: its simulated layout in the fields a train variant has (world = its GPUs).
  json describe_simulated(const VariantSpec& v) const {
    const SimulatedLayout& l = v.simulated;
    const int dp = l.gpus / l.tp;
    return {{"name", v.name},
            {"kind", v.kind},
            {"model", l.model},
            {"baseline", v.baseline},
            {"is_baseline", false},
            {"layout",
             {{"world", l.gpus},
              {"tp", l.tp},
              {"dp", dp},
              {"zero_stage", l.zero_stage},
              {"dtype", l.dtype},
              {"micro_batch", l.micro_batch},
              {"gradient_accumulation_steps", l.gas},
              {"train_batch_size", l.micro_batch * l.gas * dp},
              {"activation_checkpointing", l.recompute},
              {"overlap_comm", l.overlap_comm ? json(*l.overlap_comm) : json("auto")}}},
            {"config", l.to_json()},  // the simulated layout as the scenario file gives it
            {"cluster", l.cluster},
            {"status", "not_run"},
            {"error", ""}};
  }

  void run_train(const VariantSpec& v, json& result, int index, int total) {
    const std::string dir = options_.out_dir + "/variants/" + v.name;
    make_dir(dir);
    const std::string config_path = dir + "/config.json";
    const std::string metrics_path = dir + "/metrics.jsonl";
    io::write_text_file_atomic(config_path, v.ds_config.dump(2) + "\n");
    std::remove(metrics_path.c_str());
    std::vector<std::string> argv = {exe_,        "train",         "--config",   config_path,
                                     "--model",   model_arg_.at(v.model), "--data", spec_.data,
                                     "--steps",   std::to_string(spec_.steps), "--seed", std::to_string(spec_.seed),
                                     "--metrics", metrics_path,    "--nproc",    std::to_string(spec_.world_size),
                                     "--timeout", fmt::format("{}", spec_.timeout_s),
                                     "--device",  spec_.device,    "--backend",  spec_.backend};
    if (spec_.seq_len > 0) argv.insert(argv.end(), {"--seq-len", std::to_string(spec_.seq_len)});
    argv.insert(argv.end(), {"--tokenizer", spec_.models.at(v.model).tokenizer});
    argv.insert(argv.end(), {"--prompt-template", spec_.prompt_template, "--chat-loss", spec_.chat_loss});
    if (!spec_.chat_template.empty()) argv.insert(argv.end(), {"--chat-template", spec_.chat_template});
    if (!spec_.shuffle) argv.push_back("--no-shuffle");
    if (spec_.threads > 0) argv.insert(argv.end(), {"--threads", std::to_string(spec_.threads)});
    std::string command;
    for (const auto& a : argv) command += (command.empty() ? "" : " ") + a;
    result["command"] = command;

    launcher::LaunchOptions launch;
    launch.nproc = spec_.world_size;
    launch.argv = argv;
    launch.threads_per_rank = spec_.threads;
    launch.quiet = true;
    launch.prefix_output = true;

    auto start = Clock::now();
    std::atomic<bool> finished{false};
    launcher::LaunchResult launched;
    int restarts = 0;
    std::string launch_error;
    std::thread worker([&] {
      try {
        const auto restarted = launcher::launch_with_restarts(launch, options_.max_restarts);
        launched = restarted.last;
        restarts = restarted.restarts;
      } catch (const std::exception& e) {
        launch_error = e.what();
      }
      finished = true;
    });
    auto last_print = Clock::now();
    while (!finished) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      if (tty_ || std::chrono::duration<double>(Clock::now() - last_print).count() >= 30) {
        progress(v, index, total, count_lines(metrics_path), elapsed, false);
        last_print = Clock::now();
      }
    }
    worker.join();
    const double wall = std::chrono::duration<double>(Clock::now() - start).count();
    result["wall_s"] = wall;
    result["restarts"] = restarts;

    // Every rank's output (its tail) goes to the variant's log.
    std::string log;
    for (const auto& rank : launched.ranks)
      log += fmt::format("== rank {} (exit code {}) ==\n{}", rank.rank, rank.exit_code, rank.output_tail);
    io::write_text_file_atomic(dir + "/train.log", log);

    auto lines = read_lines(metrics_path);
    if (!launch_error.empty() || launched.exit_code != 0) {
      result["status"] = "failed";
      result["error"] = !launch_error.empty() ? launch_error : launched.summary;
    } else if (static_cast<int64_t>(lines.size()) != spec_.steps) {
      result["status"] = "failed";
      result["error"] = fmt::format("{} has {} lines for {} steps", metrics_path, lines.size(), spec_.steps);
    } else {
      result["status"] = "ok";
    }
    result.update(summarize_metrics(lines));
    add_memory(v, lines, result);
    progress(v, index, total, static_cast<int64_t>(lines.size()), wall, true);
    if (result["status"] == "failed")
      std::cerr << fmt::format("scenario: variant {} failed: {}\n", v.name, result["error"].get<std::string>());
  }

  void add_memory(const VariantSpec& v, const std::vector<json>& lines, json& result) const {
    json ranks = json::array();
    if (lines.empty()) {
      result["memory"] = {{"ranks", ranks}};
      return;
    }
    auto analytic = analytic_per_rank(v, spec_.models.at(v.model), spec_.world_size);
    const json& last = lines.back().at("memory");
    for (const auto& r : last.at("ranks")) {
      const int rank = r.at("rank").get<int>();
      int64_t peak = 0, activations = 0, reserved = 0, gathered = 0, buckets = 0;
      for (const auto& line : lines) {
        const json& lr = line.at("memory").at("ranks").at(rank);
        if (lr.value("peak_allocated_bytes", int64_t{0}) > peak) {  // the breakdown of the highest peak
          gathered = lr.value("peak_gathered_params_bytes", int64_t{0});
          buckets = lr.value("peak_gradient_buckets_bytes", int64_t{0});
        }
        peak = std::max(peak, lr.value("peak_allocated_bytes", int64_t{0}));
        activations = std::max(activations, lr.value("activations_peak_bytes", int64_t{0}));
        reserved = std::max(reserved, lr.value("peak_reserved_bytes", int64_t{0}));
      }
      ModelStateBytes measured;
      measured.params = r.at("params").get<int64_t>();
      measured.grads = r.at("grads").get<int64_t>();
      measured.master_weights = r.at("master_weights").get<int64_t>();
      measured.optimizer_states = r.at("optimizer_states").get<int64_t>();
      measured.frozen_params = r.value("frozen_params", int64_t{0});  // LoRA's base
      measured.offload_buffers = r.value("offload_buffers", int64_t{0});  // ZeRO-Offload
      measured.host = r.value("host_bytes", int64_t{0});
      ranks.push_back({{"rank", rank},
                       {"model_states", state_bytes(measured)},
                       {"analytic", state_bytes(analytic.at(rank))},
                       {"peak_allocated_bytes", peak},
                       {"peak_gathered_params_bytes", gathered},
                       {"peak_gradient_buckets_bytes", buckets},
                       {"activations_peak_bytes", activations},
                       {"peak_reserved_bytes", reserved},
                       {"peak_rss_bytes", r.value("peak_rss_bytes", int64_t{0})}});
    }
    // "cpu": autotp's counting allocator; "cuda": LibTorch's CUDA caching allocator.
    result["memory"] = {{"ranks", ranks},
                        {"device", last.value("device", std::string("cpu"))},
                        {"rank0_reported_analytic", last.value("model_states_analytic", json())}};
  }

  // The simulator in this process; "command" is the `autotp simulate` line that prints the same JSON.
  void run_simulate(const VariantSpec& v, json& result) {
    std::string command = exe_ + " simulate";
    for (const auto& a : v.simulated.simulate_args()) command += " " + a;
    result["command"] = command + " --json";
    auto start = Clock::now();
    try {
      result["simulate"] = simulate_layout(v.simulated).to_json();
      result["status"] = "ok";
    } catch (const std::exception& e) {  // e.g. cpu-local without its calibration file
      result["status"] = "failed";
      result["error"] = fmt::format("simulate: {}", e.what());
    }
    result["wall_s"] = std::chrono::duration<double>(Clock::now() - start).count();
    std::cerr << fmt::format("scenario: {} (simulate) {}{}\n", v.name, result["status"].get<std::string>(),
                             result["status"] == "ok" ? "" : ": " + result["error"].get<std::string>());
  }

  void progress(const VariantSpec& v, int index, int total, int64_t steps_done, double elapsed, bool last) {
    double variant_eta = steps_done > 0 ? elapsed / steps_done * (spec_.steps - steps_done) : 0;
    double per_variant = done_ > 0 ? done_wall_s_ / done_ : (steps_done > 0 ? elapsed / steps_done * spec_.steps : 0);
    double scenario_eta = (last ? 0 : variant_eta) + per_variant * (total - index);
    std::string line = fmt::format("scenario: [{}/{}] {} step {}/{} {} ETA {} (scenario ETA {})", index, total,
                                   v.name, steps_done, spec_.steps, format_duration(elapsed),
                                   format_duration(last ? 0 : variant_eta), format_duration(scenario_eta));
    if (tty_)
      std::cerr << "\r" << line << "\033[K" << (last ? "\n" : "") << std::flush;
    else
      std::cerr << line << "\n" << std::flush;
  }

  // Per-step differences to the baseline and ratios of the summaries.
  void compare_with_baselines(json& variants) const {
    auto find = [&](const std::string& name) -> const json* {
      for (const auto& v : variants)
        if (v["name"] == name) return &v;
      return nullptr;
    };
    for (auto& v : variants) {
      const json* b = find(v["baseline"].get<std::string>());
      json c = {{"baseline", v["baseline"]}};
      if (v["kind"] != "train" || !b || !v.contains("loss") || !b->contains("loss")) {
        v["comparison"] = c;
        continue;
      }
      json loss_diff = json::array(), loss_rel = json::array();
      double max_loss_rel = 0, max_grad_rel = 0;
      const size_t n = std::min(v["loss"].size(), (*b)["loss"].size());
      for (size_t i = 0; i < n; ++i) {
        double lv = v["loss"][i], lb = (*b)["loss"][i];
        double gv = v["grad_norm"][i], gb = (*b)["grad_norm"][i];
        loss_diff.push_back(lv - lb);
        double rel = std::fabs(lv - lb) / std::max(std::fabs(lb), 1e-30);
        loss_rel.push_back(rel);
        max_loss_rel = std::max(max_loss_rel, rel);
        max_grad_rel = std::max(max_grad_rel, std::fabs(gv - gb) / std::max(std::fabs(gb), 1e-30));
      }
      c["steps_compared"] = n;
      c["loss_diff"] = loss_diff;
      c["loss_rel_diff"] = loss_rel;
      c["max_loss_rel_diff"] = max_loss_rel;
      c["max_grad_norm_rel_diff"] = max_grad_rel;
      if (!v["memory"]["ranks"].empty() && !(*b)["memory"]["ranks"].empty()) {
        for (const std::string metric : {"model_states.total", "peak_allocated_bytes", "step_time_s", "tokens_per_s"}) {
          double den = variant_metric(*b, metric, "max");
          c["ratios"][metric] = den > 0 ? variant_metric(v, metric, "max") / den : 0.0;
        }
      }
      v["comparison"] = c;
    }
  }

  const ScenarioSpec& spec_;
  const RunOptions& options_;
  std::string exe_;
  bool tty_ = false;
  std::map<std::string, std::string> model_arg_;
  int done_ = 0;
  double done_wall_s_ = 0;
};

}  // namespace

json summarize_metrics(const std::vector<json>& lines) {
  json out;
  std::vector<double> times, tps;
  for (const char* key : {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"}) out[key] = json::array();
  for (const auto& l : lines) {
    for (const char* key : {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"})
      out[key].push_back(l.at(key));
  }
  const size_t skip = lines.size() >= 3 ? 1 : 0;
  for (size_t i = skip; i < lines.size(); ++i) {
    times.push_back(lines[i].at("step_time_s").get<double>());
    tps.push_back(lines[i].at("tokens_per_s").get<double>());
  }
  out["steps_done"] = lines.size();
  out["step_time"] = {{"median_s", median(times)},
                      {"p90_s", quantile(times, 0.9)},
                      {"mean_s", times.empty() ? 0.0 : std::accumulate(times.begin(), times.end(), 0.0) / times.size()},
                      {"steps_measured", times.size()}};
  out["tokens_per_s_median"] = median(tps);
  return out;
}

RunOutcome run_scenario(const ScenarioSpec& spec, const RunOptions& options) { return Runner(spec, options).run(); }

}  // namespace autotp::scenario
