#include "scenario/scenario_spec.h"

#include <filesystem>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "autotp/data/data_tokenizer.h"
#include "autotp/data/dataset.h"
#include "autotp/model/presets.h"
#include "autotp/base/error.h"
#include "autotp/base/strict_json.h"
#include "autotp/base/json_file.h"
#include "autotp/runtime/hf_trainer_config.h"
#include "autotp/tp/tp_plan.h"

namespace autotp::scenario {
namespace {

using nlohmann::json;

const std::vector<std::string> kTopKeys = {"name",        "description", "model",     "models",   "data",
                                           "steps",       "seq_len",     "tokenizer", "seed",      "world_size", "backend",  "device",
                                           "shuffle",     "threads",     "timeout_s", "config",   "baseline",
                                           "variants",    "sweep",       "checks",   "prompt_template",
                                           "chat_template", "chat_loss", "training_arguments"};
const std::vector<std::string> kLayoutKeys = {"tp", "zero_stage", "dtype", "micro_batch", "activation_checkpointing",
                                              "overrides", "model", "lora"};
const std::vector<std::string> kDtypes = {"fp32", "bf16", "fp16"};
const std::vector<std::string> kCheckTypes = {"loss_agreement", "ratio", "memory_ratio", "model_states_analytic",
                                              "no_failed_runs", "loss_decreases"};

// The scenario's reader: JsonSection (unknown keys with a "did you mean", typed
// getters) plus the getters scenario files need. Errors read "FILE: WHERE.key ...".
class Section : public JsonSection {
 public:
  Section(const json& j, const std::string& where, const std::string& file, std::vector<std::string> allowed,
          const std::string& context = "")
      : JsonSection(object_or_fail(j, where, file), where, file, std::move(allowed), context) {}

  std::string required_string(const std::string& key, const std::string& what) const {
    if (!has(key)) fail("{} is missing ({})", where(key), what);
    return string(key, "");
  }
  // Values outside int64 are "not an integer" (JsonSection), never wrapped.
  int64_t integer(const std::string& key, int64_t fallback, int64_t min_value) const {
    int64_t value = JsonSection::integer(key, fallback);
    if (has(key) && value < min_value)
      fail("{} is {} (allowed: an integer >= {})", where(key), value, min_value);
    return value;
  }
  json object(const std::string& key) const {
    if (!has(key)) return json::object();
    if (!at(key).is_object()) wrong_type(key, "an object");
    return at(key);
  }
  std::vector<std::string> strings(const std::string& key) const {
    std::vector<std::string> out;
    if (!has(key)) return out;
    if (!at(key).is_array()) wrong_type(key, "an array of strings");
    for (const auto& v : at(key)) {
      if (!v.is_string()) wrong_type(key, "an array of strings");
      out.push_back(v.get<std::string>());
    }
    return out;
  }

 private:
  // JsonSection calls a non-object top "the config"; here it is "the scenario".
  static const json& object_or_fail(const json& j, const std::string& where, const std::string& file) {
    if (j.is_object() || !where.empty()) return j;
    std::string message = "the scenario must be an object, got " + j.dump();
    throw UserError(file.empty() ? message : file + ": " + message);
  }
};

std::string resolve_path(const std::string& path, const std::string& base_dir) {
  if (path.empty() || path[0] == '/' || base_dir.empty()) return path;
  return base_dir + "/" + path;
}

ModelSpec parse_model(const json& j, const std::string& key, const std::string& where, const Section& top,
                      const std::string& base_dir) {
  ModelSpec m;
  m.key = key;
  if (j.is_string()) {
    m.source = j.get<std::string>();
  } else {
    try {
      Section o(j, where, "", {"source", "overrides"});  // in the try: a non-object fails naming the file too
      m.source = o.required_string("source", "preset:NAME or an HF model directory");
      m.overrides = o.object("overrides");
    } catch (const UserError& e) {
      top.fail("{}", e.what());
    }
  }
  const bool preset = m.source.rfind("preset:", 0) == 0;
  if (!preset) {
    std::string dir = resolve_path(m.source, base_dir);
    if (!std::filesystem::is_directory(dir))
      top.fail("{} '{}': no such directory {} (give preset:NAME or an HF model directory relative to the scenario)",
               where, m.source, dir);
    m.source = dir;
  }
  try {
    ModelSource source = resolve_model(m.source);
    m.config = m.overrides.empty() ? source.config
                                   : ModelConfig::from_json(merged(source.config.raw, m.overrides),
                                                            where + " (" + m.source + " with overrides)");
  } catch (const UserError& e) {
    top.fail("{}: {}", where, e.what());
  }
  return m;
}

struct Layout {
  int tp = 1;
  int zero_stage = 3;
  std::string dtype = "fp32";
  int64_t micro_batch = 0;
  std::string recompute = "off";  // activation_checkpointing: off | selective | full (true = full)
  json overrides = json::object();
  std::string model;
};

// Reads the layout keys of a baseline or an explicit variant over `defaults`.
Layout parse_layout(const Section& o, Layout layout, const std::map<std::string, ModelSpec>& models) {
  layout.tp = static_cast<int>(o.integer("tp", layout.tp, 1));
  layout.zero_stage = static_cast<int>(o.integer("zero_stage", layout.zero_stage, 0));
  if (layout.zero_stage > 3) o.fail("{} is {} (allowed: 0, 1, 2, 3)", o.where("zero_stage"), layout.zero_stage);
  layout.dtype = o.string("dtype", layout.dtype);
  if (std::find(kDtypes.begin(), kDtypes.end(), layout.dtype) == kDtypes.end())
    o.fail("{} is \"{}\" (allowed: {})", o.where("dtype"), layout.dtype, fmt::join(kDtypes, ", "));
  layout.micro_batch = o.integer("micro_batch", layout.micro_batch, 1);
  layout.recompute = read_recompute_mode(o, layout.recompute);
  if (o.has("overrides")) layout.overrides = merged(layout.overrides, o.object("overrides"));
  // A LoRA variant: the config's "lora" section (PEFT's LoraConfig fields, docs/lora.md).
  // null: full fine-tuning in a scenario whose baseline trains LoRA.
  if (o.has("lora")) layout.overrides["lora"] = o.at("lora").is_null() ? json(nullptr) : o.object("lora");
  if (o.has("model")) {
    layout.model = o.string("model", "");
    if (!models.count(layout.model)) {
      std::vector<std::string> keys;
      for (const auto& [k, _] : models) keys.push_back(k);
      std::string suggestion = closest_key(layout.model, keys);
      o.fail("{} is \"{}\", not a key of \"models\"{} (allowed: {})", o.where("model"), layout.model,
             suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)", suggestion), fmt::join(keys, ", "));
    }
  }
  return layout;
}

// The variant's DeepSpeed config: base config + layout + overrides.
json variant_config(const json& base, const Layout& layout) {
  json c = base;
  c["zero_optimization"]["stage"] = layout.zero_stage;
  c["tensor_parallel"]["autotp_size"] = layout.tp;
  if (layout.dtype == "bf16") c["bf16"]["enabled"] = true;
  if (layout.dtype == "fp16") c["fp16"]["enabled"] = true;
  if (layout.micro_batch > 0) {
    c["train_micro_batch_size_per_gpu"] = layout.micro_batch;
    // The global batch stays; accumulation follows from it.
    if (c.contains("train_batch_size")) c.erase("gradient_accumulation_steps");
  }
  if (layout.recompute != "off") c["activation_checkpointing"]["mode"] = layout.recompute;
  return merged(c, layout.overrides);
}

std::string layout_summary(const Layout& l) {
  const json tp = l.overrides.value("tensor_parallel", json::object());
  auto flag = [&](const char* key) { return tp.is_object() && tp.value(key, false) == true; };
  return fmt::format("tp {}{}{} ZeRO-{} {}{}{}", l.tp, flag("sequence_parallel") ? " + sequence parallel" : "",
                     flag("tp_overlap_comm") ? " + tp overlap" : "", l.zero_stage, l.dtype,
                     l.micro_batch ? fmt::format(" micro-batch {}", l.micro_batch) : "",
                     l.recompute == "off" ? "" : " " + l.recompute + " recomputation") +
         (l.overrides.contains("lora") && l.overrides["lora"].is_object() ? fmt::format(" LoRA r {}", l.overrides["lora"].value("r", 8)) : "");
}

bool is_auto_value(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

class Expander {
 public:
  Expander(ScenarioSpec& spec) : spec_(spec) {}

  // Builds and validates one train variant; returns the reason it cannot run, or "".
  std::string add(const std::string& name, const Layout& layout, bool is_baseline, const std::string& baseline) {
    VariantSpec v;
    v.name = name;
    v.model = layout.model;
    v.tp = layout.tp;
    v.zero_stage = layout.zero_stage;
    v.dtype = layout.dtype;
    v.micro_batch = layout.micro_batch;
    v.recompute = layout.recompute;
    v.overrides = layout.overrides;
    v.is_baseline = is_baseline;
    v.baseline = baseline;
    v.ds_config = variant_config(spec_.base_config, layout);
    const ModelSpec& model = spec_.models.at(layout.model);
    try {
      // HF-Trainer "auto" values, filled as `train` would fill them for this variant; the
      // parameters' offload is a stage-3 section.
      HfTrainingArguments args = spec_.training_arguments;
      args.max_steps = spec_.steps;
      v.ds_config = resolve_hf_trainer_config(v.ds_config, args, {spec_.world_size, model.config.hidden_size},
                                              "config")
                        .config;
      if (layout.zero_stage != 3 && v.ds_config.contains("zero_optimization"))
        v.ds_config["zero_optimization"].erase("offload_param");
      v.config = TrainConfig::from_json(v.ds_config, "config");
      v.config.resolve_batch(spec_.world_size);
      AUTOTP_USER_CHECK(v.config.expert_parallel.size() == 1,
                        "expert_parallel.autoep_size {}: scenarios do not run expert parallelism yet (allowed: 1; "
                        "`autotp train --ep` and `bench-step --ep` do)",
                        v.config.expert_parallel.autoep_size);
      TpPlan::build(model.config, v.config.tensor_parallel.plan_options());
    } catch (const UserError& e) {
      return e.what();
    }
    v.tp = v.config.tensor_parallel.autotp_size;  // overrides may have changed the layout
    v.zero_stage = v.config.zero.stage;
    // HF-Trainer semantics ("train_batch_size": "auto") give each layout micro-batch x
    // accumulation x its own data-parallel ranks, as the recipe would run it.
    const bool batch_per_layout = is_auto_value(spec_.base_config.value("train_batch_size", json()));
    if (!is_baseline && !batch_per_layout) {
      const VariantSpec& b = spec_.variant(baseline);
      if (v.config.train_batch_size != b.config.train_batch_size)
        return fmt::format(
            "global batch {} differs from baseline '{}' ({}): the losses would not be comparable (give "
            "train_batch_size in \"config\" so that every layout derives its micro-batch from it)",
            v.config.train_batch_size, baseline, b.config.train_batch_size);
    }
    for (const auto& existing : spec_.variants) {
      if (existing.name == name) return fmt::format("the name '{}' is already used", name);
      if (!is_baseline && existing.is_baseline && existing.model == v.model &&
          existing.config.to_json() == v.config.to_json())
        return fmt::format("same layout as baseline '{}'", existing.name);
    }
    spec_.variants.push_back(std::move(v));
    return "";
  }

 private:
  ScenarioSpec& spec_;
};

std::string sweep_name(const Layout& l, const json& sweep) {
  auto varies = [&](const char* axis) { return sweep.contains(axis) && sweep[axis].size() > 1; };
  std::string name = fmt::format("tp{}_z{}", l.tp, l.zero_stage);
  if (l.dtype != "fp32" || varies("dtype")) name += "_" + l.dtype;
  if (varies("micro_batch")) name += fmt::format("_mb{}", l.micro_batch);
  if (l.recompute == "full") name += "_ac";
  if (l.recompute == "selective") name += "_sel";
  if (!l.model.empty()) name += "_" + l.model;
  return name;
}

// What a check asserts, as a sentence (reports print it beside the verdict).
std::string check_sentence(const CheckSpec& c) {
  const std::string which = c.variants.empty() ? "every variant" : fmt::format("{}", fmt::join(c.variants, ", "));
  if (c.type == "loss_agreement")
    return fmt::format("{}: {} within {:g} (relative) of the baseline's at every step", which, c.metric,
                       c.max_rel_diff);
  if (c.type == "ratio") {
    std::string bounds;
    if (std::isfinite(c.min)) bounds = fmt::format("at least {:g}", c.min);
    if (std::isfinite(c.max)) bounds += fmt::format("{}at most {:g}", bounds.empty() ? "" : " and ", c.max);
    return fmt::format("{} of {} over {} ({}) is {}", c.metric, c.variant, c.of,
                       c.rank == "max" ? "largest rank" : "rank 0", bounds);
  }
  if (c.type == "model_states_analytic") return which + ": measured model-state bytes equal the formula";
  if (c.type == "loss_decreases")
    return fmt::format("{}: the final loss is below the first{}", which,
                       c.min_drop > 0 ? fmt::format(" by at least {:g} of it", c.min_drop) : "");
  return "every variant ran to the end";  // no_failed_runs
}

CheckSpec parse_check(const json& j, size_t index, const Section& top) {
  const std::string where = fmt::format("checks[{}]", index);
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    top.fail("{} must be an object with a \"type\" (allowed: {}), got {}", where, fmt::join(kCheckTypes, ", "),
             j.dump());
  CheckSpec c;
  c.json = j;
  c.type = j["type"].get<std::string>();
  if (std::find(kCheckTypes.begin(), kCheckTypes.end(), c.type) == kCheckTypes.end()) {
    std::string suggestion = closest_key(c.type, kCheckTypes);
    top.fail("{}.type is \"{}\"{} (allowed: {})", where, c.type,
             suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)", suggestion), fmt::join(kCheckTypes, ", "));
  }
  if (c.type == "memory_ratio") c.type = "ratio";
  std::vector<std::string> keys = {"type", "description"};
  if (c.type == "loss_agreement") keys.insert(keys.end(), {"variants", "metric", "max_rel_diff"});
  if (c.type == "ratio") keys.insert(keys.end(), {"variant", "of", "metric", "rank", "min", "max"});
  if (c.type == "model_states_analytic") keys.push_back("variants");
  if (c.type == "loss_decreases") keys.insert(keys.end(), {"variants", "min_drop"});
  try {
    Section checked(j, where, "", keys);
    c.variants = checked.strings("variants");
    if (c.type == "loss_agreement") {
      c.metric = checked.string("metric", "loss");
      if (c.metric != "loss" && c.metric != "grad_norm")
        checked.fail("{} is \"{}\" (allowed: loss, grad_norm)", checked.where("metric"), c.metric);
      c.max_rel_diff = checked.number("max_rel_diff", c.max_rel_diff);
      if (c.max_rel_diff < 0) checked.fail("{} must be >= 0", checked.where("max_rel_diff"));
    }
    if (c.type == "ratio") {
      c.variant = checked.required_string("variant", "the variant whose metric is the numerator");
      c.of = checked.required_string("of", "the variant whose metric is the denominator");
      c.metric = checked.required_string("metric", fmt::format("one of {}", fmt::join(ratio_metrics(), ", ")));
      const auto& metrics = ratio_metrics();
      if (std::find(metrics.begin(), metrics.end(), c.metric) == metrics.end()) {
        std::string suggestion = closest_key(c.metric, metrics);
        checked.fail("{} is \"{}\"{} (allowed: {})", checked.where("metric"), c.metric,
                     suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)", suggestion),
                     fmt::join(metrics, ", "));
      }
      c.rank = checked.string("rank", "max");
      if (c.rank != "max" && c.rank != "rank0")
        checked.fail("{} is \"{}\" (allowed: max, rank0)", checked.where("rank"), c.rank);
      c.min = checked.number("min", c.min);
      c.max = checked.number("max", c.max);
      if (!checked.has("min") && !checked.has("max"))
        checked.fail("{} needs \"min\" or \"max\" (or both)", where);
    }
    if (c.type == "loss_decreases") c.min_drop = checked.number("min_drop", 0.0);
  } catch (const UserError& e) {
    top.fail("{}", e.what());
  }
  if (!j.contains("description")) c.json["description"] = check_sentence(c);
  return c;
}

// "name" defaults to the file's stem.
std::string default_name(const std::string& file) {
  std::string stem = file.substr(file.find_last_of('/') + 1);
  stem = stem.substr(0, stem.find('.'));
  return stem.empty() ? "scenario" : stem;
}

// One "model", or named "models" (each baseline runs once per model).
std::map<std::string, ModelSpec> read_models(const Section& top, const std::string& base_dir) {
  if (top.has("model") == top.has("models"))
    top.fail("give exactly one of \"model\" (preset:NAME or an HF directory) and \"models\" ({{\"key\": model}})");
  std::map<std::string, ModelSpec> models;
  if (top.has("model")) {
    models[""] = parse_model(top.at("model"), "", "model", top, base_dir);
    return models;
  }
  const json listed = top.object("models");
  if (listed.empty()) top.fail("models is empty (give at least one {{\"key\": model}})");
  for (const auto& item : listed.items())
    models[item.key()] = parse_model(item.value(), item.key(), "models." + item.key(), top, base_dir);
  return models;
}

// "data", "steps" and "seq_len". The data must open for every model, as
// `autotp train` will open it (format, ids, seq_len).
void read_data(const Section& top, ScenarioSpec& s) {
  std::string data = top.required_string("data", "a training data file relative to the scenario file, see docs/data.md");
  s.data = resolve_path(data, s.base_dir);
  if (!std::filesystem::is_regular_file(s.data)) top.fail("data '{}': no such file {}", data, s.data);
  s.steps = top.integer("steps", s.steps, 1);
  s.seq_len = top.integer("seq_len", s.seq_len, 0);
  const bool token_arrays = s.data.size() >= 5 && s.data.substr(s.data.size() - 5) == ".json" && !holds_text(s.data);
  if (s.seq_len == 0 && !token_arrays) top.fail("seq_len is missing (required except for .json token arrays)");
  // "auto" is decided here: a model with overrides trains from a written copy
  // of its directory, which has no tokenizer files.
  s.tokenizer = top.string("tokenizer", s.tokenizer);
  s.prompt_template = top.string("prompt_template", s.prompt_template);
  if (top.has("chat_template")) s.chat_template = resolve_path(top.string("chat_template", ""), s.base_dir);
  s.chat_loss = top.string("chat_loss", s.chat_loss);
  if (s.chat_loss != "assistant" && s.chat_loss != "all") top.fail("chat_loss is \"{}\" (allowed: assistant, all)", s.chat_loss);
  if (s.prompt_template != "alpaca" && s.prompt_template != "plain")
    s.prompt_template = resolve_path(s.prompt_template, s.base_dir);
  for (auto& [key, model] : s.models) {
    if (s.tokenizer == "auto")
      model.tokenizer = model.source.rfind("preset:", 0) == 0 ? "bytes" : model.source;
    else
      model.tokenizer = s.tokenizer == "bytes" ? "bytes" : resolve_path(s.tokenizer, s.base_dir);
    DataOptions data_options;
    data_options.seq_len = s.seq_len;
    data_options.vocab_size = model.config.vocab_size;
    data_options.sft.prompt_template = s.prompt_template;
    data_options.sft.chat_template_file = s.chat_template;
    data_options.sft.assistant_only_loss = s.chat_loss == "assistant";
    if (model.tokenizer != "bytes") data_options.sft.chat_template_dir = model.tokenizer;
    try {
      data_options.tokenizer = choose_tokenizer(model.tokenizer, ModelSource{}, s.data);
      open_dataset(s.data, data_options);
    } catch (const UserError& e) {
      top.fail("data: {}", e.what());
    }
  }
}

// "training_arguments": HF TrainingArguments by their names, filling the config's "auto"
// values as `train`'s flags do (docs/config.md#hf-trainer-configs).
HfTrainingArguments read_training_arguments(const Section& top) {
  HfTrainingArguments a;
  if (!top.has("training_arguments")) return a;
  const JsonSection t = top.section(
      "training_arguments", {"learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps",
                             "warmup_steps", "warmup_ratio", "weight_decay", "max_grad_norm", "adam_beta1",
                             "adam_beta2", "adam_epsilon", "bf16", "fp16"});
  auto number = [&](const char* key, std::optional<double>& into) {
    if (t.has(key)) into = t.number(key, 0);
  };
  number("learning_rate", a.learning_rate);
  number("warmup_steps", a.warmup_steps);
  number("warmup_ratio", a.warmup_ratio);
  number("weight_decay", a.weight_decay);
  number("max_grad_norm", a.max_grad_norm);
  number("adam_beta1", a.adam_beta1);
  number("adam_beta2", a.adam_beta2);
  number("adam_epsilon", a.adam_epsilon);
  if (t.has("per_device_train_batch_size")) a.per_device_train_batch_size = t.integer("per_device_train_batch_size", 1);
  if (t.has("gradient_accumulation_steps")) a.gradient_accumulation_steps = t.integer("gradient_accumulation_steps", 1);
  t.check(a.learning_rate.value_or(0) >= 0, "learning_rate", "a number >= 0");
  t.check(a.warmup_steps.value_or(0) >= 0, "warmup_steps", "a number >= 0");
  t.check(a.warmup_ratio.value_or(0) >= 0 && a.warmup_ratio.value_or(0) <= 1, "warmup_ratio", "a number in [0, 1]");
  t.check(a.weight_decay.value_or(0) >= 0, "weight_decay", "a number >= 0");
  t.check(a.max_grad_norm.value_or(0) >= 0, "max_grad_norm", "a number >= 0");
  t.check(a.per_device_train_batch_size.value_or(1) >= 1, "per_device_train_batch_size", "an integer >= 1");
  t.check(a.gradient_accumulation_steps.value_or(1) >= 1, "gradient_accumulation_steps", "an integer >= 1");
  if (t.has("bf16")) a.bf16 = t.boolean("bf16", false);
  if (t.has("fp16")) a.fp16 = t.boolean("fp16", false);
  return a;
}

// How every variant runs: seed, world, backend and device, threads, timeout and the base DeepSpeed "config".
void read_run_settings(const Section& top, ScenarioSpec& s) {
  s.seed = static_cast<uint64_t>(top.integer("seed", static_cast<int64_t>(s.seed), 0));
  if (!top.has("world_size")) top.fail("world_size is missing (the number of ranks every variant runs on)");
  s.world_size = static_cast<int>(top.integer("world_size", 0, 1));
  s.backend = top.string("backend", s.backend);
  if (s.backend != "gloo" && s.backend != "nccl")
    top.fail("backend is \"{}\" (allowed: gloo, nccl)", s.backend);
  s.device = top.string("device", s.device);
  if (s.device != "cpu" && s.device != "cuda")
    top.fail("device is \"{}\" (allowed: cpu, cuda)", s.device);
  if (s.backend == "nccl" && s.device != "cuda") top.fail("backend nccl needs device cuda (NCCL moves CUDA tensors)");
  s.shuffle = top.boolean("shuffle", s.shuffle);
  s.threads = static_cast<int>(top.integer("threads", 0, 0));
  s.timeout_s = top.number("timeout_s", s.timeout_s);
  if (s.timeout_s <= 0) top.fail("timeout_s must be > 0");
  s.training_arguments = read_training_arguments(top);
  s.base_config = top.object("config");
  try {
    // "auto" values are filled per variant (its world, tp and model); here with a placeholder model.
    HfTrainingArguments args = s.training_arguments;
    args.max_steps = s.steps;
    TrainConfig::from_json(resolve_hf_trainer_config(s.base_config, args, {s.world_size, 64}, "config").config,
                           "config");
  } catch (const UserError& e) {
    top.fail("{}", e.what());
  }
}

// The layout variants and sweep points start from, and each model's baseline variant.
struct Baselines {
  Layout layout;
  std::map<std::string, std::string> of_model;  // model key -> baseline name
};

// "baseline": one variant per model, each of which must run.
Baselines read_baselines(const Section& top, ScenarioSpec& s, Expander& expander) {
  Layout defaults;
  defaults.model = s.models.begin()->first;
  std::string baseline_name = "baseline";
  Baselines baselines;
  baselines.layout = defaults;
  if (top.has("baseline")) {
    auto keys = kLayoutKeys;
    keys.push_back("name");
    keys.erase(std::find(keys.begin(), keys.end(), "model"));  // the baseline runs on every model
    Section b(top.at("baseline"), "baseline", s.file, keys);
    baseline_name = b.string("name", baseline_name);
    baselines.layout = parse_layout(b, defaults, s.models);
  }
  for (const auto& [key, model] : s.models) {
    Layout l = baselines.layout;
    l.model = key;
    std::string name = key.empty() ? baseline_name : baseline_name + "_" + key;
    std::string reason = expander.add(name, l, true, name);
    if (!reason.empty())
      top.fail("baseline '{}' ({}) cannot run on world {}: {}", name, layout_summary(l), s.world_size, reason);
    baselines.of_model[key] = name;
  }
  return baselines;
}

// variants[index] of kind "simulate": the keys of a simulated layout (simulated_layout.h), the same
// schema as a simulate-only scenario file; checked against its model and cluster before anything runs.
void read_simulate_variant(const json& item, const std::string& where, ScenarioSpec& s) {
  std::vector<std::string> keys = {"name", "kind"};
  keys.insert(keys.end(), simulated_layout_keys().begin(), simulated_layout_keys().end());
  Section o(item, where, s.file, keys, " in a kind \"simulate\" variant");
  VariantSpec v;
  v.name = o.required_string("name", "a unique name for the variant");
  v.kind = "simulate";
  for (const auto& existing : s.variants)
    if (existing.name == v.name) o.fail("{} is \"{}\", a name already used", o.where("name"), v.name);
  v.simulated = read_simulated_layout(o, SimulatedLayout{}, s.base_dir);
  check_simulated_layout(o, where, v.simulated);
  s.variants.push_back(std::move(v));
}

// variants[index]: unlike a sweep point, an explicit variant must run.
void read_variant(const json& item, size_t index, const Section& top, ScenarioSpec& s, Expander& expander,
                  const Baselines& baselines) {
  const std::string where = fmt::format("variants[{}]", index);
  // The kind first: it decides which keys the variant may have.
  std::string kind = "train";
  if (item.is_object() && item.contains("kind")) {
    const json& k = item["kind"];
    if (!k.is_string()) top.fail("{}.kind must be a string, got {}", where, k.dump());
    kind = k.get<std::string>();
    if (kind != "train" && kind != "simulate") top.fail("{}.kind is \"{}\" (allowed: train, simulate)", where, kind);
  }
  if (kind == "simulate") return read_simulate_variant(item, where, s);
  auto keys = kLayoutKeys;
  keys.insert(keys.end(), {"name", "kind"});
  Section o(item, where, s.file, keys);
  std::string name = o.required_string("name", "a unique name for the variant");
  Layout l = parse_layout(o, baselines.layout, s.models);
  if (!o.has("model")) l.model = s.models.begin()->first;
  std::string reason = expander.add(name, l, false, baselines.of_model.at(l.model));
  if (!reason.empty())
    o.fail("variant '{}' ({}) cannot run on world {}: {}", name, layout_summary(l), s.world_size, reason);
}

void read_variants(const Section& top, ScenarioSpec& s, Expander& expander, const Baselines& baselines) {
  if (!top.has("variants")) return;
  if (!top.at("variants").is_array()) top.fail("variants must be an array of objects");
  size_t i = 0;
  for (const auto& item : top.at("variants")) read_variant(item, i++, top, s, expander, baselines);
}

// sweep.exclude: layouts (with a "reason") whose matching sweep points are skipped.
std::vector<json> read_sweep_excludes(const Section& sweep, const std::string& file) {
  std::vector<json> excludes;
  if (!sweep.has("exclude")) return excludes;
  if (!sweep.at("exclude").is_array()) sweep.fail("{} must be an array of objects", sweep.where("exclude"));
  size_t i = 0;
  for (const auto& e : sweep.at("exclude")) {
    auto keys = kLayoutKeys;
    keys.push_back("reason");
    Section(e, fmt::format("sweep.exclude[{}]", i++), file, keys);  // checks the keys only
    excludes.push_back(e);
  }
  return excludes;
}

// Why `point` is excluded (the last matching entry wins), or "".
std::string exclusion_reason(const json& point, const std::vector<json>& excludes) {
  std::string reason;
  for (const auto& e : excludes) {
    bool match = true;
    for (const auto& item : e.items())
      if (item.key() != "reason" && point.value(item.key(), json()) != item.value()) match = false;
    if (match) reason = "excluded by sweep.exclude: " + e.value("reason", std::string(e.dump()));
  }
  return reason;
}

// One combination of the sweep's axes; one that cannot run is skipped with the reason.
void add_sweep_point(const json& point, const json& sweep, const std::vector<json>& excludes, ScenarioSpec& s,
                     Expander& expander, const Baselines& baselines) {
  Section p(point, "sweep", s.file, kLayoutKeys);
  Layout l = parse_layout(p, baselines.layout, s.models);
  std::string name = sweep_name(l, sweep);
  std::string reason = exclusion_reason(point, excludes);
  if (reason.empty()) reason = expander.add(name, l, false, baselines.of_model.at(l.model));
  if (!reason.empty()) s.skipped.push_back({name, reason});
}

// "sweep": every combination of its axes.
void read_sweep(const Section& top, ScenarioSpec& s, Expander& expander, const Baselines& baselines) {
  if (!top.has("sweep")) return;
  const json& sweep = top.at("sweep");
  Section o(sweep, "sweep", s.file, {"tp", "zero_stage", "dtype", "micro_batch", "activation_checkpointing", "model",
                                     "overrides", "lora", "exclude"});
  auto axis = [&](const char* key, const json& fallback) {
    if (!sweep.contains(key)) return json::array({fallback});
    if (!sweep[key].is_array() || sweep[key].empty()) o.fail("{} must be a non-empty array", o.where(key));
    return sweep[key];
  };
  json models = json::array();
  if (sweep.contains("model")) {
    models = axis("model", "");
  } else {
    for (const auto& [key, _] : s.models) models.push_back(key);
  }
  std::vector<json> excludes = read_sweep_excludes(o, s.file);
  const Layout& baseline = baselines.layout;
  for (const auto& model : models)
    for (const auto& tp : axis("tp", baseline.tp))
      for (const auto& stage : axis("zero_stage", baseline.zero_stage))
        for (const auto& dtype : axis("dtype", baseline.dtype))
          for (const auto& micro : axis("micro_batch", baseline.micro_batch))
            for (const auto& ac : axis("activation_checkpointing", baseline.recompute)) {
              json point = {{"tp", tp}, {"zero_stage", stage}, {"dtype", dtype}, {"micro_batch", micro},
                            {"activation_checkpointing", ac}, {"model", model}};
              if (sweep.contains("overrides")) point["overrides"] = o.object("overrides");
              if (sweep.contains("lora")) point["lora"] = o.object("lora");  // every point trains LoRA
              if (micro == 0) point.erase("micro_batch");
              add_sweep_point(point, sweep, excludes, s, expander, baselines);
            }
}

// "checks": the variants they name must exist (skipped ones are allowed: the check then reports them).
void read_checks(const Section& top, ScenarioSpec& s) {
  if (!top.has("checks")) return;
  if (!top.at("checks").is_array()) top.fail("checks must be an array of objects");
  std::vector<std::string> names;
  for (const auto& v : s.variants) names.push_back(v.name);
  for (const auto& sk : s.skipped) names.push_back(sk.name);
  size_t i = 0;
  for (const auto& item : top.at("checks")) {
    CheckSpec c = parse_check(item, i, top);
    std::vector<std::string> referenced = c.variants;
    if (!c.variant.empty()) referenced.push_back(c.variant);
    if (!c.of.empty()) referenced.push_back(c.of);
    for (const auto& name : referenced) {
      if (std::find(names.begin(), names.end(), name) != names.end()) continue;
      std::string suggestion = closest_key(name, names);
      top.fail("checks[{}] names variant '{}', which the scenario does not define{} (variants: {})", i, name,
               suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)", suggestion), fmt::join(names, ", "));
    }
    s.checks.push_back(std::move(c));
    ++i;
  }
}

// Every scenario checks that no run failed, whether or not it says so.
void add_default_checks(ScenarioSpec& s) {
  auto no_failed_runs = [](const CheckSpec& c) { return c.type == "no_failed_runs"; };
  if (std::any_of(s.checks.begin(), s.checks.end(), no_failed_runs)) return;
  CheckSpec c;
  c.type = "no_failed_runs";
  c.json = {{"type", "no_failed_runs"}, {"description", "every variant ran to the end (added by default)"}};
  s.checks.push_back(c);
}

}  // namespace

const std::vector<std::string>& ratio_metrics() {
  static const std::vector<std::string> metrics = {
      "model_states.params",  "model_states.grads",  "model_states.master_weights",
      "model_states.optimizer_states", "model_states.total", "peak_allocated_bytes",
      "activations_peak_bytes", "peak_rss_bytes", "step_time_s", "tokens_per_s"};
  return metrics;
}

json merged(json target, const json& patch) {
  target.merge_patch(patch);
  return target;
}

ScenarioSpec ScenarioSpec::from_json(const json& j, const std::string& file, const std::string& base_dir) {
  if (j.is_object() && j.contains("simulate") && j["simulate"] == true) {
    const std::string message = fmt::format(
        "a simulate-only scenario (\"simulate\": true): run it with `autotp simulate --scenario {}`",
        file.empty() ? "FILE" : file);
    throw UserError(file.empty() ? message : file + ": " + message);
  }
  Section top(j, "", file, kTopKeys);
  ScenarioSpec s;
  s.file = file;
  s.base_dir = base_dir;
  s.name = top.string("name", default_name(file));
  s.description = top.string("description", "");
  s.models = read_models(top, base_dir);
  read_data(top, s);
  read_run_settings(top, s);
  Expander expander(s);
  Baselines baselines = read_baselines(top, s, expander);
  read_variants(top, s, expander, baselines);
  read_sweep(top, s, expander, baselines);
  if (s.variants.size() == s.models.size() && s.skipped.empty())
    top.fail("no variants: give \"variants\" and/or a \"sweep\" to compare with the baseline");
  read_checks(top, s);
  add_default_checks(s);
  return s;
}

ScenarioSpec ScenarioSpec::from_file(const std::string& path) {
  json j = read_json_file(path, "scenario file");
  size_t slash = path.find_last_of('/');
  return from_json(j, path, slash == std::string::npos ? "." : path.substr(0, slash));
}

const VariantSpec& ScenarioSpec::variant(const std::string& name) const {
  for (const auto& v : variants)
    if (v.name == name) return v;
  throw_user_error("{}: no variant named '{}'", file, name);
}

void ScenarioSpec::select(const std::vector<std::string>& names) {
  if (names.empty()) return;
  std::vector<std::string> all;
  for (const auto& v : variants) all.push_back(v.name);
  std::set<std::string> keep;
  for (const auto& name : names) {
    if (std::find(all.begin(), all.end(), name) == all.end()) {
      for (const auto& sk : skipped)
        if (sk.name == name) throw_user_error("--only {}: that variant is skipped ({})", name, sk.reason);
      std::string suggestion = closest_key(name, all);
      throw_user_error("--only {}: no such variant in {}{} (variants: {})", name, file,
                       suggestion.empty() ? "" : fmt::format(" (did you mean '{}'?)", suggestion), fmt::join(all, ", "));
    }
    keep.insert(name);
    if (!variant(name).baseline.empty()) keep.insert(variant(name).baseline);  // simulate variants have none
  }
  variants.erase(std::remove_if(variants.begin(), variants.end(),
                                [&](const VariantSpec& v) { return !keep.count(v.name); }),
                 variants.end());
  skipped.clear();
}

void ScenarioSpec::set_steps(int64_t n) {
  AUTOTP_USER_CHECK(n >= 1, "--steps {} (allowed: an integer >= 1)", n);
  steps = n;
}

}  // namespace autotp::scenario
