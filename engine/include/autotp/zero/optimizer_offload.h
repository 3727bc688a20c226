// OptimizerOffload: ZeRO-Offload of the update (DeepSpeed's "offload_optimizer":
// {"device": "cpu"}). This rank's fp32 master partition, a copy of its reduced
// gradients (in the gradient dtype) and, in 16-bit training, the updated
// parameters staged in the model dtype live in host memory (pinned where asked
// and granted); the optimizer states are the FlatOptimizer's, built on the CPU.
// A unit's reduced gradients are copied device-to-host on a copy stream as soon
// as its reduction completes in the step's last micro-batch, beside the rest of
// the backward; what no reduction delivered is copied at the step. The update
// then runs on the CPU (torch's fused AdamW over the partition, on the rank's
// intra-op threads) and each updated piece goes back to the device asynchronously
// from the staging buffer while the next piece is updated. On a CPU device the
// same buffers and copies exist, so CI runs this path.
#pragma once
#include <torch/torch.h>

#include <vector>

#include "autotp/base/device.h"
#include "autotp/zero/flat_layout.h"
#include "autotp/zero/held_params.h"

namespace autotp {

class OptimizerOffload {
 public:
  // `initial`: the partition's fp32 values [part] (any device). `stage_params`:
  // a model-dtype staging buffer for the copies to the device (16-bit training
  // whose parameters are on the device; with offload_param the update writes
  // the host partition straight from the master).
  OptimizerOffload(const HeldParams& held, const torch::Tensor& initial, torch::ScalarType grad_dtype,
                   torch::ScalarType param_dtype, bool stage_params, bool pin, const torch::Device& device);

  torch::Tensor& master() { return master_; }  // host fp32 [part]
  void begin_step() { copied_.assign(held_.layout.units.size(), false); }
  // `unit`'s reduced partition gradients (on the device) are final for this step.
  void gradients_final(int unit, const torch::Tensor& reduced);
  // Copies the pieces no reduction delivered from `device_grads(begin, length)`,
  // then waits for every copy: the host gradients are complete.
  template <typename DeviceGrads>
  void collect_gradients(const DeviceGrads& device_grads) {
    for (const PartitionPiece& piece : held_.pieces)
      if (!copied_[piece.unit]) copies_.copy(grads_at(piece.part_begin, piece.length),
                                             device_grads(piece.part_begin, piece.length));
    copies_.wait_host();
  }
  torch::Tensor grads_at(int64_t begin, int64_t length) const { return grads_.narrow(0, begin, length); }
  // The updated `piece` in the model dtype, for the device's copy: a [part]
  // tensor whose piece is current (the master itself in fp32 training).
  const torch::Tensor& staged(const PartitionPiece& piece);
  const torch::Tensor& staging() const { return staging_.defined() ? staging_ : master_; }
  // The whole partition staged from the master (after a load or a skipped step).
  const torch::Tensor& staged_all();
  int64_t buffer_bytes() const;  // the gradient copy and the staging buffer (not the master)

 private:
  const HeldParams& held_;
  CopyStream copies_;
  torch::Tensor master_, grads_, staging_;  // staging_ undefined in fp32 training and with offload_param
  std::vector<bool> copied_;               // per unit, this step
};

}  // namespace autotp
