#include "autotp/zero/param_store.h"

namespace autotp {

void copy_params(torch::Tensor dst, const torch::Tensor& src) {
  dst.copy_(src, /*non_blocking=*/dst.is_cuda() && !src.is_cuda() && src.is_pinned());
}

FlatParams::FlatParams(HeldParams& held, UnitCollectives& comm) : held_(held), comm_(comm) {
  torch::NoGradGuard no_grad;
  flat_ = torch::zeros({held_.layout.padded}, held_.options);
  for (size_t i = 0; i < held_.params.size(); ++i) {
    const int64_t offset = held_.layout.offsets[i];
    flat_.narrow(0, offset, held_.layout.numels[i]).copy_(held_.params[i]->tensor.reshape({-1}));
    held_.bind(i, flat_, offset);
  }
}

torch::Tensor FlatParams::partition(torch::ScalarType dtype) const {
  if (held_.layout.stage == 0) return dtype == flat_.scalar_type() ? flat_ : flat_.to(dtype);
  return held_.partition_copy(flat_, dtype);
}

void FlatParams::piece_updated(const PartitionPiece& piece, const torch::Tensor& master) {
  if (held_.layout.stage == 0) return;
  // Stages 1-2: the unit's gather runs while the next piece is updated.
  if (master.defined())
    copy_params(flat_.narrow(0, piece.flat_begin, piece.length), master.narrow(0, piece.part_begin, piece.length));
  if (held_.layout.dp == 1) return;
  const FlatUnit& unit = held_.layout.units[piece.unit];
  // The gather reads this rank's slice before the result is copied over it.
  comm_.push(comm_.start_all_gather(held_.own_slice(flat_, piece.unit), flat_.narrow(0, unit.begin, unit.length)));
  comm_.finish(1);
}

void FlatParams::after_update(const torch::Tensor& master) {
  if (held_.layout.stage == 0) {
    if (master.defined()) held_.write_partition(master, flat_);
    return;
  }
  comm_.finish(0);
}

void FlatParams::redistribute(const torch::Tensor& master) {
  torch::NoGradGuard no_grad;
  if (held_.layout.stage == 0) {
    if (master.defined()) held_.write_partition(master, flat_);
    return;
  }
  for (const auto& piece : held_.pieces) piece_updated(piece, master);
  comm_.finish(0);
}

}  // namespace autotp
