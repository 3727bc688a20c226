#include "scenario/simulated_layout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <utility>

#include "autotp/base/error.h"
#include "autotp/base/json_file.h"

namespace autotp::scenario {
namespace {

using nlohmann::json;

const std::vector<std::string> kDtypes = {"fp32", "bf16", "fp16"};
// A variant of a simulate-only file: the rest of its layout is the top level's.
const std::vector<std::string> kSimulateOnlyVariantKeys = {"name",         "tp",           "zero_stage",
                                                            "lora_r",       "lora_targets", "offload_optimizer",
                                                            "offload_param"};
constexpr int64_t kIntMax = std::numeric_limits<int>::max();

bool is_catalog_name(const std::string& name) {
  const auto& models = sim::catalog_models();
  return std::any_of(models.begin(), models.end(), [&](const sim::CatalogModel& m) { return m.name == name; });
}

// A relative path given in a file is relative to that file.
std::string against(const std::string& path, const std::string& base_dir) {
  if (path.empty() || path[0] == '/' || base_dir.empty()) return path;
  return base_dir + "/" + path;
}

// An integer in [min, max] ("<key> is <value> (allowed: <allowed>)" otherwise).
int64_t bounded(const JsonSection& o, const std::string& key, int64_t fallback, int64_t min, int64_t max,
                const std::string& allowed) {
  const int64_t value = o.integer(key, fallback);
  if (o.has(key)) o.check(value >= min && value <= max, key, allowed);
  return value;
}

// The keys a layout must have by the time it runs; fails on `o` naming the first one missing.
void require(const JsonSection& o, const SimulatedLayout& l, const std::vector<std::string>& keys) {
  for (const auto& key : keys) {
    std::string what;
    if (key == "model" && l.model.empty())
      what = "a catalog name such as llama2-7b, preset:NAME, an HF model directory or a config.json";
    if (key == "cluster" && l.cluster.empty())
      what = fmt::format("one of {}", fmt::join(sim::cluster_names(), ", "));
    if (key == "gpus" && l.gpus == 0) what = "the number of GPUs, an integer >= 1";
    if (key == "seq_len" && l.seq_len == 0) what = "tokens per sequence, an integer >= 1";
    if (key == "tp" && l.tp == 0) what = "the tensor-parallel size, a divisor of gpus";
    if (key == "zero_stage" && l.zero_stage < 0) what = "the ZeRO stage: 0, 1, 2 or 3";
    if (!what.empty()) o.fail("{} is missing ({})", o.where(key), what);
  }
}

sim::ResolvedModel resolve_model(const JsonSection& o, const SimulatedLayout& l) {
  try {
    return sim::resolve_sim_model(l.model);
  } catch (const UserError& e) {
    std::string message = e.what();
    const std::string flag = "--model " + l.model + ": ";  // the simulator's message names the flag
    if (message.rfind(flag, 0) == 0) message = message.substr(flag.size());
    o.fail("{} is \"{}\": {}", o.where("model"), l.model, message);
  }
}

// What depends on the model and the cluster but not on the parallel layout.
void check_model_and_cluster(const JsonSection& o, const SimulatedLayout& l, const ModelConfig& config) {
  if (l.seq_len > config.max_positions)
    o.fail("{} is {}, beyond the model's {} positions (allowed: 1..{})", o.where("seq_len"), l.seq_len,
           config.max_positions, config.max_positions);
  if (l.cluster == "cpu-local") {
    if (l.dtype == "fp16")
      o.fail("{} is \"fp16\", which cannot run on cpu-local (LibTorch has no float16 matmul on CPU; allowed: bf16, "
             "fp32)",
             o.where("dtype"));
    return;
  }
  if (!l.calibration.empty())
    o.fail("{} applies to cluster cpu-local only (the cluster is {})", o.where("calibration"), l.cluster);
  const sim::ClusterSpec cluster = sim::find_cluster(l.cluster);
  if (l.gpus > cluster.gpus_per_node && l.gpus % cluster.gpus_per_node != 0)
    o.fail("{} is {}: beyond one node of {}, the GPUs must be whole nodes (allowed: up to {} or a multiple of {})",
           o.where("gpus"), l.gpus, cluster.name, cluster.gpus_per_node, cluster.gpus_per_node);
}

// What depends on tp and the ZeRO stage; then the simulator's own check (a GPU
// cluster's: cpu-local's needs its calibration file, read when the layout runs).
void check_parallel(const JsonSection& o, const std::string& where, const SimulatedLayout& l,
                    const ModelConfig& config) {
  if (l.gpus % l.tp != 0)
    o.fail("{} is {}, which does not divide gpus {} (allowed: a divisor of {})", o.where("tp"), l.tp, l.gpus, l.gpus);
  if (l.tp > config.num_heads)
    o.fail("{} is {}, more than the model's {} attention heads", o.where("tp"), l.tp, config.num_heads);
  if (l.cluster == "cpu-local") return;
  const sim::ClusterSpec cluster = sim::find_cluster(l.cluster);
  try {
    sim::validate_layout(config, cluster, l.sim_layout(cluster));
  } catch (const UserError& e) {
    o.fail("{}: {}", where.empty() ? "the layout" : where, e.what());
  }
}

}  // namespace

const std::vector<std::string>& simulated_layout_keys() {
  static const std::vector<std::string> keys = {"model",   "cluster",     "calibration", "gpus",
                                                "tp",      "zero_stage",  "seq_len",     "micro_batch",
                                                "gas",     "dtype",       "activation_checkpointing",
                                                "overlap_comm", "lora_r",  "lora_targets",
                                                "offload_optimizer", "offload_param"};
  return keys;
}

sim::SimLayout SimulatedLayout::sim_layout(const sim::ClusterSpec& cluster) const {
  sim::SimLayout l;
  l.gpus = gpus;
  l.tp = tp > 0 ? tp : 1;
  l.zero_stage = zero_stage >= 0 ? zero_stage : 0;
  l.micro_batch = micro_batch;
  l.seq_len = seq_len;
  l.gas = gas;
  l.dtype = dtype == "fp32" ? torch::kFloat32 : dtype == "fp16" ? torch::kFloat16 : torch::kBFloat16;
  l.activation_checkpointing = recompute == "full";
  l.selective_recompute = recompute == "selective";
  l.overlap_comm = overlap_comm.value_or(!cluster.calibration);
  l.cuda = !cluster.calibration;
  l.lora_r = lora_r;
  l.lora_targets = lora_targets;
  l.offload_optimizer = offload_optimizer;
  l.offload_param = offload_param;
  return l;
}

std::vector<std::string> SimulatedLayout::simulate_args() const {
  std::vector<std::string> args = {"--model",       model,
                                   "--cluster",     cluster,
                                   "--gpus",        std::to_string(gpus),
                                   "--tp",          std::to_string(tp),
                                   "--zero",        std::to_string(zero_stage),
                                   "--seq-len",     std::to_string(seq_len),
                                   "--micro-batch", std::to_string(micro_batch),
                                   "--gas",         std::to_string(gas),
                                   "--dtype",       dtype,
                                   "--recompute",   recompute};
  if (overlap_comm) args.insert(args.end(), {"--overlap-comm", *overlap_comm ? "true" : "false"});
  if (!calibration.empty()) args.insert(args.end(), {"--calibration", calibration});
  if (lora_r > 0) args.insert(args.end(), {"--lora-r", std::to_string(lora_r), "--lora-targets", lora_targets});
  if (offload_optimizer) args.push_back("--offload-optimizer");
  if (offload_param) args.push_back("--offload-param");
  return args;
}

json SimulatedLayout::to_json() const {
  json j = json::object();
  if (!model.empty()) j["model"] = model;
  if (!cluster.empty()) j["cluster"] = cluster;
  if (!calibration.empty()) j["calibration"] = calibration;
  if (gpus > 0) j["gpus"] = gpus;
  if (tp > 0) j["tp"] = tp;
  if (zero_stage >= 0) j["zero_stage"] = zero_stage;
  if (seq_len > 0) j["seq_len"] = seq_len;
  j["micro_batch"] = micro_batch;
  j["gas"] = gas;
  j["dtype"] = dtype;
  j["activation_checkpointing"] = recompute;
  if (overlap_comm) j["overlap_comm"] = *overlap_comm;
  if (lora_r > 0) j["lora_r"] = lora_r, j["lora_targets"] = lora_targets;
  if (offload_optimizer) j["offload_optimizer"] = true;
  if (offload_param) j["offload_param"] = true;
  return j;
}

std::string read_recompute_mode(const JsonSection& o, const std::string& fallback) {
  if (!o.has("activation_checkpointing")) return fallback;
  const json& ac = o.at("activation_checkpointing");
  if (ac.is_boolean()) return ac.get<bool>() ? "full" : "off";
  if (ac.is_string() && (ac == "off" || ac == "selective" || ac == "full")) return ac.get<std::string>();
  o.fail("{} is {} (allowed: \"off\", \"selective\", \"full\", true = \"full\", false = \"off\")",
         o.where("activation_checkpointing"), ac.dump());
}

SimulatedLayout read_simulated_layout(const JsonSection& o, SimulatedLayout l, const std::string& base_dir) {
  if (o.has("model")) {
    l.model = o.string("model", "");
    o.check(!l.model.empty(), "model", "a catalog name such as llama2-7b, preset:NAME, an HF model directory or a "
                                       "config.json");
    // Catalog and preset names are names; a path is relative to the file (kept as given when nothing is
    // there, so that the error names what the file says).
    if (!is_catalog_name(l.model) && l.model.rfind("preset:", 0) != 0) {
      const std::string path = against(l.model, base_dir);
      if (std::filesystem::exists(path)) l.model = path;
    }
  }
  if (o.has("cluster")) {
    l.cluster = o.string("cluster", "");
    const auto names = sim::cluster_names();
    if (std::find(names.begin(), names.end(), l.cluster) == names.end()) {
      const std::string suggestion = closest_key(l.cluster, names);
      o.fail("{} is \"{}\"{} (allowed: {})", o.where("cluster"), l.cluster,
             suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)", suggestion), fmt::join(names, ", "));
    }
  }
  if (o.has("calibration")) {
    l.calibration = o.string("calibration", "");
    o.check(!l.calibration.empty(), "calibration", "a calibration file of `autotp simulate --calibrate`");
    l.calibration = against(l.calibration, base_dir);
  }
  l.gpus = static_cast<int>(bounded(o, "gpus", l.gpus, 1, kIntMax, "an integer >= 1"));
  l.tp = static_cast<int>(bounded(o, "tp", l.tp, 1, kIntMax, "an integer >= 1 that divides gpus"));
  l.zero_stage = static_cast<int>(bounded(o, "zero_stage", l.zero_stage, 0, 3, "0, 1, 2, 3"));
  l.seq_len = bounded(o, "seq_len", l.seq_len, 1, std::numeric_limits<int64_t>::max(), "an integer >= 1");
  l.micro_batch = bounded(o, "micro_batch", l.micro_batch, 1, std::numeric_limits<int64_t>::max(), "an integer >= 1");
  l.gas = bounded(o, "gas", l.gas, 1, std::numeric_limits<int64_t>::max(), "an integer >= 1");
  l.dtype = o.string("dtype", l.dtype);
  o.check(std::find(kDtypes.begin(), kDtypes.end(), l.dtype) != kDtypes.end(), "dtype",
          fmt::format("{}", fmt::join(kDtypes, ", ")));
  l.recompute = read_recompute_mode(o, l.recompute);
  if (o.has("overlap_comm")) l.overlap_comm = o.boolean("overlap_comm", true);
  l.lora_r = bounded(o, "lora_r", l.lora_r, 0, std::numeric_limits<int64_t>::max(),
                     "an integer >= 0 (the LoRA rank; 0 = full fine-tuning)");
  l.lora_targets = o.string("lora_targets", l.lora_targets);
  o.check(!l.lora_targets.empty(), "lora_targets", "\"all-linear\" or comma-separated module names");
  l.offload_optimizer = o.boolean("offload_optimizer", l.offload_optimizer);
  l.offload_param = o.boolean("offload_param", l.offload_param);
  return l;
}

void check_simulated_layout(const JsonSection& o, const std::string& where, const SimulatedLayout& l) {
  require(o, l, {"model", "cluster", "gpus", "seq_len", "tp", "zero_stage"});
  const ModelConfig config = resolve_model(o, l).config;
  check_model_and_cluster(o, l, config);
  check_parallel(o, where, l, config);
}

sim::SimResult simulate_layout(const SimulatedLayout& l) {
  sim::ClusterOptions options;
  options.calibration_file = l.calibration;
  const sim::ClusterSpec cluster = sim::find_cluster(l.cluster, options);
  return sim::simulate(sim::resolve_sim_model(l.model), cluster, l.sim_layout(cluster));
}

SimulateScenario SimulateScenario::from_json(const json& j, const std::string& file, const std::string& base_dir) {
  auto fail = [&](const std::string& message) {
    throw UserError(file.empty() ? message : file + ": " + message);
  };
  if (!j.is_object()) fail("the scenario must be an object, got " + j.dump());
  // Before the keys: a training scenario given here gets this, not "unknown key 'data'".
  if (!j.contains("simulate"))
    fail("not a simulate-only scenario (no \"simulate\": true); a training scenario runs with `autotp scenario "
         "FILE`");
  std::vector<std::string> keys = {"simulate", "name", "assumptions", "variants"};
  keys.insert(keys.end(), simulated_layout_keys().begin(), simulated_layout_keys().end());
  const JsonSection top(j, "", file, keys);
  if (!top.boolean("simulate", false))
    top.fail("simulate is false (a simulate-only scenario says \"simulate\": true; a training scenario runs with "
             "`autotp scenario FILE`)");
  SimulateScenario s;
  s.file = file;
  s.name = top.string("name", "");
  s.assumptions = top.string("assumptions", "");
  s.base = read_simulated_layout(top, SimulatedLayout{}, base_dir);
  require(top, s.base, {"model", "cluster", "gpus", "seq_len"});
  const ModelConfig config = resolve_model(top, s.base).config;
  check_model_and_cluster(top, s.base, config);

  if (!top.has("variants")) top.fail("variants is missing (a list of {{\"name\", \"tp\", \"zero_stage\"}})");
  const json& variants = top.at("variants");
  if (!variants.is_array() || variants.empty())
    top.fail("variants must be a non-empty array of {{\"name\", \"tp\", \"zero_stage\"}}, got {}", variants.dump());
  for (size_t i = 0; i < variants.size(); ++i) {
    const std::string where = fmt::format("variants[{}]", i);
    const JsonSection o(variants[i], where, file, kSimulateOnlyVariantKeys,
                        " in a simulate-only scenario's variant (the other layout keys go at the top level)");
    Variant v;
    if (!o.has("name")) o.fail("{} is missing (a unique name for the variant)", o.where("name"));
    v.name = o.string("name", "");
    for (const auto& earlier : s.variants)
      if (earlier.name == v.name) o.fail("{} is \"{}\", the name of an earlier variant", o.where("name"), v.name);
    v.layout = read_simulated_layout(o, s.base, base_dir);
    require(o, v.layout, {"tp", "zero_stage"});
    check_parallel(o, where, v.layout, config);
    s.variants.push_back(std::move(v));
  }
  return s;
}

SimulateScenario SimulateScenario::from_file(const std::string& path) {
  const json j = read_json_file(path, "scenario file");
  const size_t slash = path.find_last_of('/');
  return from_json(j, path, slash == std::string::npos ? "" : path.substr(0, slash));
}

}  // namespace autotp::scenario
