// Reading a JSON file given by the user: one place for the error messages.
#pragma once
#include <nlohmann/json.hpp>

#include <string>

namespace autotp {

// The parsed file; UserError "PATH: cannot open WHAT" or "PATH: invalid JSON (...)".
nlohmann::json read_json_file(const std::string& path, const std::string& what);

}  // namespace autotp
