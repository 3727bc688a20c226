// What one tensor-parallel rank holds and computes, read from the engine's own
// TpPlan / ShardSpec (never re-derived; with expert parallelism the plan placed
// for one ep rank): parameter elements in total, per
// decoder layer and outside the layers, the local widths of every linear, local
// query / kv heads, intermediate and vocab widths, and the parameters whose kv
// slices are shared by several tp ranks (their gradients are summed over tp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "autotp/arch/model_config.h"
#include "autotp/tp/tp_plan.h"
#include "autotp/tp/tp_traffic.h"

namespace autotp::sim {

struct LocalLinear {
  std::string name;        // module suffix inside the layer, e.g. "self_attn.q_proj"
  int64_t in = 0, out = 0; // local input / output features of this rank
  bool row = false;        // row-parallel: all-reduce of the output in the forward
  // Of the rank's tokens it sees: an expert's experts_per_token / num_experts on
  // average; with ep, ep times that (balanced routing: each of the ep ranks sends it its share).
  double token_share = 1;
  bool frozen = false;     // LoRA's base: no weight-gradient GEMM
};

// A span [begin, end) of the rank's flat parameter buffer (plan order, as the ZeRO optimizer lays it out).
struct FlatRange {
  int64_t begin = 0, end = 0;
};

struct RankShape {
  int tp = 1, tp_rank = 0;
  int64_t local_numel = 0;                // every parameter's ShardSpec::local_numel, summed (Psi)
  // Expert parallelism: ep size, the routed experts this rank holds per sparse layer (all
  // without ep), their elements (part of local_numel), and the rows its experts compute
  // over the rank's own tokens x top-k (ep x local experts / experts under balanced routing: 1
  // when the experts divide evenly, more on the first ranks of an uneven split).
  int ep = 1;
  int64_t local_experts = 0;
  int64_t expert_numel = 0;
  double expert_rows_share = 1;
  int64_t trained_numel = 0;              // of them, what trains (all but LoRA's frozen base)
  bool head_trains = true;                // the LM head's weight gradient is computed
  std::vector<int64_t> layer_numel;       // per decoder layer
  int64_t outer_numel = 0;                // embeddings, final norm, LM head
  int64_t outer_tensors = 0;              // how many parameters are outside the layers
  int64_t tensors = 0;                    // parameters in all
  std::vector<LocalLinear> layer_linears; // layer 0's linears (every layer is modelled on it, also where a
                                          // mixture of experts mixes dense and sparse layers)
  int64_t hidden = 0, head_dim = 0;
  int64_t local_heads = 0, local_kv_heads = 0, local_intermediate = 0, local_vocab = 0;
  // A dense MLP's width on this rank (a mixture's dense layers: mlp_only_layers, decoder_sparse_step).
  int64_t local_dense_intermediate = 0;
  int64_t sparse_layers = 0;  // layers with a sparse block (a mixture of experts)
  // A sparse block's features per token of the rank (its top-k experts' and the shared
  // expert's), from the first sparse layer: local_intermediate's sparse counterpart.
  int64_t local_sparse_intermediate = 0;
  bool vocab_split = false;               // embedding / LM head vocab-parallel
  bool gpt2 = false;
  bool fused_qkv = false;                 // one [q | k | v] projection (Axis::kQkv), as Phi-3 and GPT-2
  std::vector<int64_t> shared_numel;      // global numel of each parameter with kv slices shared over tp (tp_step's)
  TpStepShape tp_step;                    // the plan's part of the step's tp collectives (tp/tp_traffic.h)
  std::vector<FlatRange> layer_ranges;    // per decoder layer: what one ZeRO-3 layer gather fetches
  std::vector<FlatRange> outer_ranges;    // per parameter outside the layers (gathered one by one)

  int64_t max_layer_numel() const;
};

// `plan` with ep_size > 1 is placed (place_experts) for the ep rank described:
// its other ranks' experts (remote) are left out, as the engine allocates none.
RankShape rank_shape(const ModelConfig& config, const TpPlan& plan, int tp_rank, int ep_size = 1);
// The plan the engine builds for `tp` (TpPlanOptions with defaults, and sequence
// parallelism when asked: it adds the partial-gradient reductions of norms, row
// biases and GPT-2's positions to the tp traffic).
TpPlan build_plan(const ModelConfig& config, int tp, bool sequence_parallel = false);

}  // namespace autotp::sim
