#include "autotp/zero/partition_norm.h"

#include <cmath>
#include <limits>

#include "autotp/optim/grad_norm.h"

namespace autotp {
namespace {

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

PartitionNorm::PartitionNorm(const std::vector<const ShardSpec*>& specs, const FlatLayout& layout, int tp_rank,
                             int dp_rank) {
  const int dp = layout.dp, stage = layout.stage;
  if (stage == 0 && dp_rank != 0) return;
  int last_unit = -1;
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t base = layout.offsets[i];
    const FlatUnit& unit = layout.units[layout.unit_of[i]];
    const int64_t s = unit.length / dp;
    const int64_t own_lo = unit.begin + dp_rank * s, own_hi = own_lo + s;
    for (auto [b, e] : owned_intervals(*specs[i], tp_rank)) {
      int64_t lo = base + b, hi = base + e;
      if (stage >= 1) {
        lo = std::max(lo, own_lo), hi = std::min(hi, own_hi);
        if (hi <= lo) continue;
        lo = unit.begin / dp + (lo - own_lo), hi = unit.begin / dp + (hi - own_lo);
      }
      // Merged only within a unit: at stage 1 a range must stay inside one piece of the flat buffer.
      if (!ranges_.empty() && last_unit == layout.unit_of[i] && ranges_.back().first + ranges_.back().second == lo)
        ranges_.back().second += hi - lo;
      else
        ranges_.emplace_back(lo, hi - lo);
      last_unit = layout.unit_of[i];
    }
  }
}

torch::Tensor PartitionNorm::local_sum_of_squares(const PartitionGrads& grads, const torch::Device& device) const {
  auto sumsq = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat64).device(device));
  for (const auto& [begin, length] : ranges_) sumsq.add_(sum_of_squares(grads(begin, length)));
  return sumsq;
}

double PartitionNorm::world_norm(torch::Tensor sumsq, Comm& world, bool skip, double loss_scale) {
  if (skip) sumsq.fill_(std::numeric_limits<double>::quiet_NaN());
  world.all_reduce(sumsq);
  // Loss scales are powers of two: unscaling the norm equals the norm of unscaled gradients.
  return std::sqrt(sumsq.item<double>()) / loss_scale;
}

double PartitionNorm::global_norm(const PartitionGrads& grads, Comm& world, bool skip, double loss_scale,
                                  const torch::Device& device) const {
  return world_norm(local_sum_of_squares(grads, device), world, skip, loss_scale);
}

int64_t PartitionNorm::first_non_finite(const PartitionGrads& grads,
                                        const std::function<int64_t(int64_t)>& param_of) const {
  // Ranges need not follow parameter order (stage 3's persistent unit): the minimum over all.
  int64_t first = -1;
  for (const auto& [begin, length] : ranges_) {
    const torch::Tensor bad = torch::isfinite(grads(begin, length)).logical_not_();
    if (!bad.any().item<bool>()) continue;
    const int64_t param = param_of(begin + bad.nonzero()[0][0].item<int64_t>());
    if (first < 0 || param < first) first = param;
  }
  return first;
}

}  // namespace autotp
