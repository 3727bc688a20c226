// Collectives that take part in autograd (Megatron's conjugate pairs):
//   copy_to_tp:     forward identity,             backward all-reduce (sum)
//   reduce_from_tp: forward all-reduce (sum),     backward identity
//   gather_from_tp: forward all-gather along dim, backward keep own slice
//   scatter_to_tp:  forward keep own slice,       backward all-gather
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

}  // namespace autotp
