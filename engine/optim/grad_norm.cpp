#include "autotp/optim/grad_norm.h"

namespace autotp {

torch::Tensor masked_sum_of_squares(const torch::Tensor& values, const torch::Tensor& mask) {
  TORCH_CHECK(values.dim() == 1 && mask.sizes() == values.sizes(), "masked_sum_of_squares: values ",
              values.sizes(), " and mask ", mask.sizes(), " must be 1-D and of one length");
  torch::NoGradGuard no_grad;
  auto sum = torch::zeros({1}, values.options().dtype(torch::kFloat64));
  const int64_t n = values.numel();
  const int64_t chunk_size = grad_norm_chunk(values.is_cuda());
  for (int64_t begin = 0; begin < n; begin += chunk_size) {
    const int64_t length = std::min(chunk_size, n - begin);
    auto owned = (values.narrow(0, begin, length) * mask.narrow(0, begin, length)).to(torch::kFloat64);
    sum.add_(at::dot(owned, owned));
  }
  return sum;
}

torch::Tensor sum_of_squares(const torch::Tensor& values) {
  TORCH_CHECK(values.dim() == 1, "sum_of_squares: values must be 1-D, got ", values.sizes());
  torch::NoGradGuard no_grad;
  auto sum = torch::zeros({1}, values.options().dtype(torch::kFloat64));
  const int64_t n = values.numel();
  const int64_t chunk_size = grad_norm_chunk(values.is_cuda());
  for (int64_t begin = 0; begin < n; begin += chunk_size) {
    auto chunk = values.narrow(0, begin, std::min(chunk_size, n - begin)).to(torch::kFloat64);
    sum.add_(at::dot(chunk, chunk));
  }
  return sum;
}

}  // namespace autotp
