// Tensor-parallel layers as functions over local shards. With a tp group of
// size 1 each is the plain layer. Weights are [out, in] (pass a Conv1D weight
// transposed).
#pragma once
#include <torch/torch.h>

#include "autotp/comm/comm.h"
#include "autotp/tp/shard_spec.h"
#include "autotp/tp/tp_plan.h"

namespace autotp {

// y_local = x W_local^T + b_local. x is whole on every rank; forward is identity
// on x, backward all-reduces x's gradient over the tp group.
torch::Tensor column_parallel_linear(const torch::Tensor& x, const torch::Tensor& weight,
                                     const torch::Tensor& bias, Comm& tp);
// The input projections of a split block as one autograd node (Megatron's
// linear with asynchronous communication, for several weights at once): returns
// x_full W_j^T for each weight (biases are the caller's). x is the block input:
// this rank's tokens along dim 1 under sequence parallelism (all-gathered here),
// else whole. Backward computes the input gradient sum_j g_j W_j, then its
// all-reduce (reduce-scatter along the sequence under sequence parallelism) and
// the weight gradients g_j^T x_full; with `overlap` the collective runs on the
// group's lane while the weight-gradient GEMMs compute. Under sequence
// parallelism the gathered input is not kept: backward gathers it again (behind
// the input-gradient GEMM with `overlap`), so the block holds 1/tp of its input.
struct ColumnInputOptions {
  bool sequence_parallel = false;
  std::vector<int64_t> sequence_sizes;  // every rank's tokens (sequence_shard_sizes)
  bool overlap = false;
};
std::vector<torch::Tensor> column_parallel_inputs(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                                  Comm& tp, const ColumnInputOptions& options);
// y = all_reduce(x_local W_local^T) + b. x is split along its last dim like W's
// input dim; the (replicated) bias is added once, after the reduce.
torch::Tensor row_parallel_linear(const torch::Tensor& x_local, const torch::Tensor& weight,
                                  const torch::Tensor& bias, Comm& tp);
// Rows [vocab_start, vocab_start + weight.size(0)) of the embedding live on this
// rank: ids outside give zeros, then the partial results are all-reduced, or with
// `sequence_sizes` reduce-scattered along the sequence (dim 1): each rank gets its
// tokens only (sequence parallelism).
torch::Tensor vocab_parallel_embedding(const torch::Tensor& ids, const torch::Tensor& weight, int64_t vocab_start,
                                       Comm& tp, const std::vector<int64_t>& sequence_sizes = {});
// Cross-entropy of logits split over the vocab ([N, V_local], columns
// [vocab_start, vocab_start + V_local)) without gathering them: max and
// sum-exp are reduced over the tp group. Returns the per-token loss [N] in fp32,
// 0 where target == ignore_index.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits_local, const torch::Tensor& targets,
                                           int64_t vocab_start, Comm& tp, int64_t ignore_index = -100);

// Sums, in place, the parts of a gradient shard that several tp ranks hold (kv
// heads shared under GQA) over their holders; other parts are unchanged. No-op
// for specs without overlap.
void sum_shared_slices(const ShardSpec& spec, torch::Tensor& local_grad, Comm& tp);
// What every tensor's gradient needs over the tp group before the optimizer reads
// it: shared slices summed (sum_shared_slices), a partial_grad tensor all-reduced
// whole; others unchanged.
void sum_partial_grads(const PlanEntry& entry, torch::Tensor& local_grad, Comm& tp);

// The whole logical tensor from every tp rank's shard `local` (all-gather over
// the tp group, then placed by the spec); every rank gets it. Detached.
torch::Tensor gather_full(const ShardSpec& spec, const torch::Tensor& local, Comm& tp);

}  // namespace autotp
