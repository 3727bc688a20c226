#include "autotp/zero/flat_layout.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace autotp {

FlatLayout FlatLayout::build(const std::vector<int64_t>& numels, const std::vector<int>& unit_of_in, int dp,
                             int stage, int min_units) {
  TORCH_CHECK(dp > 0 && stage >= 0 && stage <= 3, "FlatLayout::build: dp ", dp, " stage ", stage);
  TORCH_CHECK(unit_of_in.empty() || unit_of_in.size() == numels.size(), "FlatLayout::build: ", unit_of_in.size(),
              " unit ids for ", numels.size(), " parameters");
  FlatLayout layout;
  layout.dp = dp;
  layout.stage = stage;
  layout.numels = numels;
  layout.unit_of = unit_of_in.empty() ? std::vector<int>(numels.size(), 0) : unit_of_in;
  int units = std::max(1, min_units);
  for (int u : layout.unit_of) {
    TORCH_CHECK(u >= 0, "FlatLayout::build: negative unit id");
    units = std::max(units, u + 1);
  }
  layout.offsets.assign(numels.size(), 0);
  layout.units.resize(units);
  for (int u = 0; u < units; ++u) {
    FlatUnit& unit = layout.units[u];
    unit.begin = layout.padded;
    int64_t used = 0;
    for (size_t i = 0; i < numels.size(); ++i) {
      if (layout.unit_of[i] != u) continue;
      layout.offsets[i] = unit.begin + used;
      used += numels[i];
    }
    layout.local_numel += used;
    unit.length = (used + dp - 1) / dp * dp;
    layout.padded += unit.length;
  }
  layout.part = stage == 0 ? layout.padded : layout.padded / dp;
  return layout;
}

FlatLayout FlatLayout::build(const std::vector<const ShardSpec*>& specs, const std::vector<int>& unit_of,
                             int tp_rank, int dp, int stage, int min_units) {
  std::vector<int64_t> numels;
  numels.reserve(specs.size());
  for (const ShardSpec* spec : specs) numels.push_back(spec->local_numel(tp_rank));
  return build(numels, unit_of, dp, stage, min_units);
}

std::vector<PartitionPiece> FlatLayout::pieces(int dp_rank) const {
  if (stage == 0) return {PartitionPiece{0, 0, padded, 0}};
  std::vector<PartitionPiece> out;
  for (size_t u = 0; u < units.size(); ++u) {
    const int64_t s = units[u].length / dp;
    if (s == 0) continue;
    out.push_back({units[u].begin + dp_rank * s, units[u].begin / dp, s, static_cast<int>(u)});
  }
  return out;
}

int FlatLayout::unit_at(int64_t flat) const {
  auto it = std::upper_bound(units.begin(), units.end(), flat,
                             [](int64_t x, const FlatUnit& u) { return x < u.begin + u.length; });
  TORCH_CHECK(it != units.end(), "FlatLayout::unit_at: element ", flat, " outside the buffer of ", padded);
  return static_cast<int>(it - units.begin());
}

std::vector<int64_t> FlatLayout::range_shares(int64_t begin, int64_t end) const {
  std::vector<int64_t> shares(dp, 0);
  if (end <= begin) return shares;
  const FlatUnit& u = units[unit_at(begin)];
  TORCH_CHECK(end <= u.begin + u.length, "FlatLayout::range_shares: [", begin, ", ", end, ") crosses a unit");
  const int64_t s = u.length / dp;
  for (int r = 0; r < dp; ++r) {
    const int64_t lo = u.begin + r * s, hi = lo + s;
    shares[r] = std::max<int64_t>(0, std::min(end, hi) - std::max(begin, lo));
  }
  return shares;
}

}  // namespace autotp
