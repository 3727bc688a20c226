// The optimizer's settings: DeepSpeed's "optimizer", "scheduler" and "fp16"
// sections, each read strictly from the config's top object (docs/config.md).
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "autotp/base/strict_json.h"

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

  static OptimizerConfig read(const JsonSection& top);  // top["optimizer"]; defaults when absent
  nlohmann::json to_json() const;                       // the "optimizer" object, every default written
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

  static SchedulerConfig read(const JsonSection& top);  // top["scheduler"]; constant lr when absent
  nlohmann::json to_json() const;                       // the "scheduler" object (type set only)
};

struct Fp16Config {
  bool enabled = false;          // fp16 mixed precision with loss scaling
  double loss_scale = 0;         // 0 = dynamic; > 0 = this static scale
  int initial_scale_power = 16;  // dynamic: the first scale is 2^this
  int loss_scale_window = 1000;  // dynamic: steps without overflow before the scale doubles
  int hysteresis = 2;            // dynamic: overflows tolerated before the scale halves
  double min_loss_scale = 1;     // dynamic: the scale never drops below this

  static Fp16Config read(const JsonSection& top);  // top["fp16"]
  nlohmann::json to_json() const;
};

}  // namespace autotp
