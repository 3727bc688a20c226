// TrainConfig: the training settings, read from a DeepSpeed-style JSON config
// (the same key spellings, so one file serves both). It composes the modules'
// own configs (optim/, zero/, tp/, model/), each of which reads its section
// strictly (base/strict_json.h): an unknown key anywhere, a wrong type or a
// value out of range is a UserError that names the full key path and what is
// allowed (docs/config.md lists every key).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "autotp/lora/lora_config.h"
#include "autotp/model/recompute_config.h"
#include "autotp/optim/optim_config.h"
#include "autotp/tp/expert_parallel.h"
#include "autotp/tp/tp_config.h"
#include "autotp/zero/zero_config.h"

namespace autotp {

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
  ExpertParallelConfig expert_parallel;  // "expert_parallel": DeepSpeed AutoEP's keys (tp/expert_parallel.h)
  ActivationCheckpointingConfig activation_checkpointing;
  LoraConfig lora;  // "lora": PEFT LoraConfig fields (docs/lora.md); enabled when present
  uint64_t seed = 42;                 // data order and any randomness in training
  int64_t steps_per_print = 10;       // log every this many optimizer steps
  bool wall_clock_breakdown = false;  // log per-phase timings
  std::string device = "auto";        // cpu | cuda | auto (cuda when every local rank has a GPU of its own)
  // A non-finite loss or gradient norm (fp32 / bf16): "error" stops training naming the
  // step, rank and first non-finite parameter; "skip" drops the step's update and goes on.
  // fp16 keeps its loss scaler's skipping either way.
  std::string non_finite = "error";
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

}  // namespace autotp
