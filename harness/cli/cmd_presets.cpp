#include <fmt/format.h>

#include <iostream>

#include "autotp/model/presets.h"
#include "cli/cli.h"

namespace autotp::cli {

void register_presets(CLI::App& app) {
  auto* cmd = app.add_subcommand("presets", "List the built-in model presets with their parameter counts");
  cmd->callback([] {
    std::cout << fmt::format("{:<18} {:<20} {:>12}  {}\n", "preset", "architecture", "parameters", "description");
    for (const auto& p : presets()) {
      auto config = ModelConfig::from_json(p.config, "preset:" + p.name);
      std::cout << fmt::format("{:<18} {:<20} {:>12}  {}\n", "preset:" + p.name, config.architecture,
                               count_parameters(config), p.description);
    }
  });
}

}  // namespace autotp::cli
