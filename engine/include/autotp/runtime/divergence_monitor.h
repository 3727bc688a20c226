// DivergenceMonitor: watches each step's loss and gradient norm for the signs
// of a run going wrong that are still finite numbers: a loss spike (above
// twice the mean of the last 50 steps) and a gradient norm of exactly 0 (the
// model collapsed to a constant output, e.g. after a far too large learning
// rate). Each condition warns when it starts, not on every step it lasts.
#pragma once
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

namespace autotp {

struct DivergenceOptions {
  int64_t window = 50;          // steps in the running mean of the loss
  int64_t min_history = 5;      // steps seen before a spike can be judged
  double spike_factor = 2.0;    // a loss above this times the running mean is a spike
};

class DivergenceMonitor {
 public:
  explicit DivergenceMonitor(const DivergenceOptions& options = {}) : options_(options) {}
  // The step's numbers (skipped steps are ignored); returns the warnings that start at this step.
  std::vector<std::string> observe(int64_t step, double loss, double grad_norm, bool skipped);

 private:
  DivergenceOptions options_;
  std::deque<double> losses_;
  double sum_ = 0;
  bool spiking_ = false, zero_norm_ = false;
};

}  // namespace autotp
