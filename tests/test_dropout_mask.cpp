// Layout-independent dropout masks: a rank's block (uneven head segments, a
// micro-batch's rows) is exactly the slice of the full mask, the tensor code
// agrees with the scalar definition (and with hard-coded bits, so a change of
// the function is caught), the keep rate is binomial, and CUDA equals CPU.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "autotp/base/cuda_runtime.h"
#include "autotp/base/device.h"
#include "autotp/base/error.h"
#include "autotp/model/dropout_mask.h"

namespace autotp {
namespace {

const DropoutKey kKey{1234, 7, 3, DropoutSite::kAttentionProbs};

std::vector<DimRanges> whole(const std::vector<int64_t>& sizes) {
  std::vector<DimRanges> dims;
  for (int64_t s : sizes) dims.push_back({s, {}});
  return dims;
}

// '1' for a kept element, '0' for a dropped one, in flat order.
std::string keep_string(const torch::Tensor& mask) {
  auto m = mask.to(torch::kCPU, torch::kFloat32).contiguous().view(-1);
  std::string bits;
  for (int64_t i = 0; i < m.numel(); ++i) bits += m[i].item<float>() != 0.0f ? '1' : '0';
  return bits;
}

TEST(DropoutMask, UnevenBlockIsTheSliceOfTheFullMask) {
  // [samples, heads, positions, head_dim]; this rank holds samples 3..7 (its
  // micro-batch), heads [0, 2) and [5, 7) of 7, and columns 1..4 of the last dim.
  auto options = torch::TensorOptions().dtype(torch::kFloat32);
  auto full = dropout_mask(kKey, 0.3, whole({8, 7, 5, 6}), options);
  ASSERT_EQ(full.sizes(), torch::IntArrayRef({8, 7, 5, 6}));
  std::vector<DimRanges> dims = {{8, {{3, 4}}}, {7, {{0, 2}, {5, 2}}}, {5, {}}, {6, {{1, 3}}}};
  auto local = dropout_mask(kKey, 0.3, dims, options);
  auto heads = torch::tensor(std::vector<int64_t>{0, 1, 5, 6});
  auto expected = full.slice(0, 3, 7).index_select(1, heads).slice(3, 1, 4);
  ASSERT_EQ(local.sizes(), expected.sizes());
  EXPECT_TRUE(torch::equal(local, expected));
  // Segments out of order are held in the order given.
  std::vector<DimRanges> swapped = {{8, {}}, {7, {{5, 2}, {0, 2}}}, {5, {}}, {6, {}}};
  auto swapped_heads = torch::tensor(std::vector<int64_t>{5, 6, 0, 1});
  EXPECT_TRUE(torch::equal(dropout_mask(kKey, 0.3, swapped, options), full.index_select(1, swapped_heads)));
}

TEST(DropoutMask, MicroBatchesTileTheStepMask) {
  auto options = torch::TensorOptions().dtype(torch::kFloat32);
  auto full = dropout_mask(kKey, 0.5, whole({7, 3, 11}), options);
  std::vector<torch::Tensor> parts;
  for (auto [start, length] : {std::pair<int64_t, int64_t>{0, 2}, {2, 3}, {5, 2}})
    parts.push_back(dropout_mask(kKey, 0.5, {{7, {{start, length}}}, {3, {}}, {11, {}}}, options));
  EXPECT_TRUE(torch::equal(torch::cat(parts), full));
}

TEST(DropoutMask, MatchesTheScalarDefinition) {
  const double p = 0.3;
  auto mask = dropout_mask(kKey, p, whole({3, 5, 7}), torch::kFloat32);
  auto bits = keep_string(mask);
  ASSERT_EQ(bits.size(), 105u);
  int kept = 0;
  for (uint64_t i = 0; i < bits.size(); ++i) {
    EXPECT_EQ(bits[i] == '1', dropout_keeps(kKey, p, i)) << "flat index " << i;
    kept += bits[i] == '1';
  }
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, 105);
  // Global indices of 2^32 and more (the high word enters the hash): a block of
  // a huge logical tensor, never materialised.
  const int64_t size = int64_t{1} << 36;
  const int64_t start = (int64_t{5} << 32) + 3;
  auto far = keep_string(dropout_mask(kKey, p, {{size, {{start, 40}}}}, torch::kFloat32));
  for (int64_t i = 0; i < 40; ++i)
    EXPECT_EQ(far[i] == '1', dropout_keeps(kKey, p, static_cast<uint64_t>(start + i)))
        << "index " << start + i;
}

TEST(DropoutMask, GoldenBits) {
  // Hard-coded from an independent implementation of the header's definition:
  // a change here breaks bit-exact resume of every run with dropout.
  EXPECT_EQ(keep_string(dropout_mask(kKey, 0.5, whole({4, 16}), torch::kFloat32)),
            "1001001000001100101110001011001100000110100001000001001100100001");
  const DropoutKey embedding{0xdeadbeefcafef00dULL, 100000, -1, DropoutSite::kEmbedding};
  EXPECT_EQ(keep_string(dropout_mask(embedding, 0.1, whole({64}), torch::kFloat32)),
            "1111111111101011111111001111111111111011111111111111111111111111");
  EXPECT_EQ(keep_string(dropout_mask(embedding, 0.1, {{int64_t{1} << 36, {{int64_t{5} << 32, 32}}}},
                                     torch::kFloat32)),
            "11101111111111111101111111111011");
  EXPECT_TRUE(dropout_keeps(kKey, 0.5, 0));
  EXPECT_FALSE(dropout_keeps(kKey, 0.5, 1));
  EXPECT_FALSE(dropout_keeps(embedding, 0.1, (uint64_t{5} << 32) + 3));
}

TEST(DropoutMask, KeepRateIsBinomial) {
  const int64_t n = 1000000;
  for (double p : {0.1, 0.5}) {
    auto mask = dropout_mask(kKey, p, whole({1000, 1000}), torch::kFloat32);
    const double kept = mask.ne(0).sum().item<double>();
    const double sigma = std::sqrt(n * p * (1 - p));
    EXPECT_LE(std::abs(kept - n * (1 - p)), 5 * sigma) << "p = " << p << ", kept " << kept;
  }
}

TEST(DropoutMask, KeptValueIsExactlyTheScale) {
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (double p : {0.1, 0.3, 0.5}) {
      auto mask = dropout_mask(kKey, p, whole({4, 33, 9}), torch::TensorOptions().dtype(dtype));
      ASSERT_EQ(mask.scalar_type(), dtype);
      const auto scale = torch::full({}, 1.0 / (1.0 - p), torch::TensorOptions().dtype(dtype));
      auto kept = mask.ne(0);
      EXPECT_TRUE(mask.masked_select(kept).eq(scale).all().item<bool>()) << dtype << " p = " << p;
      // The same keep bits in every dtype.
      EXPECT_TRUE(torch::equal(kept, dropout_mask(kKey, p, whole({4, 33, 9}), torch::kFloat64).ne(0)));
    }
  }
}

TEST(DropoutMask, ProbabilityZeroAndOutOfRange) {
  auto ones = dropout_mask(kKey, 0.0, whole({3, 4}), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(ones, torch::ones({3, 4}, torch::kBFloat16)));
  auto x = torch::randn({3, 4});
  EXPECT_TRUE(apply_dropout(x, kKey, 0.0, whole({3, 4})).is_same(x));
  EXPECT_TRUE(dropout_keeps(kKey, 0.0, 17));
  for (double p : {1.0, -0.1, 1.5, std::nan("")}) {
    EXPECT_THROW(dropout_mask(kKey, p, whole({3, 4}), torch::kFloat32), UserError) << p;
    EXPECT_THROW(apply_dropout(x, kKey, p, whole({3, 4})), UserError) << p;
    EXPECT_THROW(dropout_keeps(kKey, p, 0), UserError) << p;
  }
}

TEST(DropoutMask, CallerErrorsAreRejected) {
  EXPECT_THROW(dropout_mask(kKey, 0.1, {{5, {{3, 3}}}}, torch::kFloat32), c10::Error);  // past the end
  EXPECT_THROW(dropout_mask(kKey, 0.1, {{5, {{-1, 2}}}}, torch::kFloat32), c10::Error);
  EXPECT_THROW(apply_dropout(torch::ones({3, 4}), kKey, 0.1, whole({4, 3})), c10::Error);  // wrong shape
}

TEST(DropoutMask, EveryKeyFieldChangesTheMask) {
  auto dims = whole({16, 64});
  auto base = dropout_mask(kKey, 0.5, dims, torch::kFloat32);
  EXPECT_TRUE(torch::equal(base, dropout_mask(kKey, 0.5, dims, torch::kFloat32)));
  DropoutKey seed = kKey, step = kKey, layer = kKey, site = kKey, embedding = kKey;
  seed.seed += 1;
  step.step += 1;
  layer.layer += 1;
  site.site = DropoutSite::kMlpOutput;
  embedding.layer = -1;
  for (const auto& [name, key] : {std::pair<const char*, DropoutKey>{"seed", seed},
                                  {"step", step},
                                  {"layer", layer},
                                  {"site", site},
                                  {"layer -1", embedding}})
    EXPECT_FALSE(torch::equal(base, dropout_mask(key, 0.5, dims, torch::kFloat32))) << name;
  // Seeds differing only in the high word differ too.
  DropoutKey high = kKey;
  high.seed += uint64_t{1} << 32;
  EXPECT_FALSE(torch::equal(base, dropout_mask(high, 0.5, dims, torch::kFloat32)));
}

TEST(DropoutMask, BackwardIsTheMask) {
  std::vector<DimRanges> dims = {{6, {{2, 3}}}, {7, {{0, 2}, {5, 2}}}, {8, {}}};
  auto x = torch::randn({3, 4, 8}, torch::requires_grad());
  auto y = apply_dropout(x, kKey, 0.25, dims);
  auto mask = dropout_mask(kKey, 0.25, dims, torch::kFloat32);
  EXPECT_TRUE(torch::equal(y.detach(), x.detach() * mask));
  auto g = torch::randn({3, 4, 8});
  y.backward(g);
  EXPECT_TRUE(torch::equal(x.grad(), g * mask));
  x.grad().zero_();
  apply_dropout(x, kKey, 0.25, dims).sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), mask));
}

TEST(DropoutMask, CudaEqualsCpu) {
  if (autotp::cuda_device_count() == 0)
    GTEST_SKIP() << "no GPU here (" << autotp::cuda_unavailable_reason() << "): the CPU/CUDA parity is not checked";
  std::vector<DimRanges> dims = {{64, {{8, 24}}}, {7, {{0, 2}, {5, 2}}}, {128, {}}, {64, {}}};
  for (double p : {0.1, 0.5}) {
    auto cpu = dropout_mask(kKey, p, dims, torch::kFloat32);
    auto cuda =
        dropout_mask(kKey, p, dims, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA));
    ASSERT_TRUE(cuda.is_cuda());
    EXPECT_TRUE(torch::equal(cuda.cpu(), cpu)) << "p = " << p;
  }
  const int64_t start = (int64_t{5} << 32) + 3;
  std::vector<DimRanges> far = {{int64_t{1} << 36, {{start, 4096}}}};
  auto cuda =
      dropout_mask(kKey, 0.3, far, torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA));
  EXPECT_TRUE(torch::equal(cuda.cpu(), dropout_mask(kKey, 0.3, far, torch::kBFloat16)));
}

}  // namespace
}  // namespace autotp
