// ParamStore: where ZeRO keeps the model-dtype parameters it holds, and how the
// other dp ranks' copies follow this rank's updated partition (one strategy per
// stage family):
//   FlatParams (stages 0-2): every rank holds the whole flat buffer; stage 0
//     updates all of it, stages 1-2 update their partition and all-gather each
//     unit's slice as soon as it is updated.
//   Stage3Params (stage 3, stage3_params.h): each rank holds its partition only;
//     units are gathered around their uses.
// `master`: the fp32 master partition in mixed precision, undefined in fp32
// training (the stored values are the master).
#pragma once
#include <torch/torch.h>

#include "autotp/model/sharded_model.h"
#include "autotp/zero/held_params.h"
#include "autotp/zero/unit_collectives.h"

namespace autotp {

class ParamStore {
 public:
  virtual ~ParamStore() = default;
  // The partition's values at [begin, +length) (inside one piece), in the flat dtype.
  virtual torch::Tensor at(int64_t begin, int64_t length) const = 0;
  // This rank's partition as one [part] tensor of `dtype` (a copy where not contiguous).
  virtual torch::Tensor partition(torch::ScalarType dtype) const = 0;
  // Before a step's first forward, and after each micro-batch's backward.
  virtual void begin_step() {}
  virtual void after_backward() {}
  // The update of `piece` is done.
  virtual void piece_updated(const PartitionPiece& /*piece*/, const torch::Tensor& /*master*/) {}
  // Every piece was updated.
  virtual void after_update(const torch::Tensor& master) = 0;
  // The partition changed as a whole (a skipped step, a load): copies follow.
  virtual void redistribute(const torch::Tensor& master) = 0;
  // Writes the partition from fp32 values [part] (then call redistribute).
  virtual void load(const torch::Tensor& values) = 0;
  // Use hooks (stage 3 gathers); none by default.
  virtual void acquire_use(int64_t /*use*/) {}
  virtual void release_use(int64_t /*use*/) {}
  virtual void prefetch_use(int64_t /*use*/) {}
  // Stage 3: every parameter whole until the next step.
  virtual void gather_all() {}
  virtual int64_t bytes() const = 0;  // model-dtype parameter bytes held between steps
  virtual int64_t host_bytes() const { return 0; }  // of bytes(), those in host memory (ZeRO-Offload)
};

// dst.copy_(src), asynchronous when it goes from page-locked host memory to the
// GPU (ZeRO-Offload's staged parameters): the host buffer is not rewritten
// before later work on the stream has run.
void copy_params(torch::Tensor dst, const torch::Tensor& src);

class FlatParams : public ParamStore {
 public:
  // Moves the parameters into one flat buffer of held.options.
  FlatParams(HeldParams& held, UnitCollectives& comm);
  torch::Tensor at(int64_t begin, int64_t length) const override {
    return flat_.narrow(0, held_.flat_of(begin), length);
  }
  torch::Tensor partition(torch::ScalarType dtype) const override;
  void piece_updated(const PartitionPiece& piece, const torch::Tensor& master) override;
  void after_update(const torch::Tensor& master) override;
  void redistribute(const torch::Tensor& master) override;
  void load(const torch::Tensor& values) override { held_.write_partition(values, flat_); }
  int64_t bytes() const override { return flat_.numel() * static_cast<int64_t>(flat_.element_size()); }

 private:
  HeldParams& held_;
  UnitCollectives& comm_;
  torch::Tensor flat_;  // the whole buffer
};

}  // namespace autotp
