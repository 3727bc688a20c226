#include "autotp/model/rms_norm.h"

namespace autotp {
namespace {

class RmsNorm : public torch::autograd::Function<RmsNorm> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, double eps) {
    auto x32 = x.to(torch::kFloat32);
    auto r = torch::rsqrt(x32.pow(2).mean(-1, true) + eps);
    ctx->save_for_backward({x, weight, r});
    return weight * (x32 * r).to(x.scalar_type());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &weight = saved[1], &r = saved[2];
    const torch::Tensor& g = grad_outputs[0];
    auto x32 = x.to(torch::kFloat32);
    torch::Tensor grad_weight;
    {
      auto normed = (x32 * r).to(x.scalar_type());
      grad_weight = (g * normed).sum_to_size(weight.sizes());
    }
    // Autograd's formulas, with at most two fp32 temporaries of the input's size
    // alive at once (each product is rounded as autograd rounds it).
    auto grad_x = (g * weight).to(torch::kFloat32);                          // through the cast
    auto grad_mean = -0.5 * (grad_x * x32).sum(-1, true) * r.pow(3);          // through r, rsqrt
    grad_x.mul_(r);                                                           // through x32 * r
    grad_x.add_(x32 * ((grad_mean / x32.size(-1)) * 2));                      // mean, pow(2)
    return {grad_x.to(x.scalar_type()), grad_weight, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return RmsNorm::apply(x, weight, eps);
}

torch::Tensor rms_norm_plus_one(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto x32 = x.to(torch::kFloat32);
  auto normed = x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + eps);
  return (normed * (1.0 + weight.to(torch::kFloat32))).to(x.scalar_type());
}

}  // namespace autotp
