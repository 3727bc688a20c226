#include "autotp/optim/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace autotp {

LossScaler::LossScaler(const Fp16Config& config) : config_(config) {
  if (!config_.enabled) return;
  state_.loss_scale = config_.loss_scale > 0 ? config_.loss_scale : std::pow(2.0, config_.initial_scale_power);
  state_.hysteresis_left = config_.hysteresis;
}

void LossScaler::update(bool overflow) {
  if (!config_.enabled || config_.loss_scale != 0) return;
  if (overflow) {
    if (--state_.hysteresis_left <= 0) {
      state_.loss_scale = std::max(state_.loss_scale / 2, config_.min_loss_scale);
      state_.hysteresis_left = config_.hysteresis;
    }
    state_.good_steps = 0;
  } else if (++state_.good_steps % config_.loss_scale_window == 0) {
    state_.loss_scale *= 2;
    state_.hysteresis_left = config_.hysteresis;
  }
}

}  // namespace autotp
