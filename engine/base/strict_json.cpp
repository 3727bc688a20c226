#include "autotp/base/strict_json.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

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

std::string canonical_name(const std::string& name, const std::vector<std::string>& names) {
  for (const auto& n : names)
    if (lowercase(n) == lowercase(name)) return n;
  return "";
}

JsonSection::JsonSection(const json& j, std::string path, std::string source, std::vector<std::string> allowed,
                         const std::string& context)
    : j_(j), path_(std::move(path)), source_(std::move(source)) {
  if (!j_.is_object()) fail("{} must be an object, got {}", path_.empty() ? "the config" : path_, j_.dump());
  for (const auto& item : j_.items()) {
    const std::string& key = item.key();
    if (std::find(allowed.begin(), allowed.end(), key) != allowed.end()) continue;
    std::string suggestion = closest_key(key, allowed);
    if (!suggestion.empty()) fail("unknown key '{}'{} (did you mean '{}'?)", where(key), context, where(suggestion));
    fail("unknown key '{}'{} (allowed: {})", where(key), context, fmt::join(allowed, ", "));
  }
}

JsonSection JsonSection::section(const std::string& key, std::vector<std::string> allowed,
                                 const std::string& context) const {
  static const json kEmpty = json::object();
  return JsonSection(has(key) ? at(key) : kEmpty, where(key), source_, std::move(allowed), context);
}

bool JsonSection::boolean(const std::string& key, bool fallback) const {
  if (!has(key)) return fallback;
  if (!at(key).is_boolean()) wrong_type(key, "true or false");
  return at(key).get<bool>();
}

double JsonSection::number(const std::string& key, double fallback) const {
  if (!has(key)) return fallback;
  if (!at(key).is_number()) wrong_type(key, "a number");
  return at(key).get<double>();
}

int64_t JsonSection::integer(const std::string& key, int64_t fallback) const {
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

std::string JsonSection::string(const std::string& key, const std::string& fallback) const {
  if (!has(key)) return fallback;
  if (!at(key).is_string()) wrong_type(key, "a string");
  return at(key).get<std::string>();
}

void JsonSection::check(bool ok, const std::string& key, const std::string& allowed) const {
  if (ok) return;
  if (!has(key)) fail("{} is missing (allowed: {})", where(key), allowed);
  fail("{} is {} (allowed: {})", where(key), at(key).dump(), allowed);
}

void JsonSection::wrong_type(const std::string& key, const char* expected) const {
  fail("{} must be {}, got {}", where(key), expected, at(key).dump());
}

}  // namespace autotp
