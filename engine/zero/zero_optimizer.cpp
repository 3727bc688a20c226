#include "autotp/zero/zero_optimizer.h"

#include <cmath>
#include <limits>

#include "autotp/base/error.h"
#include "autotp/zero/stage3_params.h"

namespace autotp {
namespace {

std::vector<Parameter*> held(ShardedModel& model, bool frozen) {
  std::vector<Parameter*> out;
  for (auto& p : model.parameters())
    if (p.entry->frozen == frozen) out.push_back(&p);
  return out;
}

std::unique_ptr<HeldParams> hold(std::vector<Parameter*> params, const ZeroUnits& units, const Topology& topo,
                                 int stage, int64_t persistence_threshold, torch::TensorOptions options) {
  std::vector<const PlanEntry*> entries;
  for (const Parameter* p : params) entries.push_back(p->entry);
  FlatLayout layout = zero_layout(entries, units, topo.tp_rank(), topo.dp_size(), stage, persistence_threshold);
  return std::make_unique<HeldParams>(std::move(params), std::move(layout), topo.tp_rank(), topo.dp_rank(), options);
}

torch::ScalarType held_dtype(const std::vector<Parameter*>& params, torch::ScalarType fallback) {
  if (params.empty()) return fallback;
  const torch::ScalarType dtype = params.front()->tensor.scalar_type();
  for (const Parameter* p : params)
    TORCH_CHECK(p->tensor.scalar_type() == dtype, "ZeroOptimizer: trained parameters of different dtypes (",
                params.front()->name(), " ", dtype, ", ", p->name(), " ", p->tensor.scalar_type(), ")");
  return dtype;
}

}  // namespace

ZeroOptimizer::ZeroOptimizer(ShardedModel& model, Topology& topology, const ZeroSettings& config)
    : model_(model),
      topo_(topology),
      stage_(config.zero.stage),
      clip_(config.gradient_clipping),
      comm_(topology.dp(), config.zero.reduce_bucket_size, config.zero.allgather_bucket_size,
            config.zero.overlaps(model.device().is_cuda()) && topology.dp_size() > 1),
      scaler_(config.fp16),
      optimizer_config_(config.optimizer),
      placement_{config.zero.offloads_optimizer(), config.zero.offloads_params()},
      accumulation_steps_(config.gradient_accumulation_steps) {
  torch::NoGradGuard no_grad;
  std::vector<Parameter*> trained = held(model_, /*frozen=*/false);
  low_ = held_dtype(trained, model_.dtype());
  mixed_ = low_ != torch::kFloat32;
  fp32_accum_ = mixed_ && config.gradient_accumulation_steps > 1;
  const auto options = torch::TensorOptions().dtype(low_).device(model_.device());
  const ZeroUnits units{model_.num_layers()};
  const int64_t threshold = config.zero.stage3_param_persistence_threshold;
  trained_ = hold(std::move(trained), units, topo_, stage_, threshold, options);

  // Uses (embeddings = 0, layer l = l + 1, head = L + 1) and the units each reads / reduces.
  const int64_t L = model_.num_layers();
  std::vector<std::vector<int>> use_units(L + 2);
  reduce_after_use_.assign(L + 2, {});
  use_units[0] = {ZeroUnits::kEmbedding};
  for (int64_t l = 0; l < L; ++l) use_units[l + 1] = reduce_after_use_[l + 1] = {units.layer(l)};
  use_units[L + 1] = {units.head()};
  if (model_.tied_head())
    use_units[L + 1].push_back(ZeroUnits::kEmbedding);  // reduced at the end of the backward
  else
    reduce_after_use_[L + 1] = {units.head()};

  const bool prefetch = comm_.overlap() && stage_ == 3 && config.zero.stage3_prefetch_bucket_size > 0;
  const int64_t max_live = config.zero.stage3_max_live_parameters;
  if (stage_ == 3) {
    const bool pin = config.zero.offload_param_pin_memory;
    params_ = std::make_unique<Stage3Params>(*trained_, comm_, use_units, prefetch, max_live, placement_.params, pin);
    std::vector<Parameter*> frozen = held(model_, /*frozen=*/true);
    if (!frozen.empty()) {
      const auto frozen_options = options.dtype(held_dtype(frozen, model_.dtype()));
      frozen_ = hold(std::move(frozen), units, topo_, stage_, threshold, frozen_options);
      frozen_params_ =
          std::make_unique<Stage3Params>(*frozen_, comm_, use_units, prefetch, max_live, placement_.params, pin);
    }
  } else {
    params_ = std::make_unique<FlatParams>(*trained_, comm_);
  }
  // The frozen base's bytes by formula: its stage-3 layout, or every element it holds.
  if (frozen_) {
    frozen_analytic_bytes_ = analytic_frozen_bytes(frozen_->layout, model_.dtype());
    frozen_analytic_host_ = analytic_frozen_host_bytes(frozen_->layout, model_.dtype(), placement_);
  } else {
    std::vector<const PlanEntry*> frozen_entries;
    for (auto& p : model_.parameters())
      if (!p.trains()) frozen_entries.push_back(p.entry);
    if (!frozen_entries.empty())
      frozen_analytic_bytes_ = analytic_frozen_bytes(
          zero_layout(frozen_entries, units, topo_.tp_rank(), topo_.dp_size(), stage_, threshold), model_.dtype());
  }
  if (stage_ <= 1) {
    if (stage_ == 0)
      grads_ = std::make_unique<AllReducedGrads>(*trained_, topo_, comm_, fp32_accum_);
    else
      grads_ = std::make_unique<StepScatteredGrads>(*trained_, topo_, comm_, fp32_accum_);
  } else {
    grads_ = std::make_unique<BackwardScatteredGrads>(*trained_, topo_, comm_, fp32_accum_);
  }
  std::vector<const ShardSpec*> specs;
  for (const Parameter* p : trained_->params) specs.push_back(&p->spec());
  norm_ = std::make_unique<PartitionNorm>(specs, trained_->layout, topo_.tp_rank(), topo_.dp_rank());
  if (placement_.optimizer) {
    // ZeRO-Offload: master, gradient copy and optimizer states in host memory, the update on the CPU.
    const torch::ScalarType grad_dtype = fp32_accum_ ? torch::kFloat32 : low_;
    offload_ = std::make_unique<OptimizerOffload>(*trained_, params_->partition(torch::kFloat32), grad_dtype, low_,
                                                  /*stage_params=*/!placement_.params,
                                                  config.zero.offload_optimizer_pin_memory, model_.device());
    master_ = offload_->master();
    grads_->on_reduced([this](int unit, const torch::Tensor& reduced) {
      if (micro_batch_ + 1 >= accumulation_steps_) offload_->gradients_final(unit, reduced);
    });
    optimizer_ = std::make_unique<FlatOptimizer>(config.optimizer, trained_->layout.part, torch::kCPU);
  } else {
    if (mixed_) master_ = params_->partition(torch::kFloat32);  // an fp32 copy ([padded] at stage 0)
    optimizer_ = std::make_unique<FlatOptimizer>(config.optimizer, trained_->layout.part, model_.device());
  }
  if (stage_ >= 2) install_hooks();
}

ZeroOptimizer::~ZeroOptimizer() {
  if (stage_ >= 2) model_.set_use_hooks({});
  topo_.dp().wait_all();  // nothing of ours still running on the lane (errors are dropped here)
}

void ZeroOptimizer::install_hooks() {
  UseHooks hooks;
  if (stage_ == 3) {
    auto acquire = [this](int64_t use) {
      params_->acquire_use(use);
      if (frozen_params_) frozen_params_->acquire_use(use);
    };
    auto release = [this](int64_t use) {
      params_->release_use(use);
      if (frozen_params_) frozen_params_->release_use(use);
    };
    auto prefetch = [this](int64_t use) {
      params_->prefetch_use(use);
      if (frozen_params_) frozen_params_->prefetch_use(use);
    };
    // The next use in time: forward goes up to the head, backward down to layer 0
    // (the embeddings' backward reads no weight).
    hooks.before_forward = [this, acquire, prefetch](int64_t use) {
      acquire(use);
      if (use < model_.head_use()) prefetch(use + 1);
    };
    hooks.after_forward = release;
    hooks.before_backward = [acquire, prefetch](int64_t use) {
      acquire(use);
      if (use > 0) prefetch(use - 1);
    };
    hooks.after_backward = [this, release](int64_t use) {
      release(use);  // first: the gathered unit and its gradients need not coexist
      for (int u : reduce_after_use_.at(use + 1)) grads_->reduce_unit(u);
    };
  } else {
    hooks.after_backward = [this](int64_t use) {
      for (int u : reduce_after_use_.at(use + 1)) grads_->reduce_unit(u);
    };
  }
  model_.set_use_hooks(std::move(hooks));
}

torch::Tensor ZeroOptimizer::master_at(int64_t begin, int64_t length) const {
  if (master_.defined()) return master_.narrow(0, begin, length);
  return params_->at(begin, length);  // fp32: the parameters are the master
}

void ZeroOptimizer::gather_all_params(bool frozen) {
  if (stage_ != 3) return;
  params_->gather_all();
  if (frozen && frozen_params_) frozen_params_->gather_all();
}

void ZeroOptimizer::begin_step() {
  torch::NoGradGuard no_grad;
  comm_.finish(0);  // left by a backward that did not reach after_backward
  params_->begin_step();
  if (frozen_params_) frozen_params_->begin_step();
  grads_->begin_step();
  micro_batch_ = 0;
  if (offload_) offload_->begin_step();
}

void ZeroOptimizer::after_backward() {
  torch::NoGradGuard no_grad;
  params_->after_backward();
  if (frozen_params_) frozen_params_->after_backward();
  grads_->after_backward();
  ++micro_batch_;
}

StepOutcome ZeroOptimizer::step(double lr, bool skip) {
  torch::NoGradGuard no_grad;
  StepOutcome outcome;
  outcome.loss_scale = scaler_.scale();
  comm_.finish(0);  // after_backward completes them; a caller that skipped it must not read half-reduced grads
  grads_->reduce_for_step();
  const double norm = norm_->global_norm([this](int64_t b, int64_t n) { return grads_at(b, n); }, topo_.world(),
                                         skip, outcome.loss_scale, model_.device());
  outcome.grad_norm = norm;
  const bool overflow = !std::isfinite(norm);
  outcome.non_finite = overflow;
  scaler_.update(overflow);
  if (overflow) {
    outcome.skipped = true;
    params_->redistribute(master_);
    return outcome;
  }
  const double coef = PartitionNorm::clip_coefficient(clip_, norm);
  const double scale = outcome.loss_scale;
  if (offload_) offload_->collect_gradients([this](int64_t b, int64_t n) { return grads_at(b, n); });
  // Bucket by bucket: the partition's gradients upcast to fp32, unscaled, clipped, applied.
  optimizer_->begin_step();
  const int64_t chunk = std::min(comm_.reduce_bucket(), kUpdateChunk);
  for (const auto& piece : trained_->pieces) {
    for (int64_t offset = 0; offset < piece.length; offset += chunk) {
      const int64_t n = std::min(chunk, piece.length - offset);
      const int64_t begin = piece.part_begin + offset;
      torch::Tensor g = offload_ ? offload_->grads_at(begin, n) : grads_at(begin, n);
      if (g.scalar_type() != torch::kFloat32) g = g.to(torch::kFloat32);
      if (scale != 1) g.div_(scale);
      if (coef < 1) g.mul_(coef);
      optimizer_->update(begin, master_at(begin, n), g, lr);
    }
    params_->piece_updated(piece, offload_ ? offload_->staged(piece) : master_);
  }
  params_->after_update(offload_ ? offload_->staging() : master_);
  return outcome;
}

std::pair<int, int> ZeroOptimizer::first_non_finite_gradient() const {
  torch::NoGradGuard no_grad;
  // The owned ranges hold every element once, reduced: the world's minimum over
  // them is the first parameter in model order.
  const int64_t local = norm_->first_non_finite([this](int64_t b, int64_t n) { return grads_at(b, n); },
                                                [this](int64_t index) {
                                                  return trained_->param_at(trained_->flat_of(index));
                                                });
  // The index among the model's parameters (what trains is a subset under LoRA).
  int64_t first = std::numeric_limits<int64_t>::max();
  if (local >= 0) {
    const Parameter* p = trained_->params[local];
    first = p - model_.parameters().data();
  }
  const int64_t world = topo_.world_size();
  const int64_t mine = first == std::numeric_limits<int64_t>::max() ? first : first * world + topo_.rank();
  auto key = torch::tensor({mine}, torch::kLong);
  topo_.world().all_reduce(key, ReduceOp::kMin);
  const int64_t found = key.item<int64_t>();
  if (found == std::numeric_limits<int64_t>::max()) return {-1, -1};
  return {static_cast<int>(found / world), static_cast<int>(found % world)};
}

PartitionState ZeroOptimizer::partition_state() const {
  PartitionState state;
  state.params = params_->partition(low_);
  if (mixed_) state.master_weights = master_;
  state.optimizer = optimizer_->state();
  state.optimizer_steps = optimizer_->steps();
  return state;
}

void ZeroOptimizer::load_partition_state(const torch::Tensor& master,
                                         const std::map<std::string, torch::Tensor>& optimizer,
                                         int64_t optimizer_steps) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(master.numel() == trained_->layout.part && master.scalar_type() == torch::kFloat32,
              "ZeroOptimizer::load_partition_state: master has ", master.numel(), " ", master.scalar_type(),
              " elements, the partition ", trained_->layout.part, " float");
  if (master_.defined()) master_.copy_(master);
  params_->load(master);
  for (auto& [name, tensor] : optimizer_->state()) {
    auto found = optimizer.find(name);
    TORCH_CHECK(found != optimizer.end(), "ZeroOptimizer::load_partition_state: no optimizer state '", name, "'");
    tensor.copy_(found->second);
  }
  optimizer_->set_steps(optimizer_steps);
  params_->redistribute(master_);
}

torch::Tensor ZeroOptimizer::gather_master(int64_t begin, int64_t end) {
  torch::NoGradGuard no_grad;
  if (stage_ == 0) return master_at(begin, end - begin).to(torch::kFloat32);
  // The collective runs on the device (an offloaded master lives in host memory).
  // Each rank contributes the part of [begin, end) inside its slice of the unit.
  const FlatLayout& layout = trained_->layout;
  const std::vector<int64_t> shares = layout.range_shares(begin, end);
  const int unit = layout.unit_at(begin);
  const FlatUnit& u = layout.units[unit];
  const int64_t slice = trained_->slice_of(unit);
  const int64_t own_lo = u.begin + topo_.dp_rank() * slice;
  const int64_t lo = std::clamp(begin, own_lo, own_lo + slice);
  const int64_t mine = shares[topo_.dp_rank()];
  auto local = mine == 0 ? torch::empty({0}, trained_->options.dtype(torch::kFloat32))
                         : master_at(u.begin / layout.dp + (lo - own_lo), mine).to(model_.device(), torch::kFloat32);
  return topo_.dp().all_gather(local.contiguous(), 0, shares);
}

ModelStateBytes ZeroOptimizer::model_state_bytes() const {
  ModelStateBytes b;
  b.params = params_->bytes();
  b.grads = grads_->bytes();
  b.master_weights = master_.defined() ? static_cast<int64_t>(master_.nbytes()) : 0;
  b.optimizer_states = optimizer_->state_bytes();
  if (offload_) {
    b.offload_buffers = offload_->buffer_bytes();
    b.host = b.master_weights + b.optimizer_states + b.offload_buffers;
  }
  b.host += params_->host_bytes();
  if (frozen_params_) {
    b.frozen_params = frozen_params_->bytes();
    b.host += frozen_params_->host_bytes();
  } else {
    for (auto& p : model_.parameters())
      if (!p.trains()) b.frozen_params += p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
  }
  return b;
}

ModelStateBytes ZeroOptimizer::analytic_model_state() const {
  ModelStateBytes b = analytic_model_state_bytes(trained_->layout, low_, optimizer_config_, fp32_accum_, placement_);
  b.frozen_params = frozen_analytic_bytes_;
  b.host += frozen_analytic_host_;
  return b;
}
}  // namespace autotp
