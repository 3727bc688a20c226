// The rotary settings of a config.json in either generation of transformers:
// 4.x writes top-level `rope_theta` and `rope_scaling` (Gemma 3 adds
// `rope_local_base_freq` for its sliding layers, `partial_rotary_factor` sits at
// the top); 5.x writes `rope_parameters`, one object holding rope_type,
// rope_theta, the scaling keys and partial_rotary_factor, or one such object per
// layer type ({"full_attention": {...}, "sliding_attention": {...}}).
// Both are read the way transformers 5.25 reads them (docs/models.md).
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "autotp/arch/rope_scaling.h"

namespace autotp {

struct RopeConfigDefaults {
  double theta = 10000.0;       // the config class's default rope_theta
  double local_theta = 0;       // Gemma 3: sliding layers' default base (0: the model has none)
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  bool per_layer_type = false;  // Gemma 3: full and sliding layers rotate differently
};

struct RopeConfig {
  double theta = 10000.0;
  RopeScaling scaling;          // full-attention layers (every layer but Gemma 3's sliding ones)
  double local_theta = 0;       // Gemma 3: the sliding layers' base, unscaled (0: none)
  bool from_rope_parameters = false;  // read from transformers 5's rope_parameters
};

// Reads the rotary keys of `config`; UserError naming `source` and the key for
// what autotp does not implement (partial rotary embeddings, unknown types,
// scaling on Gemma 3's sliding layers, layer types that rotate differently on
// other architectures). A config holding both forms is read as transformers 5
// reads it, with a warning.
RopeConfig read_rope_config(const nlohmann::json& config, const std::string& source,
                            const RopeConfigDefaults& defaults);

}  // namespace autotp
