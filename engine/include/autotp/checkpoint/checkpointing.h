// Checkpoints of a Trainer, in the format of autotp/io/dist_checkpoint.h:
// collective save, resume onto any layout (resharding through the ShardSpecs),
// offline resharding, and consolidated HF export (live or from a checkpoint).
// Every function that takes a Trainer is collective: all ranks call it in the
// same order. Not thread safe.
#pragma once
#include <functional>
#include <optional>
#include <string>

#include "autotp/checkpoint/dist_checkpoint.h"
#include "autotp/runtime/trainer.h"

namespace autotp {

// Points in a save where a test's fault hook runs (on every rank).
enum class SavePhase {
  kRankFilePartlyWritten,  // this rank's file has its header and first tensor, not the rest
  kRankFileWritten,        // this rank's file complete, not yet reported to rank 0
  // rank 0 only from here:
  kMetadataWritten,        // metadata.json in the staging directory, not renamed yet
  kRenamed,                // step_<N> in place, `latest` not updated yet
};

struct SaveOptions {
  bool gather_16bit_weights = false;  // also write step_<N>/hf_model: the consolidated model in 16 bits
  // The input model directory: its companion files (tokenizer, chat template,
  // generation_config.json; io::companion_file_names) are kept in step_<N>/model_files/
  // so that an export from the checkpoint is a complete model directory ("" = none).
  std::string model_files_dir;
  std::function<void(SavePhase)> fault_hook;  // tests only; empty in production
};

// Writes root/step_<steps done>/ and then root/latest. Returns the step directory.
std::string save_checkpoint(Trainer& trainer, const std::string& root, const SaveOptions& options = {});

// Restores model states, optimizer, scheduler, loss scaler, sampler and RNG
// from `path` (a root or a step directory) saved at any tp/dp/stage. Checks the
// model's tensors and every file (size, CRC-32) first; UserError naming the file
// on any problem, with nothing changed. Returns the step it resumes after.
int64_t load_checkpoint(Trainer& trainer, const std::string& path);
// The same from an already opened checkpoint (e.g. one checked before the rendezvous).
int64_t load_checkpoint(Trainer& trainer, const io::SavedCheckpoint& checkpoint);

struct ExportOptions {
  std::optional<torch::ScalarType> dtype;  // default: the training dtype
  uint64_t max_shard_bytes = 0;            // 0: one model.safetensors
  bool within_save = false;                // a checkpoint's hf_model/: the phase stays "checkpoint"
  // Companion files (tokenizer, chat template, generation_config.json) copied beside
  // the weights from this directory ("" = none). The checkpoint export takes its
  // step_<N>/model_files/ when this is empty.
  std::string model_files_dir;
};

// The checkpoint's copy of the input's companion files ("" when it has none).
std::string checkpoint_model_files(const io::SavedCheckpoint& checkpoint);

// Consolidated HF model directory from the live trainer (rank 0 writes; every
// rank holds at most one whole tensor at a time). Collective.
void export_hf(Trainer& trainer, const std::string& dir, const ExportOptions& options = {});
// The same from a saved checkpoint, in this process alone.
void export_hf(const io::SavedCheckpoint& checkpoint, const std::string& dir, const ExportOptions& options = {});

// Rewrites a checkpoint for tp x dp ranks at ZeRO `stage` into out_root
// (out_root/step_<N>/ and out_root/latest), in this process alone.
std::string reshard_checkpoint(const io::SavedCheckpoint& checkpoint, int tp, int dp, int stage,
                               const std::string& out_root);

}  // namespace autotp
