#include "autotp/zero/flat_layout.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace autotp {

FlatLayout FlatLayout::build(const std::vector<int64_t>& numels, int dp, int stage) {
  TORCH_CHECK(dp > 0 && stage >= 0 && stage <= 3, "FlatLayout::build: dp ", dp, " stage ", stage);
  FlatLayout layout;
  layout.dp = dp;
  layout.stage = stage;
  layout.numels = numels;
  for (int64_t n : numels) {
    layout.offsets.push_back(layout.local_numel);
    layout.local_numel += n;
  }
  layout.padded = (layout.local_numel + dp - 1) / dp * dp;
  layout.part = stage == 0 ? layout.padded : layout.padded / dp;
  return layout;
}

std::vector<int64_t> FlatLayout::range_shares(int64_t begin, int64_t end) const {
  std::vector<int64_t> shares;
  shares.reserve(dp);
  for (int r = 0; r < dp; ++r)
    shares.push_back(std::max<int64_t>(0, std::min(end, part_offset(r) + part) - std::max(begin, part_offset(r))));
  return shares;
}

FlatLayout FlatLayout::build(const std::vector<const ShardSpec*>& specs, int tp_rank, int dp, int stage) {
  std::vector<int64_t> numels;
  numels.reserve(specs.size());
  for (const ShardSpec* spec : specs) numels.push_back(spec->local_numel(tp_rank));
  return build(numels, dp, stage);
}

}  // namespace autotp
