#include "autotp/zero/held_params.h"

#include <algorithm>

namespace autotp {

HeldParams::HeldParams(std::vector<Parameter*> params_in, FlatLayout layout_in, int tp_rank_in, int dp_rank_in,
                       torch::TensorOptions options_in)
    : params(std::move(params_in)),
      layout(std::move(layout_in)),
      tp_rank(tp_rank_in),
      dp_rank(dp_rank_in),
      options(options_in) {
  pieces = layout.pieces(dp_rank);
  unit_params.assign(layout.units.size(), {});
  for (size_t i = 0; i < params.size(); ++i) unit_params[layout.unit_of[i]].push_back(i);
}

torch::Tensor HeldParams::own_slice(const torch::Tensor& flat, int unit) const {
  const FlatUnit& u = layout.units[unit];
  return flat.narrow(0, u.begin + dp_rank * slice_of(unit), slice_of(unit));
}

int64_t HeldParams::flat_of(int64_t index) const {
  if (layout.stage == 0) return index;
  auto it = std::upper_bound(pieces.begin(), pieces.end(), index,
                             [](int64_t x, const PartitionPiece& p) { return x < p.part_begin + p.length; });
  TORCH_CHECK(it != pieces.end(), "ZeRO: partition element ", index, " outside ", layout.part);
  return it->flat_begin + (index - it->part_begin);
}

int64_t HeldParams::param_at(int64_t flat) const {
  for (size_t i = 0; i < params.size(); ++i)
    if (flat >= layout.offsets[i] && flat < layout.offsets[i] + layout.numels[i]) return static_cast<int64_t>(i);
  return -1;
}

torch::Tensor HeldParams::partition_copy(const torch::Tensor& flat, torch::ScalarType dtype) const {
  auto out = torch::empty({layout.part}, flat.options().dtype(dtype));
  for (const auto& piece : pieces)
    out.narrow(0, piece.part_begin, piece.length).copy_(flat.narrow(0, piece.flat_begin, piece.length));
  return out;
}

void HeldParams::write_partition(const torch::Tensor& part, torch::Tensor& flat) const {
  for (const auto& piece : pieces)
    flat.narrow(0, piece.flat_begin, piece.length).copy_(part.narrow(0, piece.part_begin, piece.length));
}

void HeldParams::bind(size_t i, const torch::Tensor& storage, int64_t offset) const {
  const ShardSpec& spec = params[i]->spec();
  params[i]->tensor.set_data(storage.narrow(0, offset, layout.numels[i]).view(spec.local_shape(tp_rank)));
}

void free_storage(const torch::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

void allocate_storage(const torch::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

}  // namespace autotp
