#include "autotp/arch/rope_config.h"

#include <fmt/ranges.h>

#include <cmath>
#include <set>

#include "autotp/base/error.h"
#include "autotp/base/log.h"

namespace autotp {
namespace {

using nlohmann::json;

bool present(const json& j, const char* key) { return j.contains(key) && !j[key].is_null(); }

double number_at(const json& j, const char* key, double fallback, const std::string& source,
                 const std::string& path) {
  if (!present(j, key)) return fallback;
  AUTOTP_USER_CHECK(j[key].is_number() && std::isfinite(j[key].get<double>()), "{}: {} must be a number, got {}",
                    source, path, j[key].dump());
  return j[key].get<double>();
}

double positive_theta(const json& j, const char* key, double fallback, const std::string& source,
                      const std::string& path) {
  const double theta = number_at(j, key, fallback, source, path);
  AUTOTP_USER_CHECK(theta > 0, "{}: {} is {} (allowed: a number > 0)", source, path, theta);
  return theta;
}

void check_full_rotary(double factor, const std::string& source, const std::string& path) {
  AUTOTP_USER_CHECK(factor == 1.0,
                    "{}: {} {} is not supported (allowed: 1.0; autotp rotates every dimension of a head)", source,
                    path, factor);
}

RopeScalingContext scaling_context(const json& config, const std::string& source, const RopeConfigDefaults& d) {
  RopeScalingContext context;
  context.head_dim = d.head_dim;
  if (present(config, "original_max_position_embeddings")) {
    const json& v = config["original_max_position_embeddings"];
    AUTOTP_USER_CHECK(v.is_number_integer() && v.get<int64_t>() > 0,
                      "{}: original_max_position_embeddings must be a positive integer, got {}", source, v.dump());
    context.original_max_position_embeddings = v.get<int64_t>();
  }
  return context;
}

// transformers 4.x: top-level rope_theta, rope_scaling, partial_rotary_factor, rope_local_base_freq.
RopeConfig read_top_level(const json& config, const std::string& source, const RopeConfigDefaults& d) {
  RopeConfig r;
  r.theta = positive_theta(config, "rope_theta", d.theta, source, "rope_theta");
  r.scaling = RopeScaling::from_json(config.value("rope_scaling", json()), source, scaling_context(config, source, d));
  check_full_rotary(number_at(config, "partial_rotary_factor", 1.0, source, "partial_rotary_factor"), source,
                    "partial_rotary_factor");
  if (d.local_theta > 0)
    r.local_theta = positive_theta(config, "rope_local_base_freq", d.local_theta, source, "rope_local_base_freq");
  return r;
}

struct RopeEntry {
  double theta = 0;
  RopeScaling scaling;
  json normalized;  // the entry with HF 5's defaults filled in, to compare entries
};

// One rope_parameters object, with the defaults transformers 5's standardize_rope_params
// fills in: rope_type "default", rope_theta and partial_rotary_factor from beside it, and
// the pre-training context of llama3 / yarn / longrope from max_position_embeddings.
RopeEntry read_entry(const json& given, const std::string& path, const std::string& source, const json& config,
                     const RopeConfigDefaults& d, double theta_fallback) {
  AUTOTP_USER_CHECK(given.is_object(), "{}: {} must be an object, got {}", source, path, given.dump());
  RopeEntry e;
  json entry = json::object();
  for (const auto& [key, v] : given.items())
    if (!v.is_null()) entry[key] = v;
  e.theta = positive_theta(entry, "rope_theta", theta_fallback, source, path + ".rope_theta");
  const double partial = number_at(entry, "partial_rotary_factor",
                                   number_at(config, "partial_rotary_factor", 1.0, source, "partial_rotary_factor"),
                                   source, path + ".partial_rotary_factor");
  check_full_rotary(partial, source, path + ".partial_rotary_factor");
  entry.erase("rope_theta");
  entry.erase("partial_rotary_factor");
  if (!entry.contains("rope_type") && !entry.contains("type")) entry["rope_type"] = "default";
  const RopeScalingContext context = scaling_context(config, source, d);
  const json type = entry.contains("rope_type") ? entry["rope_type"] : entry["type"];
  const bool needs_context = type == "llama3" || type == "yarn" || type == "longrope";
  if (needs_context && !entry.contains("original_max_position_embeddings") &&
      !context.original_max_position_embeddings && d.max_position_embeddings > 0)
    entry["original_max_position_embeddings"] = d.max_position_embeddings;
  e.scaling = RopeScaling::from_json(entry, source, context, path);
  e.normalized = entry;
  e.normalized["rope_theta"] = e.theta;
  return e;
}

// The layer types config.json declares, plus the two HF names (a rope_parameters key
// among them is a per-layer-type entry).
std::set<std::string> layer_type_names(const json& config) {
  std::set<std::string> names = {"full_attention", "sliding_attention"};
  if (present(config, "layer_types") && config["layer_types"].is_array())
    for (const json& t : config["layer_types"])
      if (t.is_string()) names.insert(t.get<std::string>());
  return names;
}

// Gemma 3 (transformers 5's Gemma3TextConfig): full_attention for the global layers,
// sliding_attention for the local ones; a top-level rope_scaling is merged into the
// full_attention entry, rope_theta and rope_local_base_freq fill the entries' bases.
RopeConfig read_gemma3(const json& config, const json& params, const std::string& source,
                       const RopeConfigDefaults& d) {
  for (const auto& [key, v] : params.items())
    AUTOTP_USER_CHECK(key == "full_attention" || key == "sliding_attention",
                      "{}: rope_parameters.{} is not supported for {} (allowed keys: full_attention, "
                      "sliding_attention, one object per layer type)",
                      source, key, "Gemma 3");
  json full = present(params, "full_attention") ? params["full_attention"] : json{{"rope_type", "default"}};
  if (present(config, "rope_scaling")) {
    AUTOTP_USER_CHECK(config["rope_scaling"].is_object(), "{}: rope_scaling must be an object or null", source);
    log().warn("{}: both rope_parameters and rope_scaling are set; read as transformers 5 does: rope_scaling's keys "
               "are merged into rope_parameters.full_attention",
               source);
    full.update(config["rope_scaling"]);
  }
  const json sliding = present(params, "sliding_attention") ? params["sliding_attention"] : json{{"rope_type", "default"}};
  RopeConfig r;
  r.from_rope_parameters = true;
  const std::string full_path = present(config, "rope_scaling") ? "rope_parameters.full_attention (merged with rope_scaling)"
                                                                : "rope_parameters.full_attention";
  const RopeEntry global = read_entry(full, full_path, source, config, d,
                                      number_at(config, "rope_theta", d.theta, source, "rope_theta"));
  r.theta = global.theta;
  r.scaling = global.scaling;
  const RopeEntry local =
      read_entry(sliding, "rope_parameters.sliding_attention", source, config, d,
                 number_at(config, "rope_local_base_freq", d.local_theta, source, "rope_local_base_freq"));
  AUTOTP_USER_CHECK(local.scaling.type == "default",
                    "{}: rope_parameters.sliding_attention.rope_type '{}' is not supported (allowed: default; "
                    "autotp scales the rotary embedding of Gemma 3's full-attention layers only)",
                    source, local.scaling.type);
  r.local_theta = local.theta;
  return r;
}

}  // namespace

RopeConfig read_rope_config(const json& config, const std::string& source, const RopeConfigDefaults& d) {
  if (!present(config, "rope_parameters")) return read_top_level(config, source, d);
  const json& params = config["rope_parameters"];
  AUTOTP_USER_CHECK(params.is_object(), "{}: rope_parameters must be an object, got {}", source, params.dump());
  if (d.per_layer_type) return read_gemma3(config, params, source, d);
  const double top_theta = number_at(config, "rope_theta", d.theta, source, "rope_theta");
  // transformers 5's convert_rope_params_to_dict: a non-empty rope_scaling replaces rope_parameters.
  json chosen = params;
  std::string path = "rope_parameters";  // what messages name: the object actually read
  if (present(config, "rope_scaling") && !(config["rope_scaling"].is_object() && config["rope_scaling"].empty())) {
    path = "rope_scaling";
    log().warn("{}: both rope_parameters and rope_scaling are set; read as transformers 5 does: rope_scaling "
               "replaces rope_parameters (rope_theta from rope_scaling, else the top-level rope_theta)",
               source);
    chosen = config["rope_scaling"];
    AUTOTP_USER_CHECK(chosen.is_object(), "{}: rope_scaling must be an object or null", source);
  } else if (present(config, "rope_theta") && present(params, "rope_theta") && params["rope_theta"] != config["rope_theta"]) {
    log().warn("{}: rope_theta {} and rope_parameters.rope_theta {} differ; read as transformers 5 does: "
               "rope_parameters.rope_theta",
               source, config["rope_theta"].dump(), params["rope_theta"].dump());
  }
  const std::set<std::string> layer_types = layer_type_names(config);
  std::vector<std::string> nested;
  for (const auto& [key, v] : chosen.items())
    if (layer_types.count(key)) nested.push_back(key);
  RopeConfig r;
  r.from_rope_parameters = true;
  if (nested.empty()) {
    const RopeEntry e = read_entry(chosen, path, source, config, d, top_theta);
    r.theta = e.theta;
    r.scaling = e.scaling;
    return r;
  }
  AUTOTP_USER_CHECK(nested.size() == chosen.size(),
                    "{}: rope_parameters mixes per-layer-type entries ({}) with other keys (allowed: one object per "
                    "layer type, or one object for every layer)",
                    source, fmt::join(nested, ", "));
  // Another architecture's layers rotate alike: the entries must agree.
  std::optional<RopeEntry> first;
  for (const auto& key : nested) {
    RopeEntry e = read_entry(chosen[key], path + "." + key, source, config, d, top_theta);
    if (!first) {
      first = std::move(e);
      continue;
    }
    AUTOTP_USER_CHECK(e.normalized == first->normalized,
                      "{}: rope_parameters.{} differs from rope_parameters.{} (allowed: the same rotary embedding "
                      "for every layer type; autotp rotates layer types differently for Gemma 3 only)",
                      source, key, nested.front());
  }
  r.theta = first->theta;
  r.scaling = first->scaling;
  return r;
}

}  // namespace autotp
