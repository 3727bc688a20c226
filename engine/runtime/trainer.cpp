#include "autotp/runtime/trainer.h"

#include <sys/resource.h>

#include <cmath>

#include "autotp/optim/lr_schedule.h"
#include "autotp/base/device.h"
#include "autotp/base/error.h"
#include "autotp/base/log.h"
#include "autotp/base/memory_counter.h"
#include "autotp/base/run_phase.h"

namespace autotp {

nlohmann::json StepMetrics::to_json() const {
  nlohmann::json j = {{"step", step},
                      {"loss", loss},
                      {"grad_norm", grad_norm},
                      {"lr", lr},
                      {"skipped", skipped},
                      {"tokens", tokens},
                      {"step_time_s", step_time_s},
                      {"tokens_per_s", tokens_per_s},
                      {"time_breakdown",
                       {{"forward_backward_s", forward_backward_s},
                        {"optimizer_s", optimizer_s},
                        {"comm_forward_backward_s", comm_forward_backward_s},
                        {"comm_optimizer_s", comm_optimizer_s},
                        {"comm_async_s", comm_async_s}}},
                      {"host_cpu", {{"busy_s", host_cpu.busy_s}, {"steal_s", host_cpu.steal_s}}},
                      {"memory", {{"model_states", model_states.to_json()},
                                  {"model_states_analytic", model_states_analytic.to_json()},
                                  {"peak_rss_bytes", peak_rss_bytes},
                                  {"device", memory_device},
                                  {"allocated_bytes", allocated_bytes},
                                  {"peak_allocated_bytes", peak_allocated_bytes},
                                  {"activations_peak_bytes", activations_peak_bytes},
                                  {"peak_gathered_params_bytes", peak_gathered_params_bytes},
                                  {"peak_gradient_buckets_bytes", peak_gradient_buckets_bytes}}}};
  if (memory_device == "cuda") {
    j["memory"]["reserved_bytes"] = reserved_bytes;
    j["memory"]["peak_reserved_bytes"] = peak_reserved_bytes;
  }
  if (loss_scale != 1) j["loss_scale"] = loss_scale;
  if (router_aux_loss != 0) j["router_aux_loss"] = router_aux_loss;
  if (!expert_tokens_max.empty())
    j["expert_tokens"] = {{"max", expert_tokens_max}, {"mean", expert_tokens_mean}};
  return j;
}

torch::ScalarType training_dtype(const TrainConfig& config) {
  if (config.bf16) return torch::kBFloat16;
  return config.fp16.enabled ? torch::kFloat16 : torch::kFloat32;
}

// ZeRO-Offload sections: what applies at this stage (zero/optimizer_offload.h).
void Trainer::report_offload() const {
  const ZeroConfig& z = config_.zero;
  if (!z.offloads()) return;
  if (z.offload_optimizer_device != "none" && !z.offloads_optimizer())
    log().warn("zero_optimization.offload_optimizer applies at stages 1-3 (stage is {}): ignored", z.stage);
  if (z.offload_param_device != "none" && !z.offloads_params())
    log().warn("zero_optimization.offload_param applies at stage 3 only (stage is {}): ignored", z.stage);
  if (!z.offloads_optimizer()) return;
  log().info("ZeRO-Offload: fp32 master, optimizer states and a gradient copy in {} host memory, the update on the "
             "CPU{}",
             z.offload_optimizer_pin_memory && model_->device().is_cuda() ? "pinned" : "pageable",
             z.offloads_params() ? "; the stage-3 parameter partitions in host memory too" : "");
}

Trainer::Trainer(TrainConfig config, std::shared_ptr<Topology> topology, std::unique_ptr<CausalLM> model,
                 std::shared_ptr<Dataset> data, bool shuffle)
    : config_(std::move(config)),
      topology_(std::move(topology)),
      model_(std::move(model)),
      data_(std::move(data)),
      shuffle_(shuffle) {
  if (config_.activation_checkpointing.enabled && config_.activation_checkpointing.mode == "selective") {
    AUTOTP_USER_CHECK(config_.activation_checkpointing.layers.empty(),
                      "activation_checkpointing.layers applies to mode \"full\" only (selective recomputes every layer's attention core)");
    model_->set_selective_recompute(true);
  } else if (config_.activation_checkpointing.enabled) {
    const int64_t layers = model_->config().num_layers;
    std::vector<bool> per_layer(layers, config_.activation_checkpointing.layers.empty());
    for (int64_t l : config_.activation_checkpointing.layers) {
      AUTOTP_USER_CHECK(l >= 0 && l < layers, "activation_checkpointing.layers: layer {} does not exist (allowed: 0..{})",
                        l, layers - 1);
      per_layer[l] = true;
    }
    model_->set_activation_checkpointing(per_layer);
  }
  report_offload();
  if (data_)
    sampler_ = std::make_unique<DistributedSampler>(data_->size(), config_.train_micro_batch_size_per_gpu,
                                                    config_.gradient_accumulation_steps, topology_->dp_size(),
                                                    topology_->dp_rank(), config_.seed, shuffle);
  optimizer_ = std::make_unique<ZeroOptimizer>(
      *model_, *topology_,
      ZeroSettings{config_.zero, config_.optimizer, config_.fp16, config_.gradient_clipping,
                   config_.gradient_accumulation_steps});
}

TrainerState Trainer::state() const {
  TrainerState s;
  s.steps_done = steps_done_;
  s.applied_steps = applied_steps_;
  if (sampler_) s.sampler = sampler_->state();
  return s;
}

void Trainer::restore(const TrainerState& state) {
  steps_done_ = state.steps_done;
  applied_steps_ = state.applied_steps;
  if (sampler_) sampler_->set_state(state.sampler);
}

void Trainer::check_tp_consistency(const std::vector<Batch>& micro_batches) {
  if (topology_->tp_size() == 1) return;
  uint64_t h = 1469598103934665603ull;
  for (const auto& b : micro_batches) h = (h ^ batch_hash(b)) * 1099511628211ull;
  auto signed_hash = static_cast<int64_t>(h >> 1);  // keep it positive so -h cannot overflow
  auto both = torch::tensor({signed_hash, -signed_hash}, torch::kLong);
  topology_->tp().all_reduce(both, ReduceOp::kMax);
  if (both[0].item<int64_t>() != signed_hash || -both[1].item<int64_t>() != signed_hash)
    throw std::runtime_error(fmt::format("data differs within tensor-parallel group at step {} (dp rank {})",
                                         steps_done_ + 1, topology_->dp_rank()));
}

StepMetrics Trainer::train_step() {
  TORCH_CHECK(sampler_, "Trainer::train_step: no dataset was given");
  std::vector<Batch> micro_batches;
  for (const auto& indices : sampler_->next_step()) micro_batches.push_back(collate(*data_, indices));
  return train_step(micro_batches);
}

double Trainer::comm_seconds() const {
  double s = topology_->tp().stats().seconds + topology_->dp().stats().seconds + topology_->world().stats().seconds;
  // Expert parallelism: the token exchange (ep) and the experts' reductions (edp).
  if (topology_->ep_size() > 1) s += topology_->ep().stats().seconds + topology_->edp().stats().seconds;
  return s;
}

double Trainer::async_comm_seconds() const {
  double s = topology_->tp().stats().async_seconds + topology_->dp().stats().async_seconds +
             topology_->world().stats().async_seconds;
  if (topology_->ep_size() > 1) s += topology_->ep().stats().async_seconds + topology_->edp().stats().async_seconds;
  return s;
}

torch::Tensor Trainer::global_target_tokens(const std::vector<Batch>& micro_batches) {
  int64_t local_tokens = 0;
  for (const auto& b : micro_batches) local_tokens += (b.labels != kIgnoreLabel).sum().item<int64_t>();
  auto tokens = torch::tensor({static_cast<double>(local_tokens), 0.0}, torch::kFloat64);
  topology_->dp().all_reduce(tokens);
  return tokens;
}

std::pair<double, double> Trainer::forward_backward(const std::vector<Batch>& micro_batches, double total_tokens) {
  optimizer_->begin_step();
  expert_counts_ = torch::Tensor();
  const double scale = optimizer_->loss_scale();
  double loss_sum = 0, aux_sum = 0;
  // Micro-batch j of dp rank r holds samples (j * dp + r) * micro_batch onwards of
  // the step's global batch (DistributedSampler): the rows of its dropout masks.
  const int64_t dp = topology_->dp_size(), rank = topology_->dp_rank();
  tp_forward_s_ = tp_backward_s_ = 0;
  const Comm& tp = topology_->tp();
  for (size_t j = 0; j < micro_batches.size(); ++j) {
    const Batch& b = micro_batches[j];
    const int64_t micro_batch = b.input_ids.size(0);
    model_->set_dropout(DropoutContext{config_.seed, steps_done_,
                                       (static_cast<int64_t>(j) * dp + rank) * micro_batch,
                                       micro_batch * static_cast<int64_t>(micro_batches.size()) * dp});
    publish_phase("forward", steps_done_ + 1);
    double tp_before = tp.stats().seconds;
    auto losses = model_->token_losses(b.input_ids, b.labels);
    auto sum = losses.sum();
    loss_sum += sum.item<double>();
    tp_forward_s_ += tp.stats().seconds - tp_before;
    // HF adds router_aux_loss_coef times each forward's load-balancing loss to its
    // loss: the step's objective averages it over the global batch's micro-batches
    // (the data-parallel reduction sums the ranks' gradients).
    if (model_->config().router_aux_loss_enabled())
      aux_sum += model_->router_aux_loss(scale * model_->config().router_aux_loss_coef /
                                         static_cast<double>(micro_batches.size() * dp));
    if (const torch::Tensor counts = model_->expert_token_counts(); counts.defined())
      expert_counts_ = expert_counts_.defined() ? expert_counts_ + counts : counts;
    tp_before = tp.stats().seconds;
    publish_phase("backward", steps_done_ + 1);
    (sum * (scale / total_tokens)).backward();
    tp_backward_s_ += tp.stats().seconds - tp_before;
    optimizer_->after_backward();
  }
  model_->set_dropout(std::nullopt);
  return {loss_sum, aux_sum};
}

void Trainer::record_memory(StepMetrics& m, const torch::Device& device, int64_t at_start) const {
  m.model_states = optimizer_->model_state_bytes();
  m.model_states_analytic = optimizer_->analytic_model_state();
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  m.peak_rss_bytes = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  if (device.is_cuda()) {
    const DeviceMemory gpu = cuda_memory(device);
    m.memory_device = "cuda";
    m.allocated_bytes = gpu.allocated;
    m.peak_allocated_bytes = gpu.peak_allocated;
    m.activations_peak_bytes = gpu.peak_allocated - at_start;
    m.reserved_bytes = gpu.reserved;
    m.peak_reserved_bytes = gpu.peak_reserved;
  } else if (memory_counter_installed()) {
    auto counts = memory_counts();
    m.allocated_bytes = counts.current;
    m.peak_allocated_bytes = counts.peak;
    m.activations_peak_bytes = counts.peak - at_start;
    m.peak_gathered_params_bytes = counts.tags_at_peak[static_cast<int>(MemoryTag::kGatheredParams)];
    m.peak_gradient_buckets_bytes = counts.tags_at_peak[static_cast<int>(MemoryTag::kGradientBuckets)];
  }
}

StepMetrics Trainer::train_step(const std::vector<Batch>& micro_batches) {
  publish_phase("forward", steps_done_ + 1);  // the step's first collectives check its data
  const torch::Device device = model_->device();
  // CUDA events on a GPU (its work is asynchronous), the host clock on CPU.
  StepClock clock(device);
  const double comm_at_start = comm_seconds(), async_at_start = async_comm_seconds();
  clock.mark();
  const HostCpuTimes cpu_at_start = host_cpu_times();
  reset_memory_peak();
  reset_cuda_peak(device);
  const int64_t at_start = device.is_cuda() ? cuda_memory(device).allocated : memory_counts().current;
  TORCH_CHECK(static_cast<int64_t>(micro_batches.size()) == config_.gradient_accumulation_steps,
              "Trainer::train_step: expected ", config_.gradient_accumulation_steps, " micro-batches, got ",
              micro_batches.size());
  check_tp_consistency(micro_batches);
  // Target tokens of the whole global batch: every micro-batch's loss is a share of the global mean.
  // The tensor lives to the step's end: its bytes are part of the memory the step reports.
  const torch::Tensor tokens = global_target_tokens(micro_batches);
  const double total_tokens = tokens[0].item<double>();
  AUTOTP_USER_CHECK(total_tokens > 0, "step {}: the global batch has no target tokens (every label is masked)",
                    steps_done_ + 1);

  const auto [loss_sum, aux_sum] = forward_backward(micro_batches, total_tokens);
  clock.mark();
  const double comm_after_backward = comm_seconds();
  // The loss is summed before the update: a non-finite one must not update the weights.
  // A mixture of experts' routing counts travel in the same all-reduce.
  auto loss = torch::tensor({loss_sum, aux_sum}, torch::kFloat64);
  if (expert_counts_.defined()) loss = torch::cat({loss, expert_counts_.flatten()});
  topology_->dp().all_reduce(loss);
  const bool loss_finite = std::isfinite(loss[0].item<double>()) && std::isfinite(loss[1].item<double>());
  // The schedule advances only on applied steps (DeepSpeed skips it after an fp16 overflow).
  const double lr = learning_rate(config_.scheduler, config_.optimizer.lr, applied_steps_);
  publish_phase("optimizer", steps_done_ + 1);
  StepOutcome outcome = optimizer_->step(lr, /*skip=*/!loss_finite);
  if (!outcome.skipped) ++applied_steps_;
  ++steps_done_;
  // fp16's loss scaler owns its overflows; fp32 and bf16 stop or skip (config "non_finite").
  // outcome.non_finite is the world's verdict (a non-finite loss made the norm NaN).
  if (outcome.non_finite && !config_.fp16.enabled)
    handle_non_finite(std::isfinite(loss_sum) && std::isfinite(aux_sum), outcome.grad_norm,
                      loss[0].item<double>() / total_tokens);
  clock.mark();
  const std::vector<double> phases = clock.seconds();  // waits for the GPU

  StepMetrics m;
  m.step = steps_done_;
  m.router_aux_loss =
      loss[1].item<double>() / static_cast<double>(micro_batches.size() * topology_->dp_size());
  m.loss = loss[0].item<double>() / total_tokens + model_->config().router_aux_loss_coef * m.router_aux_loss;
  if (expert_counts_.defined()) {
    const torch::Tensor counts = loss.narrow(0, 2, expert_counts_.numel()).view(expert_counts_.sizes());
    for (int64_t l = 0; l < counts.size(0); ++l) {
      m.expert_tokens_max.push_back(counts[l].max().item<double>());
      m.expert_tokens_mean.push_back(counts[l].mean().item<double>());
    }
  }
  m.grad_norm = outcome.grad_norm;
  m.lr = lr;
  m.loss_scale = config_.fp16.enabled ? outcome.loss_scale : 1;
  m.skipped = outcome.skipped;
  m.tokens = static_cast<int64_t>(total_tokens);
  m.forward_backward_s = phases[0];
  m.optimizer_s = phases[1];
  m.comm_forward_backward_s = comm_after_backward - comm_at_start;
  m.comm_optimizer_s = comm_seconds() - comm_after_backward;
  m.comm_async_s = async_comm_seconds() - async_at_start;
  m.tp_comm_forward_s = tp_forward_s_;
  m.tp_comm_backward_s = tp_backward_s_;
  m.step_time_s = m.forward_backward_s + m.optimizer_s;
  m.tokens_per_s = total_tokens / m.step_time_s;
  const HostCpuTimes cpu_at_end = host_cpu_times();
  m.host_cpu = {cpu_at_end.busy_s - cpu_at_start.busy_s, cpu_at_end.steal_s - cpu_at_start.steal_s};
  record_memory(m, device, at_start);
  if (topology_->rank() == 0)
    for (const std::string& warning : divergence_.observe(m.step, m.loss, m.grad_norm, m.skipped))
      log().warn("{}", warning);
  return m;
}

void Trainer::handle_non_finite(bool local_loss_finite, double grad_norm, double loss) {
  // Every rank sees the summed loss and the world's norm, so all of them get here together.
  const int world = topology_->world_size();
  auto first_rank = torch::tensor({static_cast<int64_t>(local_loss_finite ? world : topology_->rank())}, torch::kLong);
  topology_->world().all_reduce(first_rank, ReduceOp::kMin);
  const auto [param, found_on] = optimizer_->first_non_finite_gradient();
  const int64_t loss_rank = first_rank.item<int64_t>();
  std::string what = fmt::format("step {}: non-finite numbers (loss {}, gradient norm {})", steps_done_, loss, grad_norm);
  if (loss_rank < world)
    what += fmt::format("; rank {} computed a non-finite loss on its micro-batches", loss_rank);
  if (param >= 0)
    what += fmt::format("; first non-finite gradient: {} (found on rank {})", model_->parameters()[param].name(),
                        found_on);
  else
    what += "; every gradient is finite";
  if (config_.non_finite == "skip") {
    if (topology_->rank() == 0) log().warn("{}: the step's update was skipped (\"non_finite\": \"skip\")", what);
    return;
  }
  throw NonFiniteError(what + ". The weights were not updated; set \"non_finite\": \"skip\" in the config to "
                              "skip such steps instead, or lower the learning rate");
}

}  // namespace autotp
