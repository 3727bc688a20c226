#include "autotp/zero/zero_optimizer.h"

#include <cmath>
#include <regex>

#include "autotp/optim/grad_norm.h"
#include "autotp/runtime/error.h"
#include "autotp/runtime/log.h"
#include "autotp/tp/parallel_layers.h"

namespace autotp {

nlohmann::json ModelStateBytes::to_json() const {
  return {{"params", params},
          {"grads", grads},
          {"master_weights", master_weights},
          {"optimizer_states", optimizer_states},
          {"total", total()}};
}

namespace {
int64_t optimizer_state_count(const OptimizerConfig& o) {
  if (o.type == "SGD") return o.momentum != 0 ? 1 : 0;
  return 2;
}
}  // namespace

ModelStateBytes ZeroOptimizer::analytic_bytes(int64_t local_numel, int dp, int stage, torch::ScalarType dtype,
                                              const OptimizerConfig& optimizer) {
  const FlatLayout layout = FlatLayout::build(std::vector<int64_t>{local_numel}, dp, stage);
  const int64_t padded = layout.padded, part = layout.part;
  const int64_t low = static_cast<int64_t>(c10::elementSize(dtype));
  const bool mixed = dtype != torch::kFloat32;
  ModelStateBytes b;
  b.params = (stage == 3 ? part : padded) * low;
  if (stage <= 1)
    b.grads = padded * low + (mixed ? padded * 4 : 0);
  else
    b.grads = part * 4;
  b.master_weights = mixed ? part * 4 : 0;
  b.optimizer_states = optimizer_state_count(optimizer) * part * 4;
  return b;
}

ZeroOptimizer::ZeroOptimizer(CausalLM& model, Topology& topology, const TrainConfig& config)
    : model_(model),
      topo_(topology),
      stage_(config.zero.stage),
      clip_(config.gradient_clipping),
      bucket_elements_(std::max<int64_t>(1, config.zero.reduce_bucket_size)),
      fp16_(config.fp16),
      low_(model.dtype()),
      mixed_(model.dtype() != torch::kFloat32) {
  torch::NoGradGuard no_grad;
  std::vector<const ShardSpec*> specs;
  for (auto& p : model_.parameters()) specs.push_back(&p.spec());
  layout_ = FlatLayout::build(specs, topo_.tp_rank(), topo_.dp_size(), stage_);
  offsets_ = layout_.offsets;
  padded_ = layout_.padded;
  part_numel_ = layout_.part;
  part_offset_ = layout_.part_offset(topo_.dp_rank());

  auto flat = torch::zeros({padded_}, low_options());
  owned_mask_ = torch::zeros({padded_}, low_options().dtype(torch::kFloat32));
  for (size_t i = 0; i < model_.parameters().size(); ++i) {
    auto& p = model_.parameters()[i];
    flat.narrow(0, offsets_[i], p.tensor.numel()).copy_(p.tensor.reshape({-1}));
    auto mask = owned_mask_.narrow(0, offsets_[i], p.tensor.numel()).view(p.tensor.sizes());
    const ShardSpec& spec = p.spec();
    for (const auto& seg : spec.owned_local(topo_.tp_rank())) {
      if (spec.is_replicated())
        mask.fill_(1);
      else
        mask.narrow(spec.dim(), seg.start, seg.length).fill_(1);
    }
  }
  if (stage_ == 0 && topo_.dp_rank() != 0) owned_mask_.zero_();  // stage 0: dp replicas count once
  bind_params(flat);
  if (stage_ == 3) {
    param_part_ = partition(flat).clone();
    master_ = mixed_ ? param_part_.to(torch::kFloat32) : param_part_;
  } else if (mixed_) {
    master_ = partition(flat_params_).to(torch::kFloat32);
  } else {
    master_ = partition(flat_params_);
  }
  optimizer_ = std::make_unique<FlatOptimizer>(config.optimizer, part_numel_, model_.device());
  if (fp16_.enabled) {
    loss_scale_ = fp16_.loss_scale > 0 ? fp16_.loss_scale : std::pow(2.0, fp16_.initial_scale_power);
    hysteresis_left_ = fp16_.hysteresis;
  }
  if (stage_ == 3) {
    static const std::regex layer_name(R"(\.(layers|h)\.([0-9]+)\.)");
    layer_params_.assign(model_.config().num_layers, {});
    for (size_t i = 0; i < model_.parameters().size(); ++i) {
      std::smatch match;
      const std::string& name = model_.parameters()[i].name();
      if (std::regex_search(name, match, layer_name))
        layer_params_[std::stoll(match[2].str())].push_back(i);
      else
        outer_params_.push_back(i);
    }
    model_.set_layer_hooks({[this](int64_t l) { gather_layer(l); }, [this](int64_t l) { release_layer(l); }});
    release_params();
  }
}

torch::Tensor ZeroOptimizer::gather_range(const torch::Tensor& part, int64_t begin, int64_t end) {
  // Each rank contributes the part of [begin, end) inside its own partition.
  const std::vector<int64_t> sizes = layout_.range_shares(begin, end);
  int64_t lo = std::max(begin, part_offset_);
  auto local = part.narrow(0, std::min(lo - part_offset_, part_numel_), sizes[topo_.dp_rank()]);
  return topo_.dp().all_gather(local.contiguous(), 0, sizes);
}

void ZeroOptimizer::gather_layer(int64_t layer) {
  torch::NoGradGuard no_grad;
  const auto& members = layer_params_.at(layer);
  const int64_t begin = offsets_[members.front()];
  const size_t last = members.back();
  const int64_t end = offsets_[last] + model_.parameters()[last].spec().local_numel(topo_.tp_rank());
  auto buffer = gather_range(param_part_, begin, end);
  for (size_t i : members) {
    auto& p = model_.parameters()[i];
    const int rank = topo_.tp_rank();
    p.tensor.set_data(buffer.narrow(0, offsets_[i] - begin, p.spec().local_numel(rank)).view(p.spec().local_shape(rank)));
  }
}

void ZeroOptimizer::release_layer(int64_t layer) {
  for (size_t i : layer_params_.at(layer))
    model_.parameters()[i].tensor.set_data(torch::empty({0}, low_options()));
}

void ZeroOptimizer::gather_all_params() {
  if (stage_ != 3) return;
  torch::NoGradGuard no_grad;
  auto full = topo_.dp().all_gather(param_part_, 0);
  int64_t i = 0;
  for (auto& p : model_.parameters()) {
    const int rank = topo_.tp_rank();
    p.tensor.set_data(full.narrow(0, offsets_[i++], p.spec().local_numel(rank)).view(p.spec().local_shape(rank)));
  }
}

torch::Tensor ZeroOptimizer::partition(const torch::Tensor& flat) const {
  return flat.narrow(0, part_offset_, part_numel_);
}

void ZeroOptimizer::bind_params(const torch::Tensor& flat) {
  flat_params_ = flat;
  for (size_t i = 0; i < model_.parameters().size(); ++i) {
    auto& p = model_.parameters()[i];
    auto shape = p.spec().local_shape(topo_.tp_rank());
    p.tensor.set_data(flat.narrow(0, offsets_[i], p.tensor.numel() > 0 ? p.tensor.numel() : 0).view(shape));
  }
}

void ZeroOptimizer::release_params() {
  // Stage 3: the parameters keep their identity (autograd) but lose their storage.
  for (auto& p : model_.parameters()) p.tensor.set_data(torch::empty({0}, low_options()));
  flat_params_ = torch::Tensor();
}

void ZeroOptimizer::bind_grads(const torch::Tensor& flat) {
  flat_grads_ = flat;
  for (size_t i = 0; i < model_.parameters().size(); ++i) {
    auto& p = model_.parameters()[i];
    // Shapes from the spec: at stage 3 a parameter may be released (empty) right now.
    const int rank = topo_.tp_rank();
    p.tensor.mutable_grad() =
        flat.narrow(0, offsets_[i], p.spec().local_numel(rank)).view(p.spec().local_shape(rank));
  }
}

void ZeroOptimizer::begin_step() {
  torch::NoGradGuard no_grad;
  if (stage_ == 3) {
    // Embeddings, final norm and head stay whole for the step; layers come and go.
    const int rank = topo_.tp_rank();
    for (size_t i : outer_params_) {
      auto& p = model_.parameters()[i];
      const int64_t n = p.spec().local_numel(rank);
      p.tensor.set_data(gather_range(param_part_, offsets_[i], offsets_[i] + n).view(p.spec().local_shape(rank)));
    }
  }
  if (!flat_grads_.defined())
    bind_grads(torch::zeros({padded_}, low_options()));
  else
    flat_grads_.zero_();
  if (mixed_) {
    if (!grad_accum_.defined())
      grad_accum_ = torch::zeros({padded_}, low_options().dtype(torch::kFloat32));
    else
      grad_accum_.zero_();
  }
}

void ZeroOptimizer::after_backward() {
  if (!mixed_) return;  // fp32 gradients accumulate in place
  torch::NoGradGuard no_grad;
  grad_accum_.add_(flat_grads_.to(torch::kFloat32));
  flat_grads_.zero_();
}

void ZeroOptimizer::sync_shared_grads(torch::Tensor& flat) {
  const int rank = topo_.tp_rank();
  for (size_t i = 0; i < model_.parameters().size(); ++i) {
    const ShardSpec& spec = model_.parameters()[i].spec();
    auto local = flat.narrow(0, offsets_[i], spec.local_numel(rank)).view(spec.local_shape(rank));
    sum_shared_slices(spec, local, topo_.tp());
  }
}

StepOutcome ZeroOptimizer::step(double lr) {
  torch::NoGradGuard no_grad;
  StepOutcome outcome;
  outcome.loss_scale = loss_scale_;
  torch::Tensor acc = mixed_ ? grad_accum_ : flat_grads_;
  sync_shared_grads(acc);
  // Gradients are reduced in buckets of reduce_bucket_size elements, so the
  // communication buffers stay bounded. Gloo in LibTorch 1.13 has no
  // reduce-scatter, so stages 2-3 all-reduce too and keep their own partition.
  for (int64_t offset = 0; offset < padded_; offset += bucket_elements_) {
    auto bucket = acc.narrow(0, offset, std::min(bucket_elements_, padded_ - offset));
    topo_.dp().all_reduce(bucket);
  }
  torch::Tensor grads;
  if (stage_ <= 1) {
    grads = partition(acc);
  } else {
    grad_part_ = partition(acc).clone();
    grads = grad_part_;
  }
  if (loss_scale_ != 1) grads.div_(loss_scale_);
  auto sumsq = masked_sum_of_squares(grads, partition(owned_mask_));
  topo_.world().all_reduce(sumsq);
  double norm = std::sqrt(sumsq.item<double>());
  outcome.grad_norm = norm;

  bool overflow = !std::isfinite(norm);
  if (fp16_.enabled && fp16_.loss_scale == 0) {
    // Dynamic loss scaling (DeepSpeed's rules): halve on overflow after `hysteresis`
    // overflows, double after loss_scale_window clean steps.
    if (overflow) {
      if (--hysteresis_left_ <= 0) {
        loss_scale_ = std::max(loss_scale_ / 2, fp16_.min_loss_scale);
        hysteresis_left_ = fp16_.hysteresis;
      }
      good_steps_ = 0;
    } else if (++good_steps_ % fp16_.loss_scale_window == 0) {
      loss_scale_ *= 2;
      hysteresis_left_ = fp16_.hysteresis;
    }
  }
  if (overflow && fp16_.enabled) {
    outcome.skipped = true;
  } else {
    if (clip_ > 0) {
      double coef = clip_ / (norm + 1e-6);
      if (coef < 1) grads.mul_(coef);
    }
    optimizer_->step(master_, grads, lr);
  }

  redistribute_params();
  if (stage_ == 3) {
    flat_grads_ = torch::Tensor();
    for (auto& p : model_.parameters()) p.tensor.mutable_grad() = torch::Tensor();
  } else {
    if (stage_ == 2) {
      // Only the reduced partition survives the step; the full buffer is rebuilt next step.
      flat_grads_ = torch::Tensor();
      for (auto& p : model_.parameters()) p.tensor.mutable_grad() = torch::Tensor();
    }
  }
  if (mixed_ && stage_ >= 2) grad_accum_ = torch::Tensor();
  return outcome;
}

void ZeroOptimizer::redistribute_params() {
  if (stage_ == 3) {
    if (mixed_) param_part_.copy_(master_);
    release_params();
    return;
  }
  if (mixed_) partition(flat_params_).copy_(master_);
  if (stage_ >= 1 && topo_.dp_size() > 1) flat_params_.copy_(topo_.dp().all_gather(partition(flat_params_), 0));
}

PartitionState ZeroOptimizer::partition_state() const {
  PartitionState state;
  state.params = stage_ == 3 ? param_part_ : partition(flat_params_);
  if (mixed_) state.master_weights = master_;
  state.optimizer = optimizer_->state();
  state.optimizer_steps = optimizer_->steps();
  return state;
}

void ZeroOptimizer::load_partition_state(const torch::Tensor& master,
                                         const std::map<std::string, torch::Tensor>& optimizer,
                                         int64_t optimizer_steps) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(master.numel() == part_numel_ && master.scalar_type() == torch::kFloat32,
              "ZeroOptimizer::load_partition_state: master has ", master.numel(), " ", master.scalar_type(),
              " elements, the partition ", part_numel_, " float");
  if (stage_ == 3) {
    if (mixed_)
      master_.copy_(master), param_part_.copy_(master);
    else
      param_part_.copy_(master);  // master_ is param_part_
  } else {
    if (mixed_) master_.copy_(master);
    partition(flat_params_).copy_(master);  // in fp32 master_ is this view
  }
  for (auto& [name, tensor] : optimizer_->state()) {
    auto found = optimizer.find(name);
    TORCH_CHECK(found != optimizer.end(), "ZeroOptimizer::load_partition_state: no optimizer state '", name, "'");
    tensor.copy_(found->second);
  }
  optimizer_->set_steps(optimizer_steps);
  redistribute_params();
}

void ZeroOptimizer::set_loss_scaler_state(const LossScalerState& state) {
  loss_scale_ = state.loss_scale;
  good_steps_ = state.good_steps;
  hysteresis_left_ = state.hysteresis_left;
}

torch::Tensor ZeroOptimizer::gather_master(int64_t begin, int64_t end) {
  torch::NoGradGuard no_grad;
  if (stage_ == 0) return master_.narrow(0, begin, end - begin);
  return gather_range(master_, begin, end);
}

ModelStateBytes ZeroOptimizer::model_state_bytes() const {
  auto bytes = [](const torch::Tensor& t) {
    return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : int64_t{0};
  };
  ModelStateBytes b;
  b.params = stage_ == 3 ? bytes(param_part_) : bytes(flat_params_);
  b.grads = stage_ <= 1 ? bytes(flat_grads_) + bytes(grad_accum_) : bytes(grad_part_);
  b.master_weights = mixed_ ? bytes(master_) : 0;
  b.optimizer_states = optimizer_->state_bytes();
  return b;
}

}  // namespace autotp
