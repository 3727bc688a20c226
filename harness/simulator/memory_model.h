// Per-rank memory of a training layout, as this engine allocates it:
//   - model states between steps: ZeroOptimizer::analytic_bytes on the rank's
//     TpPlan shard (exactly what the engine measures; docs/memory.md); with
//     expert parallelism on each of its two layouts (dense over dp, this ep
//     rank's experts over edp), summed as the engine's analytic_model_state
//   - activations kept for the backward, counted tensor by tensor from what the
//     engine's autograd graph saves (docs/simulator.md lists them), plus the
//     transients at the peak moment (the vocab-parallel cross-entropy, the
//     backward's gradient buffers)
//   - communication buffers (ZeRO-3 gathered units, all-gather outputs)
//   - the step's transient gradient buffers (one unit in flight) and optimizer temporaries
// The peak is the larger of the forward/backward phase and the optimizer phase.
#pragma once
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "autotp/arch/model_config.h"
#include "autotp/lora/lora_config.h"
#include "autotp/runtime/train_config.h"
#include "autotp/zero/zero_optimizer.h"
#include "autotp/zero/zero_units.h"
#include "simulator/rank_shape.h"

namespace autotp::sim {

struct SimLayout {
  int gpus = 1;                              // world size
  int tp = 1;                                // tensor_parallel.autotp_size
  int zero_stage = 0;                        // 0..3
  int64_t micro_batch = 1;                   // sequences per forward on one rank
  int64_t seq_len = 1;                       // tokens per sequence
  int64_t gas = 1;                           // gradient accumulation steps
  torch::ScalarType dtype = torch::kBFloat16;
  bool activation_checkpointing = false;     // full: every layer recomputed in the backward
  bool selective_recompute = false;          // the attention core recomputed (without full checkpointing)
  bool sequence_parallel = false;            // tensor_parallel.sequence_parallel (tp > 1)
  OptimizerConfig optimizer;                 // AdamW by default (2 fp32 states)
  int64_t reduce_bucket_size = ZeroConfig{}.reduce_bucket_size;        // elements per gradient bucket
  int64_t allgather_bucket_size = ZeroConfig{}.allgather_bucket_size;  // elements per parameter gather
  int64_t persistence_threshold = ZeroConfig{}.stage3_param_persistence_threshold;
  bool overlap_comm = true;  // ZeRO collectives behind compute, stage 3 prefetches a layer (the engine on CUDA)
  bool cuda = true;          // the engine trains on GPUs (false: cpu-local); sizes the grad-norm chunk
  // LoRA (docs/lora.md): rank r > 0 turns it on; the targets as lora.target_modules
  // ("all-linear", or comma-separated names). The base is frozen in `dtype`, the
  // adapters train in fp32.
  int64_t lora_r = 0;
  std::string lora_targets = "all-linear";
  // ZeRO-Offload (zero_optimization.offload_optimizer / offload_param with "device":
  // "cpu"; docs/simulator.md): the fp32 master partition and optimizer states live
  // in host memory and the CPU runs the update (stages 1-3; ignored at stage 0, as the
  // engine does); offload_param also moves the stage-3 parameter partition to the host
  // (stage 3 only, and only with offload_optimizer: validate_layout rejects the rest).
  bool offload_optimizer = false;
  bool offload_param = false;
  // Expert parallelism (expert_parallel.autoep_size; docs/simulator.md "Expert
  // parallelism"): each sparse layer's routed experts cut over ep ranks taken from
  // dp; the experts' ZeRO optimizer partitions over edp = dp / ep. 1 = off.
  int ep = 1;
  int dp() const { return gpus / tp; }
  int edp() const { return dp() / std::max(ep, 1); }
  bool offloads_optimizer() const { return offload_optimizer && zero_stage >= 1; }
  bool offloads_params() const { return offload_param && offload_optimizer && zero_stage == 3; }
  bool recompute() const { return activation_checkpointing; }
  // Tokens of a sequence the busiest rank holds between blocks (sequence_shard_sizes).
  int64_t stream_tokens() const { return sequence_parallel && tp > 1 ? (seq_len + tp - 1) / tp : seq_len; }
};

// The LoRA config of a layout with lora_r > 0 (lora_alpha = 2 r: the scale is irrelevant to cost).
LoraConfig layout_lora(const SimLayout& layout);
// The plan the engine trains on: build_plan, with the LoRA factors when the layout has them;
// with ep > 1 placed for ep rank 0 (place_experts), the rank holding the most experts.
TpPlan layout_plan(const ModelConfig& config, const SimLayout& layout);

// One ZeroOptimizer's flat layout, as the engine builds it from the rank's
// parameters (plan order, other ep ranks' experts left out): without ep one
// over dp holding everything; with ep the dense one over dp and the routed
// experts' over edp (zero_optimizer.cpp's HeldSet kDense / kExperts).
struct HeldFlat {
  FlatLayout flat;
  int dp = 1;            // ranks it is partitioned over: dp, or edp for the experts
  bool experts = false;  // the routed experts' optimizer
};
// What trains (frozen false) or LoRA's frozen base (true), for tp rank `tp_rank` of `plan` (layout_plan's).
std::vector<HeldFlat> held_flats(const ModelConfig& config, const TpPlan& plan, const SimLayout& layout, int tp_rank,
                                 bool frozen);
// LoRA: the adapted linears of decoder layer 0, by their name inside the layer ("self_attn.q_proj").
std::set<std::string> lora_layer_modules(const ModelConfig& config, const SimLayout& layout);

// ZeRO-Offload: what one rank keeps in host memory (all zero without offload).
struct HostBytes {
  int64_t master_weights = 0;    // the fp32 master partition (also in fp32 training)
  int64_t optimizer_states = 0;  // K fp32 states per partition element
  int64_t grads = 0;             // the reduced gradient partition copied from the device (its dtype)
  int64_t params = 0;            // mixed precision: the updated partition staged in the model dtype;
                                 // offload_param: the stage-3 parameter partition (the update writes it)
  int64_t total() const { return master_weights + optimizer_states + grads + params; }
};

// The host bytes of `layout` for the engine's formula of a flat layout whose
// partition has `part` elements trained in `trained_dtype` (docs/simulator.md,
// "ZeRO-Offload"): `engine` is analytic_model_state_bytes with the layout's
// OffloadPlacement, so the engine's and the simulator's host bytes are one formula.
HostBytes offloaded_bytes(const ModelStateBytes& engine, const SimLayout& layout, int64_t part,
                          torch::ScalarType trained_dtype);

// What the forward/backward phase's peak moment holds besides the model states:
// components of that one moment (they sum to forward_backward_peak with the states).
struct PeakMoment {
  int64_t activations = 0;  // saved activations and transients of the moment, and the batch
  int64_t gathered = 0;     // ZeRO-3 units gathered or being prefetched (and offload_param's slice copies)
  int64_t gradients = 0;    // gradients in reduction: buckets, reduced slices in flight
  int64_t total() const { return activations + gathered + gradients; }
};

struct MemoryEstimate {
  ModelStateBytes states;          // on the device between steps (the engine's formula less what is offloaded)
  // Expert parallelism: of `states`, the routed experts' optimizer (this ep rank's experts over edp),
  // and the expert elements this rank holds (its tp shards of its experts, before ZeRO partitioning).
  ModelStateBytes expert_states;
  int64_t expert_numel = 0;
  HostBytes host;                  // ZeRO-Offload: host memory of this rank
  // Each kind below is its largest amount during the step; `total` is the peak of the sum.
  int64_t activations = 0;         // saved activations + backward transients (one micro-batch) + the batch
  int64_t comm_buffers = 0;        // ZeRO-3 gathered parameters, all-gather outputs
  int64_t transient_grads = 0;     // one unit's gradients and their reduction buffer (stages 2-3)
  int64_t optimizer_temporaries = 0;  // grad-norm (fp64) chunk and the fp32 upcast chunk of the update
  int64_t forward_backward_peak = 0;  // = states.total() + at_peak.total()
  PeakMoment at_peak;
  int64_t optimizer_peak = 0;
  int64_t total = 0;               // predicted peak bytes = max of the two phases
  std::string peak_phase;          // "forward_backward" | "optimizer"
  nlohmann::json to_json() const;  // the contract's memory object (+ extras)
};

// Activation bytes one micro-batch keeps for the backward (no transients).
int64_t saved_activation_bytes(const ModelConfig& config, const RankShape& shape, const SimLayout& layout);

MemoryEstimate estimate_memory(const ModelConfig& config, const RankShape& shape, const SimLayout& layout);

}  // namespace autotp::sim
