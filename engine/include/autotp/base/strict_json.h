// Strict reading of JSON objects given by the user (training configs, scenario
// files): an unknown key is a UserError with a "did you mean", a wrong type or
// a value out of range names the full key path and what is allowed. Each
// module reads its own config section with these (docs/config.md).
#pragma once
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "autotp/base/error.h"

namespace autotp {

// The allowed key nearest to `key` (case-insensitive edit distance), or ""
// when none is near enough to be a plausible typo.
std::string closest_key(const std::string& key, const std::vector<std::string>& allowed);
// `name` in its canonical spelling among `names` (compared ignoring case); "" when none.
std::string canonical_name(const std::string& name, const std::vector<std::string>& names);

// One JSON object. The constructor rejects keys outside `allowed`; the getters
// check types. Errors are UserErrors "SOURCE: message" naming the key path.
class JsonSection {
 public:
  // `path` is the object's key path ("" for the top), `context` is appended to
  // unknown-key errors (e.g. " for optimizer type SGD").
  JsonSection(const nlohmann::json& j, std::string path, std::string source, std::vector<std::string> allowed,
              const std::string& context = "");

  std::string where(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  bool has(const std::string& key) const { return j_.contains(key); }
  const nlohmann::json& at(const std::string& key) const { return j_.at(key); }

  // The object at `key`, or an empty one when the key is absent.
  JsonSection section(const std::string& key, std::vector<std::string> allowed, const std::string& context = "") const;

  bool boolean(const std::string& key, bool fallback) const;
  double number(const std::string& key, double fallback) const;
  // Integers may be written as integral floats (DeepSpeed configs often say 5e8).
  int64_t integer(const std::string& key, int64_t fallback) const;
  std::string string(const std::string& key, const std::string& fallback) const;

  // A value outside its allowed range: "<path> is <value> (allowed: <allowed>)".
  void check(bool ok, const std::string& key, const std::string& allowed) const;

  template <typename... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) const {
    std::string message = fmt::format(format, std::forward<Args>(args)...);
    throw UserError(source_.empty() ? message : source_ + ": " + message);
  }

 protected:
  // "<path> must be <expected>, got <value>".
  [[noreturn]] void wrong_type(const std::string& key, const char* expected) const;

 private:
  const nlohmann::json& j_;
  std::string path_;
  std::string source_;
};

}  // namespace autotp
