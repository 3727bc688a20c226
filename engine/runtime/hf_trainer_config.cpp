#include "autotp/runtime/hf_trainer_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "autotp/base/error.h"

namespace autotp {
namespace {

using nlohmann::json;

bool is_auto(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

// Every key path ("a.b.c") whose value is "auto".
void find_autos(const json& j, const std::string& path, std::vector<std::string>& out) {
  if (is_auto(j)) out.push_back(path);
  if (!j.is_object()) return;
  for (const auto& [key, v] : j.items()) find_autos(v, path.empty() ? key : path + "." + key, out);
}

json::json_pointer pointer(const std::string& dotted) {
  std::string p;
  size_t start = 0;
  while (start <= dotted.size()) {
    const size_t dot = dotted.find('.', start);
    p += "/" + dotted.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return json::json_pointer(p);
}

std::string number_text(const json& v) { return v.is_number_float() ? fmt::format("{:g}", v.get<double>()) : v.dump(); }

// HF's fill_match / fill_only over one config, collecting what it did.
class Filler {
 public:
  Filler(json& config, std::string source) : config_(config), source_(std::move(source)) {}

  bool has(const std::string& key) const { return config_.contains(pointer(key)); }
  bool auto_at(const std::string& key) const { return has(key) && is_auto(config_.at(pointer(key))); }
  const json& at(const std::string& key) const { return config_.at(pointer(key)); }

  // `value` replaces an "auto" at `key`. A number at `key` that differs from a flag
  // given on the command line (`flag_given`) is a mismatch; with the flag absent the
  // config's number stands (HF would compare it with the TrainingArguments default).
  // `set_if_absent`: a given flag also sets a key the config lacks.
  // `origin` describes a value no flag sets (HF computes it).
  void fill(const std::string& key, const json& value, const std::string& flag, bool flag_given,
            bool set_if_absent = false, bool compare = true, const std::string& origin = "") {
    if (!has(key)) {
      if (set_if_absent && flag_given) set(key, value, "from " + flag + ", the config had no " + key);
      return;
    }
    if (auto_at(key)) {
      set(key, value, !origin.empty() ? origin : flag_given ? "from " + flag : "HF's default of " + flag);
      return;
    }
    if (flag_given && compare && !same(at(key), value))
      mismatches_.push_back(fmt::format("{} is {} but {} is {}", key, at(key).dump(), flag, number_text(value)));
  }

  void set(const std::string& key, const json& value, const std::string& why) {
    try {
      config_[pointer(key)] = value;
    } catch (const json::exception&) {  // a section on the way is not an object ("optimizer": "adam")
      throw_user_error("{}: cannot set {} from the command line: a section on its path is not an object", source_,
                       key);
    }
    filled_.push_back(fmt::format("{} = {} ({})", key, value.dump(), why));
  }

  void check_mismatches() const {
    if (mismatches_.empty()) return;
    throw_user_error(
        "{}: {} value{} of the config contradict{} the command line (set {} to \"auto\" or drop the flag, as the HF "
        "Trainer asks):\n  - {}",
        source_, mismatches_.size(), mismatches_.size() == 1 ? "" : "s", mismatches_.size() == 1 ? "s" : "",
        mismatches_.size() == 1 ? "it" : "them", fmt::join(mismatches_, "\n  - "));
  }

  std::vector<std::string> filled() const { return filled_; }

 private:
  static bool same(const json& a, const json& b) {
    if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
    if (a.is_array() && b.is_array() && a.size() == b.size()) {
      for (size_t i = 0; i < a.size(); ++i)
        if (!same(a[i], b[i])) return false;
      return true;
    }
    return a == b;
  }
  json& config_;
  std::string source_;
  std::vector<std::string> mismatches_, filled_;
};

// The keys the HF Trainer fills, with the flag that sets each one.
const std::map<std::string, std::string>& fillable_keys() {
  static const std::map<std::string, std::string> keys = {
      {"train_micro_batch_size_per_gpu", "--per_device_train_batch_size"},
      {"gradient_accumulation_steps", "--gradient_accumulation_steps"},
      {"train_batch_size", "--per_device_train_batch_size x --gradient_accumulation_steps x data-parallel ranks"},
      {"gradient_clipping", "--max_grad_norm"},
      {"optimizer.params.lr", "--learning_rate"},
      {"optimizer.params.betas", "--adam_beta1 / --adam_beta2"},
      {"optimizer.params.eps", "--adam_epsilon"},
      {"optimizer.params.weight_decay", "--weight_decay"},
      {"scheduler.params.warmup_min_lr", "(always 0)"},
      {"scheduler.params.warmup_max_lr", "--learning_rate"},
      {"scheduler.params.warmup_num_steps", "--warmup_steps / --warmup_ratio"},
      {"scheduler.params.total_num_steps", "--max_steps (or --steps)"},
      {"fp16.enabled", "--fp16"},
      {"bf16.enabled", "--bf16"},
      {"zero_optimization.reduce_bucket_size", "the model's hidden_size (hidden^2)"},
      {"zero_optimization.stage3_prefetch_bucket_size", "the model's hidden_size (0.9 x hidden^2)"},
      {"zero_optimization.stage3_param_persistence_threshold", "the model's hidden_size (10 x hidden)"}};
  return keys;
}

int64_t integer_or(const json& config, const std::string& key, int64_t fallback) {
  const auto p = pointer(key);
  if (!config.contains(p)) return fallback;
  const json& v = config.at(p);
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()) return static_cast<int64_t>(v.get<double>());
  return fallback;  // a wrong type: TrainConfig reports it
}

}  // namespace

ResolvedTrainConfig resolve_hf_trainer_config(const json& input, const HfTrainingArguments& args,
                                              const HfResolveContext& context, const std::string& source) {
  ResolvedTrainConfig out;
  out.config = input;
  if (!input.is_object()) return out;  // TrainConfig reports it
  std::vector<std::string> autos;
  find_autos(input, "", autos);
  for (const auto& key : autos) {
    if (fillable_keys().count(key)) continue;
    std::vector<std::string> allowed;
    for (const auto& [k, flag] : fillable_keys()) allowed.push_back(k);
    throw_user_error("{}: {} is \"auto\", which the HF Trainer does not fill (\"auto\" is allowed at: {}); write a value",
                     source, key, fmt::join(allowed, ", "));
  }
  Filler f(out.config, source);
  const auto given = [](const auto& flag) { return flag.has_value(); };

  // trainer_config_process
  f.fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size.value_or(8),
         "--per_device_train_batch_size", given(args.per_device_train_batch_size), true);
  f.fill("gradient_accumulation_steps", args.gradient_accumulation_steps.value_or(1), "--gradient_accumulation_steps",
         given(args.gradient_accumulation_steps), true);
  // DeepSpeed counts the data-parallel ranks (world / autotp_size) under AutoTP; the HF
  // Trainer multiplies by the world size, which over-counts (DeepSpeed #7298).
  const int64_t tp = std::max<int64_t>(1, integer_or(out.config, "tensor_parallel.autotp_size", 1));
  const int64_t dp = std::max<int64_t>(1, context.world_size / tp);
  const int64_t micro = integer_or(out.config, "train_micro_batch_size_per_gpu", args.per_device_train_batch_size.value_or(8));
  const int64_t gas = integer_or(out.config, "gradient_accumulation_steps", args.gradient_accumulation_steps.value_or(1));
  f.fill("train_batch_size", micro * gas * dp,
         "--per_device_train_batch_size x --gradient_accumulation_steps x data-parallel ranks",
         given(args.per_device_train_batch_size) || given(args.gradient_accumulation_steps));
  f.fill("gradient_clipping", args.max_grad_norm.value_or(1.0), "--max_grad_norm", given(args.max_grad_norm), true);

  const double lr = args.learning_rate.value_or(5e-5);
  const json betas = {args.adam_beta1.value_or(0.9), args.adam_beta2.value_or(0.999)};
  const bool optimizer_flags = given(args.learning_rate) || given(args.adam_beta1) || given(args.adam_beta2) ||
                               given(args.adam_epsilon) || given(args.weight_decay);
  if (!f.has("optimizer") && optimizer_flags) {
    // Without an optimizer section the HF Trainer builds its own AdamW from the arguments.
    f.set("optimizer", {{"type", "AdamW"},
                        {"params", {{"lr", lr}, {"betas", betas}, {"eps", args.adam_epsilon.value_or(1e-8)},
                                    {"weight_decay", args.weight_decay.value_or(0.0)}}}},
          "the config has no optimizer: the HF Trainer's AdamW with the flags' values");
  } else {
    f.fill("optimizer.params.lr", lr, "--learning_rate", given(args.learning_rate), true);
    f.fill("optimizer.params.betas", betas, "--adam_beta1 / --adam_beta2", given(args.adam_beta1) || given(args.adam_beta2));
    f.fill("optimizer.params.eps", args.adam_epsilon.value_or(1e-8), "--adam_epsilon", given(args.adam_epsilon));
    f.fill("optimizer.params.weight_decay", args.weight_decay.value_or(0.0), "--weight_decay", given(args.weight_decay));
  }
  f.fill("scheduler.params.warmup_min_lr", 0, "", false, false, true, "always 0 in the HF Trainer");
  f.fill("scheduler.params.warmup_max_lr", lr, "--learning_rate", given(args.learning_rate));
  f.fill("fp16.enabled", args.fp16.value_or(false), "--fp16", given(args.fp16), true);
  f.fill("bf16.enabled", args.bf16.value_or(false), "--bf16", given(args.bf16), true);

  // trainer_config_finalize
  const int64_t h = context.hidden_size;
  const std::string hidden = fmt::format("the model's hidden_size {}", h);
  f.fill("zero_optimization.reduce_bucket_size", h * h, "", false, false, true, "hidden^2, " + hidden);
  // HF fills these two at stage 3 only; autotp reads them at stage 3 only, so filling them always is the same.
  f.fill("zero_optimization.stage3_prefetch_bucket_size", static_cast<int64_t>(0.9 * static_cast<double>(h * h)), "",
         false, false, true, "int(0.9 x hidden^2), " + hidden);
  f.fill("zero_optimization.stage3_param_persistence_threshold", 10 * h, "", false, false, true,
         "10 x hidden, " + hidden);
  if (f.auto_at("scheduler.params.total_num_steps") && !args.max_steps)
    throw_user_error("{}: scheduler.params.total_num_steps is \"auto\" and the number of steps is not given "
                     "(give --max_steps or --steps)",
                     source);
  if (args.max_steps)
    f.fill("scheduler.params.total_num_steps", *args.max_steps, args.max_steps_from_hf_flag ? "--max_steps" : "--steps",
           true, false, args.max_steps_from_hf_flag);
  // TrainingArguments.get_warmup_steps: --warmup_steps when >= 1, a value below 1 as a ratio
  // (transformers 5), else ceil(steps x --warmup_ratio) (4.x).
  const double warmup_steps = args.warmup_steps.value_or(0);
  const bool ratio = warmup_steps < 1 && (warmup_steps > 0 || args.warmup_ratio.value_or(0) > 0);
  if (f.auto_at("scheduler.params.warmup_num_steps") && ratio && !args.max_steps)
    throw_user_error("{}: scheduler.params.warmup_num_steps is \"auto\" with a warmup ratio, which needs the number "
                     "of steps (give --max_steps or --steps)",
                     source);
  int64_t warmup = 0;
  if (warmup_steps >= 1)
    warmup = static_cast<int64_t>(warmup_steps);
  else if (ratio)
    warmup = static_cast<int64_t>(std::ceil(static_cast<double>(args.max_steps.value_or(0)) *
                                            (warmup_steps > 0 ? warmup_steps : *args.warmup_ratio)));
  if (f.auto_at("scheduler.params.warmup_num_steps")) {
    // transformers 5 fills at least 1 (newer DeepSpeed refuses 0; older clamped it to 2, as autotp does).
    f.fill("scheduler.params.warmup_num_steps", std::max<int64_t>(1, warmup), "--warmup_steps / --warmup_ratio",
           args.warmup_steps.has_value() || args.warmup_ratio.has_value());
  } else {
    // A ratio without the number of steps has no value to compare with.
    const bool known = !ratio || args.max_steps.has_value();
    f.fill("scheduler.params.warmup_num_steps", warmup, "--warmup_steps / --warmup_ratio",
           known && (args.warmup_steps.has_value() || args.warmup_ratio.has_value()));
  }
  f.check_mismatches();
  out.filled = f.filled();
  return out;
}

}  // namespace autotp
