#include "autotp/zero/stage3_params.h"

#include "autotp/base/device.h"
#include "autotp/base/memory_counter.h"

namespace autotp {

Stage3Params::Stage3Params(HeldParams& held, UnitCollectives& comm, std::vector<std::vector<int>> use_units,
                           bool prefetch, int64_t max_live, bool host_partition, bool pin)
    : held_(held),
      comm_(comm),
      use_units_(std::move(use_units)),
      prefetch_(prefetch),
      max_live_(max_live),
      host_partition_(host_partition) {
  torch::NoGradGuard no_grad;
  const FlatLayout& layout = held_.layout;
  const torch::Device device = held_.options.device();
  part_ = host_partition_ ? host_buffer(layout.part, held_.options.dtype().toScalarType(), device, pin)
                          : torch::empty({layout.part}, held_.options);
  gathered_.assign(layout.units.size(), 0);
  for (size_t u = 0; u < layout.units.size(); ++u) {
    const FlatUnit& unit = layout.units[u];
    auto buffer = torch::zeros({unit.length}, held_.options);
    for (size_t i : held_.unit_params[u]) {
      const int64_t offset = layout.offsets[i] - unit.begin;
      buffer.narrow(0, offset, layout.numels[i]).copy_(held_.params[i]->tensor.reshape({-1}));
      held_.bind(i, buffer, offset);
    }
    const int64_t s = held_.slice_of(static_cast<int>(u));
    part_.narrow(0, unit.begin / layout.dp, s).copy_(buffer.narrow(0, held_.dp_rank * s, s));
    if (!whole(static_cast<int>(u))) free_storage(buffer);
    unit_buffers_.push_back(buffer);
  }
}

torch::Tensor Stage3Params::local_slice(int unit) const {
  torch::Tensor local = held_.unit_part(part_, unit);
  if (!host_partition_) return local;
  const torch::Device device = held_.options.device();
  return local.to(device, /*non_blocking=*/device.is_cuda() && local.is_pinned());
}

void Stage3Params::acquire_use(int64_t use) {
  for (int u : use_units_.at(use + 1)) acquire_unit(u);
}

void Stage3Params::release_use(int64_t use) {
  for (int u : use_units_.at(use + 1)) release_unit(u);
}

void Stage3Params::prefetch_use(int64_t use) {
  if (!prefetch_) return;
  torch::NoGradGuard no_grad;
  // stage3_max_live_parameters: the elements gathered (or in flight) plus the next use's.
  int64_t live = 0;
  for (size_t u = 0; u < gathered_.size(); ++u)
    if (!whole(static_cast<int>(u)) && (gathered_[u] > 0 || prefetched_.count(static_cast<int>(u))))
      live += unit_buffers_[u].numel();
  for (int unit : use_units_.at(use + 1))
    if (!whole(unit) && gathered_[unit] == 0 && !prefetched_.count(unit)) live += unit_buffers_[unit].numel();
  if (live > max_live_) return;
  for (int unit : use_units_.at(use + 1)) {
    if (whole(unit) || gathered_[unit] > 0 || prefetched_.count(unit)) continue;
    const torch::Tensor& buffer = unit_buffers_[unit];
    allocate_storage(buffer);
    memory_tag_add(MemoryTag::kGatheredParams, static_cast<int64_t>(buffer.nbytes()));
    InFlight flight;
    try {
      torch::Tensor local = local_slice(unit);
      flight = comm_.start_all_gather(local, buffer);
      flight.release = [local]() mutable { local = torch::Tensor(); };  // the device copy lives until the gather is done
    } catch (...) {
      free_storage(buffer);
      memory_tag_add(MemoryTag::kGatheredParams, -static_cast<int64_t>(buffer.nbytes()));
      throw;
    }
    // Held here until acquired; if it never is, release_stale_units frees it.
    prefetched_.emplace(unit, std::move(flight));
  }
}

bool Stage3Params::take_prefetched(int unit) {
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

void Stage3Params::acquire_unit(int unit) {
  if (whole(unit)) return;
  if (gathered_[unit] > 0) {
    ++gathered_[unit];
    return;
  }
  torch::NoGradGuard no_grad;
  if (take_prefetched(unit)) return;
  const torch::Tensor& buffer = unit_buffers_[unit];
  allocate_storage(buffer);
  try {
    comm_.all_gather(local_slice(unit), buffer);
  } catch (...) {
    free_storage(buffer);  // not counted as gathered: the next use gathers again
    throw;
  }
  memory_tag_add(MemoryTag::kGatheredParams, static_cast<int64_t>(buffer.nbytes()));
  gathered_[unit] = 1;
}

void Stage3Params::release_stale_units() {
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
    if (gathered_[u] == 0 || whole(static_cast<int>(u))) continue;
    gathered_[u] = 1;
    release_unit(static_cast<int>(u));
  }
}

void Stage3Params::release_unit(int unit) {
  if (whole(unit)) return;
  TORCH_INTERNAL_ASSERT(gathered_[unit] > 0, "ZeRO-3: unit ", unit, " released more often than gathered");
  if (--gathered_[unit] == 0) {
    free_storage(unit_buffers_[unit]);
    memory_tag_add(MemoryTag::kGatheredParams, -static_cast<int64_t>(unit_buffers_[unit].nbytes()));
  }
}

void Stage3Params::release_pins() {
  if (!pinned_) return;
  pinned_ = false;
  for (size_t u = 0; u < unit_buffers_.size(); ++u)
    if (!whole(static_cast<int>(u))) release_unit(static_cast<int>(u));
}

void Stage3Params::gather_all() {
  if (pinned_) return;
  for (size_t u = 0; u < unit_buffers_.size(); ++u)
    if (!whole(static_cast<int>(u))) acquire_unit(static_cast<int>(u));
  pinned_ = true;
}

void Stage3Params::begin_step() {
  release_pins();
  release_stale_units();
}

void Stage3Params::redistribute(const torch::Tensor& master) {
  torch::NoGradGuard no_grad;
  release_pins();
  if (master.defined()) copy_params(part_, master);
  if (const int w = held_.layout.whole_unit; w >= 0) comm_.all_gather(local_slice(w), unit_buffers_[w]);
}

int64_t Stage3Params::bytes() const {
  int64_t b = part_.numel() * static_cast<int64_t>(part_.element_size());
  if (const int w = held_.layout.whole_unit; w >= 0)
    b += unit_buffers_[w].numel() * static_cast<int64_t>(unit_buffers_[w].element_size());
  return b;
}

}  // namespace autotp
