// The sum of squares behind the global gradient norm.
#pragma once
#include <torch/torch.h>

namespace autotp {

// Elements summed per fp64 chunk by masked_sum_of_squares: the only temporaries
// of the norm are 12 bytes per element of one chunk (the masked fp32 values and
// their fp64 copy), never a copy of the whole partition.
constexpr int64_t kGradNormChunk = int64_t{1} << 16;

// sum_i (values_i * mask_i)^2 over 1-D fp32 `values` and `mask` (0 or 1, so the
// masking is exact), accumulated in fp64 chunk by chunk (BLAS dot of each
// chunk). Returns a 1-element fp64 tensor on values' device (no host sync).
torch::Tensor masked_sum_of_squares(const torch::Tensor& values, const torch::Tensor& mask);
// sum_i values_i^2 over 1-D `values` (any float dtype), in fp64 chunk by chunk.
torch::Tensor sum_of_squares(const torch::Tensor& values);

}  // namespace autotp
