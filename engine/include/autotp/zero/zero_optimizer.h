// ZeroOptimizer: ZeRO stages 0-3 over the data-parallel group, on this rank's
// tensor-parallel shards of what trains (a ShardedModel's parameters that are not
// frozen; at stage 3 the frozen ones are partitioned and gathered too). It
// composes one ParamStore and one GradStore per stage (param_store.h,
// stage3_params.h, grad_store.h), UnitCollectives, PartitionNorm, LossScaler
// and the FlatOptimizer. The shards are views into one flat buffer per rank,
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
// with or without overlap, so the results are bit-identical.
// ZeRO-Offload (offload_optimizer at stages 1-3, optimizer_offload.h): the
// master, the optimizer states and a gradient copy live in host memory and the
// update runs on the CPU; offload_param (stage 3) keeps the parameter partition
// there too (stage3_params.h). Same arithmetic, so the same results.
// Expert parallelism (topology ep > 1): the routed experts' tensors differ
// between the ranks of an ep group, so they are held by a second ZeroOptimizer
// of the same stage over the expert-data-parallel group (the ranks holding the
// same experts); this one holds the rest over dp. Both count in one gradient
// norm, clip by it and step together; the hooks of both run around each use.
// Not thread safe.
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>

#include "autotp/comm/topology.h"
#include "autotp/model/sharded_model.h"
#include "autotp/optim/loss_scaler.h"
#include "autotp/optim/optimizer.h"
#include "autotp/optim/optim_config.h"
#include "autotp/zero/flat_layout.h"
#include "autotp/zero/grad_store.h"
#include "autotp/zero/held_params.h"
#include "autotp/zero/model_state_bytes.h"
#include "autotp/zero/optimizer_offload.h"
#include "autotp/zero/param_store.h"
#include "autotp/zero/partition_norm.h"
#include "autotp/zero/unit_collectives.h"
#include "autotp/zero/zero_config.h"
#include "autotp/zero/zero_units.h"

namespace autotp {

// This rank's ZeRO partition of the model states, as checkpoints store it.
struct PartitionState {
  torch::Tensor params;          // flat dtype [part]
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

// The groups one ZeroOptimizer works over: tp (shared slices), the group it
// partitions and reduces over, and the world (the gradient norm).
struct ZeroGroups {
  Comm* tp = nullptr;
  Comm* dp = nullptr;
  Comm* world = nullptr;
};

class ZeroOptimizer {
 public:
  ZeroOptimizer(ShardedModel& model, Topology& topology, const ZeroSettings& config);
  ~ZeroOptimizer();

  // Before the first forward of a step: zeroes gradients.
  void begin_step();
  // The factor the loss must be multiplied by before backward (fp16 loss scale, else 1).
  double loss_scale() const { return scaler_.scale(); }
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
  // model can be read, e.g. for comparisons or export; `frozen` false leaves
  // the frozen base (LoRA) partitioned. No-op at other stages.
  void gather_all_params(bool frozen = true);

  ModelStateBytes model_state_bytes() const;
  // The same numbers from the formula of docs/memory.md for this optimizer's layouts.
  ModelStateBytes analytic_model_state() const;
  // The formula for one layout (no buffers consulted).
  static ModelStateBytes analytic_bytes(const FlatLayout& layout, torch::ScalarType dtype,
                                        const OptimizerConfig& optimizer, bool fp32_grad_accumulation,
                                        OffloadPlacement offload = {}) {
    return analytic_model_state_bytes(layout, dtype, optimizer, fp32_grad_accumulation, offload);
  }
  int64_t local_numel() const { return trained_->layout.local_numel; }
  int64_t padded_numel() const { return trained_->layout.padded; }
  // The layout of what trains, its parameters (model order) and their units.
  const FlatLayout& layout() const { return trained_->layout; }
  const std::vector<Parameter*>& params() const { return trained_->params; }
  const std::vector<int>& unit_ids() const { return trained_->layout.unit_of; }
  // The dtype of the held (trained) parameters: the model's, or fp32 adapters under LoRA.
  torch::ScalarType dtype() const { return low_; }
  int stage() const { return stage_; }
  OffloadPlacement offload() const { return placement_; }
  bool fp32_grad_accumulation() const { return fp32_accum_; }

  // Expert parallelism: the optimizer of the routed experts (over the edp group), or null.
  const ZeroOptimizer* experts() const { return experts_.get(); }
  ZeroOptimizer* experts() { return experts_.get(); }

  // Checkpoints: this rank's partition [part] (copies at stages 1-2).
  PartitionState partition_state() const;
  // Restores the partition from fp32 master values [part] and optimizer states
  // (same names as partition_state), then redistributes the parameters over dp
  // as a step does. Collective over dp at stages 1-2.
  void load_partition_state(const torch::Tensor& master, const std::map<std::string, torch::Tensor>& optimizer,
                            int64_t optimizer_steps);
  LossScalerState loss_scaler_state() const { return scaler_.state(); }
  void set_loss_scaler_state(const LossScalerState& state) { scaler_.set_state(state); }
  // Elements [begin, end) (inside one parameter) of this tp rank's fp32 master
  // buffer, gathered over dp (collective over dp at stages 1-3). For export.
  torch::Tensor gather_master(int64_t begin, int64_t end);

 private:
  // Which of the model's parameters one optimizer holds.
  enum class HeldSet { kAll, kDense, kExperts };
  ZeroOptimizer(ShardedModel& model, ZeroGroups groups, const ZeroSettings& config, HeldSet set);
  bool holds(const Parameter& p) const;
  std::vector<Parameter*> held(bool frozen) const;
  // The hooks of this optimizer alone (ZeRO-2/3: reductions; ZeRO-3: gathers).
  UseHooks make_hooks();
  // The update after the norm: unscale, clip by `coef`, step, redistribute.
  void apply_update(double lr, double coef, double scale);
  // This rank's first non-finite gradient as an index into model_.parameters(), or INT64_MAX.
  int64_t local_first_non_finite() const;
  // The fp32 master values at partition [begin, +length) (inside one piece).
  torch::Tensor master_at(int64_t begin, int64_t length) const;
  torch::Tensor grads_at(int64_t begin, int64_t length) const { return grads_->at(begin, length); }

  ShardedModel& model_;
  ZeroGroups groups_;
  HeldSet set_;
  int stage_;
  double clip_;
  torch::ScalarType low_;
  bool mixed_;
  bool fp32_accum_;  // 16-bit training with gradient accumulation: gradients accumulate in fp32
  UnitCollectives comm_;
  std::unique_ptr<HeldParams> trained_;
  std::unique_ptr<ParamStore> params_;
  std::unique_ptr<GradStore> grads_;
  // Stage 3 with frozen parameters (LoRA's base): partitioned and gathered like the rest.
  std::unique_ptr<HeldParams> frozen_;
  std::unique_ptr<ParamStore> frozen_params_;
  std::vector<std::vector<int>> reduce_after_use_;  // per use + 1: units reduced when its backward ends
  std::unique_ptr<PartitionNorm> norm_;
  torch::Tensor master_;  // fp32 master partition (mixed precision, or offloaded: in host memory)
  std::unique_ptr<OptimizerOffload> offload_;  // ZeRO-Offload of the update, or null
  std::unique_ptr<FlatOptimizer> optimizer_;
  LossScaler scaler_;
  OptimizerConfig optimizer_config_;
  int64_t frozen_analytic_bytes_ = 0;  // the frozen base's formula (fixed: computed once)
  int64_t frozen_analytic_host_ = 0;   // of it, in host memory (offload_param)
  OffloadPlacement placement_;
  int64_t accumulation_steps_;
  int64_t micro_batch_ = 0;  // backward passes since begin_step
  std::unique_ptr<ZeroOptimizer> experts_;  // expert parallelism: the routed experts over edp
};

}  // namespace autotp
