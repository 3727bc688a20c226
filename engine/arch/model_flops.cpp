#include "autotp/arch/model_flops.h"

#include "autotp/arch/param_layout.h"

namespace autotp {

double model_flops_per_token(const ModelConfig& config, int64_t seq_len) {
  double matmul = 0;
  for (const auto& d : describe_parameters(config)) {
    if (d.kind != ParamKind::kLinear && d.kind != ParamKind::kConv1D && d.kind != ParamKind::kLmHead) continue;
    // An expert serves experts_per_token / num_experts of the tokens.
    const bool expert = d.axes[0] == Axis::kExpertIntermediate || d.axes[1] == Axis::kExpertIntermediate;
    matmul += static_cast<double>(d.shape[0]) * d.shape[1] *
              (expert ? static_cast<double>(config.experts_per_token) / config.num_experts : 1.0);
  }
  if (config.tie_word_embeddings) matmul += static_cast<double>(config.vocab_size) * config.hidden_size;
  const double attention_width = static_cast<double>(config.num_heads) * config.head_dim;
  return 6 * matmul + 12.0 * config.num_layers * attention_width * static_cast<double>(seq_len);
}

}  // namespace autotp
