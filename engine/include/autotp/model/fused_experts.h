// Mixture-of-experts weights in transformers 5's in-memory layout, which a model
// saved with save_original_format=False (or offloaded) holds on disk: each layer's
// experts fused into `mlp.experts.gate_up_proj` [experts, 2 x intermediate, hidden]
// (gate rows first) and `mlp.experts.down_proj` [experts, hidden, intermediate],
// and Mixtral's `block_sparse_moe` renamed `mlp`. The default save (and every 4.x
// one) writes per-expert tensors; autotp's parameters are per expert too, so these
// helpers map one per-expert name onto its slice of the fused tensor.
#pragma once
#include <torch/torch.h>

#include <optional>
#include <string>

#include "autotp/io/safetensors.h"

namespace autotp {

// `name` as transformers 5 names it in memory (Mixtral's block_sparse_moe -> mlp), or
// "" when the same.
std::string transformers5_module_name(const std::string& name);

// Where a per-expert weight (`model.layers.L.<block>.experts.E.<proj>.weight`, proj
// one of w1 / w3 / w2 or gate_proj / up_proj / down_proj) lives in a fused checkpoint.
struct FusedExpertSlice {
  std::string fused_name;  // model.layers.L.mlp.experts.gate_up_proj or .down_proj
  int64_t expert = 0;
  int64_t row_begin = 0;   // gate_up_proj: 0 for gate, intermediate for up
  int64_t rows = 0;        // rows of the expert's matrix (0: all of down_proj's)
};
std::optional<FusedExpertSlice> fused_expert_slice(const io::CheckpointReader& checkpoint, const std::string& name,
                                                   int64_t expert_intermediate_size);

// The whole per-expert tensor (the shape autotp's parameter has), read from the fused one.
torch::Tensor read_fused_expert(const io::CheckpointReader& checkpoint, const FusedExpertSlice& slice,
                                torch::ScalarType dtype);

}  // namespace autotp
