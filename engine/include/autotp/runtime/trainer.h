// Trainer: one optimizer step at a time over this rank's shards. Each step:
// the sampler gives this dp rank its micro-batches; a hash of them is checked
// across the tp group; the loss of every micro-batch is scaled by the number of
// target tokens of the whole global batch (so the step optimizes the mean token
// cross-entropy of the global batch, exactly as one rank would); the
// ZeroOptimizer reduces, clips and updates. Not thread safe.
#pragma once
#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>

#include "autotp/comm/topology.h"
#include "autotp/data/dataset.h"
#include "autotp/data/batch.h"
#include "autotp/data/sampler.h"
#include "autotp/model/causal_lm.h"
#include "autotp/base/host_cpu.h"
#include "autotp/runtime/divergence_monitor.h"
#include "autotp/runtime/train_config.h"
#include "autotp/zero/zero_optimizer.h"

namespace autotp {

struct StepMetrics {
  int64_t step = 0;            // 1-based optimizer step
  double loss = 0;             // mean token cross-entropy over the global batch, before the update,
                               // plus router_aux_loss_coef * router_aux_loss where that loss is on
  double router_aux_loss = 0;  // mixture of experts: the load-balancing loss, mean over the step's micro-batches
  // Mixture of experts: per sparse layer, the tokens routed to each expert over the
  // global batch (top-k choices), their largest and mean count over the experts.
  std::vector<double> expert_tokens_max, expert_tokens_mean;
  double grad_norm = 0;
  double lr = 0;
  double loss_scale = 1;
  bool skipped = false;
  int64_t tokens = 0;          // target tokens in the global batch
  double step_time_s = 0;
  double tokens_per_s = 0;
  double forward_backward_s = 0;  // data check, forward and backward of every micro-batch
  double optimizer_s = 0;         // reduction, norm, clipping, update, redistribution
  // Host seconds this rank was blocked in collectives (tp, dp, world) in each
  // phase: the exposed communication. Started collectives count only for the
  // time their wait blocked; the time they ran on the groups' lanes is comm_async_s.
  double comm_forward_backward_s = 0, comm_optimizer_s = 0;
  double comm_async_s = 0;
  // The tp group's part of comm_forward_backward_s, in the forwards and in the
  // backwards of the micro-batches (what tp_overlap_comm hides).
  double tp_comm_forward_s = 0, tp_comm_backward_s = 0;
  HostCpuTimes host_cpu;          // the whole machine's CPU time during the step (busy, stolen by the host)
  ModelStateBytes model_states;            // this rank
  ModelStateBytes model_states_analytic;   // the formula for this rank
  int64_t peak_rss_bytes = 0;              // this rank's peak resident set so far
  // On CPU from the counting allocator (0 unless install_memory_counter() ran),
  // on a GPU from LibTorch's CUDA caching allocator:
  std::string memory_device = "cpu";       // "cpu" | "cuda": where the next three were measured
  int64_t allocated_bytes = 0;             // live tensor bytes after the step
  int64_t peak_allocated_bytes = 0;        // peak during the step (everything: states, activations, buffers)
  int64_t activations_peak_bytes = 0;      // peak during the step minus what was live at its start
  int64_t peak_gathered_params_bytes = 0;  // CPU: of the peak, ZeRO-3 units gathered at that moment
  int64_t peak_gradient_buckets_bytes = 0; // CPU: of the peak, gradients in reduction buckets at that moment
  int64_t reserved_bytes = 0;              // GPU only: bytes the caching allocator holds after the step
  int64_t peak_reserved_bytes = 0;         // GPU only: their peak during the step
  nlohmann::json to_json() const;
};

// What a checkpoint needs of the trainer besides the model states.
struct TrainerState {
  int64_t steps_done = 0;     // optimizer steps taken (including skipped ones)
  int64_t applied_steps = 0;  // steps that updated the weights: the LR schedule's position
  SamplerState sampler;       // ignored when the trainer has no dataset
};

class Trainer {
 public:
  // `config` must be resolved (resolve_batch) for the topology's world size.
  Trainer(TrainConfig config, std::shared_ptr<Topology> topology, std::unique_ptr<CausalLM> model,
          std::shared_ptr<Dataset> data, bool shuffle);

  StepMetrics train_step();
  // One step on explicit micro-batches (this dp rank's gradient_accumulation_steps of them).
  StepMetrics train_step(const std::vector<Batch>& micro_batches);

  CausalLM& model() { return *model_; }
  ZeroOptimizer& optimizer() { return *optimizer_; }
  Topology& topology() { return *topology_; }
  const TrainConfig& config() const { return config_; }
  int64_t steps_done() const { return steps_done_; }
  DistributedSampler* sampler() { return sampler_.get(); }
  Dataset* dataset() { return data_.get(); }
  bool shuffle() const { return shuffle_; }
  TrainerState state() const;
  void restore(const TrainerState& state);

 private:
  // Logs how the zero_optimization offload sections apply at this stage.
  void report_offload() const;
  // The parts of train_step. check_tp_consistency throws when the ranks of a tp group got different batches.
  void check_tp_consistency(const std::vector<Batch>& micro_batches);
  // {target tokens of the whole global batch, 0} in float64: this rank's micro-batches summed over dp.
  torch::Tensor global_target_tokens(const std::vector<Batch>& micro_batches);
  // Forward and backward of every micro-batch; returns this rank's summed token losses.
  // Returns this rank's sum of token losses and of its micro-batches' load-balancing losses.
  std::pair<double, double> forward_backward(const std::vector<Batch>& micro_batches, double total_tokens);
  // A NaN or an infinity in the step's summed loss or gradient norm (fp32 / bf16):
  // finds the first rank whose own loss was non-finite and the first parameter whose
  // gradient is, then throws NonFiniteError naming them (config non_finite "error")
  // or warns (skip). The step's update was already dropped. Collective.
  void handle_non_finite(bool local_loss_finite, double grad_norm, double loss);
  // The memory fields of `m` after the step; `at_start`: bytes allocated when it began.
  void record_memory(StepMetrics& m, const torch::Device& device, int64_t at_start) const;
  // Host seconds blocked in collectives so far (tp, dp, world), and the seconds
  // started collectives ran on the groups' lanes: a step reports their differences.
  double comm_seconds() const;
  double async_comm_seconds() const;
  // The current step's exposed tp communication in forwards and backwards.
  double tp_forward_s_ = 0, tp_backward_s_ = 0;
  torch::Tensor expert_counts_;  // mixture of experts: this step's routing counts so far, [sparse layers, experts]

  TrainConfig config_;
  std::shared_ptr<Topology> topology_;
  std::unique_ptr<CausalLM> model_;
  std::shared_ptr<Dataset> data_;
  std::unique_ptr<DistributedSampler> sampler_;
  std::unique_ptr<ZeroOptimizer> optimizer_;
  bool shuffle_ = false;
  DivergenceMonitor divergence_;  // rank 0 warns when the loss spikes or the gradient norm is 0
  int64_t steps_done_ = 0;
  int64_t applied_steps_ = 0;  // steps that updated the weights (not skipped for fp16 overflow)
};

// Model dtype from the config: bf16, fp16 or fp32 (LibTorch 2.11 runs all three on CPU and CUDA).
torch::ScalarType training_dtype(const TrainConfig& config);

}  // namespace autotp
