#include "autotp/base/bf16_matmul.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "autotp/base/error.h"

namespace autotp {
namespace {

namespace F = torch::nn::functional;

// fp32 elements of one widened slice (4 MiB): bounds what a product holds beyond its operands.
constexpr int64_t kSliceElements = int64_t{1} << 20;

// a [M, K] @ b [K, N], both bf16, as fp32 GEMMs over widened slices, rounded once.
torch::Tensor widened_mm(const torch::Tensor& a, const torch::Tensor& b) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  const auto f32 = torch::kFloat32;
  if (K > M) {  // a long reduction (a weight's gradient over the tokens): accumulate over slices of it
    auto out = torch::zeros({M, N}, a.options().dtype(f32));
    const int64_t step = std::max<int64_t>(1, kSliceElements / std::max({M, N, int64_t{1}}));
    for (int64_t k = 0; k < K; k += step) {
      const int64_t len = std::min(step, K - k);
      out.addmm_(a.narrow(1, k, len).to(f32), b.narrow(0, k, len).to(f32));
    }
    return out.to(torch::kBFloat16);
  }
  auto out = torch::empty({M, N}, a.options());
  const auto b32 = b.to(f32);
  const int64_t step = std::max<int64_t>(1, kSliceElements / std::max({K, N, int64_t{1}}));
  for (int64_t m = 0; m < M; m += step) {
    const int64_t len = std::min(step, M - m);
    out.narrow(0, m, len).copy_(a.narrow(0, m, len).to(f32).mm(b32));
  }
  return out;
}

torch::Tensor widened_matmul(const torch::Tensor& a, const torch::Tensor& b) {
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
  int64_t rows = 1;  // not reshape's -1: ambiguous for an empty a
  for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
  shape.back() = b.size(1);
  return widened_mm(a.reshape({rows, a.size(-1)}), b).view(shape);
}

class WidenedLinear : public torch::autograd::Function<WidenedLinear> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w) {
    ctx->save_for_backward({x, w});
    return widened_matmul(x, w.t());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1];
    const torch::Tensor g = grads[0].reshape({-1, w.size(0)});
    torch::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) gx = widened_mm(g, w).view(x.sizes());
    if (ctx->needs_input_grad(1)) gw = widened_mm(g.t(), x.reshape({-1, x.size(-1)}));
    return {gx, gw};
  }
};

}  // namespace

CpuBf16Gemm parse_cpu_bf16_gemm(const char* value, bool cpu_has_avx512) {
  const std::string mode = value ? value : "auto";
  AUTOTP_USER_CHECK(mode == "auto" || mode == "native" || mode == "fp32",
                    "AUTOTP_CPU_BF16_GEMM={}: allowed values are auto, native, fp32", mode);
  if (mode == "native") return CpuBf16Gemm::kNative;
  if (mode == "fp32") return CpuBf16Gemm::kWidened;
  return cpu_has_avx512 ? CpuBf16Gemm::kNative : CpuBf16Gemm::kWidened;
}

CpuBf16Gemm cpu_bf16_gemm() {
#if defined(__x86_64__) || defined(__i386__)
  // What LibTorch's oneDNN bf16 GEMM asks of the CPU (mkldnn_bf16_device_check).
  static const bool avx512 = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("avx512dq");
#else
  static const bool avx512 = true;  // elsewhere LibTorch's own path
#endif
  static const CpuBf16Gemm mode = parse_cpu_bf16_gemm(std::getenv("AUTOTP_CPU_BF16_GEMM"), avx512);
  return mode;
}

bool widens_bf16(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == torch::kBFloat16 && b.scalar_type() == torch::kBFloat16 && a.device().is_cpu() &&
         b.device().is_cpu() && cpu_bf16_gemm() == CpuBf16Gemm::kWidened;
}

torch::Tensor matmul_nograd(const torch::Tensor& a, const torch::Tensor& b) {
  if (!widens_bf16(a, b)) return torch::matmul(a, b);
  if (b.dim() == 2) return widened_matmul(a, b);
  return torch::matmul(a.to(torch::kFloat32), b.to(torch::kFloat32)).to(a.scalar_type());  // batched: unsliced
}

torch::Tensor linear_product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias) {
  if (!widens_bf16(x, w) || (bias.defined() && bias.scalar_type() != torch::kBFloat16)) return F::linear(x, w, bias);
  auto y = WidenedLinear::apply(x, w);
  return bias.defined() ? y + bias : y;
}

torch::Tensor widened_bf16_matmul(const torch::Tensor& a, const torch::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == torch::kBFloat16 && b.scalar_type() == torch::kBFloat16 && b.dim() == 2,
              "widened_bf16_matmul: bf16 a [..., K] and b [K, N]");
  return widened_matmul(a, b);
}

torch::Tensor widened_bf16_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && w.dim() == 2,
              "widened_bf16_linear: bf16 x [..., K] and w [N, K]");
  return WidenedLinear::apply(x, w);
}

}  // namespace autotp
