#include "autotp/optim/lr_schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace autotp {
namespace {

// DeepSpeed raises the warmup length to 2 so that log(W) is never 0.
int64_t warmup_length(const SchedulerConfig& s) { return std::max<int64_t>(2, s.warmup_num_steps); }

// The warmup fraction at `iteration` < W: 0 at iteration 0, approaching 1 at W - 1 (log reaches it).
double warmup_gamma(const SchedulerConfig& s, int64_t iteration) {
  const double w = static_cast<double>(warmup_length(s));
  if (s.warmup_type == "linear") return static_cast<double>(iteration) / w;
  TORCH_CHECK(s.warmup_type == "log", "learning_rate: warmup_type '", s.warmup_type,
              "' (allowed: log, linear)");
  return std::log(static_cast<double>(iteration) + 1.0) / std::log(w);
}

}  // namespace

double scheduled_lr(const SchedulerConfig& s, double base_lr, int64_t iteration) {
  if (s.type.empty()) return base_lr;
  TORCH_CHECK(s.type == "WarmupLR" || s.type == "WarmupDecayLR" || s.type == "WarmupCosineLR",
              "scheduled_lr: scheduler type '", s.type,
              "' (allowed: WarmupLR, WarmupDecayLR, WarmupCosineLR)");
  TORCH_CHECK(iteration >= -1, "scheduled_lr: iteration ", iteration, " (allowed: >= -1)");
  const int64_t w = warmup_length(s);
  const double delta = s.warmup_max_lr - s.warmup_min_lr;
  if (s.type == "WarmupLR") {
    if (iteration < 0) return s.warmup_min_lr;
    return s.warmup_min_lr + delta * (iteration < w ? warmup_gamma(s, iteration) : 1.0);
  }
  if (s.type == "WarmupDecayLR") {
    if (iteration < 0) return s.warmup_min_lr;
    if (iteration < w) return s.warmup_min_lr + delta * warmup_gamma(s, iteration);
    const double remaining = static_cast<double>(s.total_num_steps - iteration);
    const double span = std::max(1.0, static_cast<double>(s.total_num_steps - w));
    return s.warmup_min_lr + delta * std::max(0.0, remaining / span);
  }
  // WarmupCosineLR: ratios of the optimizer's lr.
  if (iteration < 0) return 0.0;
  if (iteration < w)
    return base_lr * (s.warmup_min_ratio + (1.0 - s.warmup_min_ratio) * warmup_gamma(s, iteration));
  TORCH_CHECK(s.total_num_steps != w, "scheduled_lr: WarmupCosineLR needs total_num_steps ",
              s.total_num_steps, " != the warmup length ", w);
  const double progress = static_cast<double>(iteration - w + 1) / static_cast<double>(s.total_num_steps - w);
  const double cosine = (1.0 + std::cos(M_PI * progress)) / 2.0;
  return base_lr * std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * cosine);
}

double learning_rate(const SchedulerConfig& s, double base_lr, int64_t step) {
  TORCH_CHECK(step >= 0, "learning_rate: step ", step, " (allowed: >= 0)");
  return scheduled_lr(s, base_lr, step - 1);
}

}  // namespace autotp
