// LossScaler: fp16 loss scaling (DeepSpeed's dynamic rules, or a static scale).
// Dynamic: halve on overflow after `hysteresis` overflows, double after
// loss_scale_window clean steps. Off (bf16 / fp32): a scale of 1.
#pragma once
#include <cstdint>

#include "autotp/optim/optim_config.h"

namespace autotp {

// The scaler's state (checkpointed).
struct LossScalerState {
  double loss_scale = 1;
  int64_t good_steps = 0;    // clean steps since the last overflow
  int hysteresis_left = 0;   // overflows still tolerated before the scale halves
};

class LossScaler {
 public:
  explicit LossScaler(const Fp16Config& config);
  // The factor the loss is multiplied by before backward.
  double scale() const { return state_.loss_scale; }
  // After a step's gradient norm is known: adjusts the scale (dynamic scaling only).
  void update(bool overflow);
  const LossScalerState& state() const { return state_; }
  void set_state(const LossScalerState& state) { state_ = state; }

 private:
  Fp16Config config_;
  LossScalerState state_;
};

}  // namespace autotp
