// Causal self-attention over one rank's heads, the one implementation every
// model family uses (and bench_layers measures).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <vector>

namespace autotp {

// What only the eager path computes (both need the [T, T] scores materialised).
struct AttentionExtras {
  double softcap = 0;  // Gemma 2's attn_logit_softcapping: scores = softcap * tanh(scores / softcap), before the mask
  // Applied to the probabilities [B, Hq, T, T] (q's dtype) before they weight v: dropout.
  std::function<torch::Tensor(const torch::Tensor&)> on_probs;
  bool any() const { return softcap > 0 || static_cast<bool>(on_probs); }
};

// q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; kv_index[h] = the kv head query head
// h reads (GQA). Scores are q k^T * scale with future positions masked; the
// result is [B, T, Hq * D] in q's dtype. LibTorch's fused
// scaled_dot_product_attention (flash / memory-efficient kernels on CPU and
// CUDA): the [T, T] score matrix is never stored. A `window` > 0 (sliding-window
// attention, HF's sliding_window) also hides keys `window` or more positions back:
// query i reads keys i - window + 1 .. i; SDPA then takes an explicit [T, T] mask.
// With `extras` (softcapping, dropout), or where eager_attention_core says so, it
// runs causal_attention_eager instead.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const std::vector<int64_t>& kv_index, double scale, int64_t window = 0,
                               const AttentionExtras& extras = {});

// Whether causal_attention computes a core without extras eagerly rather than with
// the flash kernel: bf16 on a CPU whose bf16 GEMMs are native (base/bf16_matmul.h),
// where LibTorch's bf16 flash kernel ran at half the eager chain's speed
// (llama-small's shapes on a Zen 5, forward + backward: 17-18 ms a layer against
// 9), and only while T <= 4 x head_dim, where the [T, T] probabilities the chain
// keeps (fp32 and bf16) stay within 3x what the flash kernel keeps (q, k, v and its
// output). The simulator's memory model asks the same question.
bool eager_attention_core(torch::ScalarType dtype, bool cuda, int64_t T, int64_t head_dim);

// Causal attention of bf16 q, k, v [B, H, T, D] (as many kv heads as query heads)
// computed by LibTorch's fp32 flash kernel, the output [B, H, T, D] rounded to
// bf16: causal_attention takes it without a window on the CPUs where bf16 GEMMs
// are widened (base/bf16_matmul.h). It keeps what the bf16 kernel keeps.
torch::Tensor widened_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       double scale);

// The same computed eagerly (scores and fp32 softmax materialised, as HF's
// "eager" attention): the reference the fused path is tested and benchmarked against.
torch::Tensor causal_attention_eager(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const std::vector<int64_t>& kv_index, double scale, int64_t window = 0,
                                     const AttentionExtras& extras = {});

}  // namespace autotp
