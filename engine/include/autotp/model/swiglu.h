// SwiGLU's gating, silu(gate) * up, as one autograd node. On CPU (fp32, bf16, same
// shapes, contiguous) the forward is one pass writing the product and the backward
// one pass writing both gradients, where LibTorch runs silu, mul and three
// backward ops, and the node saves gate and up only (autograd on the plain ops
// also keeps silu(gate)). Rounded to the dtype where the op composition rounds
// (silu, the product; in the backward each of the three products); the
// exponential is exp_approx (within 2 ulp of LibTorch's), so results agree with
// the composition to a few ulp, not bit for bit. Elsewhere: the op composition.
#pragma once
#include <torch/torch.h>

namespace autotp {

torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up);

// The composition silu_mul replaces (the parity tests' reference).
torch::Tensor silu_mul_reference(const torch::Tensor& gate, const torch::Tensor& up);

}  // namespace autotp
