// GradStore: where gradients of the held parameters live between the backward
// and the update, and how they are reduced over dp (one strategy per stage):
//   AllReducedGrads (stage 0): a flat buffer autograd accumulates into,
//     all-reduced in buckets at the step;
//   StepScatteredGrads (stage 1): the same buffer, reduce-scattered unit by unit
//     at the step (each unit's reduced slice lands where this rank's slice was);
//   BackwardScatteredGrads (stages 2-3): each unit's gradients reduce-scattered
//     into the partition as soon as the backward has produced them, then freed.
// With 16-bit weights and gradient accumulation, gradients accumulate in fp32.
// Gradients of kv slices shared by several tp ranks (and partial_grad tensors)
// are summed over tp before the dp reduction.
#pragma once
#include <torch/torch.h>

#include <functional>

#include "autotp/comm/comm.h"
#include "autotp/zero/held_params.h"
#include "autotp/zero/unit_collectives.h"

namespace autotp {

class GradStore {
 public:
  virtual ~GradStore() = default;
  virtual void begin_step() = 0;       // zeroes
  virtual void after_backward() = 0;   // after each micro-batch's backward
  virtual void reduce_unit(int /*unit*/) {}  // a unit's backward is complete (use hooks)
  virtual void reduce_for_step() {}    // before the norm: what the backward left unreduced
  // The partition's reduced gradients at [begin, +length) (inside one piece).
  virtual torch::Tensor at(int64_t begin, int64_t length) const = 0;
  virtual int64_t bytes() const = 0;
  // Called on this thread with a unit's reduced partition gradients [slice] as soon
  // as that unit's reduction over dp has completed (stages 1-3; ZeRO-Offload's copies).
  using ReducedListener = std::function<void(int unit, const torch::Tensor& reduced)>;
  void on_reduced(ReducedListener listener) { listener_ = std::move(listener); }

 protected:
  // `flight`, which reduces `unit` into `reduced`, also tells the listener when done.
  InFlight notifying(InFlight flight, int unit, torch::Tensor reduced) const;
  ReducedListener listener_;
};

// Stages 0-1: the held parameters' .grad are views of one flat buffer.
class FlatGrads : public GradStore {
 public:
  FlatGrads(HeldParams& held, Comm& tp, UnitCollectives& comm, bool fp32_accumulation);
  void begin_step() override;
  void after_backward() override;
  torch::Tensor at(int64_t begin, int64_t length) const override {
    return accumulated().narrow(0, held_.flat_of(begin), length);
  }
  int64_t bytes() const override;

 protected:
  const torch::Tensor& accumulated() const { return fp32_accum_ ? accum_ : flat_; }
  void sum_over_tp();  // shared slices and partial tensors
  HeldParams& held_;
  Comm& tp_;
  UnitCollectives& comm_;
  bool fp32_accum_;
  torch::Tensor flat_;   // model dtype, what autograd accumulates into
  torch::Tensor accum_;  // fp32 accumulation
};

class AllReducedGrads : public FlatGrads {
 public:
  using FlatGrads::FlatGrads;
  void reduce_for_step() override;
};

class StepScatteredGrads : public FlatGrads {
 public:
  using FlatGrads::FlatGrads;
  void reduce_for_step() override;
};

class BackwardScatteredGrads : public GradStore {
 public:
  BackwardScatteredGrads(HeldParams& held, Comm& tp, UnitCollectives& comm, bool fp32_accumulation);
  void begin_step() override;
  void after_backward() override;
  void reduce_unit(int unit) override;
  torch::Tensor at(int64_t begin, int64_t length) const override { return part_.narrow(0, begin, length); }
  int64_t bytes() const override { return part_.defined() ? part_.numel() * int64_t(part_.element_size()) : 0; }

 private:
  HeldParams& held_;
  Comm& tp_;
  UnitCollectives& comm_;
  bool fp32_accum_;
  torch::Tensor part_;        // the reduced partition (flat dtype, fp32 with fp32 accumulation)
  std::vector<bool> reduced_;  // units reduced in this micro-batch's backward
};

}  // namespace autotp
