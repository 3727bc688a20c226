// What a step dispatches, counted: the framework's per-op cost (dispatcher,
// autograd graph, allocator) is paid per op whatever its size, so a model of tiny
// tensors is priced by how many ops it runs, not by its bytes (docs/simulator.md,
// "Compute": the dispatch).
#pragma once
#include <functional>
#include <memory>

#include "autotp/arch/model_config.h"
#include "simulator/memory_model.h"

namespace autotp::sim {

// Top-level ops the calling thread dispatches (aten ops not inside another op) and
// autograd nodes the backward runs (each with the ops inside it).
struct OpCounts {
  double ops = 0;
  double nodes = 0;
};

// Counts what `fn` dispatches on this thread (a CPU backward runs on the caller's thread).
OpCounts count_ops(const std::function<void()>& fn);

// A copy of `config` narrowed to tiny widths (heads of 4, MLPs of 8, vocabulary
// 64, at most 32 positions) with its layers, heads, experts, norms, windows and
// the layout's recomputation kept, on one rank (tp 1, ep 1) in the layout's
// dtype: its forward + backward (loss included; optimizer and ZeRO hooks not)
// dispatches what a micro-batch of the full model does, and its time is all
// framework: the calibration times the calibration model's copy.
class NarrowStep {
 public:
  NarrowStep(const ModelConfig& config, const SimLayout& layout);
  ~NarrowStep();
  void run();

 private:
  struct Parts;
  std::unique_ptr<Parts> parts_;
};

// What one micro-batch of `config` dispatches as `layout` runs it: NarrowStep's
// forward + backward counted. Cached per model structure and layout.
OpCounts step_op_counts(const ModelConfig& config, const SimLayout& layout);

}  // namespace autotp::sim
