// `autotp simulate`: predicted per-GPU memory and step time of a layout, a
// sweep of every layout, a simulate-only scenario report, and the calibration
// of the cpu-local cluster (docs/simulator.md).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>

#include "autotp/comm/dist_env.h"
#include "autotp/io/safetensors.h"
#include "autotp/model/presets.h"
#include "autotp/base/host_cpu.h"
#include "autotp/base/error.h"
#include "autotp/base/quantile.h"
#include "autotp/base/json_file.h"
#include "autotp/base/log.h"
#include "cli/cli.h"
#include "cli/malloc_policy.h"
#include "scenario/simulated_layout.h"
#include "simulator/calibration.h"
#include "simulator/simulator.h"

namespace autotp::cli {
namespace {

using nlohmann::json;

struct SimulateArgs {
  std::string model, cluster, dtype = "bf16", optimizer = "AdamW", calibration, scenario, markdown;
  std::vector<std::string> measured;  // --measured, once per round of one layout
  int gpus = 0;
  std::optional<int> tp, zero, ep;  // ep: expert_parallel.autoep_size (unset: 1, and a sweep tries every ep)
  int64_t micro_batch = 1, seq_len = 0, gas = 1, reduce_bucket_size = ZeroConfig{}.reduce_bucket_size;
  int64_t allgather_bucket_size = ZeroConfig{}.allgather_bucket_size;
  int64_t lora_r = 0;
  std::string lora_targets = "all-linear";
  int64_t persistence_threshold = ZeroConfig{}.stage3_param_persistence_threshold;
  std::string recompute = "off";
  std::optional<double> inter_node_bw, host_steal;
  bool activation_checkpointing = false, json = false, sweep = false, calibrate = false, sequence_parallel = false;
  bool offload_optimizer = false, offload_param = false;
  std::optional<bool> overlap_comm;  // unset: as the engine, on for GPU clusters, off on cpu-local
  bool dtype_given = false;          // --dtype on the command line (--calibrate then times that dtype, else fp32)
  WorldOptions world;
};

torch::ScalarType parse_sim_dtype(const std::string& name, const std::string& where) {
  if (name == "bf16" || name == "bfloat16") return torch::kBFloat16;
  if (name == "fp16" || name == "float16") return torch::kFloat16;
  if (name == "fp32" || name == "float32") return torch::kFloat32;
  throw_user_error("{} '{}' is not a dtype (allowed: bf16, fp16, fp32)", where, name);
}

void write_output(const std::string& path, const std::string& text) {
  auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  io::write_text_file_atomic(path, text);
}

void calibrate(const SimulateArgs& args) {
  DistEnv env = DistEnv::from_environment();
  init_logging(LogOptions{env.rank});
  const int threads = args.world.threads > 0 ? args.world.threads : env.threads;
  if (threads > 0) at::set_num_threads(threads);
  sim::CalibrationOptions options;
  if (!args.model.empty()) options.model = args.model;
  options.micro_batch = args.micro_batch > 1 ? args.micro_batch : options.micro_batch;
  if (args.seq_len > 0) options.seq_len = args.seq_len;
  options.device = place_rank(args.world, "cpu").device;
  options.dtype = args.dtype_given ? parse_sim_dtype(args.dtype, "--dtype") : torch::kFloat32;
  auto cal = sim::run_calibration(options);
  if (env.rank != 0) return;
  const std::string path = args.calibration.empty() ? sim::default_calibration_path() : args.calibration;
  write_output(path, cal.to_json().dump(2) + "\n");
  std::cout << fmt::format("calibration of {} ranks x {} threads on {} ({}) written to {}\n", cal.world,
                           cal.threads_per_rank, cal.device, cal.dtype, path);
  auto print_costs = [&](const std::string& name, const sim::ComputeCosts& costs) {
    std::cout << fmt::format("  {} GEMM: {} shapes (a grid and the step shapes of {}), best {:.2f} GFLOP/s per rank\n",
                             name, costs.gemm_seconds.size(), cal.model, costs.gemm_peak_flops / 1e9);
    std::cout << fmt::format("  {} elementwise op: {:.1f} us + bytes / {:.2f} GB/s (forward+backward {:.1f} us)\n",
                             name, costs.elementwise_forward.latency_s * 1e6, costs.elementwise_forward.rate / 1e9,
                             costs.elementwise_forward_backward.latency_s * 1e6);
  };
  print_costs(cal.dtype, cal.compute);
  for (const auto& [name, costs] : cal.other_dtypes) print_costs(name, costs);
  if (cal.dispatch_op_s)
    std::cout << fmt::format("  dispatch: {:.2f} us per op or autograd node ({} narrowed to tiny widths)\n",
                             1e6 * *cal.dispatch_op_s, cal.model);
  std::cout << fmt::format("  framework overhead: {:.1f}% of the GEMM and elementwise costs at tp 1", 100 * cal.overhead_ratio);
  for (const auto& [n, ratio] : cal.overhead_ratio_by_tp) std::cout << fmt::format(", {:.1f}% at tp {}", 100 * ratio, n);
  std::cout << "\n";
  std::cout << fmt::format("  {} ranks at once: {:.2f}x slower than one; the host took {:.0f}% of the CPU while "
                           "measuring (times are without it)\n",
                           cal.world, cal.concurrency_slowdown, 100 * cal.host_steal_fraction);
  if (cal.cpu_adam_bytes_per_core_s)
    std::cout << fmt::format("  CPU AdamW (ZeRO-Offload): {:.2f} GB/s per thread (28 bytes per element)\n",
                             *cal.cpu_adam_bytes_per_core_s / 1e9);
  for (const auto& [n, c] : cal.all_reduce)
    std::cout << fmt::format("  all-reduce over {}: {:.0f} us + bytes / {:.3f} GB/s\n", n, c.latency_s * 1e6,
                             c.rate / 1e9);
  for (const auto& [n, c] : cal.all_gather)
    std::cout << fmt::format("  all-gather over {}: {:.0f} us + bytes / {:.3f} GB/s\n", n, c.latency_s * 1e6,
                             c.rate / 1e9);
  for (const auto& [n, skew] : cal.step_collective_skew)
    std::cout << fmt::format("  inside a step, group of {} (ranks time-sharing the cores): +{:.1f}% of the forward + "
                             "backward per gradient all-reduce / parameter gather, +{:.1f}% for all ZeRO-3 layer "
                             "gathers\n",
                             n, 100 * skew, cal.layer_gather_skew.count(n) ? 100 * cal.layer_gather_skew.at(n) : 0.0);
  for (const auto& [n, wake] : cal.collective_wake_s)
    std::cout << fmt::format("  a collective over {} between short computations: +{:.0f} us beyond back-to-back\n", n,
                             wake * 1e6);
}

sim::SimLayout layout_from(const SimulateArgs& args, const sim::ClusterSpec& cluster) {
  sim::SimLayout l;
  l.gpus = args.gpus;
  l.tp = args.tp.value_or(1);
  l.zero_stage = args.zero.value_or(0);
  l.micro_batch = args.micro_batch;
  l.seq_len = args.seq_len;
  l.gas = args.gas;
  l.dtype = parse_sim_dtype(args.dtype, "--dtype");
  l.activation_checkpointing = args.activation_checkpointing || args.recompute == "full";
  l.selective_recompute = args.recompute == "selective";
  l.sequence_parallel = args.sequence_parallel;
  l.optimizer.type = args.optimizer;
  l.reduce_bucket_size = args.reduce_bucket_size;
  l.allgather_bucket_size = args.allgather_bucket_size;
  l.persistence_threshold = args.persistence_threshold;
  l.overlap_comm = args.overlap_comm.value_or(!cluster.calibration);
  l.cuda = !cluster.calibration;
  AUTOTP_USER_CHECK(args.lora_r >= 0, "--lora-r {} (allowed: >= 1, or 0 for full fine-tuning)", args.lora_r);
  l.lora_r = args.lora_r;
  l.lora_targets = args.lora_targets;
  l.offload_optimizer = args.offload_optimizer;
  l.offload_param = args.offload_param;
  l.ep = args.ep.value_or(1);
  AUTOTP_USER_CHECK(l.ep >= 1, "--ep {} is not an expert-parallel size (allowed: an integer >= 1 that divides --gpus / "
                               "--tp, at most the model's experts)",
                    l.ep);
  return l;
}

sim::ClusterSpec cluster_from(const SimulateArgs& args, const std::string& name) {
  sim::ClusterOptions options;
  options.calibration_file = args.calibration;
  options.inter_node_GBps = args.inter_node_bw;
  auto cluster = sim::find_cluster(name, options);
  if (args.host_steal) {
    AUTOTP_USER_CHECK(cluster.calibration.has_value(), "--host-steal applies to cpu-local only (got --cluster {})",
                      name);
    AUTOTP_USER_CHECK(*args.host_steal >= 0 && *args.host_steal <= 0.95,
                      "--host-steal must be a fraction in [0, 0.95], got {}", *args.host_steal);
    cluster.host_steal_fraction = *args.host_steal;
  }
  return cluster;
}

// The host's steal over the steps of a metrics file from `first` on (0 when the
// file has no host_cpu: older files, or not Linux).
double run_steal_fraction(const std::vector<json>& lines, size_t first) {
  HostCpuTimes run;
  for (size_t i = first; i < lines.size(); ++i) {
    if (!lines[i].contains("host_cpu")) continue;
    run.busy_s += lines[i]["host_cpu"].value("busy_s", 0.0);
    run.steal_s += lines[i]["host_cpu"].value("steal_s", 0.0);
  }
  return steal_fraction({}, run);
}

// The --markdown report of a simulate-only scenario: its variants' memory and
// time by kind, every layout of the sweep, and how each variant's peak adds up.
std::string scenario_markdown(const SimulateArgs& args, const scenario::SimulateScenario& s,
                              const sim::ClusterSpec& cluster, const sim::SimLayout& base,
                              const std::vector<std::string>& names, const std::vector<sim::SimResult>& variants,
                              const std::vector<sim::SimResult>& all) {
  const auto& first = variants.front();
  std::string md = fmt::format("# Simulated: {}\n\n", s.name.empty() ? args.scenario : s.name);
  md += fmt::format(
      "Generated by `autotp simulate --scenario {} --markdown {}` from the analytic model of "
      "[docs/simulator.md](simulator.md); nothing here was run on GPUs.\n\n",
      args.scenario, args.markdown);
  md += fmt::format("- model: {} ({}, {} parameters)\n", first.model, first.architecture, first.parameters);
  md += fmt::format("- cluster: {} — {}\n- sources of the figures: {}\n", cluster.name, cluster.description,
                    cluster.sources);
  if (!cluster.assumptions.empty()) md += fmt::format("- {}\n", cluster.assumptions);
  md += fmt::format("- {} GPUs, sequence length {}, micro-batch {}, gradient accumulation {}, {}, AdamW\n", base.gpus,
                    base.seq_len, base.micro_batch, base.gas, s.base.dtype);
  if (!s.assumptions.empty()) md += fmt::format("- assumptions: {}\n", s.assumptions);
  md += "\n## Variants\n\n| variant | tp | dp | ZeRO | LoRA r | offload | frozen base | params | grads | master | "
        "optimizer | activations | comm buffers | transient grads | optimizer temporaries | peak / GPU (phase) | fits | "
        "host / rank | compute | tp comm | ZeRO comm | hidden comm | offload D2H / CPU Adam / H2D | step | tokens/s | "
        "MFU |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (size_t i = 0; i < variants.size(); ++i) {
    const auto& r = variants[i];
    const auto& m = r.memory;
    const auto& t = r.time;
    md += fmt::format(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} ({}) | {} | {} | {:.0f} ms | "
        "{:.0f} ms | {:.0f} ms | {:.0f} ms | {} | {:.0f} ms | {:.0f} | {:.1f}% |\n",
        names[i], r.layout.tp, r.layout.dp(), r.layout.zero_stage,
        r.layout.lora_r > 0 ? std::to_string(r.layout.lora_r) : std::string("-"),
        r.layout.offloads_params() ? "optimizer + params" : r.layout.offloads_optimizer() ? "optimizer" : "-",
        sim::format_bytes(m.states.frozen_params), sim::format_bytes(m.states.params),
        sim::format_bytes(m.states.grads), sim::format_bytes(m.states.master_weights),
        sim::format_bytes(m.states.optimizer_states), sim::format_bytes(m.activations),
        sim::format_bytes(m.comm_buffers), sim::format_bytes(m.transient_grads),
        sim::format_bytes(m.optimizer_temporaries), sim::format_bytes(m.total),
        m.peak_phase == "optimizer" ? "optimizer" : "fwd/bwd", r.fits ? "yes" : "**no**",
        m.host.total() > 0 ? sim::format_bytes(static_cast<double>(m.host.total())) : std::string("-"),
        t.compute_s * 1e3, t.tp_comm_s * 1e3, t.zero_comm_s * 1e3, t.overlap_s * 1e3,
        r.layout.offloads_optimizer() ? fmt::format("{:.0f} / {:.0f} / {:.0f} ms", t.offload_d2h_exposed_s * 1e3,
                                                    t.cpu_adam_s * 1e3, t.offload_h2d_exposed_s * 1e3)
                                      : std::string("-"),
        t.step_s * 1e3, r.tokens_per_s, 100 * r.mfu);
  }
  md += fmt::format("\nUsable memory per GPU: {} ({} less {} reserved). Peak = the larger of the forward/backward "
                    "phase and the optimizer phase.\n",
                    sim::format_bytes(first.usable_bytes), sim::format_bytes(first.capacity_bytes),
                    sim::format_bytes(first.capacity_bytes - first.usable_bytes));
  md += "\n## Every layout (`--sweep`), fitting layouts first, by tokens/s\n\n" + sim::markdown_sweep(all);
  md += "\n## Notes\n\n";
  for (size_t i = 0; i < variants.size(); ++i) {
    const auto& r = variants[i];
    const auto& m = r.memory;
    md += fmt::format(
        "- {}: peak {} in the {} phase = model states {} + {}{}\n", names[i], sim::format_bytes(m.total),
        m.peak_phase == "optimizer" ? "optimizer" : "forward/backward", sim::format_bytes(m.states.total()),
        m.peak_phase == "optimizer"
            ? fmt::format("optimizer temporaries / gather buffers {}",
                          sim::format_bytes(m.optimizer_peak - m.states.total()))
            // The components of the peak moment itself (they sum to the peak).
            : fmt::format("at that moment activations and the batch {} + gathered parameters {} + gradients in "
                          "reduction {}",
                          sim::format_bytes(m.at_peak.activations), sim::format_bytes(m.at_peak.gathered),
                          sim::format_bytes(m.at_peak.gradients)),
        r.fits ? "" : fmt::format(" > {} usable: does not fit", sim::format_bytes(r.usable_bytes)));
  }
  return md;
}

// A simulate-only scenario (the schema and strict reader of scenario/simulated_layout.h):
// its variants, then every layout, as one markdown report. --calibration,
// --overlap-comm, --inter-node-bw and --host-steal apply over the file.
void run_scenario(const SimulateArgs& args) {
  const auto s = scenario::SimulateScenario::from_file(args.scenario);
  auto model = sim::resolve_sim_model(s.base.model);
  SimulateArgs cluster_args = args;
  if (cluster_args.calibration.empty()) cluster_args.calibration = s.base.calibration;
  auto cluster = cluster_from(cluster_args, s.base.cluster);
  auto layout_of = [&](const scenario::SimulatedLayout& l) {
    sim::SimLayout layout = l.sim_layout(cluster);
    if (args.overlap_comm) layout.overlap_comm = *args.overlap_comm;
    return layout;
  };
  const sim::SimLayout base = layout_of(s.base);

  std::vector<sim::SimResult> variants;
  std::vector<std::string> names;
  json out = json::array();
  for (const auto& v : s.variants) {
    variants.push_back(sim::simulate(model, cluster, layout_of(v.layout)));
    names.push_back(v.name);
    auto j = variants.back().to_json();
    j["name"] = names.back();
    out.push_back(j);
  }
  auto all = sim::sweep(model, cluster, base);
  if (args.json) {
    std::cout << json{{"name", s.name}, {"variants", out}}.dump(2) << "\n";
  } else if (args.markdown.empty()) {
    for (size_t i = 0; i < variants.size(); ++i) std::cout << names[i] << ":\n" << sim::format_result(variants[i]) << "\n";
    std::cout << sim::format_sweep(all);
  }
  if (args.markdown.empty()) return;

  // A report may end in hand-written text (runs pasted from the CLI, say): from
  // this line on an existing file is kept as it is.
  const std::string kept_marker =
      "<!-- Not generated: `autotp simulate --scenario --markdown` keeps what follows. -->";
  std::string report = scenario_markdown(args, s, cluster, base, names, variants, all);
  if (std::filesystem::exists(args.markdown)) {
    const std::string old = io::read_text_file(args.markdown);
    if (const size_t at = old.find(kept_marker); at != std::string::npos) report += "\n" + old.substr(at);
  }
  write_output(args.markdown, report);
  std::cout << "wrote " << args.markdown << "\n";
}

// One `autotp train --metrics` file: its layout and the step times after the first.
struct MeasuredRun {
  json layout;
  std::vector<double> times;  // step seconds, the first step left out (it pays one-time costs)
  double steal = 0;           // the host's steal over those steps
  int64_t peak = 0;           // the largest rank's peak allocated bytes
};

MeasuredRun read_measured(const std::string& path) {
  std::ifstream in(path);
  AUTOTP_USER_CHECK(in.good(), "--measured {}: cannot open", path);
  std::vector<json> lines;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) lines.push_back(json::parse(line, nullptr, false));
  AUTOTP_USER_CHECK(!lines.empty() && !lines.back().is_discarded() && lines.back().contains("layout"),
                    "--measured {}: not an `autotp train --metrics` file (JSON lines with 'layout')", path);
  MeasuredRun run;
  run.layout = lines.back()["layout"];
  const size_t first = lines.size() > 1 ? 1 : 0;
  run.steal = run_steal_fraction(lines, first);
  for (size_t i = first; i < lines.size(); ++i) run.times.push_back(lines[i].at("step_time_s").get<double>());
  for (const auto& r : lines.back().at("memory").at("ranks"))
    run.peak = std::max(run.peak, r.at("peak_allocated_bytes").get<int64_t>());
  return run;
}

// Simulated against measured: the layout comes from `autotp train --metrics` files,
// one per round of the same layout (repeated --measured). Each round is simulated
// at the steal the host took during its steps; measured and simulated are the
// medians over rounds of each round's median step.
void compare_measured(const SimulateArgs& args, const sim::ResolvedModel& model, sim::ClusterSpec cluster) {
  std::vector<MeasuredRun> runs;
  for (const auto& path : args.measured) {
    runs.push_back(read_measured(path));
    AUTOTP_USER_CHECK(runs.back().layout == runs.front().layout,
                      "--measured {}: its layout differs from {}'s (every round must run the same layout)", path,
                      args.measured.front());
  }
  const std::string& source = args.measured.front();
  const json& lay = runs.front().layout;
  SimulateArgs a = args;
  AUTOTP_USER_CHECK(lay.contains("seq_len") || args.seq_len >= 1,
                    "--seq-len is required: {} was written before metrics carried the sequence length", source);
  a.gpus = lay.at("world").get<int>();
  a.tp = lay.at("tp").get<int>();
  a.zero = lay.at("zero_stage").get<int>();
  a.dtype = lay.at("dtype").get<std::string>();
  a.overlap_comm = lay.value("overlap_comm", false);  // files from before overlap ran synchronously
  a.sequence_parallel = lay.value("sequence_parallel", false);
  // Newer files also carry the step's shape and ZeRO buckets; older ones take them from the flags.
  a.micro_batch = lay.value("micro_batch", a.micro_batch);
  a.gas = lay.value("gradient_accumulation_steps", a.gas);
  a.seq_len = lay.value("seq_len", a.seq_len);
  a.reduce_bucket_size = lay.value("reduce_bucket_size", a.reduce_bucket_size);
  a.allgather_bucket_size = lay.value("allgather_bucket_size", a.allgather_bucket_size);
  a.persistence_threshold = lay.value("stage3_param_persistence_threshold", a.persistence_threshold);
  if (lay.contains("ep")) a.ep = lay["ep"].get<int>();  // expert parallelism, where the file records it
  if (lay.contains("recompute")) {
    a.recompute = lay["recompute"].get<std::string>();
    AUTOTP_USER_CHECK(a.recompute != "some layers",
                      "--measured {}: recomputation of some layers only is not simulated (off, selective, full)",
                      source);
    a.activation_checkpointing = false;
  }
  std::vector<double> measured, simulated, all_times, steals;
  std::vector<sim::SimResult> results;
  json rounds = json::array();
  int64_t peak = 0;
  for (const auto& run : runs) {
    // cpu-local: simulated at the steal the host took during those steps, unless --host-steal says otherwise.
    if (cluster.calibration && !args.host_steal) cluster.host_steal_fraction = run.steal;
    results.push_back(sim::simulate(model, cluster, layout_from(a, cluster)));
    measured.push_back(median(run.times));
    simulated.push_back(results.back().time.step_s);
    steals.push_back(cluster.host_steal_fraction);
    all_times.insert(all_times.end(), run.times.begin(), run.times.end());
    peak = std::max(peak, run.peak);
    rounds.push_back({{"measured_step_s", measured.back()},
                      {"simulated_step_s", simulated.back()},
                      {"host_steal_fraction", cluster.host_steal_fraction}});
  }
  // The round whose simulation is the median one stands for the breakdown.
  const double step = median(measured), sim_step = median(simulated);
  size_t mid = 0;
  for (size_t i = 0; i < simulated.size(); ++i)
    if (std::abs(simulated[i] - sim_step) < std::abs(simulated[mid] - sim_step)) mid = i;
  const sim::SimResult& result = results[mid];
  // The 10th percentile beside the median: within a run the steal comes in bursts.
  const double fastest = *std::min_element(all_times.begin(), all_times.end()), p10 = quantile(all_times, 0.1);
  const double step_error = sim_step / step - 1, peak_error = static_cast<double>(result.memory.total) / peak - 1;
  const double p10_error = sim_step / p10 - 1;
  if (args.json) {
    std::cout << json{{"measured", {{"step_s", step}, {"p10_step_s", p10}, {"fastest_step_s", fastest},
                                    {"peak_allocated_bytes", peak}, {"steps", all_times.size() + runs.size()},
                                    {"host_steal_fraction", median(steals)}}},
                      {"rounds", rounds},
                      {"simulated", result.to_json()},
                      {"simulated_step_s", sim_step},
                      {"step_error", step_error},
                      {"p10_step_error", p10_error},
                      {"peak_error", peak_error}}
                     .dump(2)
              << "\n";
    return;
  }
  std::cout << fmt::format("| tp {} dp {} ZeRO-{} | {:.1f} / {:.1f} ms ({:.1f}) | {:.0f}% | {:.1f} ms | {:+.0f}% / "
                           "{:+.0f}% | {:.1f} / {:.1f} / {:.1f} ms | {} | {} | {:+.1f}% |\n",
                           result.layout.tp, result.layout.dp(), result.layout.zero_stage, step * 1e3, p10 * 1e3,
                           fastest * 1e3, 100 * median(steals), sim_step * 1e3, 100 * step_error, 100 * p10_error,
                           result.time.compute_s * 1e3,
                           result.time.tp_comm_s * 1e3, result.time.zero_comm_s * 1e3, sim::format_bytes(peak),
                           sim::format_bytes(result.memory.total), 100 * peak_error);
}

void run(const SimulateArgs& args) {
  if (args.calibrate) return calibrate(args);
  if (!args.scenario.empty()) return run_scenario(args);
  AUTOTP_USER_CHECK(!args.model.empty(), "--model is required (a catalog name, preset:NAME, an HF directory or a "
                                         "config.json)");
  AUTOTP_USER_CHECK(!args.cluster.empty(), "--cluster is required (allowed: {})",
                    fmt::join(sim::cluster_names(), ", "));
  if (!args.measured.empty())
    return compare_measured(args, sim::resolve_sim_model(args.model), cluster_from(args, args.cluster));
  AUTOTP_USER_CHECK(args.seq_len >= 1, "--seq-len is required (tokens per sequence)");
  AUTOTP_USER_CHECK(args.gpus >= 1, "--gpus is required (a positive number of GPUs)");
  if (!args.sweep) {
    AUTOTP_USER_CHECK(args.tp.has_value(), "--tp is required (or --sweep for every layout)");
    AUTOTP_USER_CHECK(args.zero.has_value(), "--zero is required (0, 1, 2 or 3; or --sweep for every layout)");
  }
  auto model = sim::resolve_sim_model(args.model);
  auto cluster = cluster_from(args, args.cluster);
  if (args.sweep) {
    // A mixture of experts: every ep of each dp, unless --ep names one.
    auto results = sim::sweep(model, cluster, layout_from(args, cluster), !args.ep.has_value());
    if (args.json) {
      json list = json::array();
      for (const auto& r : results) list.push_back(r.to_json());
      std::cout << json{{"results", list}}.dump(2) << "\n";
    } else {
      std::cout << fmt::format("{} on {} with {} GPUs, micro-batch {} x seq {} x gas {}, {}\n", model.label,
                               cluster.name, args.gpus, args.micro_batch, args.seq_len, args.gas, args.dtype);
      std::cout << sim::format_sweep(results);
    }
    if (!args.markdown.empty()) write_output(args.markdown, sim::markdown_sweep(results));
    return;
  }
  auto result = sim::simulate(model, cluster, layout_from(args, cluster));
  if (args.json)
    std::cout << result.to_json().dump(2) << "\n";
  else
    std::cout << sim::format_result(result);
}

}  // namespace

void register_simulate(CLI::App& app) {
  auto args = std::make_shared<SimulateArgs>();
  auto* cmd = app.add_subcommand("simulate", "Predict per-GPU memory and step time of a layout (docs/simulator.md)");
  cmd->add_option("--model", args->model, "Catalog name (llama2-7b, ...), preset:NAME, HF directory or config.json");
  cmd->add_option("--cluster", args->cluster, "8xA100-80GB | 8xH100-80GB | 8xH200-141GB | cpu-local");
  cmd->add_option("--gpus", args->gpus, "GPUs (world size)");
  cmd->add_option("--tp", args->tp, "Tensor-parallel size (divides --gpus, at most the heads)");
  cmd->add_option("--zero", args->zero, "ZeRO stage 0-3");
  cmd->add_option("--ep", args->ep,
                  "Expert-parallel size of a mixture of experts (expert_parallel.autoep_size; divides --gpus / --tp, "
                  "at most the experts; default 1; --sweep without it tries every ep)");
  cmd->add_option("--micro-batch", args->micro_batch, "Sequences per GPU per forward (default 1)");
  cmd->add_option("--seq-len", args->seq_len, "Tokens per sequence");
  cmd->add_option("--gas", args->gas, "Gradient accumulation steps (default 1)");
  cmd->add_option("--dtype", args->dtype, "bf16 | fp16 | fp32 (default bf16); with --calibrate the compute dtype to time (default fp32)");
  cmd->add_option("--optimizer", args->optimizer, "AdamW | Adam | SGD (default AdamW: 2 fp32 moments)")
      ->check(CLI::IsMember({"AdamW", "Adam", "SGD"}));
  cmd->add_option("--reduce-bucket-size", args->reduce_bucket_size,
                  "Elements per gradient reduction bucket (default 500000000, as the engine)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--allgather-bucket-size", args->allgather_bucket_size,
                  "Elements per parameter all-gather bucket (default 500000000, as the engine)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--persistence-threshold", args->persistence_threshold,
                  "ZeRO-3: tensors below this many elements stay whole (default 100000, as the engine; 0 = none)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--activation-checkpointing", args->activation_checkpointing,
                "Recompute every layer in the backward (= --recompute full)");
  cmd->add_flag("--sequence-parallel", args->sequence_parallel,
                "tensor_parallel.sequence_parallel: the residual stream's activations on 1/tp of the sequence");
  cmd->add_option("--recompute", args->recompute, "Activation recomputation: off | selective | full (default off)")
      ->check(CLI::IsMember({"off", "selective", "full"}));
  cmd->add_option("--overlap-comm", args->overlap_comm,
                  "zero_optimization.overlap_comm of the run: ZeRO collectives behind compute, stage-3 prefetch "
                  "(default as the engine: true on GPU clusters, false on cpu-local)");
  cmd->add_option("--inter-node-bw", args->inter_node_bw, "Per-GPU inter-node bandwidth in GB/s (multi-node)");
  cmd->add_option("--host-steal", args->host_steal,
                  "cpu-local: share of the CPU the host takes (/proc/stat steal, 0-0.95; default 0, with --measured "
                  "the run's own)");
  cmd->add_option("--lora-r", args->lora_r, "LoRA rank: the base frozen in --dtype, fp32 adapters train (default 0: full fine-tuning)");
  cmd->add_option("--lora-targets", args->lora_targets,
                  "LoRA target_modules: all-linear (default) or comma-separated names (q_proj,k_proj,v_proj,o_proj)");
  cmd->add_flag("--offload-optimizer", args->offload_optimizer,
                "zero_optimization.offload_optimizer {\"device\": \"cpu\"}: fp32 master weights and "
                "optimizer states in host memory, the update on the CPU (ZeRO stages 1-3; ignored at 0)");
  cmd->add_flag("--offload-param", args->offload_param,
                "zero_optimization.offload_param {\"device\": \"cpu\"}: the ZeRO-3 parameter partition in "
                "host memory (stage 3, with --offload-optimizer)");
  cmd->add_flag("--json", args->json, "Machine-readable output");
  cmd->add_flag("--sweep", args->sweep, "Every valid (tp, zero) for --gpus, sorted by tokens/s");
  cmd->add_option("--markdown", args->markdown, "Also write the sweep / scenario report as markdown here");
  cmd->add_option("--measured", args->measured,
                  "Compare with an `autotp train --metrics` file (layout, micro-batch, sequence, recomputation and buckets from "
                  "the file; older files need --micro-batch, --seq-len). Repeat it for rounds of the same layout: "
                  "the medians over rounds of each round's median step are compared");
  cmd->add_option("--scenario", args->scenario, "Run a simulate-only scenario file (its variants and the sweep)");
  cmd->add_flag("--calibrate", args->calibrate,
                "Measure this machine (GEMMs at step shapes, elementwise ops, Gloo collectives) for cpu-local; use "
                "with --nproc N. With --device cuda it times the GPUs' work instead (one rank per GPU, collectives "
                "over NCCL), in the same file format (\"device\": \"cuda\")");
  cmd->add_option("--calibration", args->calibration,
                  "Calibration file (default $AUTOTP_CALIBRATION or reports/calibration/cpu-local.json)");
  add_world_options(*cmd, args->world);
  add_device_options(*cmd, args->world);
  cmd->callback([args, cmd] {
    args->dtype_given = cmd->count("--dtype") > 0;
    if (args->calibrate && !run_as_rank(args->world)) return;
    if (args->calibrate) retain_freed_memory();  // as `train` runs the steps it times
    run(*args);
  });
}

}  // namespace autotp::cli
