#include "autotp/runtime/train_config.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>

#include "autotp/runtime/error.h"
#include "autotp/runtime/json_file.h"

namespace autotp {
namespace {

using nlohmann::json;

std::string lowercase(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Levenshtein distance, ignoring case: 'Zero_Optimisation' is one edit from 'zero_optimization'.
size_t edit_distance(const std::string& a_in, const std::string& b_in) {
  std::string a = lowercase(a_in), b = lowercase(b_in);
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// Maps a case-insensitive name onto its canonical spelling; "" when it is none of them.
std::string canonical_name(const std::string& name, const std::vector<std::string>& names) {
  for (const auto& n : names)
    if (lowercase(n) == lowercase(name)) return n;
  return "";
}

// One JSON object of the config. The constructor rejects keys outside `allowed`;
// the getters check types. Every error names the full key path.
class Section {
 public:
  Section(const json& j, std::string path, std::string source, std::vector<std::string> allowed,
          const std::string& context = "")
      : j_(j), path_(std::move(path)), source_(std::move(source)) {
    if (!j_.is_object())
      fail("{} must be an object, got {}", path_.empty() ? "the config" : path_, j_.dump());
    for (const auto& item : j_.items()) {
      const std::string& key = item.key();
      if (std::find(allowed.begin(), allowed.end(), key) != allowed.end()) continue;
      std::string suggestion = closest_key(key, allowed);
      if (!suggestion.empty())
        fail("unknown key '{}'{} (did you mean '{}'?)", where(key), context, where(suggestion));
      fail("unknown key '{}'{} (allowed: {})", where(key), context, fmt::join(allowed, ", "));
    }
  }

  std::string where(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  bool has(const std::string& key) const { return j_.contains(key); }
  const json& at(const std::string& key) const { return j_.at(key); }

  // The object at `key`, or an empty one when the key is absent.
  Section section(const std::string& key, std::vector<std::string> allowed,
                  const std::string& context = "") const {
    static const json kEmpty = json::object();
    return Section(has(key) ? at(key) : kEmpty, where(key), source_, std::move(allowed), context);
  }

  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_boolean()) wrong_type(key, "true or false");
    return at(key).get<bool>();
  }
  double number(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_number()) wrong_type(key, "a number");
    return at(key).get<double>();
  }
  // Integers may be written as integral floats (DeepSpeed configs often say 5e8).
  int64_t integer(const std::string& key, int64_t fallback) const {
    if (!has(key)) return fallback;
    const json& v = at(key);
    if (v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)))
      return v.get<int64_t>();
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::floor(d) == d && std::fabs(d) < 9.0e18) return static_cast<int64_t>(d);
    }
    wrong_type(key, "an integer");
  }
  std::string string(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_string()) wrong_type(key, "a string");
    return at(key).get<std::string>();
  }

  // A value outside its allowed range: "<path> is <value> (allowed: <allowed>)".
  void check(bool ok, const std::string& key, const std::string& allowed) const {
    if (ok) return;
    if (!has(key)) fail("{} is missing (allowed: {})", where(key), allowed);
    fail("{} is {} (allowed: {})", where(key), at(key).dump(), allowed);
  }

  template <typename... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) const {
    std::string message = fmt::format(format, std::forward<Args>(args)...);
    throw UserError(source_.empty() ? message : source_ + ": " + message);
  }

 private:
  [[noreturn]] void wrong_type(const std::string& key, const char* expected) const {
    fail("{} must be {}, got {}", where(key), expected, at(key).dump());
  }

  const json& j_;
  std::string path_;
  std::string source_;
};

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
                                           "activation_checkpointing",
                                           "seed",
                                           "steps_per_print",
                                           "wall_clock_breakdown",
                                           "device"};
const std::vector<std::string> kDevices = {"cpu", "cuda", "auto"};
const std::vector<std::string> kOptimizerTypes = {"AdamW", "Adam", "SGD"};
const std::vector<std::string> kAdamParams = {"lr", "betas", "eps", "weight_decay", "adam_w_mode"};
const std::vector<std::string> kSgdParams = {"lr", "momentum", "weight_decay"};
const std::vector<std::string> kSchedulerTypes = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"};
const std::vector<std::string> kWarmupTypes = {"log", "linear"};

// DeepSpeed passes scheduler params as constructor arguments, so each type takes its own set.
std::vector<std::string> scheduler_params(const std::string& type) {
  if (type == "WarmupLR") return {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"};
  if (type == "WarmupDecayLR")
    return {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"};
  return {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"};
}

OptimizerConfig parse_optimizer(const Section& top) {
  OptimizerConfig o;
  if (!top.has("optimizer")) return o;
  Section s = top.section("optimizer", {"type", "params"});
  if (s.has("type")) {
    std::string type = canonical_name(s.string("type", ""), kOptimizerTypes);
    s.check(!type.empty(), "type", "AdamW, Adam, SGD (any case)");
    o.type = type;
  }
  bool sgd = o.type == "SGD";
  Section p =
      s.section("params", sgd ? kSgdParams : kAdamParams, fmt::format(" for optimizer type {}", o.type));
  o.lr = p.number("lr", o.lr);
  p.check(o.lr >= 0, "lr", "a number >= 0");
  o.weight_decay = p.number("weight_decay", o.weight_decay);
  p.check(o.weight_decay >= 0, "weight_decay", "a number >= 0");
  if (sgd) {
    o.momentum = p.number("momentum", o.momentum);
    p.check(o.momentum >= 0 && o.momentum < 1, "momentum", "a number in [0, 1)");
    return o;
  }
  if (p.has("betas")) {
    const json& b = p.at("betas");
    bool ok = b.is_array() && b.size() == 2;
    for (size_t i = 0; ok && i < 2; ++i)
      ok = b[i].is_number() && b[i].get<double>() >= 0 && b[i].get<double>() < 1;
    p.check(ok, "betas", "two numbers in [0, 1), e.g. [0.9, 0.999]");
    o.beta1 = b[0].get<double>();
    o.beta2 = b[1].get<double>();
  }
  o.eps = p.number("eps", o.eps);
  p.check(o.eps > 0, "eps", "a number > 0");
  o.adam_w_mode = p.boolean("adam_w_mode", true);
  // DeepSpeed's AdamW ignores adam_w_mode; saying false there is a mistake worth reporting.
  if (o.type == "AdamW")
    p.check(o.adam_w_mode, "adam_w_mode", "true for type AdamW; use type Adam for L2-style weight decay");
  return o;
}

SchedulerConfig parse_scheduler(const Section& top) {
  SchedulerConfig c;
  if (!top.has("scheduler")) return c;
  Section s = top.section("scheduler", {"type", "params"});
  if (!s.has("type"))
    s.fail("{} is required (allowed: {}; omit 'scheduler' for a constant lr)", s.where("type"),
           fmt::join(kSchedulerTypes, ", "));
  c.type = canonical_name(s.string("type", ""), kSchedulerTypes);
  s.check(!c.type.empty(), "type", fmt::format("{} (any case)", fmt::join(kSchedulerTypes, ", ")));
  Section p = s.section("params", scheduler_params(c.type), fmt::format(" for scheduler type {}", c.type));
  c.warmup_min_lr = p.number("warmup_min_lr", c.warmup_min_lr);
  p.check(c.warmup_min_lr >= 0, "warmup_min_lr", "a number >= 0");
  c.warmup_max_lr = p.number("warmup_max_lr", c.warmup_max_lr);
  p.check(c.warmup_max_lr >= 0, "warmup_max_lr", "a number >= 0");
  c.warmup_num_steps = p.integer("warmup_num_steps", c.warmup_num_steps);
  p.check(c.warmup_num_steps >= 0, "warmup_num_steps", "an integer >= 0 (values below 2 act as 2)");
  c.warmup_type = p.string("warmup_type", c.warmup_type);
  p.check(std::find(kWarmupTypes.begin(), kWarmupTypes.end(), c.warmup_type) != kWarmupTypes.end(),
          "warmup_type", "log, linear");
  c.warmup_min_ratio = p.number("warmup_min_ratio", c.warmup_min_ratio);
  p.check(c.warmup_min_ratio >= 0 && c.warmup_min_ratio <= 1, "warmup_min_ratio", "a number in [0, 1]");
  c.cos_min_ratio = p.number("cos_min_ratio", c.cos_min_ratio);
  p.check(c.cos_min_ratio >= 0 && c.cos_min_ratio <= 1, "cos_min_ratio", "a number in [0, 1]");
  if (c.type == "WarmupLR") return c;
  if (!p.has("total_num_steps"))
    p.fail("{} is required for scheduler type {} (allowed: an integer >= 1)", p.where("total_num_steps"),
           c.type);
  c.total_num_steps = p.integer("total_num_steps", 0);
  p.check(c.total_num_steps >= 1, "total_num_steps", "an integer >= 1");
  // The cosine phase divides by total - warmup: equal is a division by zero, less runs the cosine backwards.
  int64_t warmup = std::max<int64_t>(2, c.warmup_num_steps);
  if (c.type == "WarmupCosineLR")
    p.check(c.total_num_steps > warmup, "total_num_steps",
            fmt::format("an integer > the warmup length max(2, warmup_num_steps) = {}", warmup));
  return c;
}

Fp16Config parse_fp16(const Section& top) {
  Fp16Config f;
  Section s = top.section("fp16", {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
                                   "hysteresis", "min_loss_scale"});
  f.enabled = s.boolean("enabled", f.enabled);
  f.loss_scale = s.number("loss_scale", f.loss_scale);
  s.check(f.loss_scale >= 0, "loss_scale", "0 (dynamic) or a number > 0 (static)");
  int64_t power = s.integer("initial_scale_power", f.initial_scale_power);
  s.check(power >= 0 && power <= 64, "initial_scale_power", "an integer in [0, 64]");
  f.initial_scale_power = static_cast<int>(power);
  int64_t window = s.integer("loss_scale_window", f.loss_scale_window);
  s.check(window >= 1 && window <= INT32_MAX, "loss_scale_window", "an integer >= 1");
  f.loss_scale_window = static_cast<int>(window);
  int64_t hysteresis = s.integer("hysteresis", f.hysteresis);
  s.check(hysteresis >= 1 && hysteresis <= INT32_MAX, "hysteresis", "an integer >= 1");
  f.hysteresis = static_cast<int>(hysteresis);
  f.min_loss_scale = s.number("min_loss_scale", f.min_loss_scale);
  s.check(f.min_loss_scale > 0, "min_loss_scale", "a number > 0");
  return f;
}

ZeroConfig parse_zero(const Section& top) {
  ZeroConfig z;
  // DeepSpeed accepts the stage3_ spelling as an alias of gather_16bit_weights_on_model_save.
  Section s =
      top.section("zero_optimization", {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                                        "contiguous_gradients", "stage3_prefetch_bucket_size",
                                        "stage3_param_persistence_threshold", "gather_16bit_weights_on_model_save",
                                        "stage3_gather_16bit_weights_on_model_save"});
  int64_t stage = s.integer("stage", z.stage);
  s.check(stage >= 0 && stage <= 3, "stage", "0, 1, 2, 3");
  z.stage = static_cast<int>(stage);
  z.reduce_bucket_size = s.integer("reduce_bucket_size", z.reduce_bucket_size);
  s.check(z.reduce_bucket_size >= 1, "reduce_bucket_size", "an integer >= 1 (elements)");
  z.allgather_bucket_size = s.integer("allgather_bucket_size", z.allgather_bucket_size);
  s.check(z.allgather_bucket_size >= 1, "allgather_bucket_size", "an integer >= 1 (elements)");
  if (s.has("overlap_comm")) z.overlap_comm = s.boolean("overlap_comm", true);
  z.contiguous_gradients = s.boolean("contiguous_gradients", z.contiguous_gradients);
  z.stage3_prefetch_bucket_size = s.integer("stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size);
  s.check(z.stage3_prefetch_bucket_size >= 0, "stage3_prefetch_bucket_size", "an integer >= 0 (elements)");
  z.stage3_param_persistence_threshold =
      s.integer("stage3_param_persistence_threshold", z.stage3_param_persistence_threshold);
  s.check(z.stage3_param_persistence_threshold >= 0, "stage3_param_persistence_threshold",
          "an integer >= 0 (elements; 0 = partition every tensor)");
  const std::string alias = "stage3_gather_16bit_weights_on_model_save";
  bool plain = s.boolean("gather_16bit_weights_on_model_save", false);
  bool staged = s.boolean(alias, false);
  if (s.has("gather_16bit_weights_on_model_save") && s.has(alias) && plain != staged)
    s.fail("{} and {} disagree (they are the same setting; give one)",
           s.where("gather_16bit_weights_on_model_save"), s.where(alias));
  z.gather_16bit_weights_on_model_save = plain || staged;
  return z;
}

TensorParallelConfig parse_tensor_parallel(const Section& top) {
  TensorParallelConfig t;
  Section s = top.section("tensor_parallel", {"autotp_size", "partition_config"});
  int64_t size = s.integer("autotp_size", t.autotp_size);
  s.check(size >= 1 && size <= INT32_MAX, "autotp_size", "an integer >= 1 that divides the world size");
  t.autotp_size = static_cast<int>(size);
  if (s.has("partition_config")) {
    try {
      t.layer_specs = parse_partition_config(s.at("partition_config"));
    } catch (const UserError& e) {
      s.fail("{}", e.what());  // adds the source prefix
    }
  }
  return t;
}

ActivationCheckpointingConfig parse_activation_checkpointing(const Section& top) {
  ActivationCheckpointingConfig a;
  Section s = top.section("activation_checkpointing", {"enabled", "mode", "layers"});
  a.enabled = s.boolean("enabled", a.enabled);
  // `mode` alone turns checkpointing on (or off); `enabled` alone means full.
  a.mode = s.has("mode") ? s.string("mode", "") : (a.enabled ? "full" : "off");
  s.check(a.mode == "off" || a.mode == "full" || a.mode == "selective", "mode", "\"off\", \"full\", \"selective\"");
  if (s.has("mode") && !s.has("enabled")) a.enabled = a.mode != "off";
  if (!a.enabled || a.mode == "off") a.enabled = false, a.mode = "off";
  if (s.has("layers")) {
    const json& layers = s.at("layers");
    bool ok = layers.is_array();
    for (size_t i = 0; ok && i < layers.size(); ++i) {
      ok = layers[i].is_number_integer() && layers[i].get<int64_t>() >= 0;
      if (ok) a.layers.push_back(layers[i].get<int64_t>());
    }
    std::vector<int64_t> sorted = a.layers;
    std::sort(sorted.begin(), sorted.end());
    ok = ok && std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
    s.check(ok, "layers", "an array of distinct layer indices >= 0; empty = every layer");
  }
  return a;
}

int64_t positive_or_unset(const Section& s, const std::string& key) {
  int64_t value = s.integer(key, 0);
  if (s.has(key)) s.check(value >= 1, key, "an integer >= 1, or leave it out to derive it");
  return value;
}

}  // namespace

std::string closest_key(const std::string& key, const std::vector<std::string>& allowed) {
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const auto& candidate : allowed) {
    size_t d = edit_distance(key, candidate);
    if (d < best_distance) best_distance = d, best = candidate;
  }
  size_t tolerance = std::max<size_t>(2, std::max(key.size(), best.size()) / 3);
  return best_distance <= tolerance ? best : "";
}

TrainConfig TrainConfig::from_json(const json& j, const std::string& source) {
  Section top(j, "", source, kTopKeys);
  TrainConfig c;
  c.raw = j;
  c.train_batch_size = positive_or_unset(top, "train_batch_size");
  c.train_micro_batch_size_per_gpu = positive_or_unset(top, "train_micro_batch_size_per_gpu");
  c.gradient_accumulation_steps = positive_or_unset(top, "gradient_accumulation_steps");
  c.optimizer = parse_optimizer(top);
  c.scheduler = parse_scheduler(top);
  c.gradient_clipping = top.number("gradient_clipping", c.gradient_clipping);
  top.check(c.gradient_clipping >= 0, "gradient_clipping", "a number >= 0 (0 = no clipping)");
  c.bf16 = top.section("bf16", {"enabled"}).boolean("enabled", false);
  c.fp16 = parse_fp16(top);
  if (c.bf16 && c.fp16.enabled)
    top.fail("bf16.enabled and fp16.enabled are both true (allowed: at most one mixed-precision mode)");
  c.zero = parse_zero(top);
  c.tensor_parallel = parse_tensor_parallel(top);
  c.activation_checkpointing = parse_activation_checkpointing(top);
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

  json optimizer_params = {{"lr", optimizer.lr}, {"weight_decay", optimizer.weight_decay}};
  if (optimizer.type == "SGD") {
    optimizer_params["momentum"] = optimizer.momentum;
  } else {
    optimizer_params["betas"] = {optimizer.beta1, optimizer.beta2};
    optimizer_params["eps"] = optimizer.eps;
    optimizer_params["adam_w_mode"] = optimizer.adam_w_mode;
  }
  j["optimizer"] = {{"type", optimizer.type}, {"params", optimizer_params}};

  if (!scheduler.type.empty()) {
    const json all = {
        {"warmup_min_lr", scheduler.warmup_min_lr},       {"warmup_max_lr", scheduler.warmup_max_lr},
        {"warmup_num_steps", scheduler.warmup_num_steps}, {"warmup_type", scheduler.warmup_type},
        {"total_num_steps", scheduler.total_num_steps},   {"warmup_min_ratio", scheduler.warmup_min_ratio},
        {"cos_min_ratio", scheduler.cos_min_ratio}};
    json params = json::object();
    for (const auto& key : scheduler_params(scheduler.type)) params[key] = all[key];
    j["scheduler"] = {{"type", scheduler.type}, {"params", params}};
  }

  j["gradient_clipping"] = gradient_clipping;
  j["bf16"] = {{"enabled", bf16}};
  j["fp16"] = {{"enabled", fp16.enabled},
               {"loss_scale", fp16.loss_scale},
               {"initial_scale_power", fp16.initial_scale_power},
               {"loss_scale_window", fp16.loss_scale_window},
               {"hysteresis", fp16.hysteresis},
               {"min_loss_scale", fp16.min_loss_scale}};
  j["zero_optimization"] = {{"stage", zero.stage},
                            {"reduce_bucket_size", zero.reduce_bucket_size},
                            {"allgather_bucket_size", zero.allgather_bucket_size},
                            {"contiguous_gradients", zero.contiguous_gradients},
                            {"stage3_prefetch_bucket_size", zero.stage3_prefetch_bucket_size},
                            {"stage3_param_persistence_threshold", zero.stage3_param_persistence_threshold},
                            {"gather_16bit_weights_on_model_save", zero.gather_16bit_weights_on_model_save}};
  if (zero.overlap_comm) j["zero_optimization"]["overlap_comm"] = *zero.overlap_comm;  // unset: by device

  json tp = {{"autotp_size", tensor_parallel.autotp_size}};
  if (!tensor_parallel.layer_specs.empty()) {
    json specs = json::array();
    for (const auto& spec : tensor_parallel.layer_specs) {
      json s = {{"patterns", spec.patterns}, {"partition_type", tp_role_name(spec.role)}};
      if (!spec.shape.empty()) s["shape"] = spec.shape;
      specs.push_back(std::move(s));
    }
    tp["partition_config"] = {{"layer_specs", std::move(specs)}};
  }
  j["tensor_parallel"] = std::move(tp);
  j["activation_checkpointing"] = {{"enabled", activation_checkpointing.enabled},
                                   {"mode", activation_checkpointing.mode},
                                   {"layers", activation_checkpointing.layers}};
  j["seed"] = seed;
  j["steps_per_print"] = steps_per_print;
  j["wall_clock_breakdown"] = wall_clock_breakdown;
  j["device"] = device;
  return j;
}

}  // namespace autotp
