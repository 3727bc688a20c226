#include "autotp/comm/autograd_collectives.h"

#include <c10/core/WrapDimMinimal.h>

#include <numeric>
#include <utility>

namespace autotp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The Comm travels through the autograd graph as an address; it must outlive
// backward (a Topology's groups live as long as the model that uses them).
int64_t comm_handle(Comm& comm) { return reinterpret_cast<int64_t>(&comm); }
Comm& comm_from(AutogradContext* ctx) { return *reinterpret_cast<Comm*>(ctx->saved_data.at("comm").toInt()); }

// Every rank's extent along dim; empty `sizes` means an even split of `total`.
std::vector<int64_t> extents_for(const Comm& comm, const std::vector<int64_t>& sizes, int64_t total,
                                 const char* op) {
  if (!sizes.empty()) {
    TORCH_CHECK(static_cast<int>(sizes.size()) == comm.size(), op, ": ", sizes.size(),
                " sizes given for group '", comm.name(), "' of size ", comm.size());
    return sizes;
  }
  TORCH_CHECK(total % comm.size() == 0, op, ": extent ", total, " does not split evenly over group '",
              comm.name(), "' of size ", comm.size(), "; pass sizes");
  return std::vector<int64_t>(comm.size(), total / comm.size());
}

int64_t offset_of(const std::vector<int64_t>& extents, int rank) {
  return std::accumulate(extents.begin(), extents.begin() + rank, int64_t{0});
}

struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, Comm* comm) {
    ctx->saved_data["comm"] = comm_handle(*comm);
    return input;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The incoming gradient may be shared with other consumers: reduce a copy.
    torch::Tensor grad = grads[0].clone(at::MemoryFormat::Contiguous);
    comm_from(ctx).all_reduce(grad);
    return {grad, torch::Tensor()};
  }
};

struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, Comm* comm) {
    torch::Tensor output = input.clone(at::MemoryFormat::Contiguous);
    comm->all_reduce(output);
    return output;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, Comm* comm,
                               std::vector<int64_t> send_counts, std::vector<int64_t> recv_counts) {
    ctx->saved_data["comm"] = comm_handle(*comm);
    ctx->saved_data["send"] = send_counts;
    ctx->saved_data["recv"] = recv_counts;
    return comm->all_to_all(input, send_counts, recv_counts);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto send = ctx->saved_data.at("send").toIntVector(), recv = ctx->saved_data.at("recv").toIntVector();
    return {comm_from(ctx).all_to_all(grads[0], recv, send), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The forward of both gathers: all-gather along dim, remembering how to undo it.
torch::Tensor gather_saving(AutogradContext* ctx, const torch::Tensor& input, Comm* comm, int64_t dim,
                            std::vector<int64_t> sizes, const char* op) {
  TORCH_CHECK(input.dim() > 0, op, ": cannot gather a 0-dim tensor");
  dim = c10::maybe_wrap_dim(dim, input.dim());
  if (sizes.empty()) sizes.assign(comm->size(), input.size(dim));
  ctx->saved_data["comm"] = comm_handle(*comm);
  ctx->saved_data["dim"] = dim;
  ctx->saved_data["sizes"] = sizes;
  return comm->all_gather(input, dim, sizes);
}

struct GatherFromTp : torch::autograd::Function<GatherFromTp> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, Comm* comm, int64_t dim,
                               std::vector<int64_t> sizes) {
    return gather_saving(ctx, input, comm, dim, std::move(sizes), "gather_from_tp");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Comm& comm = comm_from(ctx);
    const int64_t dim = ctx->saved_data.at("dim").toInt();
    const std::vector<int64_t> sizes = ctx->saved_data.at("sizes").toIntVector();
    torch::Tensor grad = grads[0].narrow(dim, offset_of(sizes, comm.rank()), sizes[comm.rank()]);
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

struct ScatterToTp : torch::autograd::Function<ScatterToTp> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, Comm* comm, int64_t dim,
                               const std::vector<int64_t>& sizes) {
    TORCH_CHECK(input.dim() > 0, "scatter_to_tp: cannot scatter a 0-dim tensor");
    dim = c10::maybe_wrap_dim(dim, input.dim());
    std::vector<int64_t> extents = extents_for(*comm, sizes, input.size(dim), "scatter_to_tp");
    const int64_t total = std::accumulate(extents.begin(), extents.end(), int64_t{0});
    TORCH_CHECK(total == input.size(dim), "scatter_to_tp: sizes sum to ", total, " but dim ", dim, " has ",
                input.size(dim));
    ctx->saved_data["comm"] = comm_handle(*comm);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["sizes"] = extents;
    // A copy: the shard must not alias (and keep alive) the full tensor.
    return input.narrow(dim, offset_of(extents, comm->rank()), extents[comm->rank()])
        .clone(at::MemoryFormat::Contiguous);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Comm& comm = comm_from(ctx);
    const int64_t dim = ctx->saved_data.at("dim").toInt();
    const std::vector<int64_t> sizes = ctx->saved_data.at("sizes").toIntVector();
    return {comm.all_gather(grads[0], dim, sizes), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// Sum over the group, this rank's chunk of `dim` (Comm reduce-scatters rows).
torch::Tensor reduce_scatter_along(Comm& comm, const torch::Tensor& full, int64_t dim,
                                   const std::vector<int64_t>& sizes) {
  if (comm.size() == 1) return full;
  torch::Tensor rows = dim == 0 ? full.contiguous() : full.movedim(dim, 0).contiguous();
  torch::Tensor chunk = comm.reduce_scatter(rows, sizes);
  return dim == 0 ? chunk : chunk.movedim(0, dim).contiguous();
}

struct GatherFromSp : torch::autograd::Function<GatherFromSp> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, Comm* comm, int64_t dim,
                               std::vector<int64_t> sizes) {
    return gather_saving(ctx, input, comm, dim, std::move(sizes), "gather_from_sp");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data.at("dim").toInt();
    const std::vector<int64_t> sizes = ctx->saved_data.at("sizes").toIntVector();
    return {reduce_scatter_along(comm_from(ctx), grads[0], dim, sizes), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

struct ReduceScatterToSp : torch::autograd::Function<ReduceScatterToSp> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, Comm* comm, int64_t dim,
                               const std::vector<int64_t>& sizes) {
    TORCH_CHECK(input.dim() > 0, "reduce_scatter_to_sp: cannot scatter a 0-dim tensor");
    dim = c10::maybe_wrap_dim(dim, input.dim());
    std::vector<int64_t> extents = extents_for(*comm, sizes, input.size(dim), "reduce_scatter_to_sp");
    ctx->saved_data["comm"] = comm_handle(*comm);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["sizes"] = extents;
    // A copy on one rank too: the shard must not alias the full tensor.
    return comm->size() == 1 ? input.clone(at::MemoryFormat::Contiguous)
                             : reduce_scatter_along(*comm, input, dim, extents);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data.at("dim").toInt();
    const std::vector<int64_t> sizes = ctx->saved_data.at("sizes").toIntVector();
    return {comm_from(ctx).all_gather(grads[0], dim, sizes), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The forward's collective runs on the lane; the caller waits before reading. The
// lane writes through a tensor of its own over the same storage (variable_data:
// no autograd metadata), so apply() setting the output's grad_fn on this thread
// never races with the lane's in-place ops.
struct StartedReduceFromTp : torch::autograd::Function<StartedReduceFromTp> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, Comm* comm, CommWork* work) {
    torch::Tensor output = input.clone(at::MemoryFormat::Contiguous);
    *work = comm->start_all_reduce(output.variable_data());
    return output;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], torch::Tensor(), torch::Tensor()};
  }
};

// Rows (dim 0) summed over the group, this rank's rows kept, on the lane.
struct StartedReduceScatterRows : torch::autograd::Function<StartedReduceScatterRows> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& rows, Comm* comm,
                               const std::vector<int64_t>& sizes, CommWork* work) {
    ctx->saved_data["comm"] = comm_handle(*comm);
    ctx->saved_data["sizes"] = sizes;
    if (comm->size() == 1) return rows.clone(at::MemoryFormat::Contiguous);  // never the input itself
    torch::Tensor output;
    *work = comm->start_reduce_scatter(output, rows.contiguous(), sizes);
    return output.variable_data();  // the lane keeps `output` (see StartedReduceFromTp)
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::vector<int64_t> sizes = ctx->saved_data.at("sizes").toIntVector();
    return {comm_from(ctx).all_gather(grads[0], 0, sizes), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

StartedReduction start_reduce_from_tp(const torch::Tensor& input, Comm& comm) {
  StartedReduction r;
  r.output = StartedReduceFromTp::apply(input, &comm, &r.work);
  return r;
}

StartedReduction start_reduce_scatter_to_sp(const torch::Tensor& input, Comm& comm, int64_t dim,
                                            const std::vector<int64_t>& sizes) {
  TORCH_CHECK(input.dim() > 0, "start_reduce_scatter_to_sp: cannot scatter a 0-dim tensor");
  dim = c10::maybe_wrap_dim(dim, input.dim());
  const std::vector<int64_t> extents = extents_for(comm, sizes, input.size(dim), "start_reduce_scatter_to_sp");
  StartedReduction r;
  r.output = StartedReduceScatterRows::apply(input.movedim(dim, 0), &comm, extents, &r.work).movedim(0, dim);
  return r;
}

std::vector<int64_t> sequence_shard_sizes(int64_t length, int ranks) {
  TORCH_CHECK(ranks >= 1 && length >= 0, "sequence_shard_sizes: length ", length, " over ", ranks, " ranks");
  std::vector<int64_t> sizes(ranks, length / ranks);
  for (int r = 0; r < length % ranks; ++r) ++sizes[r];
  return sizes;
}

torch::Tensor gather_from_sp(const torch::Tensor& input, Comm& comm, int64_t dim, const std::vector<int64_t>& sizes) {
  return GatherFromSp::apply(input, &comm, dim, sizes);
}

torch::Tensor reduce_scatter_to_sp(const torch::Tensor& input, Comm& comm, int64_t dim,
                                   const std::vector<int64_t>& sizes) {
  return ReduceScatterToSp::apply(input, &comm, dim, sizes);
}

torch::Tensor copy_to_tp(const torch::Tensor& input, Comm& comm) { return CopyToTp::apply(input, &comm); }

torch::Tensor all_to_all_rows(const torch::Tensor& input, Comm& comm, const std::vector<int64_t>& send_counts,
                              const std::vector<int64_t>& recv_counts) {
  if (comm.solo()) return input;
  return AllToAllRows::apply(input, &comm, send_counts, recv_counts);
}

torch::Tensor reduce_from_tp(const torch::Tensor& input, Comm& comm) {
  return ReduceFromTp::apply(input, &comm);
}

torch::Tensor gather_from_tp(const torch::Tensor& input, Comm& comm, int64_t dim,
                             const std::vector<int64_t>& sizes) {
  return GatherFromTp::apply(input, &comm, dim, sizes);
}

torch::Tensor scatter_to_tp(const torch::Tensor& input, Comm& comm, int64_t dim,
                            const std::vector<int64_t>& sizes) {
  return ScatterToTp::apply(input, &comm, dim, sizes);
}

}  // namespace autotp
