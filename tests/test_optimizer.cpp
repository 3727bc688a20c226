// FlatOptimizer against torch.optim's update rules written out per element in
// double precision (AdamW, Adam with L2 weight decay, SGD with momentum), over
// several steps with changing gradients and learning rates.
#include <gtest/gtest.h>

#include <cmath>

#include "autotp/optim/optimizer.h"

namespace autotp {
namespace {

struct Reference {
  std::vector<double> p, m, v, buf;
};

// One step of torch.optim.{AdamW, Adam, SGD} (documented algorithms) on every element.
void reference_step(Reference& r, const std::vector<double>& g, const OptimizerConfig& c, double lr, int step) {
  for (size_t i = 0; i < r.p.size(); ++i) {
    double grad = g[i];
    if (c.type == "SGD") {
      if (c.weight_decay != 0) grad += c.weight_decay * r.p[i];
      if (c.momentum != 0) {
        r.buf[i] = step == 1 ? grad : c.momentum * r.buf[i] + grad;
        grad = r.buf[i];
      }
      r.p[i] -= lr * grad;
      continue;
    }
    const bool decoupled = c.type == "AdamW" || c.adam_w_mode;
    if (decoupled)
      r.p[i] *= 1 - lr * c.weight_decay;
    else
      grad += c.weight_decay * r.p[i];
    r.m[i] = c.beta1 * r.m[i] + (1 - c.beta1) * grad;
    r.v[i] = c.beta2 * r.v[i] + (1 - c.beta2) * grad * grad;
    const double m_hat = r.m[i] / (1 - std::pow(c.beta1, step));
    const double v_hat = r.v[i] / (1 - std::pow(c.beta2, step));
    r.p[i] -= lr * m_hat / (std::sqrt(v_hat) + c.eps);
  }
}

std::vector<double> to_vector(const torch::Tensor& t) {
  auto d = t.to(torch::kFloat64).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

void expect_matches_reference(OptimizerConfig config) {
  constexpr int64_t n = 1000;
  torch::manual_seed(1);
  auto params = torch::randn({n});
  FlatOptimizer optimizer(config, n);
  Reference r{to_vector(params), std::vector<double>(n), std::vector<double>(n), std::vector<double>(n)};
  for (int step = 1; step <= 5; ++step) {
    auto grads = torch::randn({n}) * (0.1 * step);
    const double lr = 1e-2 / step;
    optimizer.step(params, grads, lr);
    reference_step(r, to_vector(grads), config, lr, step);
    double worst = 0;
    const auto got = to_vector(params);
    for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(got[i] - r.p[i]) / std::max(std::abs(r.p[i]), 1e-3));
    EXPECT_LT(worst, 2e-6) << config.type << " step " << step;
  }
  EXPECT_EQ(optimizer.steps(), 5);
}

TEST(FlatOptimizer, AdamWMatchesTorchOptimRule) {
  OptimizerConfig c;
  c.type = "AdamW";
  c.weight_decay = 0.1;
  expect_matches_reference(c);
}

TEST(FlatOptimizer, AdamWithL2DecayMatchesTorchOptimRule) {
  OptimizerConfig c;
  c.type = "Adam";
  c.adam_w_mode = false;
  c.weight_decay = 0.1;
  c.beta1 = 0.8;
  c.beta2 = 0.99;
  c.eps = 1e-6;
  expect_matches_reference(c);
}

TEST(FlatOptimizer, SgdWithMomentumMatchesTorchOptimRule) {
  OptimizerConfig c;
  c.type = "SGD";
  c.momentum = 0.9;
  c.weight_decay = 0.01;
  expect_matches_reference(c);
}

}  // namespace
}  // namespace autotp
