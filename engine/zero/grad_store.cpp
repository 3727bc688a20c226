#include "autotp/zero/grad_store.h"

#include "autotp/base/memory_counter.h"
#include "autotp/optim/optimizer.h"
#include "autotp/tp/parallel_layers.h"

namespace autotp {

InFlight GradStore::notifying(InFlight flight, int unit, torch::Tensor reduced) const {
  if (!listener_) return flight;
  flight.finish = [then = std::move(flight.finish), listener = listener_, unit, reduced = std::move(reduced)] {
    if (then) then();
    listener(unit, reduced);
  };
  return flight;
}

FlatGrads::FlatGrads(HeldParams& held, Comm& tp, UnitCollectives& comm, bool fp32_accumulation)
    : held_(held), tp_(tp), comm_(comm), fp32_accum_(fp32_accumulation) {}

void FlatGrads::begin_step() {
  torch::NoGradGuard no_grad;
  const FlatLayout& layout = held_.layout;
  if (!flat_.defined()) {
    flat_ = torch::zeros({layout.padded}, held_.options);
    for (size_t i = 0; i < held_.params.size(); ++i)
      held_.params[i]->tensor.mutable_grad() =
          flat_.narrow(0, layout.offsets[i], layout.numels[i]).view(held_.params[i]->spec().local_shape(held_.tp_rank));
  } else {
    flat_.zero_();
  }
  if (fp32_accum_) {
    if (!accum_.defined())
      accum_ = torch::zeros({layout.padded}, held_.options.dtype(torch::kFloat32));
    else
      accum_.zero_();
  }
}

void FlatGrads::after_backward() {
  torch::NoGradGuard no_grad;
  if (!fp32_accum_) return;  // gradients accumulate in place
  // Chunk by chunk: a mixed-dtype add_ upcasts its whole operand first.
  const int64_t padded = held_.layout.padded;
  for (int64_t begin = 0; begin < padded; begin += kUpdateChunk) {
    const int64_t n = std::min(kUpdateChunk, padded - begin);
    accum_.narrow(0, begin, n).add_(flat_.narrow(0, begin, n));
  }
  flat_.zero_();
}

int64_t FlatGrads::bytes() const {
  auto bytes = [](const torch::Tensor& t) { return t.defined() ? t.numel() * int64_t(t.element_size()) : int64_t{0}; };
  return bytes(flat_) + bytes(accum_);
}

void FlatGrads::sum_over_tp() {
  torch::Tensor acc = accumulated();
  for (size_t i = 0; i < held_.params.size(); ++i) {
    const Parameter& p = *held_.params[i];
    auto local = acc.narrow(0, held_.layout.offsets[i], held_.layout.numels[i]).view(p.spec().local_shape(held_.tp_rank));
    sum_partial_grads(*p.entry, local, tp_);
  }
}

void AllReducedGrads::reduce_for_step() {
  sum_over_tp();
  torch::Tensor acc = accumulated();
  const int64_t padded = held_.layout.padded, bucket = comm_.reduce_bucket();
  for (int64_t offset = 0; offset < padded; offset += bucket) {
    auto chunk = acc.narrow(0, offset, std::min(bucket, padded - offset));
    comm_.dp().all_reduce(chunk);
  }
}

void StepScatteredGrads::reduce_for_step() {
  sum_over_tp();
  torch::Tensor acc = accumulated();
  // Each unit's reduced slice lands where this rank's slice of it was.
  for (size_t u = 0; u < held_.layout.units.size(); ++u) {
    const FlatUnit& unit = held_.layout.units[u];
    if (unit.length == 0) continue;
    torch::Tensor slice = held_.own_slice(acc, static_cast<int>(u));
    comm_.push(notifying(comm_.start_reduce_scatter(acc.narrow(0, unit.begin, unit.length), slice, /*accumulate=*/false),
                         static_cast<int>(u), slice));
    comm_.finish(1);
  }
  comm_.finish(0);
}

BackwardScatteredGrads::BackwardScatteredGrads(HeldParams& held, Comm& tp, UnitCollectives& comm,
                                               bool fp32_accumulation)
    : held_(held), tp_(tp), comm_(comm), fp32_accum_(fp32_accumulation) {}

void BackwardScatteredGrads::begin_step() {
  torch::NoGradGuard no_grad;
  for (Parameter* p : held_.params) p->tensor.mutable_grad().reset();
  if (!part_.defined())
    part_ = torch::zeros({held_.layout.part}, held_.options.dtype(fp32_accum_ ? torch::kFloat32 : held_.options.dtype().toScalarType()));
  else
    part_.zero_();
  reduced_.assign(held_.layout.units.size(), false);
}

void BackwardScatteredGrads::reduce_unit(int unit) {
  torch::NoGradGuard no_grad;
  reduced_[unit] = true;
  const FlatUnit& u = held_.layout.units[unit];
  if (u.length == 0) return;
  const auto& members = held_.unit_params[unit];
  // Every rank runs the same graph, so every rank has gradients for the same units.
  bool any = false;
  for (size_t i : members) any = any || held_.params[i]->tensor.grad().defined();
  if (!any) return;
  // The previous unit's reduction (it ran behind this unit's backward) completes
  // first, so its bucket is gone before this one is filled.
  comm_.finish(0);
  const torch::ScalarType low = held_.options.dtype().toScalarType();
  const int64_t bucket_bytes = u.length * static_cast<int64_t>(c10::elementSize(low));
  memory_tag_add(MemoryTag::kGradientBuckets, bucket_bytes);
  torch::Tensor buffer;
  torch::Tensor only = members.size() == 1 ? held_.params[members[0]]->tensor.grad() : torch::Tensor();
  if (only.defined() && only.is_contiguous() && only.numel() == u.length && only.scalar_type() == low) {
    // A one-tensor unit without padding (an embedding, an LM head): its gradient is the bucket.
    sum_partial_grads(*held_.params[members[0]]->entry, only, tp_);
    buffer = only.view({-1});
    held_.params[members[0]]->tensor.mutable_grad().reset();
  } else {
    buffer = torch::zeros({u.length}, held_.options);
    for (size_t i : members) {
      torch::Tensor grad = held_.params[i]->tensor.mutable_grad();
      if (!grad.defined()) continue;
      sum_partial_grads(*held_.params[i]->entry, grad, tp_);
      buffer.narrow(0, held_.layout.offsets[i] - u.begin, held_.layout.numels[i]).copy_(grad.reshape({-1}));
      held_.params[i]->tensor.mutable_grad().reset();
    }
  }
  only = torch::Tensor();
  torch::Tensor reduced = held_.unit_part(part_, unit);
  InFlight flight = notifying(comm_.start_reduce_scatter(buffer, reduced, /*accumulate=*/true), unit, reduced);
  // The bucket lives until its reduction is complete (the lane holds it meanwhile).
  flight.release = [buffer = std::move(buffer), bucket_bytes]() mutable {
    buffer = torch::Tensor();
    memory_tag_add(MemoryTag::kGradientBuckets, -bucket_bytes);
  };
  if (comm_.overlap())
    comm_.push(std::move(flight));  // runs behind the next unit's backward
  else
    flight.complete();
}

void BackwardScatteredGrads::after_backward() {
  torch::NoGradGuard no_grad;
  // Units whose backward has no hook (embeddings, persistent tensors, a tied
  // head), and any gradient that arrived after its unit was reduced.
  for (size_t u = 0; u < held_.layout.units.size(); ++u) {
    bool pending = !reduced_[u];
    for (size_t i : held_.unit_params[u]) pending = pending || held_.params[i]->tensor.grad().defined();
    if (pending) reduce_unit(static_cast<int>(u));
  }
  comm_.finish(0);
  reduced_.assign(held_.layout.units.size(), false);
}

}  // namespace autotp
