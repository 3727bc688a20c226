// Paths of the CPU step against plain op compositions, in fp32 and bf16, at odd
// sizes: the gradient norm's hand-written sum of squares, attention with
// grouped kv heads against the heads selected first (forward and backward), and
// the widened bf16 products and attention (base/bf16_matmul.h) against fp64 and
// fp32 references rounded once, whatever this CPU's own path, and which bf16
// attention core a CPU with native bf16 GEMMs takes.
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "autotp/base/bf16_matmul.h"
#include "autotp/base/error.h"
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

TEST(CpuBf16Gemm, ParsesTheModeStrictly) {
  EXPECT_EQ(parse_cpu_bf16_gemm(nullptr, true), CpuBf16Gemm::kNative);
  EXPECT_EQ(parse_cpu_bf16_gemm(nullptr, false), CpuBf16Gemm::kWidened);
  EXPECT_EQ(parse_cpu_bf16_gemm("auto", false), CpuBf16Gemm::kWidened);
  EXPECT_EQ(parse_cpu_bf16_gemm("native", false), CpuBf16Gemm::kNative);
  EXPECT_EQ(parse_cpu_bf16_gemm("fp32", true), CpuBf16Gemm::kWidened);
  try {
    parse_cpu_bf16_gemm("bf16", false);
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("AUTOTP_CPU_BF16_GEMM=bf16: allowed values are auto, native, fp32"),
              std::string::npos)
        << e.what();
  }
}

// a, rounded from an fp32 sum, within one bf16 unit in the last place of b, the
// exact value rounded (2^-7 of |b|: the two round to neighbours where the exact
// value lies near a midpoint; plus a floor of the products' terms' scale for the
// fp32 sum's own error near 0), and mostly equal to it.
void expect_one_rounding(const torch::Tensor& a, const torch::Tensor& b, double term_scale) {
  ASSERT_EQ(a.sizes(), b.sizes());
  auto a64 = a.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
  auto bound = b64.abs() * std::ldexp(1.0, -7) * 1.001 + term_scale * 1e-6;
  EXPECT_TRUE(((a64 - b64).abs() <= bound).all().item<bool>()) << (a64 - b64).abs().max().item<double>();
  if (a.numel() > 0) {
    EXPECT_GT(a64.eq(b64).to(torch::kFloat64).mean().item<double>(), 0.95);
  }
}

TEST(WidenedBf16, ProductIsTheFp32ProductRoundedOnce) {
  torch::manual_seed(6);
  const auto bf16 = torch::kBFloat16;
  // Rows in slices (3000 x 64 rows, 2048 to a slice), a long reduction in slices
  // (20000 over 16384), a 3-D left operand and a transposed right one, empty ones.
  const std::vector<std::pair<torch::Tensor, torch::Tensor>> cases{
      {torch::randn({3000, 64}).to(bf16), torch::randn({64, 512}).to(bf16)},
      {torch::randn({64, 20000}).to(bf16), torch::randn({20000, 64}).to(bf16)},
      {torch::randn({2, 37, 48}).to(bf16), torch::randn({40, 48}).to(bf16).t()},
      {torch::randn({5, 3}).to(bf16), torch::randn({3, 7}).to(bf16)},
      // An expert no token was routed to, and empty reductions.
      {torch::randn({0, 48}).to(bf16), torch::randn({48, 40}).to(bf16)},
      {torch::randn({40, 0}).to(bf16), torch::randn({0, 48}).to(bf16)},
      {torch::randn({0, 0}).to(bf16), torch::randn({0, 0}).to(bf16)}};
  for (const auto& [a, b] : cases) {
    const auto got = widened_bf16_matmul(a, b);
    EXPECT_EQ(got.scalar_type(), bf16);
    const auto exact = torch::matmul(a.to(torch::kFloat64), b.to(torch::kFloat64));
    expect_one_rounding(got, exact.to(bf16), std::sqrt(static_cast<double>(a.size(-1))));
  }
}

TEST(WidenedBf16, LinearGradientsAreTheFp32OnesRoundedOnce) {
  torch::manual_seed(7);
  const auto bf16 = torch::kBFloat16, f64 = torch::kFloat64;
  auto x = torch::randn({3, 29, 48}).to(bf16).requires_grad_(true);
  auto w = torch::randn({40, 48}).to(bf16).requires_grad_(true);
  auto seed = torch::randn({3, 29, 40});
  auto y = widened_bf16_linear(x, w);
  ASSERT_EQ(y.scalar_type(), bf16);
  (y.to(torch::kFloat32) * seed).sum().backward();
  const auto g = seed.to(bf16).to(f64).reshape({-1, 40});  // the incoming gradient, rounded by the cast's backward
  expect_one_rounding(y.detach(), torch::matmul(x.detach().to(f64), w.detach().to(f64).t()).to(bf16), 7);
  expect_one_rounding(x.grad(), torch::matmul(g, w.detach().to(f64)).view({3, 29, 48}).to(bf16), 7);
  expect_one_rounding(w.grad(), torch::matmul(g.t(), x.detach().to(f64).reshape({-1, 48})).to(bf16), 10);
}

TEST(WidenedBf16, CausalAttentionIsTheFp32KernelRounded) {
  torch::manual_seed(8);
  const auto bf16 = torch::kBFloat16, f32 = torch::kFloat32;
  const int64_t B = 2, H = 3, T = 37, D = 16;
  const double scale = 0.25;
  auto q = torch::randn({B, H, T, D}).to(bf16), k = torch::randn({B, H, T, D}).to(bf16),
       v = torch::randn({B, H, T, D}).to(bf16);
  auto seed = torch::randn({B, H, T, D});
  auto widened = run([&](const std::vector<torch::Tensor>& in) { return widened_causal_attention(in[0], in[1], in[2], scale); },
                     {q, k, v}, seed);
  auto fp32 = run(
      [&](const std::vector<torch::Tensor>& in) {
        return at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, /*is_causal=*/true, scale);
      },
      {q.to(f32), k.to(f32), v.to(f32)}, seed.to(bf16));
  // The forward is LibTorch's fp32 kernel on the same values, rounded once.
  EXPECT_TRUE(torch::equal(widened.out, fp32.out.to(bf16)));
  // The backward reads the bf16 output the bf16 kernel keeps: within bf16's precision of fp32's.
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(widened.grads[i].scalar_type(), bf16);
    EXPECT_LT(relative_error(widened.grads[i], fp32.grads[i]), tolerance(bf16)) << i;
  }
}

TEST(Bf16AttentionCore, EagerOnlyForCpuBf16WithNativeGemmsAndShortSequences) {
  const bool native = cpu_bf16_gemm() == CpuBf16Gemm::kNative;
  EXPECT_EQ(eager_attention_core(torch::kBFloat16, /*cuda=*/false, 256, 64), native);
  EXPECT_EQ(eager_attention_core(torch::kBFloat16, false, 1, 64), native);
  EXPECT_FALSE(eager_attention_core(torch::kBFloat16, false, 257, 64));  // past 4 x head_dim
  EXPECT_FALSE(eager_attention_core(torch::kBFloat16, /*cuda=*/true, 256, 64));
  EXPECT_FALSE(eager_attention_core(torch::kFloat32, false, 256, 64));
  EXPECT_FALSE(eager_attention_core(torch::kFloat16, false, 256, 64));
}

// Whichever core this CPU takes for bf16 (eager with native bf16 GEMMs at short
// sequences, else the flash or widened kernel), with grouped kv heads and a window:
// within bf16's precision of the fp32 computation on the same values, forward and backward
// (measured: at most 0.45% on the output and 0.7% on a gradient, eager core and widened kernel).
TEST(Bf16AttentionCore, MatchesFp32WithinBf16Precision) {
  torch::manual_seed(9);
  const auto bf16 = torch::kBFloat16, f32 = torch::kFloat32;
  const int64_t B = 2, Hq = 4, Hkv = 2, D = 16;
  const std::vector<int64_t> grouped{0, 0, 1, 1};
  for (const auto& [T, window] : std::vector<std::pair<int64_t, int64_t>>{{37, 0}, {64, 0}, {64, 9}, {80, 0}}) {
    auto q = torch::randn({B, Hq, T, D}).to(bf16), k = torch::randn({B, Hkv, T, D}).to(bf16),
         v = torch::randn({B, Hkv, T, D}).to(bf16);
    auto seed = torch::randn({B, T, Hq * D});
    auto core = [&](const std::vector<torch::Tensor>& in) {
      return causal_attention(in[0], in[1], in[2], grouped, 0.25, window);
    };
    auto low = run(core, {q, k, v}, seed);
    auto high = run(core, {q.to(f32), k.to(f32), v.to(f32)}, seed.to(bf16));
    ASSERT_EQ(low.out.scalar_type(), bf16);
    EXPECT_LT(relative_error(low.out, high.out), tolerance(bf16)) << "T " << T << " window " << window;
    for (int i = 0; i < 3; ++i)
      EXPECT_LT(relative_error(low.grads[i], high.grads[i]), tolerance(bf16))
          << "T " << T << " window " << window << " input " << i;
  }
}

}  // namespace
}  // namespace autotp
