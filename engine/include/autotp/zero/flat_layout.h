// FlatLayout: where each parameter of one tp rank lives in that rank's flat
// buffer, and how ZeRO cuts the buffer over the dp group. Parameters follow
// each other in model order (each one its local shard's numel long); the buffer
// is padded to a multiple of dp; at stage >= 1 dp rank d owns elements
// [d * part, (d + 1) * part), at stage 0 every rank holds the whole buffer.
// The one rule shared by the ZeroOptimizer, checkpoints and memory formulas.
#pragma once
#include <cstdint>
#include <vector>

#include "autotp/tp/shard_spec.h"

namespace autotp {

struct FlatLayout {
  std::vector<int64_t> offsets;  // per parameter, into the flat buffer
  std::vector<int64_t> numels;   // per parameter, its local shard's numel
  int64_t local_numel = 0;       // sum of numels
  int64_t padded = 0;            // local_numel rounded up to a multiple of dp
  int64_t part = 0;              // elements per dp partition (padded at stage 0)
  int dp = 1, stage = 0;

  static FlatLayout build(const std::vector<const ShardSpec*>& specs, int tp_rank, int dp, int stage);
  static FlatLayout build(const std::vector<int64_t>& numels, int dp, int stage);
  // First element of dp rank `dp_rank`'s partition (0 at stage 0).
  int64_t part_offset(int dp_rank) const { return stage == 0 ? 0 : part * dp_rank; }
  // Elements of the span [begin, end) inside each dp rank's partition (stage >= 1):
  // what each rank contributes when the span is gathered.
  std::vector<int64_t> range_shares(int64_t begin, int64_t end) const;
};

}  // namespace autotp
