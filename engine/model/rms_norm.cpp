#include "autotp/model/rms_norm.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace autotp {
namespace {

template <typename scalar_t>
inline float rounded(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

// Sum of a[i] * b[i] over a row in eight lanes (so that it vectorizes), then the lanes in order.
template <typename scalar_t>
inline float row_dot(const scalar_t* a, const float* b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) lanes[k] += static_cast<float>(a[i + k]) * b[i + k];
  for (; i < n; ++i) lanes[0] += static_cast<float>(a[i]) * b[i];
  float sum = 0;
  for (float lane : lanes) sum += lane;
  return sum;
}

template <typename scalar_t>
inline float row_sum_of_squares(const scalar_t* x, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      const float v = static_cast<float>(x[i + k]);
      lanes[k] += v * v;
    }
  for (; i < n; ++i) lanes[0] += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  float sum = 0;
  for (float lane : lanes) sum += lane;
  return sum;
}

constexpr int64_t kRowsPerTask = 16;  // also the rows per partial sum of the weight gradient

// y = w * cast(x * r), r = rsqrt(mean(x^2) + eps) per row (fp32), as HF's LlamaRMSNorm.
template <typename scalar_t>
void rms_norm_forward_rows(const scalar_t* x, const scalar_t* w, scalar_t* y, float* r_out, int64_t rows,
                           int64_t D, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* xr = x + row * D;
      scalar_t* yr = y + row * D;
      const float mean = row_sum_of_squares(xr, D) / static_cast<float>(D);
      const float r = 1.0f / std::sqrt(mean + eps);
      r_out[row] = r;
      for (int64_t i = 0; i < D; ++i)
        yr[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * rounded<scalar_t>(static_cast<float>(xr[i]) * r));
    }
  });
}

// Autograd's formulas for the forward above (see the header), one pass per row; the weight
// gradient summed per block of kRowsPerTask rows in fp32, then the blocks in order.
template <typename scalar_t>
void rms_norm_backward_rows(const scalar_t* g, const scalar_t* x, const scalar_t* w, const float* r_in,
                            scalar_t* gx, float* partial_gw, int64_t rows, int64_t D) {
  const int64_t blocks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> grad_normed(D), x32(D);
    for (int64_t block = begin; block < end; ++block) {
      float* gw = partial_gw + block * D;
      for (int64_t row = block * kRowsPerTask; row < std::min(rows, (block + 1) * kRowsPerTask); ++row) {
        const scalar_t* gr = g + row * D;
        const scalar_t* xr = x + row * D;
        const float r = r_in[row];
        for (int64_t i = 0; i < D; ++i) {
          x32[i] = static_cast<float>(xr[i]);
          grad_normed[i] = rounded<scalar_t>(static_cast<float>(gr[i]) * static_cast<float>(w[i]));
          gw[i] += rounded<scalar_t>(static_cast<float>(gr[i]) * rounded<scalar_t>(x32[i] * r));
        }
        const float grad_mean = -0.5f * row_dot(x32.data(), grad_normed.data(), D) * (r * r * r);
        const float c = grad_mean / static_cast<float>(D) * 2.0f;
        scalar_t* out = gx + row * D;
        for (int64_t i = 0; i < D; ++i) out[i] = static_cast<scalar_t>(grad_normed[i] * r + x32[i] * c);
      }
    }
  });
}

bool fused_applies(const torch::Tensor& x, const torch::Tensor& weight) {
  const auto dtype = x.scalar_type();
  return x.device().is_cpu() && (dtype == torch::kFloat32 || dtype == torch::kBFloat16) &&
         weight.scalar_type() == dtype && weight.dim() == 1 && weight.size(0) == x.size(-1) && x.dim() >= 1 &&
         x.size(-1) > 0 && weight.is_contiguous();
}

class RmsNorm : public torch::autograd::Function<RmsNorm> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x_in,
                               const torch::Tensor& weight, double eps) {
    if (!fused_applies(x_in, weight)) {
      auto x32 = x_in.to(torch::kFloat32);
      auto r = torch::rsqrt(x32.pow(2).mean(-1, true) + eps);
      ctx->save_for_backward({x_in, weight, r});
      return weight * (x32 * r).to(x_in.scalar_type());
    }
    const torch::Tensor x = x_in.contiguous();
    const int64_t D = x.size(-1), rows = x.numel() / D;
    auto y = at::empty_like(x);
    std::vector<int64_t> r_shape = x.sizes().vec();
    r_shape.back() = 1;
    auto r = torch::empty(r_shape, x.options().dtype(torch::kFloat32));
    if (x.scalar_type() == torch::kFloat32)
      rms_norm_forward_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(),
                            r.data_ptr<float>(), rows, D, static_cast<float>(eps));
    else
      rms_norm_forward_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                            y.data_ptr<c10::BFloat16>(), r.data_ptr<float>(), rows, D, static_cast<float>(eps));
    ctx->save_for_backward({x, weight, r});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &weight = saved[1], &r = saved[2];
    if (fused_applies(x, weight) && x.is_contiguous()) return fused_backward(x, weight, r, grad_outputs[0]);
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

 private:
  static torch::autograd::variable_list fused_backward(const torch::Tensor& x, const torch::Tensor& weight,
                                                       const torch::Tensor& r, const torch::Tensor& grad_any) {
    const torch::Tensor g = grad_any.contiguous();
    const int64_t D = x.size(-1), rows = x.numel() / D;
    const int64_t blocks = (rows + kRowsPerTask - 1) / kRowsPerTask;
    auto partial = torch::zeros({blocks, D}, x.options().dtype(torch::kFloat32));
    auto grad_x = at::empty_like(x);
    if (x.scalar_type() == torch::kFloat32)
      rms_norm_backward_rows(g.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(),
                             r.data_ptr<float>(), grad_x.data_ptr<float>(), partial.data_ptr<float>(), rows, D);
    else
      rms_norm_backward_rows(g.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                             weight.data_ptr<c10::BFloat16>(), r.data_ptr<float>(),
                             grad_x.data_ptr<c10::BFloat16>(), partial.data_ptr<float>(), rows, D);
    // The blocks in order (not a parallel reduction): the same sum at any thread count.
    auto grad_weight32 = torch::zeros({D}, partial.options());
    float* gw = grad_weight32.data_ptr<float>();
    const float* p = partial.data_ptr<float>();
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t i = 0; i < D; ++i) gw[i] += p[b * D + i];
    return {grad_x, grad_weight32.to(weight.scalar_type()), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return RmsNorm::apply(x, weight, eps);
}

torch::Tensor rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto x32 = x.to(torch::kFloat32);
  return weight * (x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
}

torch::Tensor rms_norm_plus_one(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto x32 = x.to(torch::kFloat32);
  auto normed = x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + eps);
  return (normed * (1.0 + weight.to(torch::kFloat32))).to(x.scalar_type());
}

}  // namespace autotp
