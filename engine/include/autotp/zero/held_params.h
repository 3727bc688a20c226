// HeldParams: a set of parameters ZeRO holds in flat buffers (what trains, or
// at stage 3 the frozen base), their FlatLayout and this rank's place in it:
// the pieces of its dp partition and the index conversions every ZeRO part
// shares (flat buffer <-> partition).
#pragma once
#include <torch/torch.h>

#include <vector>

#include "autotp/model/sharded_model.h"
#include "autotp/zero/flat_layout.h"

namespace autotp {

struct HeldParams {
  std::vector<Parameter*> params;             // in layout order
  FlatLayout layout;
  std::vector<PartitionPiece> pieces;         // this dp rank's partition
  std::vector<std::vector<size_t>> unit_params;  // indices into params, per unit
  int tp_rank = 0, dp_rank = 0;
  torch::TensorOptions options;               // the flat buffers' dtype and device

  HeldParams(std::vector<Parameter*> params, FlatLayout layout, int tp_rank, int dp_rank,
             torch::TensorOptions options);

  int64_t slice_of(int unit) const { return layout.units[unit].length / layout.dp; }
  // This rank's slice of `unit` within a flat-buffer-sized tensor.
  torch::Tensor own_slice(const torch::Tensor& flat, int unit) const;
  // Partition [begin, +slice) of `unit` within a partition-sized tensor.
  torch::Tensor unit_part(const torch::Tensor& part, int unit) const {
    return part.narrow(0, layout.units[unit].begin / layout.dp, slice_of(unit));
  }
  // Flat position of partition element `index` (stage >= 1; the identity at stage 0).
  int64_t flat_of(int64_t index) const;
  // The parameter holding flat element `flat`, or -1 (padding).
  int64_t param_at(int64_t flat) const;
  // This rank's pieces of a flat-buffer-sized tensor as one [part] tensor of `dtype`, and back.
  torch::Tensor partition_copy(const torch::Tensor& flat, torch::ScalarType dtype) const;
  void write_partition(const torch::Tensor& part, torch::Tensor& flat) const;
  // Points parameter i at `numel` elements of `storage` from `offset`, shaped as its shard.
  void bind(size_t i, const torch::Tensor& storage, int64_t offset) const;
};

// Stage 3 frees a unit's storage between uses; the parameters (views of it)
// and anything autograd saved keep pointing at the same storage, which is
// refilled before the next use (FSDP's approach).
void free_storage(const torch::Tensor& t);
void allocate_storage(const torch::Tensor& t);

}  // namespace autotp
