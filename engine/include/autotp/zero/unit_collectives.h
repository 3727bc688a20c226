// UnitCollectives: ZeRO's communication over the data-parallel group, one unit
// (zero_units.h) at a time: a unit-sized tensor is reduce-scattered or
// all-gathered in buckets so that every rank moves 1/dp of it. With overlap the
// collectives start on the dp group's lane and are queued (InFlight); the owner
// completes them just before their results are needed. Not thread safe.
#pragma once
#include <torch/torch.h>

#include <deque>
#include <functional>
#include <vector>

#include "autotp/comm/comm.h"

namespace autotp {

// Started collectives and what runs once they have finished (on this thread):
// `finish` when all succeeded, `release` (buffers, memory tags) in any case.
struct InFlight {
  std::vector<CommWork> works;
  std::function<void()> finish, release;
  void complete();
};

class UnitCollectives {
 public:
  UnitCollectives(Comm& dp, int64_t reduce_bucket_elements, int64_t gather_bucket_elements, bool overlap);

  bool overlap() const { return overlap_; }
  Comm& dp() const { return dp_; }  // the group the units are partitioned over
  int64_t reduce_bucket() const { return reduce_bucket_; }
  // Reduce-scatters a unit-sized tensor over dp in buckets of reduce_bucket_size
  // and adds (or copies) this rank's slice into `out` when completed.
  InFlight start_reduce_scatter(const torch::Tensor& unit_values, torch::Tensor out, bool accumulate);
  // All-gathers every rank's slice `local` of a unit into `unit_values` in
  // buckets of allgather_bucket_size; complete before reading unit_values.
  InFlight start_all_gather(const torch::Tensor& local, torch::Tensor unit_values);
  void all_gather(const torch::Tensor& local, torch::Tensor unit_values) {
    start_all_gather(local, std::move(unit_values)).complete();
  }
  // The queue of collectives in flight (at most two are kept by the callers).
  void push(InFlight flight) { in_flight_.push_back(std::move(flight)); }
  void finish(size_t keep);  // completes the oldest until `keep` are left

 private:
  Comm& dp_;
  int64_t reduce_bucket_, gather_bucket_;
  bool overlap_;
  std::deque<InFlight> in_flight_;
};

}  // namespace autotp
