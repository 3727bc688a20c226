#include "autotp/optim/optimizer.h"

#include <cmath>

#include "autotp/base/error.h"

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
  begin_step();
  update(0, params, grads_in, lr);
}

void FlatOptimizer::update(int64_t offset, torch::Tensor params, const torch::Tensor& grads_in, double lr) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(step_ > 0, "FlatOptimizer::update before begin_step");
  const int64_t n = params.numel();
  auto slice = [&](const torch::Tensor& state) { return state.narrow(0, offset, n); };
  const double wd = config_.weight_decay;
  if (config_.type == "SGD") {
    torch::Tensor d = wd != 0 ? grads_in.add(params, wd) : grads_in;
    if (momentum_.defined()) {
      auto buf = slice(momentum_);
      if (step_ == 1)
        buf.copy_(d);
      else
        buf.mul_(config_.momentum).add_(d);
      d = buf;
    }
    params.add_(d, -lr);
    return;
  }
  // torch.optim's fused Adam / AdamW kernel (CPU and CUDA): one pass over the
  // partition computing torch.optim's update (decoupled decay for AdamW and
  // DeepSpeed's adam_w_mode, L2 added to the gradient otherwise).
  const bool decoupled = config_.type == "AdamW" || config_.adam_w_mode;
  auto steps = torch::full({}, static_cast<double>(step_),
                           torch::TensorOptions().dtype(torch::kFloat32).device(params.device()));
  const std::vector<torch::Tensor> p{params}, g{grads_in}, m{slice(exp_avg_)}, v{slice(exp_avg_sq_)}, t{steps};
  if (decoupled)
    at::_fused_adamw_(p, g, m, v, {}, t, lr, config_.beta1, config_.beta2, wd, config_.eps, /*amsgrad=*/false,
                      /*maximize=*/false);
  else
    at::_fused_adam_(p, g, m, v, {}, t, lr, config_.beta1, config_.beta2, wd, config_.eps, /*amsgrad=*/false,
                     /*maximize=*/false);
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
