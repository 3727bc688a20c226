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
    auto normed = (x32 * r).to(x.scalar_type());
    auto grad_weight = (g * normed).sum_to_size(weight.sizes());
    auto grad_normed = (g * weight).to(torch::kFloat32);
    auto grad_direct = grad_normed * r;                                    // through x32 * r
    auto grad_r = (grad_normed * x32).sum(-1, true);                       // through r
    auto grad_mean = -0.5 * grad_r * r.pow(3);                             // rsqrt
    auto grad_squares = grad_mean.expand(x32.sizes()) / x32.size(-1);      // mean
    auto grad_x = grad_direct + grad_squares * 2 * x32;                    // pow(2)
    return {grad_x.to(x.scalar_type()), grad_weight, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return RmsNorm::apply(x, weight, eps);
}

}  // namespace autotp
