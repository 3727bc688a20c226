#include "autotp/zero/optimizer_offload.h"

namespace autotp {

OptimizerOffload::OptimizerOffload(const HeldParams& held, const torch::Tensor& initial, torch::ScalarType grad_dtype,
                                   torch::ScalarType param_dtype, bool stage_params, bool pin,
                                   const torch::Device& device)
    : held_(held), copies_(device) {
  torch::NoGradGuard no_grad;
  const int64_t part = held_.layout.part;
  master_ = host_buffer(part, torch::kFloat32, device, pin);
  master_.copy_(initial);
  grads_ = host_buffer(part, grad_dtype, device, pin);
  grads_.zero_();
  if (stage_params && param_dtype != torch::kFloat32) {
    staging_ = host_buffer(part, param_dtype, device, pin);
    staging_.copy_(master_);
  }
  begin_step();
}

void OptimizerOffload::gradients_final(int unit, const torch::Tensor& reduced) {
  copies_.copy(held_.unit_part(grads_, unit), reduced);
  copied_[unit] = true;
}

const torch::Tensor& OptimizerOffload::staged(const PartitionPiece& piece) {
  if (!staging_.defined()) return master_;
  staging_.narrow(0, piece.part_begin, piece.length).copy_(master_.narrow(0, piece.part_begin, piece.length));
  return staging_;
}

const torch::Tensor& OptimizerOffload::staged_all() {
  if (!staging_.defined()) return master_;
  staging_.copy_(master_);
  return staging_;
}

int64_t OptimizerOffload::buffer_bytes() const {
  auto bytes = [](const torch::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : int64_t{0}; };
  return bytes(grads_) + bytes(staging_);
}

}  // namespace autotp
