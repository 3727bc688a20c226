#include "autotp/model/attention.h"

#include <limits>
#include <map>

namespace autotp {
namespace {

// [T, T]: 0 on and below the diagonal, -inf above (future positions). Built
// once per length and dtype per thread: every layer of every step reuses it.
const torch::Tensor& causal_bias(int64_t T, torch::ScalarType dtype) {
  thread_local std::map<std::pair<int64_t, int>, torch::Tensor> cache;
  auto& bias = cache[{T, static_cast<int>(dtype)}];
  if (!bias.defined()) {
    torch::NoGradGuard no_grad;
    bias = torch::full({T, T}, -std::numeric_limits<float>::infinity(), torch::TensorOptions().dtype(dtype)).triu(1);
  }
  return bias;
}

}  // namespace

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const std::vector<int64_t>& kv_index, double scale) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  bool identity = static_cast<int64_t>(kv_index.size()) == k.size(1);
  for (size_t i = 0; identity && i < kv_index.size(); ++i) identity = kv_index[i] == static_cast<int64_t>(i);
  torch::Tensor k_sel = k, v_sel = v;
  if (!identity) {
    auto index = torch::tensor(kv_index, torch::kLong);
    k_sel = k.index_select(1, index);
    v_sel = v.index_select(1, index);
  }
  // One batched GEMM gives scale * q k^T with the mask already added (no
  // separate scaling and masking passes over the [T, T] scores, forward or backward).
  auto q3 = q.reshape({B * H, T, D}), k3 = k_sel.reshape({B * H, T, D}), v3 = v_sel.reshape({B * H, T, D});
  auto scores = at::baddbmm(causal_bias(T, q.scalar_type()).expand({B * H, T, T}), q3, k3.transpose(1, 2),
                            /*beta=*/1.0, /*alpha=*/scale);
  auto probs = torch::softmax(scores, -1, torch::kFloat32).to(q.scalar_type());
  auto out = torch::bmm(probs, v3).view({B, H, T, D});
  return out.transpose(1, 2).reshape({B, T, H * D});
}

}  // namespace autotp
