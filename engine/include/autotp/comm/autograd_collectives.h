// Collectives that take part in autograd (Megatron's conjugate pairs):
//   copy_to_tp:     forward identity,             backward all-reduce (sum)
//   reduce_from_tp: forward all-reduce (sum),     backward identity
//   gather_from_tp: forward all-gather along dim, backward keep own slice
//   scatter_to_tp:  forward keep own slice,       backward all-gather
// and the sequence-parallel pair (Korthikanti et al. 2022), whose gathered side
// is consumed by tp-split layers, so its gradient is a sum over the group:
//   gather_from_sp:       forward all-gather along dim,     backward reduce-scatter (sum)
//   reduce_scatter_to_sp: forward reduce-scatter along dim, backward all-gather
// and the expert-parallel token exchange:
//   all_to_all_rows:      forward all-to-all of rows,       backward the reverse all-to-all
// `sizes` lists every rank's extent along `dim` (uneven shards); empty = equal.
#pragma once
#include <torch/torch.h>

#include "autotp/comm/comm.h"

namespace autotp {

torch::Tensor copy_to_tp(const torch::Tensor& input, Comm& comm);
torch::Tensor reduce_from_tp(const torch::Tensor& input, Comm& comm);
torch::Tensor gather_from_tp(const torch::Tensor& input, Comm& comm, int64_t dim,
                             const std::vector<int64_t>& sizes = {});
torch::Tensor scatter_to_tp(const torch::Tensor& input, Comm& comm, int64_t dim,
                            const std::vector<int64_t>& sizes = {});
torch::Tensor gather_from_sp(const torch::Tensor& input, Comm& comm, int64_t dim,
                             const std::vector<int64_t>& sizes = {});
torch::Tensor reduce_scatter_to_sp(const torch::Tensor& input, Comm& comm, int64_t dim,
                                   const std::vector<int64_t>& sizes = {});

// Comm::all_to_all with send_counts / recv_counts; the gradient travels back with the counts swapped.
torch::Tensor all_to_all_rows(const torch::Tensor& input, Comm& comm, const std::vector<int64_t>& send_counts,
                              const std::vector<int64_t>& recv_counts);

// reduce_from_tp and reduce_scatter_to_sp started on the group's lane (Domino's
// overlap): `output` may be read only after `work.wait()`; backward as the
// blocking ones (identity; all-gather along dim).
struct StartedReduction {
  torch::Tensor output;
  CommWork work;
};
StartedReduction start_reduce_from_tp(const torch::Tensor& input, Comm& comm);
StartedReduction start_reduce_scatter_to_sp(const torch::Tensor& input, Comm& comm, int64_t dim,
                                            const std::vector<int64_t>& sizes = {});

// The sequence's remainder rule: of `length` tokens, rank r of `ranks` holds
// length / ranks, plus one for r < length % ranks (the first ranks take the rest,
// as uneven heads do).
std::vector<int64_t> sequence_shard_sizes(int64_t length, int ranks);

}  // namespace autotp
