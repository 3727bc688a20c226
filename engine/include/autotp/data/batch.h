// Turning sampled example indices into tensors, and a fingerprint of a batch.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "autotp/data/dataset.h"

namespace autotp {

// One micro-batch: int64 [micro_batch, seq_len] each; labels use kIgnoreLabel.
struct Batch {
  torch::Tensor input_ids;
  torch::Tensor labels;
};

// Stacks data.get(i) for each index, in order. indices must be non-empty and
// in range (checked); every example of a Dataset has the same length.
Batch collate(const Dataset& data, const std::vector<int64_t>& indices);

// FNV-1a (64-bit) over the shapes and values of input_ids and labels. Cheap
// enough to run every step so the ranks of a tensor-parallel group can check
// (one small all-gather) that they hold the same batch.
uint64_t batch_hash(const Batch& batch);

}  // namespace autotp
