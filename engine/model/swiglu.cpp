#include "autotp/model/swiglu.h"

#include <ATen/Parallel.h>

#include "autotp/base/exp_approx.h"

namespace autotp {
namespace {

template <typename scalar_t>
inline float rounded(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

constexpr int64_t kGrain = 16384;  // elements per task: keeps small tensors on one thread

template <typename scalar_t>
void silu_mul_forward(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t n) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float g = static_cast<float>(gate[i]);
      const float a = rounded<scalar_t>(g / (1.0f + exp_approx(-g)));
      out[i] = static_cast<scalar_t>(a * static_cast<float>(up[i]));
    }
  });
}

template <typename scalar_t>
void silu_mul_backward(const scalar_t* grad, const scalar_t* gate, const scalar_t* up, scalar_t* grad_gate,
                       scalar_t* grad_up, int64_t n) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float g = static_cast<float>(gate[i]), dy = static_cast<float>(grad[i]);
      const float sig = 1.0f / (1.0f + exp_approx(-g));
      const float a = rounded<scalar_t>(g * sig);
      grad_up[i] = static_cast<scalar_t>(dy * a);
      const float grad_a = rounded<scalar_t>(dy * static_cast<float>(up[i]));
      grad_gate[i] = static_cast<scalar_t>(grad_a * sig * (1.0f + g * (1.0f - sig)));
    }
  });
}

class SiluMul : public torch::autograd::Function<SiluMul> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& up) {
    ctx->save_for_backward({gate, up});
    auto out = at::empty_like(gate, at::MemoryFormat::Contiguous);
    if (gate.scalar_type() == torch::kFloat32)
      silu_mul_forward(gate.data_ptr<float>(), up.data_ptr<float>(), out.data_ptr<float>(), out.numel());
    else
      silu_mul_forward(gate.data_ptr<c10::BFloat16>(), up.data_ptr<c10::BFloat16>(),
                       out.data_ptr<c10::BFloat16>(), out.numel());
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &gate = saved[0], &up = saved[1];
    const torch::Tensor grad = grads[0].contiguous();
    auto grad_gate = at::empty_like(gate), grad_up = at::empty_like(up);
    if (gate.scalar_type() == torch::kFloat32)
      silu_mul_backward(grad.data_ptr<float>(), gate.data_ptr<float>(), up.data_ptr<float>(),
                        grad_gate.data_ptr<float>(), grad_up.data_ptr<float>(), grad.numel());
    else
      silu_mul_backward(grad.data_ptr<c10::BFloat16>(), gate.data_ptr<c10::BFloat16>(),
                        up.data_ptr<c10::BFloat16>(), grad_gate.data_ptr<c10::BFloat16>(),
                        grad_up.data_ptr<c10::BFloat16>(), grad.numel());
    return {grad_gate, grad_up};
  }
};

}  // namespace

torch::Tensor silu_mul_reference(const torch::Tensor& gate, const torch::Tensor& up) {
  return torch::silu(gate) * up;
}

torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  const auto dtype = gate.scalar_type();
  const bool fused = gate.device().is_cpu() && up.device().is_cpu() && up.scalar_type() == dtype &&
                     (dtype == torch::kFloat32 || dtype == torch::kBFloat16) && gate.sizes() == up.sizes() &&
                     gate.is_contiguous() && up.is_contiguous();
  return fused ? SiluMul::apply(gate, up) : silu_mul_reference(gate, up);
}

}  // namespace autotp
