// PartitionNorm: the global gradient norm of a model held as tp shards and ZeRO
// partitions, counting every logical element once (its TpPlan owner across tp,
// the holder of its partition across dp; stage 0: dp rank 0) from precomputed
// ranges of this rank's partition, without a mask; and gradient clipping.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <utility>
#include <vector>

#include "autotp/comm/comm.h"
#include "autotp/tp/shard_spec.h"
#include "autotp/zero/flat_layout.h"

namespace autotp {

// The partition's gradients at [begin, +length) (inside one piece).
using PartitionGrads = std::function<torch::Tensor(int64_t begin, int64_t length)>;

class PartitionNorm {
 public:
  // `specs`: the held parameters' ShardSpecs in layout order.
  PartitionNorm(const std::vector<const ShardSpec*>& specs, const FlatLayout& layout, int tp_rank, int dp_rank);

  // sqrt of the world's sum of squares (fp64 partial sums, one all-reduce over
  // `world`) divided by `loss_scale`. `skip`: this rank contributes NaN, so every
  // rank sees a non-finite norm and drops the update together.
  double global_norm(const PartitionGrads& grads, Comm& world, bool skip, double loss_scale,
                     const torch::Device& device) const;
  // Its two halves, for several partitions counted together (expert parallelism's
  // dense and expert parts): this rank's fp64 sum of squares [1], and the norm of
  // the world's sum of such partial sums.
  torch::Tensor local_sum_of_squares(const PartitionGrads& grads, const torch::Device& device) const;
  static double world_norm(torch::Tensor sumsq, Comm& world, bool skip, double loss_scale);
  // The first parameter (by `param_of`, partition index -> parameter index) whose
  // owned gradient elements hold a NaN or an infinity on this rank, or -1.
  int64_t first_non_finite(const PartitionGrads& grads, const std::function<int64_t(int64_t)>& param_of) const;
  // The factor gradients are multiplied by for a max global norm `max_norm` (0 = no clipping): < 1 clips.
  static double clip_coefficient(double max_norm, double norm) { return max_norm > 0 ? max_norm / (norm + 1e-6) : 1; }

 private:
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // partition [begin, length) this rank counts
};

}  // namespace autotp
