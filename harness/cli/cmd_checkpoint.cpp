// `autotp export` and `autotp reshard`: offline work on a saved checkpoint, in one process.
#include <fmt/format.h>

#include <iostream>

#include "autotp/model/presets.h"
#include "autotp/checkpoint/checkpointing.h"
#include "autotp/base/error.h"
#include "cli/cli.h"

namespace autotp::cli {

void register_export(CLI::App& app) {
  struct Args {
    std::string checkpoint, out, dtype, max_shard_size = "0";
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("export", "Write a consolidated HF model directory from a checkpoint");
  cmd->add_option("--checkpoint", args->checkpoint, "Checkpoint root (its latest) or a step_N directory")->required();
  cmd->add_option("--out", args->out, "HF model directory to write (config.json + safetensors)")->required();
  cmd->add_option("--dtype", args->dtype, "bf16, f16 or f32 (default: the training dtype)");
  cmd->add_option("--max-shard-size", args->max_shard_size, "Shard above this size, e.g. 2GB (default: one file)");
  cmd->callback([args] {
    auto ckpt = io::SavedCheckpoint::open(args->checkpoint);
    ckpt.verify();
    ExportOptions options;
    if (!args->dtype.empty()) options.dtype = parse_dtype(args->dtype);
    options.max_shard_bytes = io::parse_byte_size(args->max_shard_size);
    export_hf(ckpt, args->out, options);
    const auto& meta = ckpt.metadata();
    std::cout << fmt::format("exported {} (step {}, saved at tp {}, dp {}, ZeRO stage {}) to {}\n", ckpt.dir(),
                             meta.step, meta.tp, meta.dp, meta.stage, args->out);
  });
}

void register_reshard(CLI::App& app) {
  struct Args {
    std::string checkpoint, out;
    int tp = 1, dp = 1;
    std::optional<int> stage;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("reshard", "Rewrite a checkpoint for another tp / dp size or ZeRO stage");
  cmd->add_option("--checkpoint", args->checkpoint, "Checkpoint root (its latest) or a step_N directory")->required();
  cmd->add_option("--tp", args->tp, "Tensor-parallel size of the new layout")->required()->check(CLI::PositiveNumber);
  cmd->add_option("--dp", args->dp, "Data-parallel size of the new layout")->required()->check(CLI::PositiveNumber);
  cmd->add_option("--stage", args->stage, "ZeRO stage of the new layout (default: the checkpoint's)")
      ->check(CLI::Range(0, 3));
  cmd->add_option("--out", args->out, "New checkpoint root (gets step_N/ and latest)")->required();
  cmd->callback([args] {
    auto ckpt = io::SavedCheckpoint::open(args->checkpoint);
    const int stage = args->stage.value_or(ckpt.metadata().stage);
    const std::string dir = reshard_checkpoint(ckpt, args->tp, args->dp, stage, args->out);
    const auto& meta = ckpt.metadata();
    std::cout << fmt::format("resharded {} (tp {}, dp {}, stage {}) to {} (tp {}, dp {}, stage {})\n", ckpt.dir(),
                             meta.tp, meta.dp, meta.stage, dir, args->tp, args->dp, stage);
  });
}

}  // namespace autotp::cli
