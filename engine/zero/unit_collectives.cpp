#include "autotp/zero/unit_collectives.h"

#include <algorithm>

namespace autotp {

void InFlight::complete() {
  // Every work is waited (a failed one must not leave others writing), then
  // `finish` only if all succeeded, `release` always.
  std::exception_ptr error;
  for (auto& work : works) {
    try {
      work.wait();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  works.clear();
  auto then = std::move(finish), cleanup = std::move(release);
  finish = nullptr;
  release = nullptr;
  if (then && !error) {
    try {
      then();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (cleanup) cleanup();
  if (error) std::rethrow_exception(error);
}

UnitCollectives::UnitCollectives(Comm& dp, int64_t reduce_bucket_elements, int64_t gather_bucket_elements,
                                 bool overlap)
    : dp_(dp),
      reduce_bucket_(std::max<int64_t>(1, reduce_bucket_elements)),
      gather_bucket_(std::max<int64_t>(1, gather_bucket_elements)),
      overlap_(overlap) {}

InFlight UnitCollectives::start_reduce_scatter(const torch::Tensor& unit_values, torch::Tensor out, bool accumulate) {
  torch::NoGradGuard no_grad;
  InFlight flight;
  const int dp = dp_.size();
  const int64_t s = unit_values.numel() / dp;
  if (s == 0) return flight;
  if (dp_.solo()) {  // one rank: the sum is the unit itself
    if (unit_values.data_ptr() == out.data_ptr()) return flight;
    if (accumulate)
      out.add_(unit_values);
    else
      out.copy_(unit_values);
    return flight;
  }
  const int64_t columns = std::clamp<int64_t>(reduce_bucket_ / dp, 1, s);
  auto grid = unit_values.view({dp, s});
  std::vector<torch::Tensor> reduced;
  for (int64_t j = 0; j < s; j += columns) {
    const int64_t n = std::min(columns, s - j);
    // A column bucket is copied to contiguous memory by the collective itself:
    // on the CPU lane when it runs; with NCCL when it starts, so there several
    // buckets of a unit are reduced one at a time rather than all copied at once.
    auto bucket = n == s ? unit_values : grid.narrow(1, j, n);
    reduced.push_back(torch::empty({n}, unit_values.options()));
    if (overlap_ && (n == s || !unit_values.is_cuda()))
      flight.works.push_back(dp_.start_reduce_scatter_into(reduced.back(), bucket));
    else
      dp_.reduce_scatter_into(reduced.back(), bucket);
  }
  flight.finish = [out, reduced = std::move(reduced), columns, accumulate]() mutable {
    for (size_t b = 0; b < reduced.size(); ++b) {
      auto target = out.narrow(0, static_cast<int64_t>(b) * columns, reduced[b].numel());
      if (accumulate)
        target.add_(reduced[b]);
      else
        target.copy_(reduced[b]);
    }
  };
  if (!overlap_) flight.complete();
  return flight;
}

InFlight UnitCollectives::start_all_gather(const torch::Tensor& local, torch::Tensor unit_values) {
  torch::NoGradGuard no_grad;
  InFlight flight;
  const int dp = dp_.size();
  const int64_t s = local.numel();
  if (s == 0) return flight;
  if (dp_.solo()) {
    if (unit_values.data_ptr() != local.data_ptr()) unit_values.copy_(local);
    return flight;
  }
  const int64_t columns = std::clamp<int64_t>(gather_bucket_ / dp, 1, s);
  if (columns == s) {
    // One bucket: straight into the unit (`local` may be this rank's own slice of it).
    if (overlap_)
      flight.works.push_back(dp_.start_all_gather_into(unit_values, local));
    else
      dp_.all_gather_into(unit_values, local);
    return flight;
  }
  // Column buckets, one at a time through a bucket-sized buffer (not overlapped:
  // holding every bucket's buffer until the unit completes would cost a unit).
  auto grid = unit_values.view({dp, s});
  for (int64_t j = 0; j < s; j += columns) {
    const int64_t n = std::min(columns, s - j);
    auto gathered = torch::empty({dp * n}, local.options());
    dp_.all_gather_into(gathered, local.narrow(0, j, n).contiguous());
    grid.narrow(1, j, n).copy_(gathered.view({dp, n}));
  }
  return flight;
}

void UnitCollectives::finish(size_t keep) {
  while (in_flight_.size() > keep) {
    InFlight flight = std::move(in_flight_.front());
    in_flight_.pop_front();
    flight.complete();
  }
}

}  // namespace autotp
