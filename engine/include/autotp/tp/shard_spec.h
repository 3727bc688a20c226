// ShardSpec: how one logical (HF) tensor is cut across the tp ranks. The single
// source of truth for loading, gathering, saving, resharding and grad norms.
// A split tensor is cut along one dim; each rank holds a list of segments of
// that dim (global coordinates) concatenated in order. Segments of different
// ranks may overlap (kv heads replicated for GQA); every element of the dim is
// held by at least one rank.
#pragma once
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <vector>

namespace autotp {

struct Segment {
  int64_t start = 0;   // global index along the split dim
  int64_t length = 0;
  bool operator==(const Segment& o) const { return start == o.start && length == o.length; }
};

// `total` split in `parts` contiguous sizes that differ by at most one, larger first
// (6 over 4 -> 2, 2, 1, 1).
std::vector<int64_t> split_evenly(int64_t total, int parts);

class ShardSpec {
 public:
  ShardSpec() = default;
  static ShardSpec replicated(std::vector<int64_t> global_shape, int tp_size);
  static ShardSpec split(std::vector<int64_t> global_shape, int64_t dim, std::vector<std::vector<Segment>> per_rank);

  const std::vector<int64_t>& global_shape() const { return global_shape_; }
  bool is_replicated() const { return dim_ < 0; }
  int64_t dim() const { return dim_; }  // -1 when replicated
  int tp_size() const { return tp_size_; }
  const std::vector<Segment>& segments(int rank) const { return per_rank_.at(rank); }

  std::vector<int64_t> local_shape(int rank) const;
  int64_t local_extent(int rank) const;   // size along dim (global size when replicated)
  int64_t local_numel(int rank) const;
  bool has_overlap() const { return overlap_; }  // some element held by more than one rank

  // The rank's shard of a full tensor (a copy).
  torch::Tensor slice(const torch::Tensor& full, int rank) const;
  // Writes (or adds) a rank's shard into the full tensor.
  void place(torch::Tensor& full, const torch::Tensor& local, int rank, bool accumulate = false) const;
  // Local index ranges (along dim) of elements for which `rank` is the lowest
  // holder: counting only these counts every logical element exactly once.
  std::vector<Segment> owned_local(int rank) const;
  // Ranks holding element `index` of the split dim.
  std::vector<int> holders(int64_t index) const;

  nlohmann::json to_json() const;
  static ShardSpec from_json(const nlohmann::json& json);
  bool operator==(const ShardSpec& other) const;

 private:
  std::vector<int64_t> global_shape_;
  int64_t dim_ = -1;
  int tp_size_ = 1;
  std::vector<std::vector<Segment>> per_rank_;
  bool overlap_ = false;
};

}  // namespace autotp
