// The data-parallel collectives ZeroOptimizer issues in one optimizer step, as
// a closed form of its flat layout: the one list both the engine's expected
// communication volume (step_comm_volume.h) and the simulator's time model read.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "autotp/zero/flat_layout.h"

namespace autotp {

struct ZeroCollective {
  enum class Op { kAllReduce, kAllGather, kReduceScatter };
  // What the collective can run behind when overlap_comm is on (zero_optimizer.h):
  // the forward compute (stage-3 gathers prefetched there), the backward
  // compute (stage 2-3 reductions of the layers above layer 0 and of an untied
  // head, stage-3 layer gathers prefetched there), the optimizer's update of the
  // next unit (stage 1-2 gathers but the last), or nothing (waited at once:
  // stage 0-1 reductions, reductions at the backward's end, the embeddings'
  // gather, the head's backward gather, persistent tensors).
  enum class Behind { kNothing, kForward, kBackward, kUpdate };
  Op op = Op::kAllReduce;
  int64_t calls = 0;
  int64_t bytes = 0;          // summed over the calls (all-gather: the gathered output; else the input)
  bool layer_gather = false;  // stage 3: a decoder layer's gather in the forward or the backward
  std::string what;
  Behind behind = Behind::kNothing;
};

struct ZeroStepShape {
  int64_t num_layers = 0;
  int64_t gradient_accumulation_steps = 1;
  int64_t element_bytes = 2;       // the model dtype
  bool fp32_accumulation = false;  // 16-bit gradients accumulated in fp32 (stages 0-1 reduce fp32)
  bool tied_embeddings = false;
  int64_t reduce_bucket_size = 500000000;     // elements
  int64_t allgather_bucket_size = 500000000;  // elements
};

// Empty when the layout has one dp rank (a group of one communicates nothing).
std::vector<ZeroCollective> zero_step_collectives(const FlatLayout& layout, const ZeroStepShape& shape);

}  // namespace autotp
