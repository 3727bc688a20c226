// Rotary position embeddings as HF's transformers computes them
// (modeling_rope_utils): the inverse frequencies of the plain rotation and of
// the config.json `rope_scaling` types linear, dynamic (NTK), yarn, llama3 and
// longrope (Phi-3), with the attention factor that scales cos and sin. The same
// fp32 operations in the same order as HF, so the tables match its bit for bit
// on CPU.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace autotp {

// The config.json keys outside `rope_scaling` that its meaning depends on; the
// model config fills them from the top level of config.json.
struct RopeScalingContext {
  // 0: unknown. Otherwise longrope's factor lists are checked to have
  // head_dim / 2 values when the config is read (else at the first table).
  int64_t head_dim = 0;
  // The top-level `original_max_position_embeddings` (Phi3Config has it there);
  // absent: none. Like transformers 5's standardize_rope_params it takes
  // precedence over rope_scaling's key for llama3, yarn and longrope.
  std::optional<int64_t> original_max_position_embeddings;
};

struct RopeScaling {
  std::string type = "default";  // default | linear | dynamic | yarn | llama3 | longrope
  // linear, dynamic, yarn, llama3; longrope: optional, 0 when absent (then
  // max_position_embeddings / the pre-training context).
  double factor = 1;
  // llama3: frequencies between these wavelength bounds are blended.
  double low_freq_factor = 1, high_freq_factor = 4;
  // llama3, yarn and longrope: the pre-training context (0: max_position_embeddings).
  int64_t original_max_positions = 0;
  // yarn and longrope (absent: derived from the factor)
  std::optional<double> attention_factor;
  // yarn
  std::optional<double> mscale, mscale_all_dim;
  double beta_fast = 32, beta_slow = 1;
  bool truncate = true;
  // longrope: per-frequency divisors of the plain inverse frequencies (head_dim / 2
  // each), the long ones for sequences longer than the pre-training context.
  std::vector<double> short_factor, long_factor;

  // The `rope_scaling` value of config.json (null or absent: default). The type
  // comes from "rope_type" or the older "type"; unknown types and keys are a
  // UserError naming `source` and the allowed values. `context` carries the
  // top-level keys rope_scaling depends on (see RopeScalingContext). `path` names the
  // object in messages: "rope_scaling", or a transformers 5 "rope_parameters" entry.
  static RopeScaling from_json(const nlohmann::json& rope_scaling, const std::string& source,
                               const RopeScalingContext& context = {}, const std::string& path = "rope_scaling");
  static const std::vector<std::string>& types();
};

struct RotaryFrequencies {
  torch::Tensor inv_freq;        // fp32 [head_dim / 2]
  double attention_factor = 1;   // multiplies cos and sin (yarn, longrope)
};

// The inverse frequencies for sequences of `seq_len` tokens (positions 0 to
// seq_len - 1). Two types depend on it: dynamic recomputes the base once a
// sequence exceeds max_position_embeddings, and longrope uses long_factor once
// it exceeds the pre-training context (short_factor up to it), as HF's
// dynamic_rope_update does.
RotaryFrequencies rotary_frequencies(const RopeScaling& scaling, double theta, int64_t head_dim,
                                     int64_t max_positions, int64_t seq_len);

}  // namespace autotp
