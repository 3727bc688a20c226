#include "autotp/tp/shard_spec.h"

#include <algorithm>
#include <limits>

#include "autotp/base/error.h"

namespace autotp {

std::vector<int64_t> split_evenly(int64_t total, int parts) {
  TORCH_CHECK(parts > 0, "split_evenly: parts must be positive, got ", parts);
  std::vector<int64_t> sizes(parts, total / parts);
  for (int64_t i = 0; i < total % parts; ++i) sizes[i] += 1;
  return sizes;
}

ShardSpec ShardSpec::replicated(std::vector<int64_t> global_shape, int tp_size) {
  ShardSpec s;
  s.global_shape_ = std::move(global_shape);
  s.tp_size_ = tp_size;
  s.per_rank_.assign(tp_size, {});
  s.overlap_ = tp_size > 1;
  return s;
}

ShardSpec ShardSpec::split(std::vector<int64_t> global_shape, int64_t dim,
                           std::vector<std::vector<Segment>> per_rank) {
  TORCH_CHECK(dim >= 0 && dim < static_cast<int64_t>(global_shape.size()), "ShardSpec::split: dim ", dim,
              " out of range for a ", global_shape.size(), "-d tensor");
  ShardSpec s;
  s.global_shape_ = std::move(global_shape);
  s.dim_ = dim;
  s.tp_size_ = static_cast<int>(per_rank.size());
  s.per_rank_ = std::move(per_rank);
  // Coverage and overlap from the segments sorted by start: memory and time follow
  // the segments, never the extent (a checkpoint file may claim any extent).
  const int64_t extent = s.global_shape_[dim];
  std::vector<Segment> all;
  for (int r = 0; r < s.tp_size_; ++r)
    for (const auto& seg : s.per_rank_[r]) {
      TORCH_INTERNAL_ASSERT(seg.start >= 0 && seg.length > 0 && seg.start <= extent && seg.length <= extent - seg.start,
                            "ShardSpec: segment [", seg.start, ", +", seg.length, ") outside extent ", extent);
      all.push_back(seg);
    }
  std::sort(all.begin(), all.end(), [](const Segment& a, const Segment& b) { return a.start < b.start; });
  int64_t covered = 0;  // [0, covered) is held
  for (const auto& seg : all) {
    TORCH_INTERNAL_ASSERT(seg.start <= covered, "ShardSpec: index ", covered, " of dim ", dim, " is held by no rank");
    if (seg.start < covered) s.overlap_ = true;
    covered = std::max(covered, seg.start + seg.length);
  }
  TORCH_INTERNAL_ASSERT(covered == extent, "ShardSpec: index ", covered, " of dim ", dim, " is held by no rank");
  return s;
}

int64_t ShardSpec::local_extent(int rank) const {
  if (is_replicated()) return global_shape_.empty() ? 1 : global_shape_[0];
  int64_t n = 0;
  for (const auto& seg : per_rank_.at(rank)) n += seg.length;
  return n;
}

std::vector<int64_t> ShardSpec::local_shape(int rank) const {
  std::vector<int64_t> shape = global_shape_;
  if (!is_replicated()) shape[dim_] = local_extent(rank);
  return shape;
}

int64_t ShardSpec::local_numel(int rank) const {
  int64_t n = 1;
  for (int64_t d : local_shape(rank)) n *= d;
  return n;
}

torch::Tensor ShardSpec::slice(const torch::Tensor& full, int rank) const {
  TORCH_CHECK(full.sizes().vec() == global_shape_, "ShardSpec::slice: tensor shape ", full.sizes(),
              " does not match the spec's global shape ", c10::IntArrayRef(global_shape_));
  if (is_replicated()) return full.clone();
  std::vector<torch::Tensor> parts;
  for (const auto& seg : per_rank_.at(rank)) parts.push_back(full.narrow(dim_, seg.start, seg.length));
  return torch::cat(parts, dim_).contiguous();
}

void ShardSpec::place(torch::Tensor& full, const torch::Tensor& local, int rank, bool accumulate) const {
  TORCH_CHECK(local.sizes().vec() == local_shape(rank), "ShardSpec::place: local shape ", local.sizes(),
              " does not match rank ", rank, "'s shard shape ", c10::IntArrayRef(local_shape(rank)));
  if (is_replicated()) {
    accumulate ? full.add_(local) : full.copy_(local);
    return;
  }
  int64_t offset = 0;
  for (const auto& seg : per_rank_.at(rank)) {
    auto target = full.narrow(dim_, seg.start, seg.length);
    auto source = local.narrow(dim_, offset, seg.length);
    accumulate ? target.add_(source) : target.copy_(source);
    offset += seg.length;
  }
}

std::vector<int> ShardSpec::holders(int64_t index) const {
  std::vector<int> ranks;
  for (int r = 0; r < tp_size_; ++r) {
    if (is_replicated()) {
      ranks.push_back(r);
      continue;
    }
    for (const auto& seg : per_rank_[r])
      if (index >= seg.start && index < seg.start + seg.length) {
        ranks.push_back(r);
        break;
      }
  }
  return ranks;
}

std::vector<Segment> ShardSpec::owned_local(int rank) const {
  if (is_replicated()) {
    if (rank == 0) return {Segment{0, local_extent(0)}};
    return {};
  }
  if (!overlap_) return {Segment{0, local_extent(rank)}};
  std::vector<Segment> owned;
  int64_t local = 0;
  for (const auto& seg : per_rank_.at(rank)) {
    for (int64_t i = 0; i < seg.length; ++i) {
      bool mine = holders(seg.start + i).front() == rank;
      if (mine) {
        if (!owned.empty() && owned.back().start + owned.back().length == local + i)
          owned.back().length += 1;
        else
          owned.push_back(Segment{local + i, 1});
      }
    }
    local += seg.length;
  }
  return owned;
}

nlohmann::json ShardSpec::to_json() const {
  nlohmann::json j;
  j["global_shape"] = global_shape_;
  j["tp_size"] = tp_size_;
  j["dim"] = dim_;
  if (!is_replicated()) {
    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& segs : per_rank_) {
      nlohmann::json list = nlohmann::json::array();
      for (const auto& s : segs) list.push_back({s.start, s.length});
      ranks.push_back(list);
    }
    j["segments"] = ranks;
  }
  return j;
}

namespace {

// An integer of the JSON (a float or one out of T's range is an error, never a
// cast: 1e30 as int64 is undefined behaviour). The caller turns c10::Error into its UserError.
template <typename T>
T json_integer(const nlohmann::json& v, const char* what) {
  const bool fits = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())
                    : v.is_number_integer() ? v.get<int64_t>() >= std::numeric_limits<T>::min() &&
                                                  v.get<int64_t>() <= std::numeric_limits<T>::max()
                                            : false;
  TORCH_CHECK(fits, "ShardSpec: ", what, " is ", v.dump(), ", not an integer in range");
  return static_cast<T>(v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>()) : v.get<int64_t>());
}

}  // namespace

ShardSpec ShardSpec::from_json(const nlohmann::json& j) {
  std::vector<int64_t> shape;
  const auto& shape_json = j.at("global_shape");
  TORCH_CHECK(shape_json.is_array(), "ShardSpec: global_shape is ", shape_json.dump(), ", not an array");
  for (const auto& extent : shape_json) {
    shape.push_back(json_integer<int64_t>(extent, "a global_shape extent"));
    TORCH_CHECK(shape.back() >= 0, "ShardSpec: global_shape ", shape_json.dump(), " has a negative extent");
  }
  int64_t dim = json_integer<int64_t>(j.at("dim"), "dim");
  int tp = json_integer<int>(j.at("tp_size"), "tp_size");
  if (dim < 0) return replicated(shape, tp);
  std::vector<std::vector<Segment>> per_rank;
  for (const auto& segs : j.at("segments")) {
    std::vector<Segment> list;
    for (const auto& s : segs)
      list.push_back(Segment{json_integer<int64_t>(s.at(0), "a segment start"),
                             json_integer<int64_t>(s.at(1), "a segment length")});
    per_rank.push_back(list);
  }
  return split(shape, dim, per_rank);
}

bool ShardSpec::operator==(const ShardSpec& o) const {
  return global_shape_ == o.global_shape_ && dim_ == o.dim_ && tp_size_ == o.tp_size_ && per_rank_ == o.per_rank_;
}

}  // namespace autotp
