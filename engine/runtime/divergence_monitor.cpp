#include "autotp/runtime/divergence_monitor.h"

#include <fmt/format.h>

#include <cmath>

namespace autotp {

std::vector<std::string> DivergenceMonitor::observe(int64_t step, double loss, double grad_norm, bool skipped) {
  std::vector<std::string> warnings;
  if (skipped || !std::isfinite(loss)) return warnings;
  const int64_t seen = static_cast<int64_t>(losses_.size());
  const double mean = seen > 0 ? sum_ / static_cast<double>(seen) : 0;
  const bool spike = seen >= options_.min_history && mean > 0 && loss > options_.spike_factor * mean;
  if (spike && !spiking_)
    warnings.push_back(fmt::format("step {}: loss {:.4f} is above {} times its mean over the last {} steps ({:.4f}): "
                                   "the run may be diverging (lower the learning rate or clip gradients)",
                                   step, loss, options_.spike_factor, seen, mean));
  spiking_ = spike;
  const bool zero = grad_norm == 0;
  if (zero && !zero_norm_)
    warnings.push_back(fmt::format("step {}: the gradient norm is exactly 0: the model no longer learns (e.g. its "
                                   "output collapsed to a constant after a too large learning rate, or every "
                                   "parameter is frozen)",
                                   step));
  zero_norm_ = zero;
  losses_.push_back(loss);
  sum_ += loss;
  if (static_cast<int64_t>(losses_.size()) > options_.window) {
    sum_ -= losses_.front();
    losses_.pop_front();
  }
  return warnings;
}

}  // namespace autotp
