// RMSNorm as HF's Llama computes it: normalise in fp32, cast back to the input
// dtype, then scale by the weight. Memory-lean: the backward keeps only the
// input and the fp32 reciprocal RMS of each row (recomputing the normalised
// value), where autograd on the plain ops keeps the fp32 input and both
// normalised values (8 bytes per element in bf16 instead of 2). Its gradients
// are autograd's own formulas in autograd's order.
#pragma once
#include <torch/torch.h>

namespace autotp {

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// Gemma's RMSNorm: normalise and scale by (1 + weight), both in fp32, then cast to
// the input dtype (HF's Gemma2RMSNorm / Gemma3RMSNorm). Plain autograd ops.
torch::Tensor rms_norm_plus_one(const torch::Tensor& x, const torch::Tensor& weight, double eps);

}  // namespace autotp
