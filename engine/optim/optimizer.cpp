#include "autotp/optim/optimizer.h"

#include <cmath>

#include "autotp/runtime/error.h"

namespace autotp {

FlatOptimizer::FlatOptimizer(const OptimizerConfig& config, int64_t numel, torch::Device device) : config_(config) {
  const auto fp32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  if (config_.type == "SGD") {
    if (config_.momentum != 0) momentum_ = torch::zeros({numel}, fp32);
  } else if (config_.type == "AdamW" || config_.type == "Adam") {
    exp_avg_ = torch::zeros({numel}, fp32);
    exp_avg_sq_ = torch::zeros({numel}, fp32);
  } else {
    throw_user_error("optimizer.type '{}' is not supported (allowed: AdamW, Adam, SGD)", config_.type);
  }
}

void FlatOptimizer::step(torch::Tensor& params, const torch::Tensor& grads_in, double lr) {
  torch::NoGradGuard no_grad;
  ++step_;
  const double wd = config_.weight_decay;
  if (config_.type == "SGD") {
    torch::Tensor d = wd != 0 ? grads_in.add(params, wd) : grads_in;
    if (momentum_.defined()) {
      if (step_ == 1)
        momentum_.copy_(d);
      else
        momentum_.mul_(config_.momentum).add_(d);
      d = momentum_;
    }
    params.add_(d, -lr);
    return;
  }
  torch::Tensor grads = grads_in;
  bool decoupled = config_.type == "AdamW" || config_.adam_w_mode;
  if (decoupled)
    params.mul_(1 - lr * wd);
  else if (wd != 0)
    grads = grads_in.add(params, wd);
  const double b1 = config_.beta1, b2 = config_.beta2;
  exp_avg_.mul_(b1).add_(grads, 1 - b1);
  exp_avg_sq_.mul_(b2).addcmul_(grads, grads, 1 - b2);
  const double bias_correction1 = 1 - std::pow(b1, static_cast<double>(step_));
  const double bias_correction2 = 1 - std::pow(b2, static_cast<double>(step_));
  const double step_size = lr / bias_correction1;
  auto denom = (exp_avg_sq_.sqrt() / std::sqrt(bias_correction2)).add_(config_.eps);
  params.addcdiv_(exp_avg_, denom, -step_size);
}

std::vector<std::pair<std::string, torch::Tensor>> FlatOptimizer::state() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  if (exp_avg_.defined()) out.emplace_back("exp_avg", exp_avg_);
  if (exp_avg_sq_.defined()) out.emplace_back("exp_avg_sq", exp_avg_sq_);
  if (momentum_.defined()) out.emplace_back("momentum_buffer", momentum_);
  return out;
}

int64_t FlatOptimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& [name, t] : state()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  return bytes;
}

}  // namespace autotp
