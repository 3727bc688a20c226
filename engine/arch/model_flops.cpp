#include "autotp/arch/model_flops.h"

#include "autotp/arch/param_layout.h"

namespace autotp {

double model_flops_per_token(const ModelConfig& config, int64_t seq_len) {
  double matmul = 0;
  for (const auto& d : describe_parameters(config)) {
    if (d.kind == ParamKind::kLinear || d.kind == ParamKind::kConv1D || d.kind == ParamKind::kLmHead)
      matmul += static_cast<double>(d.shape[0]) * d.shape[1];
  }
  if (config.tie_word_embeddings) matmul += static_cast<double>(config.vocab_size) * config.hidden_size;
  const double attention_width = static_cast<double>(config.num_heads) * config.head_dim;
  return 6 * matmul + 12.0 * config.num_layers * attention_width * static_cast<double>(seq_len);
}

}  // namespace autotp
