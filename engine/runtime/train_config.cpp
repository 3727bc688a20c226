#include "autotp/runtime/train_config.h"

#include <fmt/ranges.h>

#include <algorithm>

#include "autotp/base/error.h"
#include "autotp/base/json_file.h"
#include "autotp/base/strict_json.h"
#include "autotp/model/presets.h"

namespace autotp {
namespace {

using nlohmann::json;

const std::vector<std::string> kTopKeys = {"train_batch_size",
                                           "train_micro_batch_size_per_gpu",
                                           "gradient_accumulation_steps",
                                           "optimizer",
                                           "scheduler",
                                           "gradient_clipping",
                                           "bf16",
                                           "fp16",
                                           "zero_optimization",
                                           "tensor_parallel",
                                           "expert_parallel",
                                           "activation_checkpointing",
                                           "lora",
                                           "seed",
                                           "steps_per_print",
                                           "wall_clock_breakdown",
                                           "device",
                                           "non_finite",
                                           // HF-Trainer configs carry these; DeepSpeed's own optimizer is always used
                                           "zero_allow_untested_optimizer",
                                           "zero_force_ds_cpu_optimizer"};
const std::vector<std::string> kDevices = {"cpu", "cuda", "auto"};
const std::vector<std::string> kNonFinite = {"error", "skip"};

int64_t positive_or_unset(const JsonSection& s, const std::string& key) {
  int64_t value = s.integer(key, 0);
  if (s.has(key)) s.check(value >= 1, key, "an integer >= 1, or leave it out to derive it");
  return value;
}

}  // namespace

TrainConfig TrainConfig::from_json(const json& j, const std::string& source) {
  JsonSection top(j, "", source, kTopKeys);
  TrainConfig c;
  c.raw = j;
  c.train_batch_size = positive_or_unset(top, "train_batch_size");
  c.train_micro_batch_size_per_gpu = positive_or_unset(top, "train_micro_batch_size_per_gpu");
  c.gradient_accumulation_steps = positive_or_unset(top, "gradient_accumulation_steps");
  c.optimizer = OptimizerConfig::read(top);
  c.scheduler = SchedulerConfig::read(top);
  c.gradient_clipping = top.number("gradient_clipping", c.gradient_clipping);
  top.check(c.gradient_clipping >= 0, "gradient_clipping", "a number >= 0 (0 = no clipping)");
  c.bf16 = top.section("bf16", {"enabled"}).boolean("enabled", false);
  c.fp16 = Fp16Config::read(top);
  if (c.bf16 && c.fp16.enabled)
    top.fail("bf16.enabled and fp16.enabled are both true (allowed: at most one mixed-precision mode)");
  c.zero = ZeroConfig::read(top);
  c.tensor_parallel = TensorParallelConfig::read(top);
  c.expert_parallel = ExpertParallelConfig::read(top);
  if (!c.tensor_parallel.dtype.empty()) {
    // DeepSpeed casts the model to tensor_parallel.dtype; autotp trains in the dtype bf16 / fp16 choose.
    const std::string d = c.tensor_parallel.dtype;
    const torch::ScalarType wanted = c.bf16 ? torch::kBFloat16 : c.fp16.enabled ? torch::kFloat16 : torch::kFloat32;
    bool same = false;
    try {
      same = parse_dtype(d.rfind("torch.", 0) == 0 ? d.substr(6) : d) == wanted;
    } catch (const UserError&) {
      // an unknown name is a mismatch too: reported below with the allowed ones
    }
    if (!same)
      top.fail("tensor_parallel.dtype is \"{}\" but the training dtype is {} (bf16.enabled / fp16.enabled decide it; "
               "allowed: {} or torch.{})",
               d, hf_dtype_name(wanted), hf_dtype_name(wanted), hf_dtype_name(wanted));
  }
  c.activation_checkpointing = ActivationCheckpointingConfig::read(top);
  c.lora = LoraConfig::read(top);
  if (top.has("seed")) {
    const json& seed = top.at("seed");
    top.check(seed.is_number_unsigned() || (seed.is_number_integer() && seed.get<int64_t>() >= 0), "seed",
              "an integer in [0, 2^64)");
    c.seed = seed.get<uint64_t>();
  }
  c.steps_per_print = top.integer("steps_per_print", c.steps_per_print);
  top.check(c.steps_per_print >= 1, "steps_per_print", "an integer >= 1");
  c.wall_clock_breakdown = top.boolean("wall_clock_breakdown", c.wall_clock_breakdown);
  c.device = top.string("device", c.device);
  top.check(std::find(kDevices.begin(), kDevices.end(), c.device) != kDevices.end(), "device",
            "one of cpu, cuda, auto");
  top.boolean("zero_allow_untested_optimizer", false);  // type checks only: no effect (docs/config.md)
  top.boolean("zero_force_ds_cpu_optimizer", false);
  c.non_finite = top.string("non_finite", c.non_finite);
  top.check(std::find(kNonFinite.begin(), kNonFinite.end(), c.non_finite) != kNonFinite.end(), "non_finite",
            "one of error, skip");
  return c;
}

TrainConfig TrainConfig::from_file(const std::string& path) {
  return from_json(read_json_file(path, "config file"), path);
}

void TrainConfig::resolve_batch(int world_size) {
  const int tp = tensor_parallel.autotp_size;
  AUTOTP_USER_CHECK(world_size >= 1, "world size {} (allowed: >= 1)", world_size);
  AUTOTP_USER_CHECK(
      world_size % tp == 0,
      "tensor_parallel.autotp_size {} does not divide the world size {} (allowed: a divisor of {})", tp,
      world_size, world_size);
  const int64_t dp = world_size / tp;
  const std::string dp_text =
      fmt::format("data-parallel size {} (world {} / autotp_size {})", dp, world_size, tp);
  int64_t& tbs = train_batch_size;
  int64_t& micro = train_micro_batch_size_per_gpu;
  int64_t& gas = gradient_accumulation_steps;
  // Every product below is a factor of micro * gas * dp (unset ones as 1): it must fit an int64.
  int64_t product = 0;
  AUTOTP_USER_CHECK(!__builtin_mul_overflow(std::max<int64_t>(micro, 1), std::max<int64_t>(gas, 1), &product) &&
                        !__builtin_mul_overflow(product, dp, &product),
                    "train_micro_batch_size_per_gpu {} * gradient_accumulation_steps {} * {} overflows a 64-bit "
                    "integer (allowed: a product below 2^63)",
                    micro, gas, dp_text);
  if (tbs > 0 && micro > 0 && gas > 0) {
    AUTOTP_USER_CHECK(
        tbs == micro * gas * dp,
        "train_batch_size {} != train_micro_batch_size_per_gpu {} * gradient_accumulation_steps {} * "
        "{} = {}",
        tbs, micro, gas, dp_text, micro * gas * dp);
  } else if (tbs > 0 && micro > 0) {
    AUTOTP_USER_CHECK(
        tbs % (micro * dp) == 0,
        "train_batch_size {} is not a multiple of train_micro_batch_size_per_gpu {} * {} = {}, so "
        "gradient_accumulation_steps = {} / {} is not an integer",
        tbs, micro, dp_text, micro * dp, tbs, micro * dp);
    gas = tbs / (micro * dp);
  } else if (tbs > 0 && gas > 0) {
    AUTOTP_USER_CHECK(tbs % (gas * dp) == 0,
                      "train_batch_size {} is not a multiple of gradient_accumulation_steps {} * {} = {}, so "
                      "train_micro_batch_size_per_gpu = {} / {} is not an integer",
                      tbs, gas, dp_text, gas * dp, tbs, gas * dp);
    micro = tbs / (gas * dp);
  } else if (micro > 0) {
    if (gas == 0) gas = 1;
    tbs = micro * gas * dp;
  } else if (tbs > 0) {
    AUTOTP_USER_CHECK(
        tbs % dp == 0,
        "train_batch_size {} is not a multiple of the {}, so train_micro_batch_size_per_gpu = {} / {} "
        "is not an integer (gradient_accumulation_steps defaults to 1)",
        tbs, dp_text, tbs, dp);
    gas = 1;
    micro = tbs / dp;
  } else {
    throw_user_error(
        "the batch size is not set: give train_batch_size or train_micro_batch_size_per_gpu "
        "(gradient_accumulation_steps alone does not determine it)");
  }
}

json TrainConfig::to_json() const {
  json j = json::object();
  if (train_batch_size > 0) j["train_batch_size"] = train_batch_size;
  if (train_micro_batch_size_per_gpu > 0)
    j["train_micro_batch_size_per_gpu"] = train_micro_batch_size_per_gpu;
  if (gradient_accumulation_steps > 0) j["gradient_accumulation_steps"] = gradient_accumulation_steps;

  j["optimizer"] = optimizer.to_json();
  if (!scheduler.type.empty()) j["scheduler"] = scheduler.to_json();
  j["gradient_clipping"] = gradient_clipping;
  j["bf16"] = {{"enabled", bf16}};
  j["fp16"] = fp16.to_json();
  j["zero_optimization"] = zero.to_json();
  j["tensor_parallel"] = tensor_parallel.to_json();
  if (expert_parallel.enabled) j["expert_parallel"] = expert_parallel.to_json();
  j["activation_checkpointing"] = activation_checkpointing.to_json();
  if (lora.enabled) j["lora"] = lora.to_json();
  j["seed"] = seed;
  j["steps_per_print"] = steps_per_print;
  j["wall_clock_breakdown"] = wall_clock_breakdown;
  j["device"] = device;
  j["non_finite"] = non_finite;
  return j;
}

}  // namespace autotp
