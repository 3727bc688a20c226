// Runs the built `autotp` binary (path from AUTOTP_CLI, set by ctest) for end-to-end tests.
#pragma once
#include <string>

namespace autotp::test {

struct CliResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs `autotp ARGS` through the shell (arguments are not quoted: keep them simple).
CliResult run_cli(const std::string& args);
std::string read_file(const std::string& path);

}  // namespace autotp::test
