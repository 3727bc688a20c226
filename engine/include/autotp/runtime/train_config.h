// TrainConfig: the training settings, read from a DeepSpeed-style JSON config
// (the same key spellings, so one file serves both). Parsing is strict: an
// unknown key anywhere, a wrong type or a value out of range is a UserError
// that names the full key path and what is allowed (docs/config.md lists every
// key). Plain values; no thread-safety concerns beyond those of a struct.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "autotp/tp/tp_plan.h"

namespace autotp {

struct OptimizerConfig {
  std::string type = "AdamW";  // AdamW | Adam | SGD (case-insensitive in the file, normalized here)
  double lr = 1e-3;            // base learning rate (the schedules' WarmupLR/WarmupDecayLR ignore it)
  double beta1 = 0.9;          // Adam*: first-moment decay, params.betas[0]
  double beta2 = 0.999;        // Adam*: second-moment decay, params.betas[1]
  double eps = 1e-8;           // Adam*: denominator epsilon
  double weight_decay = 0.0;   // decoupled for AdamW (and Adam with adam_w_mode), L2 otherwise
  bool adam_w_mode = true;  // DeepSpeed's Adam: decoupled decay unless false (then L2 added to the gradient)
  double momentum = 0.0;    // SGD: heavy-ball momentum
};

struct SchedulerConfig {
  std::string type;                 // "" (constant lr) | WarmupLR | WarmupDecayLR | WarmupCosineLR
  double warmup_min_lr = 0;         // WarmupLR, WarmupDecayLR: lr at the start of warmup
  double warmup_max_lr = 1e-3;      // WarmupLR, WarmupDecayLR: lr at the end of warmup
  int64_t warmup_num_steps = 1000;  // all: warmup length (DeepSpeed uses max(2, this))
  std::string warmup_type = "log";  // all: log | linear
  int64_t total_num_steps = 0;      // WarmupDecayLR, WarmupCosineLR: step where the decay ends (required)
  double warmup_min_ratio = 0;      // WarmupCosineLR: lr / optimizer lr at the start of warmup
  double cos_min_ratio = 1e-4;      // WarmupCosineLR: lr / optimizer lr at total_num_steps
};

struct Fp16Config {
  bool enabled = false;          // fp16 mixed precision with loss scaling
  double loss_scale = 0;         // 0 = dynamic; > 0 = this static scale
  int initial_scale_power = 16;  // dynamic: the first scale is 2^this
  int loss_scale_window = 1000;  // dynamic: steps without overflow before the scale doubles
  int hysteresis = 2;            // dynamic: overflows tolerated before the scale halves
  double min_loss_scale = 1;     // dynamic: the scale never drops below this
};

struct ZeroConfig {
  int stage = 0;                                    // 0 (plain data parallel) .. 3
  int64_t reduce_bucket_size = 500000000;           // elements per gradient reduction (all-reduce / reduce-scatter)
  int64_t allgather_bucket_size = 500000000;        // elements per parameter all-gather
  // dp collectives on a background lane, waited before use (docs/memory.md);
  // unset: on when training on CUDA, off on CPU (there the lane competes with
  // compute for the same cores and gains nothing).
  std::optional<bool> overlap_comm;
  bool overlaps(bool cuda) const { return overlap_comm.value_or(cuda); }
  bool contiguous_gradients = true;                 // accepted; buckets are always contiguous copies
  int64_t stage3_prefetch_bucket_size = 50000000;   // > 0: stage 3 gathers the next layer ahead (one use); 0: off
  int64_t stage3_param_persistence_threshold = 100000;  // stage 3: tensors below this many elements stay whole
  bool gather_16bit_weights_on_model_save = false;  // stage 3: also save gathered 16-bit weights
};

struct TensorParallelConfig {
  int autotp_size = 1;                 // ranks per tensor-parallel group; divides the world size
  std::vector<LayerSpec> layer_specs;  // partition_config, via parse_partition_config (tp_plan.h)
};

struct ActivationCheckpointingConfig {
  bool enabled = false;         // recompute something in the backward pass (mode says what)
  std::string mode = "off";     // "off", "full" (whole layers) or "selective" (the attention core)
  std::vector<int64_t> layers;  // full mode: which decoder layers; empty = every layer
};

struct TrainConfig {
  int64_t train_batch_size = 0;                // sequences per optimizer step, all ranks; 0 = derive
  int64_t train_micro_batch_size_per_gpu = 0;  // sequences per forward on one rank; 0 = derive
  int64_t gradient_accumulation_steps = 0;     // micro-batches per optimizer step; 0 = derive
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  double gradient_clipping = 0;  // max global gradient norm; 0 = no clipping
  bool bf16 = false;             // bf16.enabled: bf16 mixed precision
  Fp16Config fp16;
  ZeroConfig zero;
  TensorParallelConfig tensor_parallel;
  ActivationCheckpointingConfig activation_checkpointing;
  uint64_t seed = 42;                 // data order and any randomness in training
  int64_t steps_per_print = 10;       // log every this many optimizer steps
  bool wall_clock_breakdown = false;  // log per-phase timings
  std::string device = "auto";        // cpu | cuda | auto (cuda when every local rank has a GPU of its own)
  nlohmann::json raw;                 // the input as given

  // Errors are UserErrors prefixed with `source` (a file name, or "" for none).
  static TrainConfig from_json(const nlohmann::json& json, const std::string& source);
  static TrainConfig from_file(const std::string& path);

  // Fills the batch triple for a world of `world_size` ranks, in place.
  // dp = world_size / autotp_size (not the world size). Any two of the three
  // determine the third; all three must satisfy train_batch_size ==
  // micro * gas * dp; only micro given -> gas 1; only train_batch_size -> gas 1,
  // micro = tbs / dp. UserErrors spell out the arithmetic. Also checks that
  // autotp_size divides world_size. A second call checks the filled triple.
  void resolve_batch(int world_size);
  int64_t data_parallel_size(int world_size) const { return world_size / tensor_parallel.autotp_size; }

  // The config in DeepSpeed spelling with every default written out (for
  // checkpoints and metrics); from_json(to_json()) gives the same config.
  nlohmann::json to_json() const;
};

// The allowed key nearest to `key` (case-insensitive edit distance), or ""
// when none is near enough to be a plausible typo: the "did you mean" of every
// strict JSON reader (configs, scenario files).
std::string closest_key(const std::string& key, const std::vector<std::string>& allowed);

}  // namespace autotp
