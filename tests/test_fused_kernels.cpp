// The fused CPU kernels against the op compositions they replace, forward and
// backward, in fp32 and bf16, at shapes with odd sizes and row counts that are not
// multiples of the kernels' blocks: rotary (bit for bit), RMSNorm and SwiGLU (a few
// ulp), the exponential behind SwiGLU, the gradient norm's sum of squares, and the
// grouped kv heads of attention.
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "autotp/base/exp_approx.h"

#include <limits>
#include "autotp/model/attention.h"
#include "autotp/model/rms_norm.h"
#include "autotp/model/rotary.h"
#include "autotp/model/swiglu.h"
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

class FusedKernels : public ::testing::TestWithParam<std::tuple<torch::ScalarType, int64_t>> {
 protected:
  torch::ScalarType dtype() const { return std::get<0>(GetParam()); }
  int64_t tokens() const { return std::get<1>(GetParam()); }
  torch::Tensor randn(std::vector<int64_t> sizes) const {
    return torch::randn(sizes, torch::TensorOptions().dtype(torch::kFloat32)).to(dtype());
  }
};

TEST_P(FusedKernels, RotaryEqualsTheOpCompositionBitForBit) {
  torch::manual_seed(1);
  const int64_t B = 2, T = tokens(), H = 3, D = 10;
  // q as the model has it: [B, H, T, D], a transposed view of the projection's [B, T, H, D].
  auto q = randn({B, T, H, D}).transpose(1, 2);
  auto angles = torch::rand({T, D}) * 6.0;
  auto cos = angles.cos().to(dtype()).view({1, 1, T, D}), sin = angles.sin().to(dtype()).view({1, 1, T, D});
  auto grad = randn({B, H, T, D});
  auto fused = run([&](const std::vector<torch::Tensor>& in) { return apply_rotary(in[0], cos, sin); }, {q}, grad);
  auto plain =
      run([&](const std::vector<torch::Tensor>& in) { return apply_rotary_reference(in[0], cos, sin); }, {q}, grad);
  EXPECT_TRUE(torch::equal(fused.out, plain.out)) << relative_error(fused.out, plain.out);
  EXPECT_TRUE(torch::equal(fused.grads[0], plain.grads[0])) << relative_error(fused.grads[0], plain.grads[0]);
  if (T > 1) {  // the layout SDPA then reads (a length-1 dim's stride is arbitrary)
    EXPECT_EQ(fused.out.strides(), plain.out.strides());
  }
}

TEST_P(FusedKernels, RmsNormMatchesTheOpComposition) {
  torch::manual_seed(2);
  const int64_t D = 37;  // not a multiple of the kernel's eight lanes
  auto x = randn({3, tokens(), D}) * 3.0;
  auto w = (torch::rand({D}) + 0.5).to(dtype());
  auto grad = randn({3, tokens(), D});
  auto fused = run([](const std::vector<torch::Tensor>& in) { return rms_norm(in[0], in[1], 1e-6); }, {x, w}, grad);
  auto plain =
      run([](const std::vector<torch::Tensor>& in) { return rms_norm_reference(in[0], in[1], 1e-6); }, {x, w}, grad);
  EXPECT_LT(relative_error(fused.out, plain.out), tolerance(dtype()));
  EXPECT_LT(relative_error(fused.grads[0], plain.grads[0]), tolerance(dtype()));
  // The weight gradient sums every row: bf16 rounds that sum once, the reference too.
  EXPECT_LT(relative_error(fused.grads[1], plain.grads[1]), tolerance(dtype()));
  EXPECT_EQ(fused.out.scalar_type(), dtype());
  EXPECT_EQ(fused.grads[1].scalar_type(), dtype());
}

TEST_P(FusedKernels, SwigluMatchesTheOpComposition) {
  torch::manual_seed(3);
  auto gate = randn({2, tokens(), 29}) * 4.0, up = randn({2, tokens(), 29});
  auto grad = randn({2, tokens(), 29});
  auto fused = run([](const std::vector<torch::Tensor>& in) { return silu_mul(in[0], in[1]); }, {gate, up}, grad);
  auto plain =
      run([](const std::vector<torch::Tensor>& in) { return silu_mul_reference(in[0], in[1]); }, {gate, up}, grad);
  EXPECT_LT(relative_error(fused.out, plain.out), tolerance(dtype()));
  EXPECT_LT(relative_error(fused.grads[0], plain.grads[0]), tolerance(dtype()));
  EXPECT_LT(relative_error(fused.grads[1], plain.grads[1]), tolerance(dtype()));
}

TEST_P(FusedKernels, GroupedKvHeadsMatchIndexSelect) {
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

INSTANTIATE_TEST_SUITE_P(DtypesAndLengths, FusedKernels,
                         ::testing::Combine(::testing::Values(torch::kFloat32, torch::kBFloat16),
                                            ::testing::Values(1, 5, 17, 64)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == torch::kFloat32 ? "f32" : "bf16") +
                                  "_T" + std::to_string(std::get<1>(info.param));
                         });

TEST(ExpApprox, WithinTwoUlpOfStdExp) {
  double worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.001953125f) {
    const double exact = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::abs(exp_approx(x) - exact) / exact);
  }
  EXPECT_LT(worst, 2.5e-7);  // 2 ulp of float is 2.4e-7 relative at worst
  EXPECT_EQ(exp_approx(-200.0f) < 1e-37f, true);
  EXPECT_TRUE(std::isfinite(exp_approx(200.0f)));
  // NaN stays NaN (a diverged run must still show it), also through the fused SwiGLU.
  EXPECT_TRUE(std::isnan(exp_approx(std::numeric_limits<float>::quiet_NaN())));
  auto gate = torch::ones({64});
  gate[3] = std::numeric_limits<float>::quiet_NaN();
  auto out = silu_mul(gate, torch::ones({64}));
  EXPECT_TRUE(std::isnan(out[3].item<float>()));
  EXPECT_FALSE(std::isnan(out[4].item<float>()));
}

TEST(SumOfSquares, CpuLoopMatchesFp64Reference) {
  torch::manual_seed(5);
  for (int64_t n : {0, 1, 7, 65536, 65536 * 3 + 5}) {
    auto values = torch::randn({n});
    const double expected = values.to(torch::kFloat64).pow(2).sum().item<double>();
    EXPECT_NEAR(sum_of_squares(values).item<double>(), expected, 1e-12 * std::max(expected, 1.0)) << n;
    auto bf16 = values.to(torch::kBFloat16);
    const double expected16 = bf16.to(torch::kFloat64).pow(2).sum().item<double>();
    EXPECT_NEAR(sum_of_squares(bf16).item<double>(), expected16, 1e-12 * std::max(expected16, 1.0)) << n;
  }
}

}  // namespace
}  // namespace autotp
