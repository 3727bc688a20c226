#include "autotp/data/sampler.h"

#include <torch/torch.h>

#include <numeric>

#include "autotp/base/error.h"

namespace autotp {
namespace {

// splitmix64 (Steele, Lea, Flood 2014): tiny, fully specified, good enough for shuffling.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t next() { return mix64(state_ += 0x9E3779B97F4A7C15ULL); }
  // Uniform in [0, bound) without modulo bias: reject the few values below 2^64 mod bound.
  uint64_t below(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      const uint64_t value = next();
      if (value >= threshold) return value % bound;
    }
  }

 private:
  uint64_t state_;
};

}  // namespace

std::vector<int64_t> epoch_order(int64_t dataset_size, uint64_t seed, int64_t epoch, bool shuffle) {
  std::vector<int64_t> order(static_cast<size_t>(dataset_size));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (!shuffle) return order;
  // Mixing the epoch separately keeps (seed, epoch) and (seed + 1, epoch - 1) apart.
  SplitMix64 rng(mix64(seed) ^ mix64(static_cast<uint64_t>(epoch) + 0x632BE59BD9B4E019ULL));
  for (size_t i = order.size(); i > 1; --i) {
    const auto j = static_cast<size_t>(rng.below(i));
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t micro_batch, int64_t gas, int dp_size,
                                       int dp_rank, uint64_t seed, bool shuffle)
    : dataset_size_(dataset_size),
      micro_batch_(micro_batch),
      gas_(gas),
      dp_size_(dp_size),
      dp_rank_(dp_rank),
      seed_(seed),
      shuffle_(shuffle) {
  AUTOTP_USER_CHECK(micro_batch > 0, "DistributedSampler: micro batch size must be positive, got {}",
                    micro_batch);
  AUTOTP_USER_CHECK(gas > 0, "DistributedSampler: gradient accumulation steps must be positive, got {}", gas);
  TORCH_CHECK(dp_size > 0 && dp_rank >= 0 && dp_rank < dp_size, "DistributedSampler: dp_rank ", dp_rank,
              " outside [0, ", dp_size, ")");
  global_batch_ = micro_batch * gas * dp_size;
  AUTOTP_USER_CHECK(dataset_size >= global_batch_,
                    "DistributedSampler: the dataset has {} examples, fewer than one global batch of {} "
                    "(micro batch {} x gradient accumulation {} x data-parallel size {}); use more data, a "
                    "shorter seq_len or a smaller batch",
                    dataset_size, global_batch_, micro_batch, gas, dp_size);
}

void DistributedSampler::roll_over_if_exhausted() {
  if (dataset_size_ - state_.offset < global_batch_) {
    ++state_.epoch;
    state_.offset = 0;
  }
}

const std::vector<int64_t>& DistributedSampler::order() {
  if (order_epoch_ != state_.epoch) {
    order_ = epoch_order(dataset_size_, seed_, state_.epoch, shuffle_);
    order_epoch_ = state_.epoch;
  }
  return order_;
}

std::vector<std::vector<int64_t>> DistributedSampler::next_step() {
  const std::vector<int64_t>& epoch = order();
  std::vector<std::vector<int64_t>> micro_batches(static_cast<size_t>(gas_));
  for (int64_t j = 0; j < gas_; ++j) {
    const int64_t begin = state_.offset + (j * dp_size_ + dp_rank_) * micro_batch_;
    micro_batches[static_cast<size_t>(j)].assign(epoch.begin() + begin, epoch.begin() + begin + micro_batch_);
  }
  state_.offset += global_batch_;
  roll_over_if_exhausted();
  return micro_batches;
}

void DistributedSampler::set_state(const SamplerState& state) {
  AUTOTP_USER_CHECK(state.epoch >= 0 && state.offset >= 0 && state.offset <= dataset_size_,
                    "DistributedSampler::set_state: epoch {} offset {} does not fit a dataset of {} examples "
                    "(was the checkpoint written for other data?)",
                    state.epoch, state.offset, dataset_size_);
  state_ = state;
  roll_over_if_exhausted();
}

}  // namespace autotp
