// The sum of squares behind the global gradient norm.
#pragma once
#include <torch/torch.h>

namespace autotp {

// Elements summed per fp64 chunk: the only temporary of the norm is the fp64 copy
// of one chunk (none on CPU for fp32 / bf16), never a copy of the whole partition. Small on CPU, where the chunk stays in cache; large on
// CUDA, where each chunk costs three kernel launches (64 K-element chunks made a
// 7 B model's norm take 2.5 s on an H200: 300 000 launches).
constexpr int64_t kGradNormChunkCpu = int64_t{1} << 16;
constexpr int64_t kGradNormChunkCuda = int64_t{1} << 22;
constexpr int64_t grad_norm_chunk(bool cuda) { return cuda ? kGradNormChunkCuda : kGradNormChunkCpu; }

// sum_i values_i^2 over 1-D `values` (any float dtype), in fp64 chunk by chunk
// (BLAS dot of each chunk's fp64 copy), as a 1-element fp64 tensor on values'
// device (no host sync). On
// CPU for contiguous fp32 / bf16 a hand-written loop squares each chunk in fp64
// without copying it (the chunks in parallel, their sums added in order).
torch::Tensor sum_of_squares(const torch::Tensor& values);

}  // namespace autotp
