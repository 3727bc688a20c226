// The order in which a decoder layer's two tensor-parallel blocks (attention,
// MLP) compute and reduce. Each block ends in a row-parallel layer whose partial
// output is reduced over tp (all-reduce, or reduce-scatter under sequence
// parallelism). Plain: each reduction blocks. Overlapped (tp_overlap_comm, after
// Domino, Wang et al. 2024): the micro-batch is cut into two pieces and each
// piece's reduction runs on the tp group's lane while the other piece computes:
//   attention(A) start(A) attention(B) start(B) wait(A) mlp(A) start(A')
//   wait(B) mlp(B) start(B') wait(A') wait(B')
// so of four reductions per layer only the last is exposed. Pieces are halves of
// the batch (the first takes the odd one); with one sequence they are halves of
// the sequence, and attention runs on the whole sequence (causal attention of
// the second half needs the first half's keys) before its output is cut.
#pragma once
#include <torch/torch.h>

#include <functional>

#include "autotp/comm/autograd_collectives.h"

namespace autotp {

enum class PieceAxis { kNone, kBatch, kSequence };

struct LayerBlocks {
  // residual stream piece -> the attention block's partial row output
  std::function<torch::Tensor(const torch::Tensor&)> attention;
  // (residual stream piece, reduced attention output) -> residual stream after attention
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> after_attention;
  std::function<torch::Tensor(const torch::Tensor&)> mlp;
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> after_mlp;
  // the row reduction, blocking and started on the lane
  std::function<torch::Tensor(const torch::Tensor&)> reduce;
  std::function<StartedReduction(const torch::Tensor&)> start_reduce;
  // called before a piece's work with its first index along the axis (batch
  // sample or token) and after it with -1: the model's dropout masks follow it
  std::function<void(PieceAxis, int64_t)> enter_piece;
  // whether each block is split over tp (a whole block's output needs no reduction)
  bool attention_split = true, mlp_split = true;
};

// The layer's output for residual stream x [B, T, hidden]; `axis` kNone runs it
// plain, else in two pieces along the axis (at least 2 entries, both blocks split).
torch::Tensor run_layer_blocks(const torch::Tensor& x, const LayerBlocks& blocks, PieceAxis axis);
// The attention block alone, plain (layers whose MLP is a mixture of experts).
torch::Tensor run_attention_block(const torch::Tensor& x, const LayerBlocks& blocks);

}  // namespace autotp
