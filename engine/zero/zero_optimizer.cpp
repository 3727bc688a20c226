#include "autotp/zero/zero_optimizer.h"

#include <cmath>
#include <limits>
#include <regex>

#include "autotp/optim/grad_norm.h"
#include "autotp/base/error.h"
#include "autotp/base/log.h"
#include "autotp/base/memory_counter.h"
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

ModelStateBytes ZeroOptimizer::analytic_bytes(const FlatLayout& layout, torch::ScalarType dtype,
                                              const OptimizerConfig& optimizer, bool fp32_grad_accumulation) {
  const int64_t padded = layout.padded, part = layout.part;
  const int64_t low = static_cast<int64_t>(c10::elementSize(dtype));
  const bool mixed = dtype != torch::kFloat32;
  const bool accumulate32 = mixed && fp32_grad_accumulation;
  ModelStateBytes b;
  if (layout.stage == 3) {
    // The partition, plus the persistent unit held whole.
    const int64_t whole = layout.whole_unit >= 0 ? layout.units[layout.whole_unit].length : 0;
    b.params = (part + whole) * low;
  } else {
    b.params = padded * low;
  }
  if (layout.stage <= 1)
    b.grads = padded * low + (accumulate32 ? padded * 4 : 0);
  else
    b.grads = part * (accumulate32 ? 4 : low);
  b.master_weights = mixed ? part * 4 : 0;
  b.optimizer_states = optimizer_state_count(optimizer) * part * 4;
  return b;
}

namespace {

// Stage 3 frees a unit's storage between uses; the parameters (views of it)
// and anything autograd saved keep pointing at the same storage, which is
// refilled before the next use (FSDP's approach).
void free_storage(const torch::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

void allocate_storage(const torch::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

// Flat intervals [begin, end) of a local shard that tp rank `tp_rank` owns (counts in norms).
std::vector<std::pair<int64_t, int64_t>> owned_intervals(const ShardSpec& spec, int tp_rank) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const auto owned = spec.owned_local(tp_rank);
  const int64_t numel = spec.local_numel(tp_rank);
  if (owned.empty() || numel == 0) return out;
  if (spec.is_replicated()) return {{0, numel}};
  const auto shape = spec.local_shape(tp_rank);
  const int64_t dim = spec.dim();
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= shape[d];
  for (size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t extent = shape[dim];
  for (int64_t o = 0; o < outer; ++o)
    for (const auto& seg : owned) {
      const int64_t begin = (o * extent + seg.start) * inner, end = begin + seg.length * inner;
      if (!out.empty() && out.back().second == begin)
        out.back().second = end;
      else
        out.emplace_back(begin, end);
    }
  return out;
}

}  // namespace

ZeroOptimizer::ZeroOptimizer(CausalLM& model, Topology& topology, const ZeroSettings& config)
    : model_(model),
      topo_(topology),
      stage_(config.zero.stage),
      clip_(config.gradient_clipping),
      reduce_bucket_(std::max<int64_t>(1, config.zero.reduce_bucket_size)),
      gather_bucket_(std::max<int64_t>(1, config.zero.allgather_bucket_size)),
      fp16_(config.fp16),
      low_(model.dtype()),
      mixed_(model.dtype() != torch::kFloat32),
      fp32_accum_(model.dtype() != torch::kFloat32 && config.gradient_accumulation_steps > 1),
      overlap_(config.zero.overlaps(model.device().is_cuda()) && topology.dp_size() > 1),
      prefetch_(overlap_ && stage_ == 3 && config.zero.stage3_prefetch_bucket_size > 0),
      max_live_(config.zero.stage3_max_live_parameters) {
  torch::NoGradGuard no_grad;
  auto& params = model_.parameters();
  const int tp_rank = topo_.tp_rank(), dp = topo_.dp_size(), dp_rank = topo_.dp_rank();
  layout_ = zero_layout(model_.plan(), tp_rank, dp, stage_, config.zero.stage3_param_persistence_threshold);
  pieces_ = layout_.pieces(dp_rank);
  ids_ = ZeroUnits{model_.config().num_layers};
  unit_params_.assign(layout_.units.size(), {});
  for (size_t i = 0; i < params.size(); ++i) unit_params_[layout_.unit_of[i]].push_back(i);

  compute_norm_ranges();
  auto bind = [&](size_t i, const torch::Tensor& storage, int64_t offset) {
    const ShardSpec& spec = params[i].spec();
    params[i].tensor.set_data(storage.narrow(0, offset, layout_.numels[i]).view(spec.local_shape(tp_rank)));
  };
  // The parameters move into the flat buffer (stages 0-2) or unit by unit into
  // their unit buffers (stage 3: each freed once its slice is in the partition,
  // so the whole model never exists twice).
  auto fill = [&](const torch::Tensor& buffer, int64_t base, size_t i) {
    buffer.narrow(0, layout_.offsets[i] - base, layout_.numels[i]).copy_(params[i].tensor.reshape({-1}));
    bind(i, buffer, layout_.offsets[i] - base);
  };
  if (stage_ == 3) {
    param_part_ = torch::empty({layout_.part}, low_options());
    gathered_.assign(layout_.units.size(), 0);
    for (size_t u = 0; u < layout_.units.size(); ++u) {
      const FlatUnit& unit = layout_.units[u];
      auto buffer = torch::zeros({unit.length}, low_options());
      for (size_t i : unit_params_[u]) fill(buffer, unit.begin, i);
      const int64_t s = slice_of(static_cast<int>(u));
      param_part_.narrow(0, unit.begin / layout_.dp, s).copy_(buffer.narrow(0, dp_rank * s, s));
      if (static_cast<int>(u) != layout_.whole_unit) free_storage(buffer);
      unit_buffers_.push_back(buffer);
    }
    if (mixed_) master_ = param_part_.to(torch::kFloat32);
  } else {
    flat_params_ = torch::zeros({layout_.padded}, low_options());
    for (size_t i = 0; i < params.size(); ++i) fill(flat_params_, 0, i);
    if (mixed_) master_ = master_partition();  // an fp32 copy ([padded] at stage 0)
  }
  if (mixed_ && master_.scalar_type() != torch::kFloat32) master_ = master_.to(torch::kFloat32);
  optimizer_ = std::make_unique<FlatOptimizer>(config.optimizer, layout_.part, model_.device());
  if (fp16_.enabled) {
    loss_scale_ = fp16_.loss_scale > 0 ? fp16_.loss_scale : std::pow(2.0, fp16_.initial_scale_power);
    hysteresis_left_ = fp16_.hysteresis;
  }
  // Uses (embeddings = 0, layer l = l + 1, head = L + 1) and the units each reads / reduces.
  const int64_t L = model_.config().num_layers;
  use_units_.assign(L + 2, {});
  reduce_after_use_.assign(L + 2, {});
  use_units_[0] = {ZeroUnits::kEmbedding};
  for (int64_t l = 0; l < L; ++l) use_units_[l + 1] = reduce_after_use_[l + 1] = {ids_.layer(l)};
  use_units_[L + 1] = {ids_.head()};
  if (model_.config().tie_word_embeddings)
    use_units_[L + 1].push_back(ZeroUnits::kEmbedding);  // reduced at the end of the backward
  else
    reduce_after_use_[L + 1] = {ids_.head()};
  if (stage_ >= 2) install_hooks();
}

ZeroOptimizer::~ZeroOptimizer() {
  if (stage_ >= 2) model_.set_use_hooks({});
  topo_.dp().wait_all();  // nothing of ours still running on the lane (errors are dropped here)
}

void ZeroOptimizer::install_hooks() {
  CausalLM::UseHooks hooks;
  if (stage_ == 3) {
    auto acquire = [this](int64_t use) {
      for (int u : use_units_.at(use + 1)) acquire_unit(u);
    };
    auto release = [this](int64_t use) {
      for (int u : use_units_.at(use + 1)) release_unit(u);
    };
    // The next use in time: forward goes up to the head, backward down to layer 0
    // (the embeddings' backward reads no weight).
    hooks.before_forward = [this, acquire](int64_t use) {
      acquire(use);
      if (prefetch_ && use < model_.head_use()) prefetch_use(use + 1);
    };
    hooks.after_forward = release;
    hooks.before_backward = [this, acquire](int64_t use) {
      acquire(use);
      if (prefetch_ && use > 0) prefetch_use(use - 1);
    };
    hooks.after_backward = [this, release](int64_t use) {
      release(use);  // first: the gathered unit and its gradients need not coexist
      for (int u : reduce_after_use_.at(use + 1)) reduce_unit_grads(u);
    };
  } else {
    hooks.after_backward = [this](int64_t use) {
      for (int u : reduce_after_use_.at(use + 1)) reduce_unit_grads(u);
    };
  }
  model_.set_use_hooks(std::move(hooks));
}

void ZeroOptimizer::compute_norm_ranges() {
  // Each logical element once: its tp owner (TpPlan), and over dp the holder of
  // its partition (stage 0: dp rank 0, every rank holds everything).
  norm_ranges_.clear();
  const int tp_rank = topo_.tp_rank(), dp = topo_.dp_size(), dp_rank = topo_.dp_rank();
  if (stage_ == 0 && dp_rank != 0) return;
  auto& params = model_.parameters();
  int last_unit = -1;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t base = layout_.offsets[i];
    const FlatUnit& unit = layout_.units[layout_.unit_of[i]];
    const int64_t s = unit.length / dp;
    const int64_t own_lo = unit.begin + dp_rank * s, own_hi = own_lo + s;
    for (auto [b, e] : owned_intervals(params[i].spec(), tp_rank)) {
      int64_t lo = base + b, hi = base + e;
      if (stage_ >= 1) {
        lo = std::max(lo, own_lo), hi = std::min(hi, own_hi);
        if (hi <= lo) continue;
        lo = unit.begin / dp + (lo - own_lo), hi = unit.begin / dp + (hi - own_lo);
      }
      // Merged only within a unit: at stage 1 a range must stay inside one piece of the flat buffer.
      if (!norm_ranges_.empty() && last_unit == layout_.unit_of[i] &&
          norm_ranges_.back().first + norm_ranges_.back().second == lo)
        norm_ranges_.back().second += hi - lo;
      else
        norm_ranges_.emplace_back(lo, hi - lo);
      last_unit = layout_.unit_of[i];
    }
  }
}

torch::Tensor ZeroOptimizer::own_slice(const torch::Tensor& flat, int unit) const {
  const FlatUnit& u = layout_.units[unit];
  return flat.narrow(0, u.begin + topo_.dp_rank() * slice_of(unit), slice_of(unit));
}

int64_t ZeroOptimizer::flat_of(int64_t index) const {
  if (stage_ == 0) return index;
  auto it = std::upper_bound(pieces_.begin(), pieces_.end(), index,
                             [](int64_t x, const PartitionPiece& p) { return x < p.part_begin + p.length; });
  TORCH_CHECK(it != pieces_.end(), "ZeroOptimizer: partition element ", index, " outside ", layout_.part);
  return it->flat_begin + (index - it->part_begin);
}

torch::Tensor ZeroOptimizer::grads_at(int64_t begin, int64_t length) const {
  if (stage_ >= 2) return grad_part_.narrow(0, begin, length);
  const torch::Tensor& acc = fp32_accum_ ? grad_accum_ : flat_grads_;
  return acc.narrow(0, flat_of(begin), length);
}

torch::Tensor ZeroOptimizer::master_at(int64_t begin, int64_t length) const {
  if (mixed_) return master_.narrow(0, begin, length);
  if (stage_ == 3) return param_part_.narrow(0, begin, length);
  return flat_params_.narrow(0, flat_of(begin), length);  // fp32: the parameters are the master
}

torch::Tensor ZeroOptimizer::master_partition() const {
  if (mixed_ && master_.defined()) return master_;
  const torch::Tensor& values = stage_ == 3 ? param_part_ : flat_params_;
  if (stage_ == 0 || stage_ == 3) return values.to(torch::kFloat32);
  return partition_copy(values, torch::kFloat32);
}

torch::Tensor ZeroOptimizer::partition_copy(const torch::Tensor& flat, torch::ScalarType dtype) const {
  auto out = torch::empty({layout_.part}, flat.options().dtype(dtype));
  for (const auto& piece : pieces_)
    out.narrow(0, piece.part_begin, piece.length).copy_(flat.narrow(0, piece.flat_begin, piece.length));
  return out;
}

void ZeroOptimizer::write_partition(const torch::Tensor& part, torch::Tensor& flat) const {
  for (const auto& piece : pieces_)
    flat.narrow(0, piece.flat_begin, piece.length).copy_(part.narrow(0, piece.part_begin, piece.length));
}

void ZeroOptimizer::InFlight::complete() {
  // Every work is waited (a failed one must not leave others writing), then
  // `finish` only if all succeeded, `release` always.
  std::exception_ptr error;
  for (auto& work : works) {
    try {
      work.wait();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  works.clear();
  auto then = std::move(finish), cleanup = std::move(release);
  finish = nullptr;
  release = nullptr;
  if (then && !error) {
    try {
      then();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (cleanup) cleanup();
  if (error) std::rethrow_exception(error);
}

ZeroOptimizer::InFlight ZeroOptimizer::start_reduce_scatter_unit(const torch::Tensor& unit_values,
                                                                 torch::Tensor out, bool accumulate) {
  torch::NoGradGuard no_grad;
  InFlight flight;
  const int dp = topo_.dp_size();
  const int64_t s = unit_values.numel() / dp;
  if (s == 0) return flight;
  if (dp == 1) {  // one rank: the sum is the unit itself
    if (unit_values.data_ptr() == out.data_ptr()) return flight;
    if (accumulate)
      out.add_(unit_values);
    else
      out.copy_(unit_values);
    return flight;
  }
  const int64_t columns = std::clamp<int64_t>(reduce_bucket_ / dp, 1, s);
  auto grid = unit_values.view({dp, s});
  std::vector<torch::Tensor> reduced;
  for (int64_t j = 0; j < s; j += columns) {
    const int64_t n = std::min(columns, s - j);
    // A column bucket is copied to contiguous memory by the collective itself:
    // on the CPU lane when it runs; with NCCL when it starts, so there several
    // buckets of a unit are reduced one at a time rather than all copied at once.
    auto bucket = n == s ? unit_values : grid.narrow(1, j, n);
    reduced.push_back(torch::empty({n}, unit_values.options()));
    if (overlap_ && (n == s || !unit_values.is_cuda()))
      flight.works.push_back(topo_.dp().start_reduce_scatter_into(reduced.back(), bucket));
    else
      topo_.dp().reduce_scatter_into(reduced.back(), bucket);
  }
  flight.finish = [out, reduced = std::move(reduced), columns, accumulate]() mutable {
    for (size_t b = 0; b < reduced.size(); ++b) {
      auto target = out.narrow(0, static_cast<int64_t>(b) * columns, reduced[b].numel());
      if (accumulate)
        target.add_(reduced[b]);
      else
        target.copy_(reduced[b]);
    }
  };
  if (!overlap_) flight.complete();
  return flight;
}

ZeroOptimizer::InFlight ZeroOptimizer::start_all_gather_unit(const torch::Tensor& local, torch::Tensor unit_values) {
  torch::NoGradGuard no_grad;
  InFlight flight;
  const int dp = topo_.dp_size();
  const int64_t s = local.numel();
  if (s == 0) return flight;
  if (dp == 1) {
    if (unit_values.data_ptr() != local.data_ptr()) unit_values.copy_(local);
    return flight;
  }
  Comm& comm = topo_.dp();
  const int64_t columns = std::clamp<int64_t>(gather_bucket_ / dp, 1, s);
  if (columns == s) {
    // One bucket: straight into the unit (`local` may be this rank's own slice of it).
    if (overlap_)
      flight.works.push_back(comm.start_all_gather_into(unit_values, local));
    else
      comm.all_gather_into(unit_values, local);
    return flight;
  }
  // Column buckets, one at a time through a bucket-sized buffer (not overlapped:
  // holding every bucket's buffer until the unit completes would cost a unit).
  auto grid = unit_values.view({dp, s});
  for (int64_t j = 0; j < s; j += columns) {
    const int64_t n = std::min(columns, s - j);
    auto gathered = torch::empty({dp * n}, local.options());
    comm.all_gather_into(gathered, local.narrow(0, j, n).contiguous());
    grid.narrow(1, j, n).copy_(gathered.view({dp, n}));
  }
  return flight;
}

void ZeroOptimizer::finish_in_flight(size_t keep) {
  while (in_flight_.size() > keep) {
    InFlight flight = std::move(in_flight_.front());
    in_flight_.pop_front();
    flight.complete();
  }
}

void ZeroOptimizer::prefetch_use(int64_t use) {
  torch::NoGradGuard no_grad;
  // stage3_max_live_parameters: the elements gathered (or in flight) plus the next use's.
  int64_t live = 0;
  for (size_t u = 0; u < gathered_.size(); ++u)
    if (static_cast<int>(u) != layout_.whole_unit && (gathered_[u] > 0 || prefetched_.count(static_cast<int>(u))))
      live += unit_buffers_[u].numel();
  for (int unit : use_units_.at(use + 1))
    if (unit != layout_.whole_unit && gathered_[unit] == 0 && !prefetched_.count(unit))
      live += unit_buffers_[unit].numel();
  if (live > max_live_) return;
  for (int unit : use_units_.at(use + 1)) {
    if (unit == layout_.whole_unit || gathered_[unit] > 0 || prefetched_.count(unit)) continue;
    const torch::Tensor& buffer = unit_buffers_[unit];
    allocate_storage(buffer);
    memory_tag_add(MemoryTag::kGatheredParams, static_cast<int64_t>(buffer.nbytes()));
    const int64_t begin = layout_.units[unit].begin / layout_.dp;
    InFlight flight;
    try {
      flight = start_all_gather_unit(param_part_.narrow(0, begin, slice_of(unit)), buffer);
    } catch (...) {
      free_storage(buffer);
      memory_tag_add(MemoryTag::kGatheredParams, -static_cast<int64_t>(buffer.nbytes()));
      throw;
    }
    // Held here until acquired; if it never is, release_stale_units frees it.
    prefetched_.emplace(unit, std::move(flight));
  }
}

bool ZeroOptimizer::take_prefetched(int unit) {
  auto ahead = prefetched_.find(unit);
  if (ahead == prefetched_.end()) return false;
  InFlight flight = std::move(ahead->second);
  prefetched_.erase(ahead);
  gathered_[unit] = 1;  // storage and memory tag came with the prefetch
  try {
    flight.complete();
  } catch (...) {
    release_unit(unit);
    throw;
  }
  return true;
}

void ZeroOptimizer::acquire_unit(int unit) {
  if (unit == layout_.whole_unit) return;
  if (gathered_[unit] > 0) {
    ++gathered_[unit];
    return;
  }
  torch::NoGradGuard no_grad;
  if (take_prefetched(unit)) return;
  const torch::Tensor& buffer = unit_buffers_[unit];
  allocate_storage(buffer);
  try {
    const int64_t begin = layout_.units[unit].begin / layout_.dp;
    all_gather_unit(param_part_.narrow(0, begin, slice_of(unit)), buffer);
  } catch (...) {
    free_storage(buffer);  // not counted as gathered: the next use gathers again
    throw;
  }
  memory_tag_add(MemoryTag::kGatheredParams, static_cast<int64_t>(buffer.nbytes()));
  gathered_[unit] = 1;
}

void ZeroOptimizer::release_stale_units() {
  // A use whose release never ran (an exception inside it, or a backward that
  // acquired a unit without reaching the use's input) must not keep its unit,
  // with weights of an earlier step, beyond the backward.
  // Prefetches never used: their gathers finish before the storage goes.
  while (!prefetched_.empty()) {
    const int unit = prefetched_.begin()->first;
    take_prefetched(unit);
    release_unit(unit);
  }
  if (pinned_) return;
  for (size_t u = 0; u < gathered_.size(); ++u) {
    if (gathered_[u] == 0 || static_cast<int>(u) == layout_.whole_unit) continue;
    gathered_[u] = 1;
    release_unit(static_cast<int>(u));
  }
}

void ZeroOptimizer::release_unit(int unit) {
  if (unit == layout_.whole_unit) return;
  TORCH_INTERNAL_ASSERT(gathered_[unit] > 0, "ZeroOptimizer: unit ", unit, " released more often than gathered");
  if (--gathered_[unit] == 0) {
    free_storage(unit_buffers_[unit]);
    memory_tag_add(MemoryTag::kGatheredParams, -static_cast<int64_t>(unit_buffers_[unit].nbytes()));
  }
}

void ZeroOptimizer::release_pins() {
  if (!pinned_) return;
  pinned_ = false;
  for (size_t u = 0; u < unit_buffers_.size(); ++u)
    if (static_cast<int>(u) != layout_.whole_unit) release_unit(static_cast<int>(u));
}

void ZeroOptimizer::gather_all_params() {
  if (stage_ != 3 || pinned_) return;
  for (size_t u = 0; u < unit_buffers_.size(); ++u)
    if (static_cast<int>(u) != layout_.whole_unit) acquire_unit(static_cast<int>(u));
  pinned_ = true;
}

void ZeroOptimizer::begin_step() {
  torch::NoGradGuard no_grad;
  finish_in_flight(0);  // left by a backward that did not reach after_backward
  release_pins();
  if (stage_ == 3) release_stale_units();
  auto& params = model_.parameters();
  if (stage_ <= 1) {
    if (!flat_grads_.defined()) {
      flat_grads_ = torch::zeros({layout_.padded}, low_options());
      const int rank = topo_.tp_rank();
      for (size_t i = 0; i < params.size(); ++i)
        params[i].tensor.mutable_grad() = flat_grads_.narrow(0, layout_.offsets[i], layout_.numels[i])
                                              .view(params[i].spec().local_shape(rank));
    } else {
      flat_grads_.zero_();
    }
    if (fp32_accum_) {
      if (!grad_accum_.defined())
        grad_accum_ = torch::zeros({layout_.padded}, low_options().dtype(torch::kFloat32));
      else
        grad_accum_.zero_();
    }
    return;
  }
  for (auto& p : params) p.tensor.mutable_grad().reset();
  if (!grad_part_.defined())
    grad_part_ = torch::zeros({layout_.part}, low_options().dtype(fp32_accum_ ? torch::kFloat32 : low_));
  else
    grad_part_.zero_();
  unit_reduced_.assign(layout_.units.size(), false);
}

void ZeroOptimizer::reduce_unit_grads(int unit) {
  torch::NoGradGuard no_grad;
  auto& params = model_.parameters();
  unit_reduced_[unit] = true;
  const FlatUnit& u = layout_.units[unit];
  if (u.length == 0) return;
  // Every rank runs the same graph, so every rank has gradients for the same units.
  bool any = false;
  for (size_t i : unit_params_[unit]) any = any || params[i].tensor.grad().defined();
  if (!any) return;
  // The previous unit's reduction (it ran behind this unit's backward) completes
  // first, so its bucket is gone before this one is filled.
  finish_in_flight(0);
  const int64_t bucket_bytes = u.length * static_cast<int64_t>(c10::elementSize(low_));
  memory_tag_add(MemoryTag::kGradientBuckets, bucket_bytes);
  torch::Tensor buffer;
  const auto& members = unit_params_[unit];
  torch::Tensor only = members.size() == 1 ? params[members[0]].tensor.grad() : torch::Tensor();
  if (only.defined() && only.is_contiguous() && only.numel() == u.length && only.scalar_type() == low_) {
    // A one-tensor unit without padding (an embedding, an LM head): its gradient is the bucket.
    sum_partial_grads(*params[members[0]].entry, only, topo_.tp());
    buffer = only.view({-1});
    params[members[0]].tensor.mutable_grad().reset();
  } else {
    buffer = torch::zeros({u.length}, low_options());
    for (size_t i : members) {
      torch::Tensor grad = params[i].tensor.mutable_grad();
      if (!grad.defined()) continue;
      sum_partial_grads(*params[i].entry, grad, topo_.tp());
      buffer.narrow(0, layout_.offsets[i] - u.begin, layout_.numels[i]).copy_(grad.reshape({-1}));
      params[i].tensor.mutable_grad().reset();
    }
  }
  only = torch::Tensor();
  InFlight flight =
      start_reduce_scatter_unit(buffer, grad_part_.narrow(0, u.begin / layout_.dp, slice_of(unit)), /*accumulate=*/true);
  // The bucket lives until its reduction is complete (the lane holds it meanwhile).
  flight.release = [buffer = std::move(buffer), bucket_bytes]() mutable {
    buffer = torch::Tensor();
    memory_tag_add(MemoryTag::kGradientBuckets, -bucket_bytes);
  };
  if (overlap_)
    in_flight_.push_back(std::move(flight));  // runs behind the next unit's backward
  else
    flight.complete();
}

void ZeroOptimizer::after_backward() {
  torch::NoGradGuard no_grad;
  if (stage_ <= 1) {
    if (!fp32_accum_) return;  // gradients accumulate in place
    // Chunk by chunk: a mixed-dtype add_ upcasts its whole operand first.
    for (int64_t begin = 0; begin < layout_.padded; begin += kUpdateChunk) {
      const int64_t n = std::min(kUpdateChunk, layout_.padded - begin);
      grad_accum_.narrow(0, begin, n).add_(flat_grads_.narrow(0, begin, n));
    }
    flat_grads_.zero_();
    return;
  }
  if (stage_ == 3) release_stale_units();
  // Units whose backward has no hook (embeddings, persistent tensors, a tied
  // head), and any gradient that arrived after its unit was reduced.
  auto& params = model_.parameters();
  for (size_t u = 0; u < layout_.units.size(); ++u) {
    bool pending = !unit_reduced_[u];
    for (size_t i : unit_params_[u]) pending = pending || params[i].tensor.grad().defined();
    if (pending) reduce_unit_grads(static_cast<int>(u));
  }
  finish_in_flight(0);
  unit_reduced_.assign(layout_.units.size(), false);
}

void ZeroOptimizer::sync_shared_grads(torch::Tensor& flat) {
  const int rank = topo_.tp_rank();
  for (size_t i = 0; i < model_.parameters().size(); ++i) {
    const ShardSpec& spec = model_.parameters()[i].spec();
    auto local = flat.narrow(0, layout_.offsets[i], layout_.numels[i]).view(spec.local_shape(rank));
    sum_partial_grads(*model_.parameters()[i].entry, local, topo_.tp());
  }
}

StepOutcome ZeroOptimizer::step(double lr, bool skip) {
  torch::NoGradGuard no_grad;
  StepOutcome outcome;
  outcome.loss_scale = loss_scale_;
  finish_in_flight(0);  // after_backward completes them; a caller that skipped it must not read half-reduced grads
  if (stage_ <= 1) {
    torch::Tensor acc = fp32_accum_ ? grad_accum_ : flat_grads_;
    sync_shared_grads(acc);
    if (stage_ == 0) {
      for (int64_t offset = 0; offset < layout_.padded; offset += reduce_bucket_) {
        auto bucket = acc.narrow(0, offset, std::min(reduce_bucket_, layout_.padded - offset));
        topo_.dp().all_reduce(bucket);
      }
    } else {
      // Each unit's reduced slice lands where this rank's slice of it was.
      for (size_t u = 0; u < layout_.units.size(); ++u) {
        const FlatUnit& unit = layout_.units[u];
        if (unit.length == 0) continue;
        in_flight_.push_back(start_reduce_scatter_unit(acc.narrow(0, unit.begin, unit.length),
                                                       own_slice(acc, static_cast<int>(u)), /*accumulate=*/false));
        finish_in_flight(1);
      }
      finish_in_flight(0);
    }
  }
  // The global norm from the owned ranges (fp64 partial sums, one all-reduce).
  auto sumsq = torch::zeros({1}, low_options().dtype(torch::kFloat64));
  for (const auto& [begin, length] : norm_ranges_) sumsq.add_(sum_of_squares(grads_at(begin, length)));
  // A rank asked to skip makes the world's norm NaN: every rank then skips together.
  if (skip) sumsq.fill_(std::numeric_limits<double>::quiet_NaN());
  topo_.world().all_reduce(sumsq);
  // Loss scales are powers of two: unscaling the norm equals the norm of unscaled gradients.
  const double norm = std::sqrt(sumsq.item<double>()) / loss_scale_;
  outcome.grad_norm = norm;

  const bool overflow = !std::isfinite(norm);
  outcome.non_finite = overflow;
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
  if (overflow) {
    outcome.skipped = true;
  } else {
    const double coef = clip_ > 0 ? clip_ / (norm + 1e-6) : 1;
    const double scale = outcome.loss_scale;
    // Bucket by bucket: the partition's gradients upcast to fp32, unscaled, clipped, applied.
    optimizer_->begin_step();
    const int64_t chunk = std::min(reduce_bucket_, kUpdateChunk);
    for (const auto& piece : pieces_) {
      for (int64_t offset = 0; offset < piece.length; offset += chunk) {
        const int64_t n = std::min(chunk, piece.length - offset);
        const int64_t begin = piece.part_begin + offset;
        torch::Tensor g = grads_at(begin, n);
        if (g.scalar_type() != torch::kFloat32) g = g.to(torch::kFloat32);
        if (scale != 1) g.div_(scale);
        if (coef < 1) g.mul_(coef);
        optimizer_->update(begin, master_at(begin, n), g, lr);
      }
      // Stages 1-2: the unit's gather runs while the next piece is updated.
      if (stage_ == 1 || stage_ == 2) redistribute_piece(piece);
    }
    if (stage_ == 1 || stage_ == 2) {
      finish_in_flight(0);
      return outcome;
    }
  }
  redistribute_params();
  return outcome;
}

std::pair<int, int> ZeroOptimizer::first_non_finite_gradient() const {
  torch::NoGradGuard no_grad;
  // The owned ranges hold every element once, reduced: the world's minimum over
  // them is the first parameter in model order.
  int64_t first = std::numeric_limits<int64_t>::max();
  const int64_t params = static_cast<int64_t>(model_.parameters().size());
  for (const auto& [begin, length] : norm_ranges_) {
    const torch::Tensor bad = torch::isfinite(grads_at(begin, length)).logical_not_();
    if (!bad.any().item<bool>()) continue;
    const int64_t index = begin + bad.nonzero()[0][0].item<int64_t>();
    const int64_t flat = flat_of(index);
    for (int64_t i = 0; i < params; ++i)
      if (flat >= layout_.offsets[i] && flat < layout_.offsets[i] + layout_.numels[i]) {
        first = std::min(first, i);
        break;
      }
  }
  const int64_t world = topo_.world_size();
  const int64_t mine = first == std::numeric_limits<int64_t>::max() ? first : first * world + topo_.rank();
  auto key = torch::tensor({mine}, torch::kLong);
  topo_.world().all_reduce(key, ReduceOp::kMin);
  const int64_t found = key.item<int64_t>();
  if (found == std::numeric_limits<int64_t>::max()) return {-1, -1};
  return {static_cast<int>(found / world), static_cast<int>(found % world)};
}

void ZeroOptimizer::redistribute_piece(const PartitionPiece& piece) {
  if (mixed_)
    flat_params_.narrow(0, piece.flat_begin, piece.length).copy_(master_.narrow(0, piece.part_begin, piece.length));
  if (topo_.dp_size() == 1) return;
  const FlatUnit& unit = layout_.units[piece.unit];
  // The gather reads this rank's slice before the result is copied over it.
  in_flight_.push_back(start_all_gather_unit(own_slice(flat_params_, piece.unit),
                                             flat_params_.narrow(0, unit.begin, unit.length)));
  finish_in_flight(1);
}

void ZeroOptimizer::redistribute_params() {
  torch::NoGradGuard no_grad;
  release_pins();
  if (stage_ == 3) {
    if (mixed_) param_part_.copy_(master_);
    if (const int whole = layout_.whole_unit; whole >= 0)
      all_gather_unit(param_part_.narrow(0, layout_.units[whole].begin / layout_.dp, slice_of(whole)),
                      unit_buffers_[whole]);
    return;
  }
  if (stage_ == 0) {
    if (mixed_) write_partition(master_, flat_params_);
    return;
  }
  for (const auto& piece : pieces_) redistribute_piece(piece);
  finish_in_flight(0);
}

PartitionState ZeroOptimizer::partition_state() const {
  PartitionState state;
  if (stage_ == 3 || stage_ == 0)
    state.params = stage_ == 3 ? param_part_ : flat_params_;
  else
    state.params = partition_copy(flat_params_, low_);
  if (mixed_) state.master_weights = master_;
  state.optimizer = optimizer_->state();
  state.optimizer_steps = optimizer_->steps();
  return state;
}

void ZeroOptimizer::load_partition_state(const torch::Tensor& master,
                                         const std::map<std::string, torch::Tensor>& optimizer,
                                         int64_t optimizer_steps) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(master.numel() == layout_.part && master.scalar_type() == torch::kFloat32,
              "ZeroOptimizer::load_partition_state: master has ", master.numel(), " ", master.scalar_type(),
              " elements, the partition ", layout_.part, " float");
  if (mixed_) master_.copy_(master);
  if (stage_ == 3)
    param_part_.copy_(master);
  else
    write_partition(master, flat_params_);
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
  if (stage_ == 0) return master_at(begin, end - begin).to(torch::kFloat32);
  // Each rank contributes the part of [begin, end) inside its slice of the unit.
  const std::vector<int64_t> shares = layout_.range_shares(begin, end);
  const int unit = layout_.unit_at(begin);
  const FlatUnit& u = layout_.units[unit];
  const int64_t own_lo = u.begin + topo_.dp_rank() * slice_of(unit);
  const int64_t lo = std::clamp(begin, own_lo, own_lo + slice_of(unit));
  const int64_t mine = shares[topo_.dp_rank()];
  auto local = mine == 0 ? torch::empty({0}, low_options().dtype(torch::kFloat32))
                         : master_at(u.begin / layout_.dp + (lo - own_lo), mine).to(torch::kFloat32);
  return topo_.dp().all_gather(local.contiguous(), 0, shares);
}

ModelStateBytes ZeroOptimizer::model_state_bytes() const {
  auto bytes = [](const torch::Tensor& t) {
    return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : int64_t{0};
  };
  ModelStateBytes b;
  if (stage_ == 3) {
    b.params = bytes(param_part_);
      if (layout_.whole_unit >= 0) b.params += bytes(unit_buffers_[layout_.whole_unit]);
  } else {
    b.params = bytes(flat_params_);
  }
  b.grads = stage_ <= 1 ? bytes(flat_grads_) + bytes(grad_accum_) : bytes(grad_part_);
  b.master_weights = mixed_ ? bytes(master_) : 0;
  b.optimizer_states = optimizer_->state_bytes();
  return b;
}

}  // namespace autotp
