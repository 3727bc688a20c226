// Which examples each data-parallel rank trains on, step by step.
//
// Every rank builds its own DistributedSampler from the same arguments (except
// dp_rank); with no communication they agree on the order, because the order is
// a pure function of (dataset_size, seed, epoch). Tensor-parallel ranks of one
// dp group share dp_rank and so get identical indices. Not thread-safe.
#pragma once
#include <cstdint>
#include <vector>

namespace autotp {

// Where the sampler stands; saved in checkpoints to resume the data order.
struct SamplerState {
  int64_t epoch = 0;   // current epoch (0-based)
  int64_t offset = 0;  // examples of this epoch's order already consumed, over all ranks
};

// The epoch's order: [0, n) in order, or a Fisher-Yates permutation driven by
// splitmix64 seeded from (seed, epoch). Self-contained on purpose: std::shuffle
// and the std distributions differ between standard libraries, which would
// break resuming a run on another machine.
std::vector<int64_t> epoch_order(int64_t dataset_size, uint64_t seed, int64_t epoch, bool shuffle);

class DistributedSampler {
 public:
  // global batch = micro_batch * gas * dp_size examples per optimizer step.
  // UserError if the dataset holds fewer examples than one global batch.
  DistributedSampler(int64_t dataset_size, int64_t micro_batch, int64_t gas, int dp_size, int dp_rank,
                     uint64_t seed, bool shuffle);

  // This rank's example indices for the next optimizer step: gas micro-batches
  // of micro_batch indices. The step takes the next global_batch() entries of
  // the epoch's order; micro-batch j of dp rank r is entries
  // [(j * dp_size + r) * micro_batch, +micro_batch) of that slice, so the ranks'
  // micro-batches tile the global batch exactly. An epoch's remainder shorter
  // than a global batch is dropped (drop_last) and the next epoch begins.
  std::vector<std::vector<int64_t>> next_step();

  int64_t global_batch() const { return global_batch_; }
  int64_t steps_per_epoch() const { return dataset_size_ / global_batch_; }

  // After a step the state already points at the next one (a finished epoch has
  // rolled over), so state() -> set_state() on a fresh sampler continues identically.
  SamplerState state() const { return state_; }
  // Accepts any offset in [0, dataset_size]: a run resumed with another global
  // batch size continues the same order from the same example.
  void set_state(const SamplerState& state);

 private:
  void roll_over_if_exhausted();
  const std::vector<int64_t>& order();

  int64_t dataset_size_;
  int64_t micro_batch_;
  int64_t gas_;
  int dp_size_;
  int dp_rank_;
  uint64_t seed_;
  bool shuffle_;
  int64_t global_batch_;
  SamplerState state_;
  std::vector<int64_t> order_;  // the order of epoch order_epoch_
  int64_t order_epoch_ = -1;    // -1: not computed yet
};

}  // namespace autotp
