// The distributed checkpoint format (no pickle). A checkpoint root holds
//   step_<N>/metadata.json          topology, every tensor's ShardSpec, config, step,
//                                   scheduler, sampler, loss scaler, file checksums
//   step_<N>/tp<T>_dp<D>.safetensors  one per rank: its ZeRO partition of the flat
//                                   buffer ("params" in the model dtype, "master_weights"
//                                   in mixed precision, "optimizer.<state>") and
//                                   "rng_state"; at stage 0 only dp 0 holds states
//   step_<N>/experts_ep<E>/         expert parallelism only: the routed experts ep rank E
//                                   holds, as a checkpoint of its own (metadata.json and
//                                   tp<T>_dp<D> files over the expert-data-parallel group);
//                                   the top-level files then hold the other tensors
//   latest                          the newest complete step directory's name
// A step directory is written as .step_<N>.partial and renamed when complete;
// `latest` is written last (temporary name + rename). SavedCheckpoint reads any
// tensor back in any layout from the ShardSpecs, which is what resharding,
// resuming and export are built on. Not thread safe.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "autotp/io/safetensors.h"
#include "autotp/tp/shard_spec.h"
#include "autotp/zero/flat_layout.h"

namespace autotp::io {

// 2: ZeRO partitions cut unit by unit (each tensor records its unit); 1: one
// contiguous partition per rank (still read: every tensor in unit 0).
constexpr int kCheckpointFormatVersion = 2;
constexpr int kOldestCheckpointFormatVersion = 1;
constexpr const char* kCheckpointMetadataFile = "metadata.json";
constexpr const char* kCheckpointLatestFile = "latest";

std::string rank_file_name(int tp_rank, int dp_rank);  // "tp0_dp1.safetensors"
std::string step_dir_name(int64_t step);                // "step_12"

struct CheckpointTensor {
  std::string name;  // HF name
  ShardSpec spec;    // how it is cut over the saved tp size
  int unit = 0;      // its ZeRO unit (zero_units.h) in the saved flat layout
};

struct CheckpointFile {
  std::string name;  // relative to the step directory
  int tp_rank = 0, dp_rank = 0;
  uint32_t crc32 = 0;
  uint64_t bytes = 0;
};

struct CheckpointMetadata {
  int64_t step = 0;
  int tp = 1, dp = 1, stage = 0;
  std::string dtype = "float32";          // model dtype (HF spelling)
  std::vector<CheckpointTensor> tensors;  // model order
  std::vector<std::string> optimizer_states;  // e.g. exp_avg, exp_avg_sq
  std::vector<CheckpointFile> files;
  nlohmann::json model_config;  // HF config.json
  nlohmann::json train_config;  // DeepSpeed-style, every default written out
  nlohmann::json trainer;       // steps, applied_steps, optimizer_steps, scheduler
  nlohmann::json sampler;       // epoch, offset, dataset_size, seed, shuffle (null without data)
  nlohmann::json loss_scaler;   // loss_scale, good_steps, hysteresis_left
  // Expert parallelism: the sub-directories holding each ep rank's experts (empty without).
  std::vector<std::string> expert_parts;

  nlohmann::json to_json() const;
  static CheckpointMetadata from_json(const nlohmann::json& json, const std::string& source);
  // The flat layout of tp rank `tp_rank` (offsets of every tensor, padding, partition).
  FlatLayout layout(int tp_rank) const;
  bool mixed_precision() const { return dtype != "float32"; }
  // Index of the tensor named `name`, or nullopt.
  std::optional<size_t> find(const std::string& name) const;
};

// The tensors a rank file holds for one partition, in file order.
NamedTensors rank_file_tensors(const torch::Tensor& params, const torch::Tensor& master_weights,
                               const std::vector<std::pair<std::string, torch::Tensor>>& optimizer,
                               const torch::Tensor& rng_state);

class SavedCheckpoint {
 public:
  // `path`: a checkpoint root (its `latest` names the step) or one step directory.
  // Parses metadata.json; UserError naming the file when anything is off.
  static SavedCheckpoint open(const std::string& path);

  const std::string& dir() const { return dir_; }
  const CheckpointMetadata& metadata() const { return meta_; }
  // The expert parts (expert parallelism), opened with the checkpoint.
  const std::vector<std::shared_ptr<SavedCheckpoint>>& expert_parts() const { return parts_; }
  // Every tensor's name and whole shape, this checkpoint's and its parts', in `order`
  // (the model's parameter names; names not in it go last).
  std::vector<std::pair<std::string, std::vector<int64_t>>> all_tensors(const std::vector<std::string>& order) const;
  // The whole logical tensor `name` of `state` as fp32, from wherever it is held.
  torch::Tensor read_full(const std::string& name, const std::string& state) const;
  bool holds(const std::string& name) const;
  // The files of the checkpoint and of its parts.
  size_t file_count() const;
  // The problem with file `index` of file_count() (missing, wrong size = truncated,
  // CRC-32 mismatch, unreadable header), or "" when it is intact.
  std::string check_file(size_t index) const;
  // check_file for every file; UserError with the first problem.
  void verify() const;

  // "master" is the fp32 master copy: master_weights in mixed precision, else params.
  // Elements [begin, begin + length) of tp rank `tp_rank`'s flat buffer of `state`, as fp32.
  torch::Tensor read_flat(int tp_rank, const std::string& state, int64_t begin, int64_t length) const;
  // Tensor `index`'s local shard on saved tp rank `tp_rank` / the whole logical tensor, as fp32.
  torch::Tensor read_local(size_t index, int tp_rank, const std::string& state) const;
  torch::Tensor read_full(size_t index, const std::string& state) const;
  // The rng_state saved by global rank `rank` (rank 0's when the checkpoint had fewer ranks).
  torch::Tensor read_rng_state(int rank) const;

  // Elements [begin, end) of the flat buffer of a target layout (`specs`: the
  // target's ShardSpec of every tensor, by name in the target's order) on tp
  // rank `tp_rank`, as fp32; padding is zero. Reads only what it needs.
  torch::Tensor assemble(const std::string& state, const std::vector<std::pair<std::string, const ShardSpec*>>& specs,
                         int tp_rank, const FlatLayout& layout, int64_t begin, int64_t end) const;

 private:
  const SafetensorsFile& file(int tp_rank, int dp_rank) const;
  std::string state_name(const std::string& state) const;
  std::string dir_;
  CheckpointMetadata meta_;
  // The target shard of tensor `name` (cut by `spec` for tp rank `tp_rank`), from
  // this checkpoint or a part; null when neither holds it.
  std::optional<torch::Tensor> shard_of(const std::string& name, const ShardSpec& spec, int tp_rank,
                                        const std::string& state) const;
  std::vector<FlatLayout> layouts_;  // per saved tp rank
  std::vector<std::shared_ptr<SavedCheckpoint>> parts_;
  mutable std::map<std::string, std::shared_ptr<SafetensorsFile>> open_;
};

// Writes metadata.json into `staging` and moves it to `root/step_<N>`
// (replacing an older directory of that name), then points `root/latest` at it.
// `after_metadata` / `after_rename` run between the steps (fault-injection tests).
void commit_checkpoint(const std::string& root, const std::string& staging, const CheckpointMetadata& metadata,
                       const std::function<void()>& after_metadata = {},
                       const std::function<void()>& after_rename = {});
// `root/.step_<N>.partial`: created empty (stale partial saves of any step removed).
std::string prepare_staging(const std::string& root, int64_t step);

}  // namespace autotp::io
