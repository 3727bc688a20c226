#include <fmt/format.h>
#include <sys/stat.h>

#include <iostream>

#include "autotp/io/safetensors.h"
#include "autotp/model/presets.h"
#include "autotp/base/error.h"
#include "cli/cli.h"

namespace autotp::cli {

void register_init(CLI::App& app) {
  struct Args {
    std::string model, out, dtype = "f32";
    uint64_t seed = 0;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("init", "Write an HF model directory (config.json + model.safetensors) from a preset");
  cmd->add_option("--model", args->model, "Preset (preset:NAME or NAME; see `autotp presets`)")->required();
  cmd->add_option("--out", args->out, "Output directory (created)")->required();
  cmd->add_option("--seed", args->seed, "Seed of the random weights (default 0)");
  cmd->add_option("--dtype", args->dtype, "Weight dtype: f32 or bf16 (default f32)");
  cmd->callback([args] {
    auto source = resolve_model(args->model.rfind("preset:", 0) == 0 ? args->model : "preset:" + args->model);
    auto dtype = parse_dtype(args->dtype);
    AUTOTP_USER_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
                      "--dtype {} is not allowed for init (allowed: f32, bf16)", args->dtype);
    write_model_dir(source, args->out, dtype, args->seed);
    std::cout << fmt::format("wrote {} ({} parameters, {}) to {}\n", source.label,
                             count_parameters(source.config), hf_dtype_name(dtype), args->out);
  });
}

}  // namespace autotp::cli
