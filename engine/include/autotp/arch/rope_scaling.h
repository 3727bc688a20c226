// Rotary position embeddings as HF's transformers computes them
// (modeling_rope_utils): the inverse frequencies of the plain rotation and of
// the config.json `rope_scaling` types linear, dynamic (NTK), yarn and llama3,
// with the attention factor that scales cos and sin. The same fp32 operations
// in the same order as HF, so the tables match its bit for bit on CPU.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace autotp {

struct RopeScaling {
  std::string type = "default";  // default | linear | dynamic | yarn | llama3
  double factor = 1;             // linear, dynamic, yarn, llama3
  // llama3: frequencies between these wavelength bounds are blended.
  double low_freq_factor = 1, high_freq_factor = 4;
  // llama3 and yarn: the pre-training context (0: max_position_embeddings).
  int64_t original_max_positions = 0;
  // yarn
  std::optional<double> attention_factor, mscale, mscale_all_dim;
  double beta_fast = 32, beta_slow = 1;
  bool truncate = true;

  // The `rope_scaling` value of config.json (null or absent: default). The type
  // comes from "rope_type" or the older "type"; unknown types and keys are a
  // UserError naming `source` and the allowed values.
  static RopeScaling from_json(const nlohmann::json& rope_scaling, const std::string& source);
  static const std::vector<std::string>& types();
};

struct RotaryFrequencies {
  torch::Tensor inv_freq;        // fp32 [head_dim / 2]
  double attention_factor = 1;   // multiplies cos and sin (yarn)
};

// The inverse frequencies for sequences of `seq_len` tokens (dynamic scaling
// depends on it: HF recomputes the base once a sequence exceeds
// max_position_embeddings).
RotaryFrequencies rotary_frequencies(const RopeScaling& scaling, double theta, int64_t head_dim,
                                     int64_t max_positions, int64_t seq_len);

}  // namespace autotp
