#include "autotp/optim/grad_norm.h"

#include <ATen/Parallel.h>

namespace autotp {
namespace {

// One chunk's sum of squares in fp64, in eight lanes (so that it vectorizes), then the lanes in order.
template <typename scalar_t>
double chunk_sum_of_squares(const scalar_t* x, int64_t n) {
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      const double v = static_cast<double>(static_cast<float>(x[i + k]));
      lanes[k] += v * v;
    }
  for (; i < n; ++i) {
    const double v = static_cast<double>(static_cast<float>(x[i]));
    lanes[0] += v * v;
  }
  double sum = 0;
  for (double lane : lanes) sum += lane;
  return sum;
}

// CPU fp32 / bf16: no fp64 copies; the chunks in parallel, their sums added in order
// (the same result at any thread count).
template <typename scalar_t>
torch::Tensor cpu_sum_of_squares(const torch::Tensor& values) {
  const int64_t n = values.numel(), chunk = kGradNormChunkCpu, chunks = (n + chunk - 1) / chunk;
  std::vector<double> sums(chunks);
  const scalar_t* data = values.data_ptr<scalar_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) sums[c] = chunk_sum_of_squares(data + c * chunk, std::min(chunk, n - c * chunk));
  });
  double total = 0;
  for (double s : sums) total += s;
  return torch::full({1}, total, values.options().dtype(torch::kFloat64));
}

}  // namespace

torch::Tensor sum_of_squares(const torch::Tensor& values) {
  TORCH_CHECK(values.dim() == 1, "sum_of_squares: values must be 1-D, got ", values.sizes());
  torch::NoGradGuard no_grad;
  if (values.device().is_cpu() && values.is_contiguous()) {
    if (values.scalar_type() == torch::kFloat32) return cpu_sum_of_squares<float>(values);
    if (values.scalar_type() == torch::kBFloat16) return cpu_sum_of_squares<c10::BFloat16>(values);
  }
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
