// Optimizer math over one flat fp32 tensor (a ZeRO partition or the whole
// model), following torch.optim exactly (same operation order), so results
// match an independent PyTorch loop bit for bit where the arithmetic allows.
//   AdamW: p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//          p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
//   Adam:  DeepSpeed's Adam = AdamW unless adam_w_mode is false (then g += wd*p)
//   SGD:   d = g + wd*p; buf = momentum*buf + d (buf = d at t=1); p -= lr*buf
#pragma once
#include <torch/torch.h>

#include "autotp/optim/optim_config.h"

namespace autotp {

// Elements of 16-bit gradients the ZeRO step upcasts to fp32 and hands to
// update() at a time (16 MiB of fp32): the update's only temporary. On the CPU
// (unless the optimizer is offloaded, whose pieces the host-to-device copies
// follow) 1 MiB of fp32, so the upcast, unscale and clip are read back from the
// cache rather than from memory.
constexpr int64_t kUpdateChunk = int64_t{1} << 22;
constexpr int64_t kUpdateChunkCpu = int64_t{1} << 18;
constexpr int64_t update_chunk(bool cuda) { return cuda ? kUpdateChunk : kUpdateChunkCpu; }

class FlatOptimizer {
 public:
  // States are fp32 tensors of `numel` elements on `device`.
  FlatOptimizer(const OptimizerConfig& config, int64_t numel, torch::Device device = torch::kCPU);

  // One update of `params` (fp32, in place) with `grads` (fp32) at learning rate lr.
  void step(torch::Tensor& params, const torch::Tensor& grads, double lr);
  // The same in pieces: begin_step() once, then update() for stretches
  // [offset, offset + params.numel()) that together cover the states once.
  void begin_step() { ++step_; }
  void update(int64_t offset, torch::Tensor params, const torch::Tensor& grads, double lr);

  int64_t steps() const { return step_; }
  // State tensors by name ("exp_avg", "exp_avg_sq" or "momentum_buffer"), for checkpoints and memory accounting.
  std::vector<std::pair<std::string, torch::Tensor>> state() const;
  void set_steps(int64_t steps) { step_ = steps; }
  int64_t state_bytes() const;

 private:
  OptimizerConfig config_;
  int64_t step_ = 0;
  torch::Tensor exp_avg_, exp_avg_sq_, momentum_;
};

}  // namespace autotp
