// Runs the built `autotp` binary (path from AUTOTP_CLI, set by ctest) for end-to-end tests.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace autotp::test {

struct CliResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs `autotp ARGS` through the shell (arguments are not quoted: keep them simple).
CliResult run_cli(const std::string& args);
std::string read_file(const std::string& path);
// One JSON value per non-empty line (metrics files).
std::vector<nlohmann::json> read_json_lines(const std::string& path);

}  // namespace autotp::test
