// DeepSpeed's learning-rate schedules (deepspeed/runtime/lr_schedules.py:
// WarmupLR, WarmupDecayLR, WarmupCosineLR) as pure functions of the step, so
// a resumed run needs only the step count. Thread-safe (no state).
//
// Step convention, as DeepSpeed's engine runs it: the scheduler is built with
// last_batch_iteration = -1, and scheduler.step() runs after every applied
// optimizer step (not after one skipped for an fp16 overflow). So the
// optimizer's step k (0-based) uses the lr computed for iteration k - 1, and
// step 0 uses the value the constructor sets: warmup_min_lr for WarmupLR and
// WarmupDecayLR, 0 for WarmupCosineLR (its get_lr returns 0 before the first
// step()). With W = max(2, warmup_num_steps), T = total_num_steps and
// gamma(i) = log(i + 1) / log(W) (log warmup) or i / W (linear warmup):
//   WarmupLR        lr(i) = min + (max - min) * (i < W ? gamma(i) : 1)
//   WarmupDecayLR   lr(i) = min + (max - min) * (i < W ? gamma(i) : max(0, (T - i) / max(1, T - W)))
//   WarmupCosineLR  lr(i) = base * (i < W ? r0 + (1 - r0) * gamma(i)
//                                         : max(0, rc + (1 - rc) * c(i)))
//                   c(i) = (1 + cos(pi * (i - W + 1) / (T - W))) / 2
// where min/max = warmup_min_lr/warmup_max_lr, base = the optimizer's lr,
// r0 = warmup_min_ratio, rc = cos_min_ratio. WarmupLR and WarmupDecayLR ignore
// the optimizer's lr, as in DeepSpeed. Past T, WarmupDecayLR stays at min and
// WarmupCosineLR follows the cosine back up (DeepSpeed does not clamp it).
#pragma once
#include <cstdint>

#include "autotp/optim/optim_config.h"

namespace autotp {

// The lr DeepSpeed's scheduler holds once last_batch_iteration == `iteration`
// (-1: freshly built, before any step()). An empty type gives base_lr.
double scheduled_lr(const SchedulerConfig& schedule, double base_lr, int64_t iteration);

// The lr for the optimizer step that follows `step` applied steps (0 for the
// first step): scheduled_lr(schedule, base_lr, step - 1).
double learning_rate(const SchedulerConfig& schedule, double base_lr, int64_t step);

}  // namespace autotp
