// FlatLayout: where each parameter of one tp rank lives in that rank's flat
// buffer, and how ZeRO cuts the buffer over the dp group. The buffer is a
// sequence of units (one per decoder layer, the embeddings, the head, and at
// stage 3 the persistent small tensors; see zero_units.h); each unit holds its
// parameters in model order and is padded to a multiple of dp. At stage >= 1 dp
// rank d owns the d-th of dp equal slices of every unit, so gathering or
// reducing one unit moves 1/dp of it from each rank, and the rank's partition
// is the concatenation of its slices, unit by unit. At stage 0 every rank holds
// the whole buffer. One unit holding every parameter gives the contiguous
// partition of checkpoint format 1.
// The one rule shared by the ZeroOptimizer, checkpoints and memory formulas.
#pragma once
#include <cstdint>
#include <vector>

#include "autotp/tp/shard_spec.h"

namespace autotp {

struct FlatUnit {
  int64_t begin = 0;   // first element in the flat buffer
  int64_t length = 0;  // elements, a multiple of dp (each dp rank owns length / dp)
};

// A stretch of one dp rank's partition: flat [flat_begin, +length) is
// partition [part_begin, +length).
struct PartitionPiece {
  int64_t flat_begin = 0, part_begin = 0, length = 0;
  int unit = 0;
};

struct FlatLayout {
  std::vector<int64_t> offsets;  // per parameter, into the flat buffer
  std::vector<int64_t> numels;   // per parameter, its local shard's numel
  std::vector<int> unit_of;      // per parameter, its unit
  std::vector<FlatUnit> units;   // in flat-buffer order
  int64_t local_numel = 0;       // sum of numels
  int64_t padded = 0;            // the flat buffer: sum of unit lengths
  int64_t part = 0;              // elements per dp partition (padded at stage 0)
  int dp = 1, stage = 0;
  int whole_unit = -1;           // stage 3: a unit every rank holds whole (persistent tensors), or -1

  // `unit_of` gives each parameter's unit id (0 .. units-1; empty = one unit);
  // there are at least `min_units` units (empty ones hold nothing).
  static FlatLayout build(const std::vector<int64_t>& numels, const std::vector<int>& unit_of, int dp, int stage,
                          int min_units = 1);
  static FlatLayout build(const std::vector<const ShardSpec*>& specs, const std::vector<int>& unit_of, int tp_rank,
                          int dp, int stage, int min_units = 1);
  // The stretches of dp rank `dp_rank`'s partition, in partition order (stage 0: the whole buffer).
  std::vector<PartitionPiece> pieces(int dp_rank) const;
  // Elements of the span [begin, end) (inside one unit) in each dp rank's
  // partition (stage >= 1): what each rank contributes when the span is gathered.
  std::vector<int64_t> range_shares(int64_t begin, int64_t end) const;
  // The unit holding flat element `flat`.
  int unit_at(int64_t flat) const;
};

}  // namespace autotp
