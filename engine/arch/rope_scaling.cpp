#include "autotp/arch/rope_scaling.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "autotp/base/strict_json.h"

namespace autotp {
namespace {

using nlohmann::json;

// The keys each type reads (HF's rope_config_validation lists the same).
std::vector<std::string> keys_of(const std::string& type) {
  std::vector<std::string> keys = {"rope_type", "type"};
  if (type == "default") return keys;
  keys.push_back("factor");
  if (type == "llama3")
    keys.insert(keys.end(), {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
  if (type == "yarn")
    keys.insert(keys.end(), {"original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                             "mscale", "mscale_all_dim", "truncate"});
  if (type == "longrope")
    keys.insert(keys.end(),
                {"short_factor", "long_factor", "attention_factor", "original_max_position_embeddings"});
  return keys;
}

// Python's `number / tensor` is tensor.reciprocal() * number (torch/_tensor.py),
// two roundings where C++'s operator/ has one: HF's tables are made that way.
torch::Tensor rdiv(double number, const torch::Tensor& t) { return t.reciprocal() * number; }

// 2i / dim for i < dim / 2, in fp32.
torch::Tensor rotary_exponents(int64_t dim) {
  return torch::arange(0, dim, 2, torch::kLong).to(torch::kFloat32) / static_cast<double>(dim);
}

// longrope's factor lists hold one divisor per frequency. `where` prefixes the
// message ("SOURCE: " when reading config.json, "" when building the tables).
void check_factor_count(const std::vector<double>& factors, const std::string& key, int64_t head_dim,
                        const std::string& where) {
  AUTOTP_USER_CHECK(static_cast<int64_t>(factors.size()) == head_dim / 2,
                    "{}{} has {} values (expected head_dim / 2 = {})", where, key, factors.size(), head_dim / 2);
}

// short_factor or long_factor: a list of numbers > 0, of head_dim / 2 of them
// when head_dim is known (0: checked when the tables are built).
std::vector<double> factor_list(const JsonSection& section, const char* key, int64_t head_dim,
                                const std::string& source) {
  AUTOTP_USER_CHECK(section.has(key), "{}: {} is missing (needed by type longrope)", source,
                    section.where(key));
  const json& list = section.at(key);
  const bool positive_numbers = list.is_array() && std::all_of(list.begin(), list.end(), [](const json& v) {
                                  return v.is_number() && v.get<double>() > 0;
                                });
  section.check(positive_numbers, key, "a list of numbers > 0");
  std::vector<double> factors;
  for (const json& v : list) factors.push_back(v.get<double>());
  if (head_dim > 0) check_factor_count(factors, section.where(key), head_dim, source + ": ");
  return factors;
}

torch::Tensor scalar(double v) { return torch::tensor(v, torch::kFloat64).to(torch::kFloat32); }

torch::Tensor llama3_inv_freq(const RopeScaling& s, torch::Tensor inv_freq, int64_t max_positions) {
  const double context = static_cast<double>(s.original_max_positions > 0 ? s.original_max_positions : max_positions);
  const double low_freq_wavelen = context / s.low_freq_factor, high_freq_wavelen = context / s.high_freq_factor;
  auto wavelen = rdiv(2 * M_PI, inv_freq);
  auto scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
  auto smooth = (rdiv(context, wavelen) - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  auto smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  auto medium = torch::logical_not(wavelen < high_freq_wavelen).logical_and(torch::logical_not(wavelen > low_freq_wavelen));
  return torch::where(medium, smoothed, scaled);
}

double yarn_mscale(double scale, double mscale = 1) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

RotaryFrequencies yarn(const RopeScaling& s, double theta, int64_t dim, int64_t max_positions) {
  const double context = static_cast<double>(s.original_max_positions > 0 ? s.original_max_positions : max_positions);
  RotaryFrequencies out;
  if (s.attention_factor) {
    out.attention_factor = *s.attention_factor;
  } else if (s.mscale && s.mscale_all_dim && *s.mscale != 0 && *s.mscale_all_dim != 0) {
    out.attention_factor = yarn_mscale(s.factor, *s.mscale) / yarn_mscale(s.factor, *s.mscale_all_dim);
  } else {
    out.attention_factor = yarn_mscale(s.factor);
  }
  // The dimension that turns `rotations` times over the pre-training context.
  auto correction_dim = [&](double rotations) {
    return (static_cast<double>(dim) * std::log(context / (rotations * 2 * M_PI))) / (2 * std::log(theta));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // HF: avoids a zero-width ramp
  auto pos_freqs = torch::pow(theta, rotary_exponents(dim));
  auto extrapolation = rdiv(1.0, pos_freqs);
  auto interpolation = rdiv(1.0, s.factor * pos_freqs);
  auto ramp = torch::clamp((torch::arange(dim / 2, torch::kFloat32) - low) / (high - low), 0, 1);
  auto extrapolation_factor = 1 - ramp;
  out.inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
  return out;
}

// HF's _compute_longrope_parameters as transformers 5 has it, with the choice of
// its dynamic_rope_update: short_factor up to the pre-training context, long_factor
// beyond it (HF builds the long table on the first longer sequence).
RotaryFrequencies longrope(const RopeScaling& s, double theta, int64_t dim, int64_t max_positions,
                           int64_t seq_len) {
  check_factor_count(s.short_factor, "rope_scaling.short_factor", dim, "");
  check_factor_count(s.long_factor, "rope_scaling.long_factor", dim, "");
  const int64_t context = s.original_max_positions > 0 ? s.original_max_positions : max_positions;
  // Without a factor HF takes how far max_position_embeddings extends the context.
  const double factor =
      s.factor > 0 ? s.factor : static_cast<double>(max_positions) / static_cast<double>(context);
  RotaryFrequencies out;
  if (s.attention_factor) {
    out.attention_factor = *s.attention_factor;
  } else {
    out.attention_factor =
        factor <= 1 ? 1.0 : std::sqrt(1 + std::log(factor) / std::log(static_cast<double>(context)));
  }
  const std::vector<double>& divisors = seq_len > context ? s.long_factor : s.short_factor;
  // HF: torch.tensor(list, dtype=float32), each Python float rounded once to fp32.
  auto ext_factors = torch::tensor(divisors, torch::dtype(torch::kFloat64)).to(torch::kFloat32);
  out.inv_freq = rdiv(1.0, ext_factors * torch::pow(theta, rotary_exponents(dim)));
  return out;
}

}  // namespace

const std::vector<std::string>& RopeScaling::types() {
  static const std::vector<std::string> names = {"default", "linear", "dynamic", "yarn", "llama3", "longrope"};
  return names;
}

RopeScaling RopeScaling::from_json(const json& value, const std::string& source,
                                   const RopeScalingContext& context, const std::string& path) {
  RopeScaling s;
  if (value.is_null()) return s;
  if (!value.is_object()) throw UserError(fmt::format("{}: {} must be an object or null", source, path));
  json given = json::object();  // HF writes unset options as null
  for (const auto& [key, v] : value.items())
    if (!v.is_null()) given[key] = v;
  const char* type_key = given.contains("rope_type") ? "rope_type" : "type";
  AUTOTP_USER_CHECK(!given.contains(type_key) || given[type_key].is_string(), "{}: {}.{} must be a string",
                    source, path, type_key);
  const std::string type = given.value(type_key, std::string());
  if (std::find(types().begin(), types().end(), type) == types().end())
    throw UserError(fmt::format("{}: {} type '{}' is not supported (allowed: {})", source, path, type,
                                fmt::join(types(), ", ")));
  s.type = type;
  const JsonSection section(given, path, source, keys_of(type), " for " + path + " type " + type);
  if (type == "default") return s;
  if (type == "longrope") {
    s.factor = section.number("factor", 0);  // optional: 0 derives it from the contexts
    section.check(!section.has("factor") || s.factor > 0, "factor", "a number > 0");
  } else {
    AUTOTP_USER_CHECK(section.has("factor"), "{}: {} is missing (needed by type {})", source,
                      section.where("factor"), type);
    s.factor = section.number("factor", 1);
    section.check(type == "yarn" || type == "llama3" ? s.factor >= 1 : s.factor > 0, "factor",
                  type == "yarn" || type == "llama3" ? "a number >= 1" : "a number > 0");
  }
  s.original_max_positions = section.integer("original_max_position_embeddings", 0);
  section.check(s.original_max_positions >= 0, "original_max_position_embeddings", "a positive integer");
  // transformers 5 (standardize_rope_params) lets a top-level key win, as Phi3Config writes it.
  const bool top_level_context = context.original_max_position_embeddings.has_value() &&
                                 (type == "llama3" || type == "yarn" || type == "longrope");
  if (top_level_context) {
    s.original_max_positions = *context.original_max_position_embeddings;
    AUTOTP_USER_CHECK(s.original_max_positions > 0,
                      "{}: original_max_position_embeddings is {} (allowed: a positive integer)", source,
                      s.original_max_positions);
  }
  if ((type == "yarn" || type == "longrope") && section.has("attention_factor"))
    s.attention_factor = section.number("attention_factor", 1);
  if (type == "llama3") {
    for (const char* key : {"low_freq_factor", "high_freq_factor"})
      AUTOTP_USER_CHECK(section.has(key), "{}: {} is missing (needed by type llama3)", source, section.where(key));
    AUTOTP_USER_CHECK(section.has("original_max_position_embeddings") || top_level_context,
                      "{}: {} is missing (needed by type llama3)", source,
                      section.where("original_max_position_embeddings"));
    s.low_freq_factor = section.number("low_freq_factor", 1);
    s.high_freq_factor = section.number("high_freq_factor", 4);
    section.check(s.high_freq_factor > s.low_freq_factor, "high_freq_factor", "a number > low_freq_factor");
  }
  if (type == "yarn") {
    if (section.has("mscale")) s.mscale = section.number("mscale", 1);
    if (section.has("mscale_all_dim")) s.mscale_all_dim = section.number("mscale_all_dim", 1);
    s.beta_fast = section.number("beta_fast", 32);
    s.beta_slow = section.number("beta_slow", 1);
    s.truncate = section.boolean("truncate", true);
    section.check(s.beta_fast > 0 && s.beta_slow > 0, "beta_fast", "beta_fast and beta_slow > 0");
  }
  if (type == "longrope") {
    s.short_factor = factor_list(section, "short_factor", context.head_dim, source);
    s.long_factor = factor_list(section, "long_factor", context.head_dim, source);
  }
  return s;
}

RotaryFrequencies rotary_frequencies(const RopeScaling& s, double theta, int64_t head_dim, int64_t max_positions,
                                     int64_t seq_len) {
  if (s.type == "yarn") return yarn(s, theta, head_dim, max_positions);
  if (s.type == "longrope") return longrope(s, theta, head_dim, max_positions, seq_len);
  RotaryFrequencies out;
  if (s.type == "dynamic" && seq_len > max_positions) {
    // HF recomputes the base from the sequence length, in fp32 tensors.
    auto base = scalar(theta) * torch::pow(scalar(s.factor) * static_cast<double>(seq_len) /
                                                   static_cast<double>(max_positions) -
                                               (s.factor - 1),
                                           static_cast<double>(head_dim) / static_cast<double>(head_dim - 2));
    out.inv_freq = rdiv(1.0, torch::pow(base, rotary_exponents(head_dim)));
    return out;
  }
  out.inv_freq = rdiv(1.0, torch::pow(theta, rotary_exponents(head_dim)));
  if (s.type == "linear") out.inv_freq = out.inv_freq / s.factor;
  if (s.type == "llama3") out.inv_freq = llama3_inv_freq(s, out.inv_freq, max_positions);
  return out;
}

}  // namespace autotp
