// Causal self-attention over one rank's heads, the one implementation every
// model family uses (and bench_layers measures).
#pragma once
#include <torch/torch.h>

#include <vector>

namespace autotp {

// q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; kv_index[h] = the kv head query head
// h reads (GQA). Scores are q k^T * scale with future positions masked; the
// result is [B, T, Hq * D] in q's dtype. LibTorch's fused
// scaled_dot_product_attention (flash / memory-efficient kernels on CPU and
// CUDA): the [T, T] score matrix is never stored. A `window` > 0 (sliding-window
// attention, HF's sliding_window) also hides keys `window` or more positions back:
// query i reads keys i - window + 1 .. i; SDPA then takes an explicit [T, T] mask.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const std::vector<int64_t>& kv_index, double scale, int64_t window = 0);

// The same computed eagerly (scores and fp32 softmax materialised, as HF's
// "eager" attention): the reference the fused path is tested and benchmarked against.
torch::Tensor causal_attention_eager(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const std::vector<int64_t>& kv_index, double scale, int64_t window = 0);

}  // namespace autotp
