#include "autotp/model/attention.h"

#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>

#include <limits>
#include <map>

#include "autotp/base/bf16_matmul.h"

namespace autotp {
namespace {

// [T, T]: 0 where query i reads key j (j <= i, and i - j < window when the
// window is shorter than T), -inf elsewhere. Built once per length, window, dtype
// and device per thread: every layer of every step reuses it.
const torch::Tensor& causal_bias(int64_t T, int64_t window, torch::ScalarType dtype, const torch::Device& device) {
  thread_local std::map<std::tuple<int64_t, int64_t, int, std::string>, torch::Tensor> cache;
  const int64_t w = window > 0 && window < T ? window : 0;
  auto& bias = cache[{T, w, static_cast<int>(dtype), device.str()}];
  if (!bias.defined()) {
    torch::NoGradGuard no_grad;
    const auto options = torch::TensorOptions().dtype(dtype).device(device);
    bias = torch::full({T, T}, -std::numeric_limits<float>::infinity(), options).triu(1);
    if (w > 0) bias = bias + torch::full({T, T}, -std::numeric_limits<float>::infinity(), options).tril(-w);
  }
  return bias;
}

// [T, T] booleans, true where query i reads key j (SDPA's attn_mask).
const torch::Tensor& window_mask(int64_t T, int64_t window, const torch::Device& device) {
  thread_local std::map<std::tuple<int64_t, int64_t, std::string>, torch::Tensor> cache;
  auto& mask = cache[{T, window, device.str()}];
  if (!mask.defined()) {
    torch::NoGradGuard no_grad;
    auto ones = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(device));
    mask = ones.tril(0).logical_and(ones.triu(-(window - 1)));
  }
  return mask;
}

bool is_identity(const std::vector<int64_t>& kv_index, int64_t kv_heads) {
  if (static_cast<int64_t>(kv_index.size()) != kv_heads) return false;
  for (size_t i = 0; i < kv_index.size(); ++i)
    if (kv_index[i] != static_cast<int64_t>(i)) return false;
  return true;
}

// Query head h reads kv head h / (Hq / Hkv): the layout SDPA's enable_gqa serves.
bool is_grouped(const std::vector<int64_t>& kv_index, int64_t kv_heads) {
  const auto heads = static_cast<int64_t>(kv_index.size());
  if (kv_heads == 0 || heads % kv_heads != 0) return false;
  const int64_t group = heads / kv_heads;
  for (int64_t h = 0; h < heads; ++h)
    if (kv_index[h] != h / group) return false;
  return true;
}

// k or v with one head per query head (kv_index picks which).
torch::Tensor select_heads(const torch::Tensor& t, const std::vector<int64_t>& kv_index) {
  return t.index_select(1, torch::tensor(kv_index, torch::TensorOptions().dtype(torch::kLong).device(t.device())));
}

// Causal flash attention on bf16 q, k, v computed in fp32 (bf16_matmul.h: where
// LibTorch's CPU bf16 GEMM is slow, its bf16 flash kernel is too: 440 ms against
// 50 in fp32 for llama-small's backward). It keeps what the bf16 kernel keeps (q,
// k, v and the output in bf16, the fp32 log-sum-exp) and widens them again in the
// backward.
class WidenedCausalAttention : public torch::autograd::Function<WidenedCausalAttention> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, double scale) {
    const auto f32 = torch::kFloat32;
    auto [out, logsumexp] = at::_scaled_dot_product_flash_attention_for_cpu(q.to(f32), k.to(f32), v.to(f32),
                                                                            /*dropout_p=*/0.0, /*is_causal=*/true,
                                                                            /*attn_mask=*/{}, scale);
    out = out.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, out, logsumexp});
    ctx->saved_data["scale"] = scale;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto f32 = torch::kFloat32;
    auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grads[0].to(f32), s[0].to(f32), s[1].to(f32), s[2].to(f32), s[3].to(f32), s[4], /*dropout_p=*/0.0,
        /*is_causal=*/true, /*attn_mask=*/{}, ctx->saved_data["scale"].toDouble());
    const auto dtype = s[0].scalar_type();
    return {gq.to(dtype), gk.to(dtype), gv.to(dtype), torch::Tensor()};
  }
};

}  // namespace

bool eager_attention_core(torch::ScalarType dtype, bool cuda, int64_t T, int64_t head_dim) {
  return !cuda && dtype == torch::kBFloat16 && cpu_bf16_gemm() == CpuBf16Gemm::kNative && T <= 4 * head_dim;
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const std::vector<int64_t>& kv_index, double scale, int64_t window,
                               const AttentionExtras& extras) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  if (extras.any() || eager_attention_core(q.scalar_type(), q.is_cuda(), T, D))
    return causal_attention_eager(q, k, v, kv_index, scale, window, extras);
  torch::Tensor k_sel = k, v_sel = v;
  bool gqa = false;
  if (!is_identity(kv_index, k.size(1))) {
    // CUDA's fused kernels read shared kv heads in place; LibTorch 2.11's CPU
    // enable_gqa path measured slower than expanding the heads first.
    gqa = q.is_cuda() && is_grouped(kv_index, k.size(1));
    if (!gqa) k_sel = select_heads(k, kv_index), v_sel = select_heads(v, kv_index);
  }
  const bool windowed = window > 0 && window < T;
  if (!windowed && !gqa && widens_bf16(q, k_sel) && v_sel.scalar_type() == q.scalar_type())
    return widened_causal_attention(q, k_sel, v_sel, scale).transpose(1, 2).reshape({B, T, H * D});
  auto out = windowed ? at::scaled_dot_product_attention(q, k_sel, v_sel, window_mask(T, window, q.device()),
                                                         /*dropout_p=*/0.0, /*is_causal=*/false, scale, gqa)
                      : at::scaled_dot_product_attention(q, k_sel, v_sel, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                         /*is_causal=*/true, scale, gqa);
  return out.transpose(1, 2).reshape({B, T, H * D});
}

torch::Tensor widened_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       double scale) {
  return WidenedCausalAttention::apply(q, k, v, scale);
}

torch::Tensor causal_attention_eager(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const std::vector<int64_t>& kv_index, double scale, int64_t window,
                                     const AttentionExtras& extras) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  torch::Tensor k_sel = k, v_sel = v;
  if (!is_identity(kv_index, k.size(1))) k_sel = select_heads(k, kv_index), v_sel = select_heads(v, kv_index);
  // One batched GEMM gives scale * q k^T with the mask already added (no
  // separate scaling and masking passes over the [T, T] scores, forward or backward).
  auto q3 = q.reshape({B * H, T, D}), k3 = k_sel.reshape({B * H, T, D}), v3 = v_sel.reshape({B * H, T, D});
  const torch::Tensor& bias = causal_bias(T, window, q.scalar_type(), q.device());
  torch::Tensor scores;
  if (extras.softcap > 0) {  // HF's order: scale, cap, then the mask
    scores = torch::bmm(q3, k3.transpose(1, 2)) * scale;
    scores = torch::tanh(scores / extras.softcap) * extras.softcap + bias;
  } else {
    scores = at::baddbmm(bias.expand({B * H, T, T}), q3, k3.transpose(1, 2), /*beta=*/1.0, /*alpha=*/scale);
  }
  auto probs = torch::softmax(scores, -1, torch::kFloat32).to(q.scalar_type());
  if (extras.on_probs) probs = extras.on_probs(probs.view({B, H, T, T})).reshape({B * H, T, T});
  auto out = torch::bmm(probs, v3).view({B, H, T, D});
  return out.transpose(1, 2).reshape({B, T, H * D});
}

}  // namespace autotp
