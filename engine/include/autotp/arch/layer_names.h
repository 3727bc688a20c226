// Where a parameter name sits in the architecture: the one rule that reads the
// decoder layer out of an HF name ("model.layers.3.", "transformer.h.3."). ZeRO's
// units (zero_units.h), the tensor-parallel step traffic (tp/tp_traffic.h) and
// the simulator's per-rank shape all call it.
#pragma once
#include <cstdint>
#include <string>

namespace autotp {

struct DecoderLayerName {
  int64_t layer = -1;  // the decoder layer's index, -1 when the name is outside the layers
  std::string within;  // the rest of the name inside the layer, e.g. "self_attn.q_proj.weight"; empty when layer < 0
};

// The first "layers.<i>." or "h.<i>." that starts the name or follows a dot:
//   "model.layers.3.self_attn.q_proj.weight" -> {3, "self_attn.q_proj.weight"}
//   "transformer.h.11.attn.c_attn.weight"    -> {11, "attn.c_attn.weight"}
//   "model.norm.weight"                      -> {-1, ""}
DecoderLayerName decoder_layer_name(const std::string& name);

// decoder_layer_name(name).layer: the decoder layer a parameter name belongs to, or -1.
int64_t decoder_layer_of(const std::string& name);

}  // namespace autotp
