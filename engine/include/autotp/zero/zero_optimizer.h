// ZeroOptimizer: ZeRO stages 0-3 over the data-parallel group, on this rank's
// tensor-parallel shards. The shards are views into one flat buffer per rank,
// made of units (zero_units.h: the embeddings, each decoder layer, the head);
// dp rank d owns the d-th slice of every unit (flat_layout.h), so a unit is
// gathered or reduced by one collective per bucket in which every rank moves
// 1/dp of it:
//   stage 0: gradients (model dtype) all-reduced in buckets; optimizer states for the whole buffer
//   stage 1: gradients (model dtype) reduce-scattered unit by unit at the step;
//            fp32 master weights and optimizer states for this rank's partition
//            only; updated partitions all-gathered unit by unit
//   stage 2: each unit's gradients reduce-scattered as soon as the backward has
//            produced them (the model's use hooks) and then freed: only the
//            reduced partition is kept
//   stage 3: parameters partitioned too: each unit is all-gathered right
//            before its use (embeddings, each layer, the head) and its storage
//            freed right after, again around its backward; small tensors stay
//            whole (stage3_param_persistence_threshold)
// The optimizer step upcasts the partition's gradients to fp32 one bucket at a
// time. With bf16/fp16 and gradient_accumulation_steps > 1, gradients
// accumulate in fp32 instead (docs/memory.md). Gradients of kv slices shared by
// several tp ranks are summed over them first; the global gradient norm counts
// every logical element once (TpPlan ownership across tp, partitions across
// dp) from precomputed ranges, without a mask.
// Overlap (zero_optimization.overlap_comm; default on CUDA): at stages 2-3 a unit's
// gradient reduce-scatter runs on the dp group's lane while the backward goes
// on (waited when the next unit's starts, so at most two are in flight); at
// stage 3 the next use's units are gathered while the current one computes
// (stage3_prefetch_bucket_size > 0): forward prefetches the next layer,
// backward the previous one. The collectives and their order are the same
// with or without overlap, so the results are bit-identical. Not thread safe.
#pragma once
#include <torch/torch.h>

#include <deque>
#include <functional>
#include <map>

#include "autotp/comm/topology.h"
#include "autotp/model/causal_lm.h"
#include "autotp/optim/optimizer.h"
#include "autotp/optim/optim_config.h"
#include "autotp/zero/zero_config.h"
#include "autotp/zero/flat_layout.h"
#include "autotp/zero/zero_units.h"

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
  bool skipped = false;   // no update happened: fp16 overflow, a non-finite norm, or the caller asked
  bool non_finite = false;  // the gradient norm is NaN or infinite
  double loss_scale = 1;  // scale used for this step's backward
};

// What ZeroOptimizer reads of the training config (the trainer composes it).
struct ZeroSettings {
  ZeroConfig zero;
  OptimizerConfig optimizer;
  Fp16Config fp16;
  double gradient_clipping = 0;             // max global norm; 0 = none
  int64_t gradient_accumulation_steps = 1;  // > 1 with 16-bit weights: fp32 accumulation
};

class ZeroOptimizer {
 public:
  ZeroOptimizer(CausalLM& model, Topology& topology, const ZeroSettings& config);
  ~ZeroOptimizer();

  // Before the first forward of a step: zeroes gradients.
  void begin_step();
  // The factor the loss must be multiplied by before backward (fp16 loss scale, else 1).
  double loss_scale() const { return loss_scale_; }
  // After each micro-batch's backward: accumulates (stages 0-1) or reduces the
  // units the backward left unreduced (stages 2-3: embeddings, persistent tensors).
  void after_backward();
  // Reduces (stages 0-1), clips, updates and redistributes; returns the step's gradient norm.
  // A non-finite norm never updates the weights (fp16 also adjusts its loss scale);
  // `skip` on any rank (it found a non-finite loss) makes the world's norm NaN, so
  // every rank drops the update together.
  StepOutcome step(double lr, bool skip = false);
  // After step(): the first parameter (model order) whose reduced gradient holds a NaN or
  // an infinity, over the whole world, as {parameter index, rank that found it};
  // {-1, -1} when every gradient is finite. Collective over the world.
  std::pair<int, int> first_non_finite_gradient() const;

  // Stage 3: makes every parameter whole again (until the next step) so the
  // model can be read, e.g. for comparisons or export. No-op at other stages.
  void gather_all_params();

  ModelStateBytes model_state_bytes() const;
  // The same numbers from the formula of docs/memory.md (no buffers consulted).
  // `fp32_grad_accumulation`: 16-bit training with gradient accumulation.
  static ModelStateBytes analytic_bytes(const FlatLayout& layout, torch::ScalarType dtype,
                                        const OptimizerConfig& optimizer, bool fp32_grad_accumulation);
  int64_t local_numel() const { return layout_.local_numel; }
  int64_t padded_numel() const { return layout_.padded; }
  const FlatLayout& layout() const { return layout_; }
  const std::vector<int>& unit_ids() const { return layout_.unit_of; }
  int stage() const { return stage_; }
  bool fp32_grad_accumulation() const { return fp32_accum_; }

  // Checkpoints: this rank's partition [part] (copies at stages 1-2).
  PartitionState partition_state() const;
  // Restores the partition from fp32 master values [part] and optimizer states
  // (same names as partition_state), then redistributes the parameters over dp
  // as a step does. Collective over dp at stages 1-2.
  void load_partition_state(const torch::Tensor& master, const std::map<std::string, torch::Tensor>& optimizer,
                            int64_t optimizer_steps);
  LossScalerState loss_scaler_state() const { return {loss_scale_, good_steps_, hysteresis_left_}; }
  void set_loss_scaler_state(const LossScalerState& state);
  // Elements [begin, end) (inside one parameter) of this tp rank's fp32 master
  // buffer, gathered over dp (collective over dp at stages 1-3). For export.
  torch::Tensor gather_master(int64_t begin, int64_t end);

 private:
  // Model-dtype flat buffers on the model's device.
  torch::TensorOptions low_options() const { return torch::TensorOptions().dtype(low_).device(model_.device()); }
  int64_t slice_of(int unit) const { return layout_.units[unit].length / layout_.dp; }
  // This rank's slice of `unit` within a flat-buffer-sized tensor.
  torch::Tensor own_slice(const torch::Tensor& flat, int unit) const;
  // Flat position of partition element `index` (stage >= 1).
  int64_t flat_of(int64_t index) const;
  // The partition's gradients / fp32 master values at partition [begin, +length) (inside one piece).
  torch::Tensor grads_at(int64_t begin, int64_t length) const;
  torch::Tensor master_at(int64_t begin, int64_t length) const;
  torch::Tensor master_partition() const;  // [part] fp32 (a copy where not contiguous)
  // This rank's pieces of a flat-buffer-sized tensor as one [part] tensor of `dtype`, and back.
  torch::Tensor partition_copy(const torch::Tensor& flat, torch::ScalarType dtype) const;
  void write_partition(const torch::Tensor& part, torch::Tensor& flat) const;
  // Started collectives and what runs once they have finished (on this thread):
  // `finish` when all succeeded, `release` (buffers, memory tags) in any case.
  struct InFlight {
    std::vector<CommWork> works;
    std::function<void()> finish, release;
    void complete();
  };
  // Reduce-scatters a unit-sized tensor over dp in buckets of reduce_bucket_size
  // and adds (or copies) this rank's slice into `out` when completed.
  InFlight start_reduce_scatter_unit(const torch::Tensor& unit_values, torch::Tensor out, bool accumulate);
  // All-gathers every rank's slice `local` of a unit into `unit_values` in
  // buckets of allgather_bucket_size; complete before reading unit_values.
  InFlight start_all_gather_unit(const torch::Tensor& local, torch::Tensor unit_values);
  void all_gather_unit(const torch::Tensor& local, torch::Tensor unit_values) {
    start_all_gather_unit(local, std::move(unit_values)).complete();
  }
  void finish_in_flight(size_t keep);  // completes the oldest of in_flight_ until `keep` are left
  // Stages 2-3: moves the unit's parameter gradients into one buffer, reduce-scatters it into the partition.
  void reduce_unit_grads(int unit);
  void acquire_unit(int unit);  // stage 3: gather (counted), or complete its prefetch
  void prefetch_use(int64_t use);  // stage 3: starts gathering the use's units not yet held
  // Stage 3: if `unit` is being prefetched, completes its gather and holds it once; false otherwise.
  bool take_prefetched(int unit);
  void release_unit(int unit);
  void release_pins();
  void release_stale_units();  // stage 3: frees units still held outside a use
  void install_hooks();
  // After the partition changed: low-precision copies and the other dp ranks' views follow.
  void redistribute_params();
  void redistribute_piece(const PartitionPiece& piece);  // stages 1-2: one unit's share; its gather started
  void sync_shared_grads(torch::Tensor& flat);
  void compute_norm_ranges();

  CausalLM& model_;
  Topology& topo_;
  int stage_;
  double clip_;
  int64_t reduce_bucket_, gather_bucket_;
  Fp16Config fp16_;
  torch::ScalarType low_;
  bool mixed_;
  bool fp32_accum_;  // 16-bit training with gradient accumulation: gradients accumulate in fp32
  bool overlap_;     // collectives started on the lane, waited just before their results are needed
  bool prefetch_;    // stage 3: gather the next use's units ahead
  int64_t max_live_; // stage 3: prefetch only while the gathered elements stay within this
  FlatLayout layout_;
  std::vector<PartitionPiece> pieces_;             // this dp rank's partition
  ZeroUnits ids_;
  std::vector<std::vector<size_t>> unit_params_;   // parameter indices per unit
  std::vector<std::vector<int>> use_units_;        // per use + 1: the units it reads
  std::vector<std::vector<int>> reduce_after_use_; // per use + 1: units reduced when its backward ends
  std::vector<std::pair<int64_t, int64_t>> norm_ranges_;  // partition [begin, length) this rank counts in the norm
  torch::Tensor flat_params_;                // stages 0-2: model dtype, the whole buffer
  torch::Tensor param_part_;                 // stage 3: this rank's partition of the parameters
  std::vector<torch::Tensor> unit_buffers_;  // stage 3: per unit, its whole buffer (storage freed when released)
  std::vector<int> gathered_;                // stage 3: holders per unit
  bool pinned_ = false;                      // stage 3: gather_all_params holds every unit
  std::map<int, InFlight> prefetched_;       // stage 3: units being gathered ahead of their use
  std::deque<InFlight> in_flight_;           // unit reduce-scatters / gathers in flight (at most two)
  torch::Tensor flat_grads_;   // stages 0-1: model dtype, what autograd accumulates into
  torch::Tensor grad_accum_;   // stages 0-1 with fp32 accumulation
  torch::Tensor grad_part_;    // stages 2-3: the reduced partition (model dtype, fp32 with fp32 accumulation)
  std::vector<bool> unit_reduced_;  // stages 2-3: reduced in this micro-batch's backward
  torch::Tensor master_;       // fp32 master partition (mixed precision only)
  std::unique_ptr<FlatOptimizer> optimizer_;
  double loss_scale_ = 1;
  int64_t good_steps_ = 0;
  int hysteresis_left_ = 0;
};

}  // namespace autotp
