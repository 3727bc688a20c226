#include "autotp/optim/optim_config.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>

namespace autotp {
namespace {

using nlohmann::json;

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

}  // namespace

OptimizerConfig OptimizerConfig::read(const JsonSection& top) {
  OptimizerConfig o;
  if (!top.has("optimizer")) return o;
  JsonSection s = top.section("optimizer", {"type", "params"});
  if (s.has("type")) {
    std::string type = canonical_name(s.string("type", ""), kOptimizerTypes);
    s.check(!type.empty(), "type", "AdamW, Adam, SGD (any case)");
    o.type = type;
  }
  bool sgd = o.type == "SGD";
  JsonSection p =
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

json OptimizerConfig::to_json() const {
  json params = {{"lr", lr}, {"weight_decay", weight_decay}};
  if (type == "SGD") {
    params["momentum"] = momentum;
  } else {
    params["betas"] = {beta1, beta2};
    params["eps"] = eps;
    params["adam_w_mode"] = adam_w_mode;
  }
  return {{"type", type}, {"params", params}};
}

SchedulerConfig SchedulerConfig::read(const JsonSection& top) {
  SchedulerConfig c;
  if (!top.has("scheduler")) return c;
  JsonSection s = top.section("scheduler", {"type", "params"});
  if (!s.has("type"))
    s.fail("{} is required (allowed: {}; omit 'scheduler' for a constant lr)", s.where("type"),
           fmt::join(kSchedulerTypes, ", "));
  c.type = canonical_name(s.string("type", ""), kSchedulerTypes);
  s.check(!c.type.empty(), "type", fmt::format("{} (any case)", fmt::join(kSchedulerTypes, ", ")));
  JsonSection p = s.section("params", scheduler_params(c.type), fmt::format(" for scheduler type {}", c.type));
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

json SchedulerConfig::to_json() const {
  const json all = {{"warmup_min_lr", warmup_min_lr},       {"warmup_max_lr", warmup_max_lr},
                    {"warmup_num_steps", warmup_num_steps}, {"warmup_type", warmup_type},
                    {"total_num_steps", total_num_steps},   {"warmup_min_ratio", warmup_min_ratio},
                    {"cos_min_ratio", cos_min_ratio}};
  json params = json::object();
  for (const auto& key : scheduler_params(type)) params[key] = all[key];
  return {{"type", type}, {"params", params}};
}

Fp16Config Fp16Config::read(const JsonSection& top) {
  Fp16Config f;
  JsonSection s = top.section("fp16", {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
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

json Fp16Config::to_json() const {
  return {{"enabled", enabled},
          {"loss_scale", loss_scale},
          {"initial_scale_power", initial_scale_power},
          {"loss_scale_window", loss_scale_window},
          {"hysteresis", hysteresis},
          {"min_loss_scale", min_loss_scale}};
}

}  // namespace autotp
