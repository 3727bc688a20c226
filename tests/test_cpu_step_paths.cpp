// Paths of the CPU step against plain op compositions, in fp32 and bf16, at odd
// sizes: the gradient norm's hand-written sum of squares, and attention with
// grouped kv heads against the heads selected first (forward and backward).
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "autotp/model/attention.h"
#include "autotp/optim/grad_norm.h"

namespace autotp {
namespace {

struct Run {
  torch::Tensor out;
  std::vector<torch::Tensor> grads;
};

// out = fn(inputs), then out.backward(grad_out): the output and every input's gradient.
template <typename Fn>
Run run(Fn fn, const std::vector<torch::Tensor>& inputs, const torch::Tensor& grad_out_seed) {
  std::vector<torch::Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(t.detach().clone().requires_grad_(true));
  Run r;
  r.out = fn(leaves);
  r.out.backward(grad_out_seed.to(r.out.scalar_type()));
  for (const auto& l : leaves) r.grads.push_back(l.grad());
  r.out = r.out.detach();
  return r;
}

// max |a - b| / max |b|, in fp32.
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  auto a32 = a.to(torch::kFloat32), b32 = b.to(torch::kFloat32);
  const double scale = std::max(b32.abs().max().item<double>(), 1e-30);
  return (a32 - b32).abs().max().item<double>() / scale;
}

// fp32: ~1e-6 of the largest value; bf16: two units in the last place (2^-7).
double tolerance(torch::ScalarType dtype) { return dtype == torch::kFloat32 ? 2e-6 : 1.6e-2; }

class CpuStepPaths : public ::testing::TestWithParam<std::tuple<torch::ScalarType, int64_t>> {
 protected:
  torch::ScalarType dtype() const { return std::get<0>(GetParam()); }
  int64_t tokens() const { return std::get<1>(GetParam()); }
  torch::Tensor randn(std::vector<int64_t> sizes) const {
    return torch::randn(sizes, torch::TensorOptions().dtype(torch::kFloat32)).to(dtype());
  }
};

TEST_P(CpuStepPaths, GroupedKvHeadsMatchIndexSelect) {
  torch::manual_seed(4);
  const int64_t B = 2, T = tokens(), Hq = 6, Hkv = 2, D = 8;
  auto q = randn({B, Hq, T, D}), k = randn({B, Hkv, T, D}), v = randn({B, Hkv, T, D});
  auto grad = randn({B, T, Hq * D});
  const std::vector<int64_t> grouped{0, 0, 0, 1, 1, 1}, identity{0, 1, 2, 3, 4, 5};
  auto index = torch::tensor(grouped);
  auto fused = run([&](const std::vector<torch::Tensor>& in) { return causal_attention(in[0], in[1], in[2], grouped, 0.3); },
                   {q, k, v}, grad);
  auto plain = run(
      [&](const std::vector<torch::Tensor>& in) {
        return causal_attention(in[0], in[1].index_select(1, index), in[2].index_select(1, index), identity, 0.3);
      },
      {q, k, v}, grad);
  EXPECT_TRUE(torch::equal(fused.out, plain.out));
  for (int i = 0; i < 3; ++i) EXPECT_LT(relative_error(fused.grads[i], plain.grads[i]), tolerance(dtype())) << i;
}

INSTANTIATE_TEST_SUITE_P(DtypesAndLengths, CpuStepPaths,
                         ::testing::Combine(::testing::Values(torch::kFloat32, torch::kBFloat16),
                                            ::testing::Values(1, 5, 17, 64)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == torch::kFloat32 ? "f32" : "bf16") +
                                  "_T" + std::to_string(std::get<1>(info.param));
                         });

TEST(SumOfSquares, CpuLoopMatchesFp64Reference) {
  torch::manual_seed(5);
  for (int64_t n : {0, 1, 7, 65536, 65536 * 3 + 5}) {
    auto values = torch::randn({n});
    const double expected = values.to(torch::kFloat64).pow(2).sum().item<double>();
    EXPECT_NEAR(sum_of_squares(values).item<double>(), expected, 1e-12 * std::max(expected, 1.0)) << n;
    auto bf16 = values.to(torch::kBFloat16);
    const double expected16 = bf16.to(torch::kFloat64).pow(2).sum().item<double>();
    EXPECT_NEAR(sum_of_squares(bf16).item<double>(), expected16, 1e-12 * std::max(expected16, 1.0)) << n;
    // The chunks' sums are added in order: the same bits at any thread count.
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    const double one = sum_of_squares(values).item<double>();
    at::set_num_threads(2);
    const double two = sum_of_squares(values).item<double>();
    at::set_num_threads(threads);
    EXPECT_EQ(one, two) << n;
  }
}

}  // namespace
}  // namespace autotp
