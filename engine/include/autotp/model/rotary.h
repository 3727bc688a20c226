// Rotary position embedding in HF's rotate-half layout, x * cos + rotate_half(x) * sin,
// as one autograd node. On CPU (fp32, bf16) the forward and the backward are one pass
// each over x (LibTorch runs narrow, neg, cat and three arithmetic ops, and as many in
// the backward); every product and sum is rounded to x's dtype as those ops round it,
// so the result equals the op composition bit for bit. Elsewhere (CUDA, other dtypes,
// odd head sizes) it runs the op composition.
#pragma once
#include <torch/torch.h>

namespace autotp {

// x: [B, H, T, D] (any strides with a unit last stride), cos / sin: [1, 1, T, D] or
// [T, D] in x's dtype. No gradient flows to cos and sin.
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// The op composition apply_rotary replaces (the parity tests' reference).
torch::Tensor apply_rotary_reference(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

}  // namespace autotp
