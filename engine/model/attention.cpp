#include "autotp/model/attention.h"

#include <limits>

namespace autotp {

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
  torch::Tensor scores = torch::matmul(q, k_sel.transpose(-1, -2)) * scale;
  auto causal = torch::ones({T, T}, torch::kBool).triu(1);
  scores = scores.masked_fill(causal, -std::numeric_limits<float>::infinity());
  auto probs = torch::softmax(scores, -1, torch::kFloat32).to(q.scalar_type());
  auto out = torch::matmul(probs, v_sel);  // [B, H, T, D]
  return out.transpose(1, 2).reshape({B, T, H * D});
}

}  // namespace autotp
