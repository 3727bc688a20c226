#include "autotp/tp/tp_config.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>

namespace autotp {

namespace {

// DeepSpeed's TPTrainingConfig keys, and the "tp" (tensor_parallel) object inside it.
const std::vector<std::string> kKeys = {"autotp_size",        "tp_overlap_comm", "dtype",
                                        "tensor_parallel",    "tp",              "injection_policy_tuple",
                                        "partition_config",   "preset_model",    "keep_module_on_host",
                                        "replace_with_kernel_inject", "kernel_inject", "sequence_parallel"};
// DeepSpeed's AutoTP presets whose architectures autotp shards by its own rules.
const std::vector<std::string> kPresetsKnown = {"llama", "qwen2", "mixtral", "phi3"};
const std::vector<std::string> kPresetsUnknown = {"bloom", "chatglm", "deepseek_v2"};

void read_inner_tp(const JsonSection& s, int autotp_size) {
  const char* key = s.has("tp") ? "tp" : "tensor_parallel";
  if (!s.has(key)) return;
  JsonSection tp = s.section(key, {"tp_size", "tp_grain_size", "mpu", "tp_group", "enabled"});
  if (tp.has("tp_size")) {
    const int64_t size = tp.integer("tp_size", autotp_size);
    tp.check(size == autotp_size, "tp_size", fmt::format("{} (autotp_size: the one tensor-parallel size)", autotp_size));
  }
  tp.integer("tp_grain_size", 1);  // DeepSpeed's training path does not use it either; autotp splits by rows
  for (const char* object : {"mpu", "tp_group"})
    if (tp.has(object) && !tp.at(object).is_null())
      tp.fail("{} is a Python object in DeepSpeed; autotp makes its groups from the launcher's world (remove it)",
              tp.where(object));
}

}  // namespace

TensorParallelConfig TensorParallelConfig::read(const JsonSection& top) {
  TensorParallelConfig t;
  JsonSection s = top.section("tensor_parallel", kKeys);
  int64_t size = s.integer("autotp_size", t.autotp_size);
  s.check(size >= 0 && size <= INT32_MAX, "autotp_size", "an integer >= 1 that divides the world size (0 = off)");
  t.autotp_size = size == 0 ? 1 : static_cast<int>(size);  // DeepSpeed: 0 turns AutoTP off
  t.overlap_comm = s.boolean("tp_overlap_comm", false);
  t.dtype = s.string("dtype", "");
  t.sequence_parallel = s.boolean("sequence_parallel", false);
  read_inner_tp(s, t.autotp_size);
  if (s.has("injection_policy_tuple") && !s.at("injection_policy_tuple").is_null())
    s.fail("{} names Python module classes; say which tensors to split with partition_config.layer_specs",
           s.where("injection_policy_tuple"));
  for (const char* kernel : {"replace_with_kernel_inject", "kernel_inject"})
    if (s.boolean(kernel, false))
      s.fail("{}: DeepSpeed's inference kernels have no training counterpart (allowed: false)", s.where(kernel));
  s.boolean("keep_module_on_host", false);  // autotp reads each rank's slices from the files either way
  if (s.has("preset_model")) {
    const std::string preset = s.string("preset_model", "");
    const bool known = std::find(kPresetsKnown.begin(), kPresetsKnown.end(), preset) != kPresetsKnown.end();
    if (!known)
      s.fail("{} is \"{}\": {} (allowed: {}, whose tensors autotp's own rules split the same way; it finds the "
             "rules of every model it supports by itself)",
             s.where("preset_model"), preset,
             std::find(kPresetsUnknown.begin(), kPresetsUnknown.end(), preset) != kPresetsUnknown.end()
                 ? "a DeepSpeed preset for an architecture autotp does not train yet"
                 : "not a DeepSpeed preset",
             fmt::join(kPresetsKnown, ", "));
  }
  if (s.has("partition_config")) {
    try {
      t.layer_specs = parse_partition_config(s.at("partition_config"));
    } catch (const UserError& e) {
      s.fail("{}", e.what());  // adds the source prefix
    }
  }
  return t;
}

TpPlanOptions TensorParallelConfig::plan_options() const {
  TpPlanOptions options;
  options.tp_size = autotp_size;
  options.layer_specs = layer_specs;
  options.sequence_parallel = sequence_parallel;
  options.overlap_comm = overlap_comm;
  return options;
}

nlohmann::json TensorParallelConfig::to_json() const {
  nlohmann::json tp = {{"autotp_size", autotp_size}};
  if (!dtype.empty()) tp["dtype"] = dtype;
  if (sequence_parallel) tp["sequence_parallel"] = true;
  if (overlap_comm) tp["tp_overlap_comm"] = true;
  if (!layer_specs.empty()) {
    nlohmann::json specs = nlohmann::json::array();
    for (const auto& spec : layer_specs) {
      nlohmann::json s = {{"patterns", spec.patterns}, {"partition_type", tp_role_name(spec.role)}};
      if (!spec.shape.empty()) s["shape"] = spec.shape;
      specs.push_back(std::move(s));
    }
    tp["partition_config"] = {{"layer_specs", std::move(specs)}};
  }
  return tp;
}

}  // namespace autotp
