#include "autotp/model/rotary.h"

#include <ATen/Parallel.h>

namespace autotp {
namespace {

// Rounds a float to the kernel's element type, as an ATen op of that dtype rounds its result.
template <typename scalar_t>
inline float rounded(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

// Row r of a 4-D tensor's first three dims (the last dim has stride 1).
inline int64_t row_offset(const torch::Tensor& t, int64_t r) {
  const int64_t d2 = t.size(2), d1 = t.size(1);
  const int64_t i2 = r % d2, i1 = (r / d2) % d1, i0 = r / (d2 * d1);
  return i0 * t.stride(0) + i1 * t.stride(1) + i2 * t.stride(2);
}

// out[i] = in[i] c[i] - in[i + h] s[i], out[i + h] = in[i + h] c[i + h] + in[i] s[i + h] with
// sign = 1 (forward); the backward is the same with sign = -1 and the s terms of the other half:
// g[i] c[i] + g[i + h] s[i + h], g[i + h] c[i + h] - g[i] s[i].
template <typename scalar_t, bool kBackward>
void rotate_rows(const torch::Tensor& in, const torch::Tensor& out, const torch::Tensor& cos,
                 const torch::Tensor& sin) {
  const int64_t rows = in.size(0) * in.size(1) * in.size(2), D = in.size(3), half = D / 2, T = in.size(2);
  const scalar_t* in_data = in.data_ptr<scalar_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  const scalar_t* cos_data = cos.data_ptr<scalar_t>();
  const scalar_t* sin_data = sin.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* x = in_data + row_offset(in, r);
      scalar_t* y = out_data + row_offset(out, r);
      const int64_t t = r % T;
      const scalar_t* c = cos_data + t * D;
      const scalar_t* s = sin_data + t * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
        if (!kBackward) {
          // x * cos + cat(-x2, x1) * sin, each product rounded, then the sum.
          y[i] = static_cast<scalar_t>(rounded<scalar_t>(a * static_cast<float>(c[i])) +
                                       rounded<scalar_t>(-b * static_cast<float>(s[i])));
          y[i + half] = static_cast<scalar_t>(rounded<scalar_t>(b * static_cast<float>(c[i + half])) +
                                              rounded<scalar_t>(a * static_cast<float>(s[i + half])));
        } else {
          // g * cos, plus rotate_half's backward of g * sin.
          y[i] = static_cast<scalar_t>(rounded<scalar_t>(a * static_cast<float>(c[i])) +
                                       rounded<scalar_t>(b * static_cast<float>(s[i + half])));
          y[i + half] = static_cast<scalar_t>(rounded<scalar_t>(b * static_cast<float>(c[i + half])) -
                                              rounded<scalar_t>(a * static_cast<float>(s[i])));
        }
      }
    }
  });
}

template <bool kBackward>
torch::Tensor rotate(const torch::Tensor& in_any, const torch::Tensor& cos, const torch::Tensor& sin) {
  const torch::Tensor in = in_any.stride(-1) == 1 ? in_any : in_any.contiguous();
  torch::Tensor out = at::empty_like(in);  // keeps in's layout ([B, T, H, D] underneath for q and k)
  if (out.stride(-1) != 1) out = at::empty(in.sizes(), in.options());
  if (in.scalar_type() == torch::kFloat32)
    rotate_rows<float, kBackward>(in, out, cos, sin);
  else
    rotate_rows<c10::BFloat16, kBackward>(in, out, cos, sin);
  return out;
}

class Rotary : public torch::autograd::Function<Rotary> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotate<false>(x, cos, sin);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {rotate<true>(grads[0], saved[0], saved[1]), torch::Tensor(), torch::Tensor()};
  }
};

bool fused_applies(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto dtype = x.scalar_type();
  if (!x.device().is_cpu() || x.dim() != 4 || x.size(3) % 2 != 0) return false;
  if (dtype != torch::kFloat32 && dtype != torch::kBFloat16) return false;
  const int64_t T = x.size(2), D = x.size(3);
  for (const auto* table : {&cos, &sin})
    if (table->scalar_type() != dtype || !table->is_contiguous() || table->numel() != T * D ||
        table->size(-1) != D || table->requires_grad())
      return false;
  return true;
}

}  // namespace

torch::Tensor apply_rotary_reference(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  return x * cos + torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1) * sin;
}

torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  if (!fused_applies(x, cos, sin)) return apply_rotary_reference(x, cos, sin);
  return Rotary::apply(x, cos, sin);
}

}  // namespace autotp
