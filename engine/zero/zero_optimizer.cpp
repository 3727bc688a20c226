#include "autotp/zero/zero_optimizer.h"

#include <cmath>
#include <limits>

#include "autotp/base/error.h"
#include "autotp/zero/stage3_params.h"

namespace autotp {
namespace {

std::unique_ptr<HeldParams> hold(std::vector<Parameter*> params, const ZeroUnits& units, const ZeroGroups& groups,
                                 int stage, int64_t persistence_threshold, torch::TensorOptions options) {
  std::vector<const PlanEntry*> entries;
  for (const Parameter* p : params) entries.push_back(p->entry);
  FlatLayout layout =
      zero_layout(entries, units, groups.tp->rank(), groups.dp->size(), stage, persistence_threshold);
  return std::make_unique<HeldParams>(std::move(params), std::move(layout), groups.tp->rank(), groups.dp->rank(),
                                      options);
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

bool ZeroOptimizer::holds(const Parameter& p) const {
  switch (set_) {
    case HeldSet::kAll:
      return true;
    case HeldSet::kDense:
      return p.entry->expert < 0;
    case HeldSet::kExperts:
      return p.entry->expert >= 0;
  }
  return true;
}

std::vector<Parameter*> ZeroOptimizer::held(bool frozen) const {
  std::vector<Parameter*> out;
  for (auto& p : model_.parameters())
    if (p.entry->frozen == frozen && holds(p)) out.push_back(&p);
  return out;
}

ZeroOptimizer::ZeroOptimizer(ShardedModel& model, Topology& topology, const ZeroSettings& config)
    : ZeroOptimizer(model, ZeroGroups{&topology.tp(), &topology.dp(), &topology.world()}, config,
                    topology.ep_size() > 1 ? HeldSet::kDense : HeldSet::kAll) {
  if (topology.ep_size() > 1)
    experts_.reset(new ZeroOptimizer(model, ZeroGroups{&topology.tp(), &topology.edp(), &topology.world()}, config,
                                     HeldSet::kExperts));
  if (stage_ < 2) return;
  UseHooks hooks = make_hooks();
  if (experts_) {
    // Both optimizers around every use: this one's units, then the experts'.
    UseHooks theirs = experts_->make_hooks();
    auto both = [](std::function<void(int64_t)> a, std::function<void(int64_t)> b) -> std::function<void(int64_t)> {
      if (!a || !b) return a ? a : b;
      return [a, b](int64_t use) {
        a(use);
        b(use);
      };
    };
    hooks.before_forward = both(hooks.before_forward, theirs.before_forward);
    hooks.after_forward = both(hooks.after_forward, theirs.after_forward);
    hooks.before_backward = both(hooks.before_backward, theirs.before_backward);
    hooks.after_backward = both(hooks.after_backward, theirs.after_backward);
  }
  model_.set_use_hooks(std::move(hooks));
}

ZeroOptimizer::ZeroOptimizer(ShardedModel& model, ZeroGroups groups, const ZeroSettings& config, HeldSet set)
    : model_(model),
      groups_(groups),
      set_(set),
      stage_(config.zero.stage),
      clip_(config.gradient_clipping),
      comm_(*groups.dp, config.zero.reduce_bucket_size, config.zero.allgather_bucket_size,
            config.zero.overlaps(model.device().is_cuda()) && groups.dp->size() > 1),
      scaler_(config.fp16),
      optimizer_config_(config.optimizer),
      placement_{config.zero.offloads_optimizer(), config.zero.offloads_params()},
      accumulation_steps_(config.gradient_accumulation_steps) {
  torch::NoGradGuard no_grad;
  std::vector<Parameter*> trained = held(/*frozen=*/false);
  low_ = held_dtype(trained, model_.dtype());
  mixed_ = low_ != torch::kFloat32;
  fp32_accum_ = mixed_ && config.gradient_accumulation_steps > 1;
  const auto options = torch::TensorOptions().dtype(low_).device(model_.device());
  const ZeroUnits units{model_.num_layers()};
  const int64_t threshold = config.zero.stage3_param_persistence_threshold;
  trained_ = hold(std::move(trained), units, groups_, stage_, threshold, options);

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
    std::vector<Parameter*> frozen = held(/*frozen=*/true);
    if (!frozen.empty()) {
      const auto frozen_options = options.dtype(held_dtype(frozen, model_.dtype()));
      frozen_ = hold(std::move(frozen), units, groups_, stage_, threshold, frozen_options);
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
      if (!p.trains() && holds(p)) frozen_entries.push_back(p.entry);
    if (!frozen_entries.empty())
      frozen_analytic_bytes_ = analytic_frozen_bytes(
          zero_layout(frozen_entries, units, groups_.tp->rank(), groups_.dp->size(), stage_, threshold),
          model_.dtype());
  }
  if (stage_ <= 1) {
    if (stage_ == 0)
      grads_ = std::make_unique<AllReducedGrads>(*trained_, *groups_.tp, comm_, fp32_accum_);
    else
      grads_ = std::make_unique<StepScatteredGrads>(*trained_, *groups_.tp, comm_, fp32_accum_);
  } else {
    grads_ = std::make_unique<BackwardScatteredGrads>(*trained_, *groups_.tp, comm_, fp32_accum_);
  }
  std::vector<const ShardSpec*> specs;
  for (const Parameter* p : trained_->params) specs.push_back(&p->spec());
  norm_ = std::make_unique<PartitionNorm>(specs, trained_->layout, groups_.tp->rank(), groups_.dp->rank());
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
}

ZeroOptimizer::~ZeroOptimizer() {
  if (stage_ >= 2 && set_ != HeldSet::kExperts) model_.set_use_hooks({});
  groups_.dp->wait_all();  // nothing of ours still running on the lane (errors are dropped here)
}

UseHooks ZeroOptimizer::make_hooks() {
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
  return hooks;
}

torch::Tensor ZeroOptimizer::master_at(int64_t begin, int64_t length) const {
  if (master_.defined()) return master_.narrow(0, begin, length);
  return params_->at(begin, length);  // fp32: the parameters are the master
}

void ZeroOptimizer::gather_all_params(bool frozen) {
  if (stage_ != 3) return;
  params_->gather_all();
  if (frozen && frozen_params_) frozen_params_->gather_all();
  if (experts_) experts_->gather_all_params(frozen);
}

void ZeroOptimizer::begin_step() {
  torch::NoGradGuard no_grad;
  comm_.finish(0);  // left by a backward that did not reach after_backward
  params_->begin_step();
  if (frozen_params_) frozen_params_->begin_step();
  grads_->begin_step();
  micro_batch_ = 0;
  if (offload_) offload_->begin_step();
  if (experts_) experts_->begin_step();
}

void ZeroOptimizer::after_backward() {
  torch::NoGradGuard no_grad;
  params_->after_backward();
  if (frozen_params_) frozen_params_->after_backward();
  grads_->after_backward();
  ++micro_batch_;
  if (experts_) experts_->after_backward();
}

StepOutcome ZeroOptimizer::step(double lr, bool skip) {
  torch::NoGradGuard no_grad;
  StepOutcome outcome;
  outcome.loss_scale = scaler_.scale();
  comm_.finish(0);  // after_backward completes them; a caller that skipped it must not read half-reduced grads
  grads_->reduce_for_step();
  const PartitionGrads grads = [this](int64_t b, int64_t n) { return grads_at(b, n); };
  torch::Tensor sumsq = norm_->local_sum_of_squares(grads, model_.device());
  if (experts_) {
    experts_->comm_.finish(0);
    experts_->grads_->reduce_for_step();
    sumsq.add_(experts_->norm_->local_sum_of_squares(
        [e = experts_.get()](int64_t b, int64_t n) { return e->grads_at(b, n); }, model_.device()));
  }
  const double norm = PartitionNorm::world_norm(sumsq, *groups_.world, skip, outcome.loss_scale);
  outcome.grad_norm = norm;
  const bool overflow = !std::isfinite(norm);
  outcome.non_finite = overflow;
  scaler_.update(overflow);
  if (overflow) {
    outcome.skipped = true;
    params_->redistribute(master_);
    if (experts_) experts_->params_->redistribute(experts_->master_);
    return outcome;
  }
  const double coef = PartitionNorm::clip_coefficient(clip_, norm);
  apply_update(lr, coef, outcome.loss_scale);
  if (experts_) experts_->apply_update(lr, coef, outcome.loss_scale);
  return outcome;
}

void ZeroOptimizer::apply_update(double lr, double coef, double scale) {
  if (offload_) offload_->collect_gradients([this](int64_t b, int64_t n) { return grads_at(b, n); });
  // Bucket by bucket: the partition's gradients upcast to fp32, unscaled, clipped, applied.
  optimizer_->begin_step();
  const int64_t chunk = std::min(comm_.reduce_bucket(), offload_ ? kUpdateChunk : update_chunk(model_.device().is_cuda()));
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
}

int64_t ZeroOptimizer::local_first_non_finite() const {
  // The owned ranges hold every element once, reduced: the minimum over them is
  // the first parameter in model order.
  const int64_t local = norm_->first_non_finite([this](int64_t b, int64_t n) { return grads_at(b, n); },
                                                [this](int64_t index) {
                                                  return trained_->param_at(trained_->flat_of(index));
                                                });
  // The index among the model's parameters (what trains is a subset under LoRA).
  int64_t first = local < 0 ? std::numeric_limits<int64_t>::max() : trained_->params[local] - model_.parameters().data();
  if (experts_) first = std::min(first, experts_->local_first_non_finite());
  return first;
}

std::pair<int, int> ZeroOptimizer::first_non_finite_gradient() const {
  torch::NoGradGuard no_grad;
  const int64_t first = local_first_non_finite();
  const int64_t world = groups_.world->size();
  const int64_t mine = first == std::numeric_limits<int64_t>::max() ? first : first * world + groups_.world->rank();
  auto key = torch::tensor({mine}, torch::kLong);
  groups_.world->all_reduce(key, ReduceOp::kMin);
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
  const int64_t own_lo = u.begin + groups_.dp->rank() * slice;
  const int64_t lo = std::clamp(begin, own_lo, own_lo + slice);
  const int64_t mine = shares[groups_.dp->rank()];
  auto local = mine == 0 ? torch::empty({0}, trained_->options.dtype(torch::kFloat32))
                         : master_at(u.begin / layout.dp + (lo - own_lo), mine).to(model_.device(), torch::kFloat32);
  return groups_.dp->all_gather(local.contiguous(), 0, shares);
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
      if (!p.trains() && holds(p)) b.frozen_params += p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
  }
  if (experts_) b += experts_->model_state_bytes();
  return b;
}

ModelStateBytes ZeroOptimizer::analytic_model_state() const {
  ModelStateBytes b = analytic_model_state_bytes(trained_->layout, low_, optimizer_config_, fp32_accum_, placement_);
  b.frozen_params = frozen_analytic_bytes_;
  b.host += frozen_analytic_host_;
  if (experts_) b += experts_->analytic_model_state();
  return b;
}
}  // namespace autotp
