// The tensor-parallel collectives of one training step (the model's forward and
// backward under Trainer::train_step, and the optimizer's sums of shared kv
// slices), as a closed form of the plan and the run: the one list both the
// engine's expected communication volume (runtime/step_comm_volume.h) and the
// simulator's time model read: all-reduces, and under sequence parallelism the
// all-gathers and reduce-scatters that replace them. The ZeRO (dp) side is
// zero/zero_traffic.h.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "autotp/tp/tp_plan.h"

namespace autotp {

enum class TpOp { kAllReduce, kAllGather, kReduceScatter };

struct TpCollective {
  TpOp op = TpOp::kAllReduce;
  int64_t calls = 0;
  int64_t bytes = 0;             // summed over the calls (as CommStats counts: the tensor passed, a gather's
                                 // output, a reduce-scatter's whole input)
  bool per_micro_batch = false;  // calls and bytes of one micro-batch (a step has gradient_accumulation_steps
                                 // of them); else of the whole step
  std::string what;
};

struct TpStepShape {
  // The plan's part (tp_step_shape):
  int tp_size = 1;
  std::vector<int64_t> row_linears;   // per decoder layer: its row-parallel reductions (one per block; a sparse
                                      // block reduces its experts once)
  std::vector<bool> sparse;           // per decoder layer: its MLP is a mixture of experts
  bool embedding_split = false;       // a vocab-parallel token embedding
  bool head_split = false;            // a vocab-parallel LM head (the embedding when tied)
  std::vector<int64_t> shared_numel;  // whole elements of each split tensor whose slices several tp ranks hold
                                      // (shared kv heads) and of each partial_grad tensor, in plan order
  // The run's part:
  std::vector<bool> recompute;        // per decoder layer: re-runs its forward in the backward (full
                                      // activation checkpointing); shorter than row_linears = not recomputed
  int64_t tokens = 0;                 // of one micro-batch (micro_batch x seq_len)
  int64_t micro_batch = 1;            // sequences of one micro-batch (how tp_overlap_comm cuts it)
  bool sequence_parallel = false;     // tensor_parallel.sequence_parallel
  bool overlap = false;               // tensor_parallel.tp_overlap_comm (layer_schedule.h cuts layers in two)
  int64_t hidden = 0;
  int zero_stage = 0;                 // stages 2-3 sum shared slices with each micro-batch's reduction
  int64_t element_bytes = 2;          // the model dtype: activations and gradients
  bool fp32_accumulation = false;     // 16-bit gradients accumulated in fp32 (stages 0-1 sum shared slices in fp32)
  // 16-bit tensors counted as fp32 (4 bytes an element): what a backend that
  // reduces them in fp32 moves (Gloo; Comm converts). CommStats counts the
  // tensor passed, so the engine's expected volume leaves it off; the
  // simulator's clusters with reduce_16bit_as_fp32 set it.
  bool reduce_16bit_as_fp32 = false;
};

// The plan's part of the shape: the tp size, the row-parallel linears of each of
// `num_layers` decoder layers, the vocab splits and the shared slices.
TpStepShape tp_step_shape(const TpPlan& plan, int64_t num_layers);

// Empty when tp_size is 1 (a group of one communicates nothing).
std::vector<TpCollective> tp_step_collectives(const TpStepShape& shape);

}  // namespace autotp
