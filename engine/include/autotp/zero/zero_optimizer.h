// ZeroOptimizer: ZeRO stages 0-3 over the data-parallel group, on this rank's
// tensor-parallel shards. The shards are views into one flat buffer per rank
// (padded to a multiple of the dp size), so a ZeRO partition is one contiguous
// range of it and every reduction is a single collective:
//   stage 0: gradients all-reduced; optimizer states for the whole buffer
//   stage 1: gradients all-reduced; fp32 master weights and optimizer states for
//            this rank's partition only; updated partitions all-gathered
//   stage 2: gradients reduce-scattered, only the partition is kept after the step
//   stage 3: parameters partitioned too: each decoder layer's parameters are
//            all-gathered right before the layer runs and released right after,
//            in the forward and again around its recomputation in the backward;
//            embeddings, final norm and LM head are gathered for the whole step
// Gradients of kv slices shared by several tp ranks are summed over them first;
// the global gradient norm counts every logical element once (TpPlan ownership
// across tp, partitions across dp). Not thread safe.
#pragma once
#include <torch/torch.h>

#include "autotp/comm/topology.h"
#include "autotp/model/causal_lm.h"
#include "autotp/optim/optimizer.h"
#include "autotp/runtime/train_config.h"
#include "autotp/zero/flat_layout.h"

namespace autotp {

// Persistent per-rank bytes of model states.
struct ModelStateBytes {
  int64_t params = 0;          // model-dtype parameters held between steps
  int64_t grads = 0;           // gradient buffers held between steps
  int64_t master_weights = 0;  // fp32 master copy (mixed precision only)
  int64_t optimizer_states = 0;
  int64_t total() const { return params + grads + master_weights + optimizer_states; }
  nlohmann::json to_json() const;
};

// fp16 dynamic loss scaling state (checkpointed).
struct LossScalerState {
  double loss_scale = 1;
  int64_t good_steps = 0;    // clean steps since the last overflow
  int hysteresis_left = 0;   // overflows still tolerated before the scale halves
};

// This rank's ZeRO partition of the model states, as checkpoints store it.
struct PartitionState {
  torch::Tensor params;          // model dtype [part]
  torch::Tensor master_weights;  // fp32 [part]; undefined in fp32 training (params are the master)
  std::vector<std::pair<std::string, torch::Tensor>> optimizer;  // fp32 [part] each, by state name
  int64_t optimizer_steps = 0;
};

struct StepOutcome {
  double grad_norm = 0;   // before clipping, unscaled
  bool skipped = false;   // fp16 overflow: no update happened
  double loss_scale = 1;  // scale used for this step's backward
};

class ZeroOptimizer {
 public:
  ZeroOptimizer(CausalLM& model, Topology& topology, const TrainConfig& config);

  // Before the first forward of a step: zeroes gradients (and gathers parameters at stage 3).
  void begin_step();
  // The factor the loss must be multiplied by before backward (fp16 loss scale, else 1).
  double loss_scale() const { return loss_scale_; }
  // After each micro-batch's backward (low-precision grads move into the fp32 accumulator).
  void after_backward();
  // Reduces, clips, updates and redistributes; returns the step's gradient norm.
  StepOutcome step(double lr);

  // Stage 3: makes every parameter whole again (until the next step) so the
  // model can be read, e.g. for comparisons or export. No-op at other stages.
  void gather_all_params();

  ModelStateBytes model_state_bytes() const;
  // The same numbers from the formula of docs/memory.md (no buffers consulted).
  static ModelStateBytes analytic_bytes(int64_t local_numel, int dp_size, int stage, torch::ScalarType dtype,
                                        const OptimizerConfig& optimizer);
  int64_t local_numel() const { return layout_.local_numel; }
  int64_t padded_numel() const { return layout_.padded; }
  const FlatLayout& layout() const { return layout_; }
  int stage() const { return stage_; }

  // Checkpoints: this rank's partition (views, not copies; valid between steps).
  PartitionState partition_state() const;
  // Restores the partition from fp32 master values [part] and optimizer states
  // (same names as partition_state), then redistributes the parameters over dp
  // as a step does. Collective over dp at stages 1-2.
  void load_partition_state(const torch::Tensor& master, const std::map<std::string, torch::Tensor>& optimizer,
                            int64_t optimizer_steps);
  LossScalerState loss_scaler_state() const { return {loss_scale_, good_steps_, hysteresis_left_}; }
  void set_loss_scaler_state(const LossScalerState& state);
  // Elements [begin, end) of this tp rank's fp32 master buffer, gathered over dp
  // (collective over dp at stages 1-3; local at stage 0). For export.
  torch::Tensor gather_master(int64_t begin, int64_t end);

 private:
  void bind_params(const torch::Tensor& flat);
  void bind_grads(const torch::Tensor& flat);
  void release_params();
  // After the partition changed: low-precision copies and the other dp ranks' views follow.
  void redistribute_params();
  torch::Tensor gather_range(const torch::Tensor& part, int64_t begin, int64_t end);
  void gather_layer(int64_t layer);
  void release_layer(int64_t layer);
  void sync_shared_grads(torch::Tensor& flat_fp32);
  torch::Tensor partition(const torch::Tensor& flat) const;

  CausalLM& model_;
  Topology& topo_;
  int stage_;
  double clip_;
  int64_t bucket_elements_;  // zero_optimization.reduce_bucket_size
  Fp16Config fp16_;
  torch::ScalarType low_;
  // Flat buffers in the model dtype on the model's device.
  torch::TensorOptions low_options() const { return torch::TensorOptions().dtype(low_).device(model_.device()); }
  bool mixed_;
  FlatLayout layout_;
  int64_t padded_ = 0, part_numel_ = 0, part_offset_ = 0;  // from layout_, for brevity
  std::vector<int64_t> offsets_;                            // layout_.offsets
  std::vector<std::vector<size_t>> layer_params_;  // stage 3: parameter indices of each decoder layer
  std::vector<size_t> outer_params_;               // stage 3: the others (embeddings, final norm, head)
  torch::Tensor flat_params_;     // model dtype, padded (absent between steps at stage 3)
  torch::Tensor param_part_;      // stage 3: this rank's partition of the parameters
  torch::Tensor flat_grads_;      // model dtype, what autograd accumulates into
  torch::Tensor grad_accum_;      // fp32 accumulator when the model dtype is not fp32
  torch::Tensor grad_part_;       // stage 2/3: reduced gradient partition (fp32)
  torch::Tensor master_;          // fp32 master partition (a view of the params in fp32 training)
  torch::Tensor owned_mask_;      // fp32, 1 where this tp rank owns the element for norms
  std::unique_ptr<FlatOptimizer> optimizer_;
  double loss_scale_ = 1;
  int64_t good_steps_ = 0;
  int hysteresis_left_ = 0;
};

}  // namespace autotp
