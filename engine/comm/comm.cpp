#include "autotp/comm/comm.h"

#include "autotp/comm/comm_lane.h"
#include "autotp/comm/shared_memory_transport.h"
#include "autotp/base/run_phase.h"

#include <c10/core/WrapDimMinimal.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <thread>

namespace autotp {
namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp ", static_cast<int>(op));
}

std::string error_text(const std::exception& error) {
  if (auto* c10_error = dynamic_cast<const c10::Error*>(&error)) return c10_error->what_without_backtrace();
  return error.what();
}

// On Gloo bfloat16 reductions run in fp32 (more accurate, and the shared-memory
// transport sums fp32); NCCL reduces bfloat16 natively. Broadcast and all_gather
// only move bytes, so other types travel as a type of the same width that every
// backend handles.
torch::Tensor reduction_buffer(const torch::Tensor& tensor, bool nccl) {
  if (tensor.scalar_type() == torch::kBFloat16 && !nccl) return tensor.to(torch::kFloat32);
  return tensor.contiguous();
}
// 16-bit floats are summed in fp32 by the CPU reduce-scatters (as by all_reduce).
bool is_16bit_float(const torch::Tensor& tensor) {
  return tensor.scalar_type() == torch::kBFloat16 || tensor.scalar_type() == torch::kFloat16;
}

torch::Tensor movement_view(const torch::Tensor& tensor) {
  switch (tensor.scalar_type()) {
    case torch::kFloat32:
    case torch::kFloat64:
    case torch::kFloat16:
    case torch::kInt8:
    case torch::kUInt8:
    case torch::kInt32:
    case torch::kInt64:
      return tensor;
    default:
      break;
  }
  switch (tensor.element_size()) {
    case 1:
      return tensor.view(torch::kUInt8);
    case 2:
      return tensor.view(torch::kFloat16);
    case 4:
      return tensor.view(torch::kInt32);
    case 8:
      return tensor.view(torch::kInt64);
    default:
      return tensor;  // Gloo names the type it rejects
  }
}

// Adds the wall time of one counted collective to the stats.
class Stopwatch {
 public:
  explicit Stopwatch(double& total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~Stopwatch() { total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  double& total_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

Comm::Comm() : global_ranks_{0} {}

Comm::~Comm() { wait_all(); }

CommStats Comm::stats() const {
  CommStats stats = stats_;
  stats.async_seconds = static_cast<double>(async_ns_->load()) * 1e-9;
  return stats;
}

void Comm::reset_stats() {
  stats_ = {};
  async_ns_->store(0);
}

void Comm::wait_all() {
  if (lane_) lane_->drain();
}

void Comm::communicate_alone() {
  TORCH_CHECK(group_, "Comm::communicate_alone: group '", name_, "' has no process group");
  wait_all();
  alone_shortcut_ = false;
  if (!lane_) lane_ = std::make_shared<CommLane>();
}

void Comm::share_lane_with(const Comm& other) {
  TORCH_CHECK(group_ == other.group_, "Comm::share_lane_with: group '", name_, "' and group '", other.name_,
              "' do not share a process group");
  lane_ = other.lane_;
}

void CommWork::wait() {
  if (!pending()) return;
  Stopwatch timed(comm_->stats_.seconds);
  auto job = std::move(job_);  // cleared first: a second wait is a no-op
  auto work = std::move(work_);
  if (job) {
    job->wait();  // its error already names the op and the group
    return;
  }
  try {
    work->wait();
  } catch (const std::exception& error) {
    comm_->fail(op_, error);
  }
}

template <typename Start>
CommWork Comm::start_on_nccl(const char* op, Start&& start) {
  wait_all();  // the group's CPU collectives first
  CommWork work;
  work.comm_ = this;
  work.op_ = op;
  try {
    work.work_ = start();
  } catch (const std::exception& error) {
    fail(op, error);
  }
  return work;
}

CommWork Comm::post(const char* op, std::function<void()> body) {
  CommWork work;
  work.comm_ = this;
  work.op_ = op;
  work.job_ = lane_->post([counter = async_ns_, body = std::move(body)] {
    const auto start = std::chrono::steady_clock::now();
    auto add_elapsed = [&] {
      counter->fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
                             .count());
    };
    try {
      body();
    } catch (...) {
      add_elapsed();
      throw;
    }
    add_elapsed();
  });
  return work;
}

void Comm::use_shared_memory(std::shared_ptr<SharedMemoryTransport> transport) {
  TORCH_CHECK(!transport || transport->size() == size_, "Comm::use_shared_memory on group '", name_,
              "': a transport for ", transport ? transport->size() : 0, " ranks given to a group of ", size_);
  shm_ = std::move(transport);
}

void Comm::fail(const char* op, const std::exception& error) const {
  // The rank's phase says where in the run it broke (the launcher's error line names it too).
  const std::string phase = current_phase().describe();
  const int global_rank = rank_ < static_cast<int>(global_ranks_.size()) ? global_ranks_[rank_] : rank_;
  throw std::runtime_error(fmt::format("Comm::{} on group '{}' (rank {} of {}, global ranks [{}]; this is global rank {}) "
                                       "failed{}: {}",
                                       op, name_, rank_, size_, fmt::join(global_ranks_, ", "), global_rank,
                                       phase.empty() ? "" : " during " + phase, error_text(error)));
}

Comm::Comm(c10::intrusive_ptr<c10d::ProcessGroup> group, std::vector<int> global_ranks, std::string name,
           Backend backend)
    : group_(std::move(group)), global_ranks_(std::move(global_ranks)), name_(std::move(name)), backend_(backend) {
  if (group_) {
    rank_ = group_->getRank();
    size_ = group_->getSize();
  }
  if (size_ > 1) lane_ = std::make_shared<CommLane>();  // its thread starts with the first started collective
  TORCH_CHECK(group_ || global_ranks_.size() == 1, "Comm '", name_, "': a group of ", global_ranks_.size(),
              " ranks needs a process group");
  TORCH_CHECK(static_cast<int>(global_ranks_.size()) == size_, "Comm '", name_, "': ", global_ranks_.size(),
              " global ranks given for a process group of size ", size_);
}

// Blocks on one collective; any failure (Gloo timeout, a peer that died, a bad
// argument) becomes an error naming the op and the group, so that a rank's last
// words say which collective in which group broke.
template <typename Start>
void Comm::run(const char* op, Start&& start, bool settle) {
  try {
    c10::intrusive_ptr<c10d::Work> work = start();
    work->wait();
    // Gloo's worker thread drops its reference to the work (and with it the
    // tensors it holds, e.g. an uneven all-gather's padded blocks) just after
    // waking us: waiting for that keeps the free, and so peak memory,
    // independent of scheduling. Only where the work holds a temporary.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
    if (settle && work.use_count() > 1) {
      Stopwatch timed(stats_.settle_seconds);  // what exact peak accounting costs, measured
      while (work.use_count() > 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    }
  } catch (const std::exception& error) {
    fail(op, error);
  }
}

void Comm::all_reduce(torch::Tensor& tensor, ReduceOp op) {
  if (solo()) return;
  stats_.all_reduce_calls += 1;
  stats_.all_reduce_bytes += static_cast<int64_t>(tensor.nbytes());
  Stopwatch timed(stats_.seconds);
  all_reduce_in_place(tensor, op, "all_reduce");
}

CommWork Comm::start_all_reduce(const torch::Tensor& tensor) {
  if (solo() || tensor.numel() == 0) return {};
  stats_.all_reduce_calls += 1;
  stats_.all_reduce_bytes += static_cast<int64_t>(tensor.nbytes());
  if (on_nccl(tensor)) {
    TORCH_CHECK(tensor.is_contiguous(), "Comm::start_all_reduce on group '", name_, "': needs a contiguous tensor");
    return start_on_nccl("all_reduce", [&] {
      std::vector<at::Tensor> tensors{tensor};
      return group_->allreduce(tensors, c10d::AllreduceOptions{});
    });
  }
  return post("all_reduce", [this, target = tensor]() mutable { reduce_in_place(target, ReduceOp::kSum, "all_reduce"); });
}

void Comm::all_reduce_in_place(torch::Tensor& tensor, ReduceOp op, const char* op_name) {
  if (tensor.numel() == 0) return;
  wait_all();
  reduce_in_place(tensor, op, op_name);
}

void Comm::reduce_in_place(torch::Tensor& tensor, ReduceOp op, const char* op_name) {
  torch::NoGradGuard no_grad;
  torch::Tensor buffer = reduction_buffer(tensor, on_nccl(tensor));
  if (shm_ && !tensor.is_cuda()) {
    try {
      shm_->all_reduce(buffer, op);
    } catch (const std::exception& error) {
      fail(op_name, error);
    }
    if (!buffer.is_same(tensor)) tensor.copy_(buffer);
    return;
  }
  run(op_name, [&] {
    std::vector<at::Tensor> tensors{buffer};
    c10d::AllreduceOptions options;
    options.reduceOp = to_c10d(op);
    return group_->allreduce(tensors, options);
  });
  if (!buffer.is_same(tensor)) tensor.copy_(buffer);
}

void Comm::broadcast(torch::Tensor& tensor, int root) {
  TORCH_CHECK(root >= 0 && root < size_, "Comm::broadcast on group '", name_, "': root ", root,
              " is not a rank of a group of size ", size_);
  if (solo()) return;
  stats_.broadcast_calls += 1;
  stats_.broadcast_bytes += static_cast<int64_t>(tensor.nbytes());
  if (tensor.numel() == 0) return;
  Stopwatch timed(stats_.seconds);
  wait_all();
  torch::NoGradGuard no_grad;
  torch::Tensor buffer = movement_view(tensor.contiguous());
  run("broadcast", [&] {
    std::vector<at::Tensor> tensors{buffer};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    options.rootTensor = 0;
    return group_->broadcast(tensors, options);
  });
  if (!tensor.is_contiguous()) tensor.copy_(buffer.view(tensor.scalar_type()));
}

// Every rank's equal block `input` into row r of `stacked` ([size, ...], contiguous):
// shared memory, NCCL's single-buffer gather, or Gloo's list of blocks.
void Comm::gather_blocks(const torch::Tensor& input, torch::Tensor& stacked, bool settle) {
  if (shm_ && !input.is_cuda()) {
    try {
      shm_->all_gather(input, stacked);
    } catch (const std::exception& error) {
      fail("all_gather", error);
    }
  } else if (on_nccl(input)) {
    // NCCL gathers into one buffer; its work is ordered on the stream, nothing to settle.
    run("all_gather", [&] {
      at::Tensor out = movement_view(stacked), in = movement_view(input);
      return group_->_allgather_base(out, in);
    });
  } else {
    run(
        "all_gather",
        [&] {
          std::vector<std::vector<at::Tensor>> outputs(1);
          for (int r = 0; r < size_; ++r) outputs[0].push_back(movement_view(stacked[r]));
          std::vector<at::Tensor> inputs{movement_view(input)};
          return group_->allgather(outputs, inputs);
        },
        settle);
  }
}

Comm::GatherLayout Comm::gather_layout(const torch::Tensor& local, int64_t dim, const std::vector<int64_t>& sizes) const {
  TORCH_CHECK(local.dim() > 0, "Comm::all_gather on group '", name_, "': cannot gather a 0-dim tensor");
  GatherLayout g;
  g.dim = c10::maybe_wrap_dim(dim, local.dim());
  g.extents = sizes.empty() ? std::vector<int64_t>(size_, local.size(g.dim)) : sizes;
  TORCH_CHECK(static_cast<int>(g.extents.size()) == size_, "Comm::all_gather on group '", name_,
              "': ", g.extents.size(), " sizes given for a group of size ", size_);
  TORCH_CHECK(g.extents[rank_] == local.size(g.dim), "Comm::all_gather on group '", name_, "': rank ", rank_,
              " holds ", local.size(g.dim), " along dim ", g.dim, " but sizes say ", g.extents[rank_]);
  const int64_t max_extent = *std::max_element(g.extents.begin(), g.extents.end());
  g.gathered_shape = local.sizes().vec();
  g.gathered_shape[g.dim] = std::accumulate(g.extents.begin(), g.extents.end(), int64_t{0});
  g.padded_shape = local.sizes().vec();
  g.padded_shape[g.dim] = max_extent;
  g.even = std::all_of(g.extents.begin(), g.extents.end(), [&](int64_t e) { return e == max_extent; });
  return g;
}

// The gather itself (after the checks, the counting and the wait for the lane).
void Comm::gather_along(torch::Tensor& out, const torch::Tensor& local, const GatherLayout& g) {
  torch::NoGradGuard no_grad;
  // Gloo's allgather needs every rank's block to have the same shape: uneven
  // shards are padded to the largest and cut back after the gather.
  torch::Tensor input;
  if (local.size(g.dim) == g.padded_shape[g.dim]) {
    input = local.contiguous();
  } else {
    input = torch::zeros(g.padded_shape, local.options());
    input.narrow(g.dim, 0, local.size(g.dim)).copy_(local);
  }
  // The blocks are consecutive slices of one buffer: along dim 0 with even
  // extents that buffer is the result itself (no concatenation copy).
  std::vector<int64_t> stacked_shape = g.padded_shape;
  stacked_shape.insert(stacked_shape.begin(), size_);
  if (g.dim == 0 && g.even && out.is_contiguous()) {
    torch::Tensor stacked = out.view(stacked_shape);
    gather_blocks(input, stacked, /*settle=*/false);
    return;
  }
  torch::Tensor stacked = torch::empty(stacked_shape, local.options());
  gather_blocks(input, stacked, /*settle=*/true);
  int64_t offset = 0;
  for (int r = 0; r < size_; ++r) {
    out.narrow(g.dim, offset, g.extents[r]).copy_(stacked[r].narrow(g.dim, 0, g.extents[r]));
    offset += g.extents[r];
  }
}

torch::Tensor Comm::all_gather(const torch::Tensor& local, int64_t dim, const std::vector<int64_t>& sizes) {
  const GatherLayout g = gather_layout(local, dim, sizes);
  if (solo()) return local;
  stats_.all_gather_calls += 1;
  stats_.all_gather_bytes += static_cast<int64_t>(c10::multiply_integers(g.gathered_shape) * local.element_size());
  torch::Tensor out = torch::empty(g.gathered_shape, local.options());
  if (c10::multiply_integers(g.padded_shape) == 0) return out;
  Stopwatch timed(stats_.seconds);
  wait_all();
  gather_along(out, local, g);
  return out;
}

CommWork Comm::start_all_gather(torch::Tensor& out, const torch::Tensor& local, int64_t dim,
                                const std::vector<int64_t>& sizes) {
  const GatherLayout g = gather_layout(local, dim, sizes);
  if (solo() || c10::multiply_integers(g.padded_shape) == 0 || local.is_cuda()) {
    out = all_gather(local, dim, sizes);  // CUDA: ordered on the stream already
    return {};
  }
  stats_.all_gather_calls += 1;
  stats_.all_gather_bytes += static_cast<int64_t>(c10::multiply_integers(g.gathered_shape) * local.element_size());
  out = torch::empty(g.gathered_shape, local.options());
  return post("all_gather", [this, out, local, g]() mutable { gather_along(out, local, g); });
}

void Comm::check_into(const char* op, const torch::Tensor& out, const torch::Tensor& in, bool gather) const {
  const int64_t expected = gather ? in.numel() * size_ : in.numel();
  const int64_t given = gather ? out.numel() : out.numel() * size_;
  TORCH_CHECK(out.is_contiguous() && given == expected && out.scalar_type() == in.scalar_type(), "Comm::", op,
              " on group '", name_, "': ", out.numel(), " contiguous ", out.scalar_type(), " output elements for ",
              in.numel(), " ", in.scalar_type(), " input elements over ", size_, " ranks");
  if (!out.storage().is_alias_of(in.storage())) return;
  // A gather's input may be exactly this rank's own block of the output (in place, as NCCL allows).
  const bool own_block = gather && in.is_contiguous() && in.numel() > 0 &&
                         static_cast<const char*>(in.data_ptr()) ==
                             static_cast<const char*>(out.data_ptr()) + rank_ * in.nbytes();
  TORCH_CHECK(own_block || (gather && size_ == 1), "Comm::", op, " on group '", name_, "': the ",
              gather ? "input overlaps the output other than as this rank's own block"
                     : "output lies inside the input");
}

void Comm::all_gather_into(torch::Tensor& out, const torch::Tensor& local) {
  check_into("all_gather_into", out, local, /*gather=*/true);
  torch::NoGradGuard no_grad;
  auto input = local.contiguous().view({-1});
  auto stacked = out.view({size_, local.numel()});
  if (solo()) {
    stacked[0].copy_(input);
    return;
  }
  stats_.all_gather_calls += 1;
  stats_.all_gather_bytes += static_cast<int64_t>(out.nbytes());
  if (local.numel() == 0) return;
  Stopwatch timed(stats_.seconds);
  wait_all();
  gather_blocks(input, stacked, /*settle=*/false);
}

CommWork Comm::start_all_gather_into(const torch::Tensor& out, const torch::Tensor& local) {
  if (solo() || local.numel() == 0) {
    torch::Tensor target = out;
    all_gather_into(target, local);
    return {};
  }
  check_into("start_all_gather_into", out, local, /*gather=*/true);
  stats_.all_gather_calls += 1;
  stats_.all_gather_bytes += static_cast<int64_t>(out.nbytes());
  torch::NoGradGuard no_grad;
  auto input = local.contiguous().view({-1});
  auto stacked = out.view({size_, local.numel()});
  if (on_nccl(input)) {
    return start_on_nccl("all_gather", [&] {
      at::Tensor into = movement_view(stacked), from = movement_view(input);
      return group_->_allgather_base(into, from);
    });
  }
  return post("all_gather", [this, input, stacked]() mutable { gather_blocks(input, stacked, /*settle=*/false); });
}

torch::Tensor Comm::reduce_scatter(const torch::Tensor& full, const std::vector<int64_t>& sizes) {
  const std::vector<int64_t> extents = scatter_extents(full, sizes);
  if (solo()) return full;
  stats_.reduce_scatter_calls += 1;
  stats_.reduce_scatter_bytes += static_cast<int64_t>(full.nbytes());
  torch::NoGradGuard no_grad;
  Stopwatch timed(stats_.seconds);
  wait_all();
  return reduce_scatter_rows(full, extents);
}

std::vector<int64_t> Comm::scatter_extents(const torch::Tensor& full, const std::vector<int64_t>& sizes) const {
  TORCH_CHECK(full.dim() > 0, "Comm::reduce_scatter on group '", name_, "': cannot scatter a 0-dim tensor");
  std::vector<int64_t> extents = sizes;
  if (extents.empty()) {
    TORCH_CHECK(full.size(0) % size_ == 0, "Comm::reduce_scatter on group '", name_, "': ", full.size(0),
                " rows do not split evenly over ", size_, " ranks; pass sizes");
    extents.assign(size_, full.size(0) / size_);
  }
  TORCH_CHECK(static_cast<int>(extents.size()) == size_, "Comm::reduce_scatter on group '", name_,
              "': ", extents.size(), " sizes given for a group of size ", size_);
  const int64_t total = std::accumulate(extents.begin(), extents.end(), int64_t{0});
  TORCH_CHECK(total == full.size(0), "Comm::reduce_scatter on group '", name_, "': sizes sum to ", total,
              " but the tensor has ", full.size(0), " rows");
  return extents;
}

CommWork Comm::start_reduce_scatter(torch::Tensor& out, const torch::Tensor& full, const std::vector<int64_t>& sizes) {
  if (solo() || full.is_cuda()) {  // CUDA: ordered on the stream already
    out = reduce_scatter(full, sizes);
    return {};
  }
  const std::vector<int64_t> extents = scatter_extents(full, sizes);
  stats_.reduce_scatter_calls += 1;
  stats_.reduce_scatter_bytes += static_cast<int64_t>(full.nbytes());
  std::vector<int64_t> chunk_shape = full.sizes().vec();
  chunk_shape[0] = extents[rank_];
  out = torch::empty(chunk_shape, full.options());
  return post("reduce_scatter", [this, out, full, extents]() mutable {
    torch::NoGradGuard no_grad;
    out.copy_(reduce_scatter_rows(full, extents));
  });
}

torch::Tensor Comm::reduce_scatter_rows(const torch::Tensor& full, const std::vector<int64_t>& extents) {
  const int64_t total = full.size(0);
  if (on_nccl(full)) return reduce_scatter_nccl(full, extents);
  if (shm_ && !full.is_cuda()) return reduce_scatter_shared_memory(full, extents);
  // Gloo's reduce_scatter all-reduces the whole tensor. An all-to-all moves exactly a reduce-scatter's
  // traffic: rank r sends rows of chunk q to rank q and receives every rank's
  // copy of chunk r, then sums them in rank order. Types Gloo cannot add travel
  // as bytes here, and the sum runs in fp32 for bfloat16 (as all_reduce does).
  const int64_t row_numel = full.numel() / std::max<int64_t>(full.size(0), 1);
  std::vector<int64_t> output_shape = full.sizes().vec();
  output_shape[0] = extents[rank_] * size_;
  std::vector<int64_t> input_counts(extents.begin(), extents.end());
  std::vector<int64_t> output_counts(size_, extents[rank_]);
  torch::Tensor input = full.contiguous();
  torch::Tensor received = torch::empty(output_shape, full.options());
  if (row_numel > 0 && total > 0) {
    run("reduce_scatter", [&] {
      at::Tensor out = movement_view(received), in = movement_view(input);
      return group_->alltoall_base(out, in, output_counts, input_counts);
    });
  }
  std::vector<int64_t> chunk_shape = full.sizes().vec();
  chunk_shape[0] = extents[rank_];
  auto parts = received.view([&] {
    std::vector<int64_t> shape = chunk_shape;
    shape.insert(shape.begin(), size_);
    return shape;
  }());
  const bool low_precision = is_16bit_float(full);
  // One pass over the received copies, in rank order; integers stay in their type.
  torch::Tensor result = parts.sum(0, /*keepdim=*/false, low_precision ? torch::kFloat32 : full.scalar_type());
  return low_precision ? result.to(full.scalar_type()) : result;
}

void Comm::reduce_scatter_into(torch::Tensor& out, const torch::Tensor& full) {
  check_into("reduce_scatter_into", out, full, /*gather=*/false);
  torch::NoGradGuard no_grad;
  if (full.numel() == 0) return;
  if (solo()) {
    out.view({-1}).copy_(full.reshape({-1}));
    return;
  }
  stats_.reduce_scatter_calls += 1;
  stats_.reduce_scatter_bytes += static_cast<int64_t>(full.nbytes());
  Stopwatch timed(stats_.seconds);
  wait_all();
  reduce_scatter_chunk(out, full);
}

CommWork Comm::start_reduce_scatter_into(const torch::Tensor& out, const torch::Tensor& full) {
  if (solo() || full.numel() == 0) {
    torch::Tensor target = out;
    reduce_scatter_into(target, full);
    return {};
  }
  check_into("start_reduce_scatter_into", out, full, /*gather=*/false);
  stats_.reduce_scatter_calls += 1;
  stats_.reduce_scatter_bytes += static_cast<int64_t>(full.nbytes());
  torch::NoGradGuard no_grad;
  if (on_nccl(full)) {
    return start_on_nccl("reduce_scatter", [&] {
      c10d::ReduceScatterOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      at::Tensor into = out.view({-1}), from = full.contiguous().view({-1});
      return group_->_reduce_scatter_base(into, from, options);
    });
  }
  return post("reduce_scatter", [this, out, full] { reduce_scatter_chunk(out, full); });
}

// Over shared memory straight into `out` (16-bit floats excepted: summed in fp32).
void Comm::reduce_scatter_chunk(const torch::Tensor& out, const torch::Tensor& full) {
  torch::NoGradGuard no_grad;
  if (shm_ && !full.is_cuda() && !is_16bit_float(full)) {
    try {
      shm_->reduce_scatter(full.contiguous().view({-1}), rank_ * out.numel(), out.numel(), out);
    } catch (const std::exception& error) {
      fail("reduce_scatter", error);
    }
    return;
  }
  // One row of `full` per rank.
  auto chunk = reduce_scatter_rows(full.reshape({size_, -1}), std::vector<int64_t>(size_, 1)).view({-1});
  if (chunk.data_ptr() != out.data_ptr()) out.view({-1}).copy_(chunk);
}

// Each rank sums only its own rows of every member's copy, in rank order (in
// fp32 for 16-bit types, as the Gloo path does).
torch::Tensor Comm::reduce_scatter_shared_memory(const torch::Tensor& full, const std::vector<int64_t>& extents) {
  const int64_t row_numel = full.numel() / std::max<int64_t>(full.size(0), 1);
  const int64_t first_row = std::accumulate(extents.begin(), extents.begin() + rank_, int64_t{0});
  const bool low_precision = is_16bit_float(full);
  const torch::Tensor buffer = full.contiguous();  // 16-bit: summed in fp32 by the transport, returned in fp32
  std::vector<int64_t> chunk_shape = full.sizes().vec();
  chunk_shape[0] = extents[rank_];
  torch::Tensor result;
  try {
    result = shm_->reduce_scatter(buffer, first_row * row_numel, extents[rank_] * row_numel).view(chunk_shape);
  } catch (const std::exception& error) {
    fail("reduce_scatter", error);
  }
  return low_precision ? result.to(full.scalar_type()) : result;
}

// NCCL's reduce-scatter takes equal chunks: uneven ones are padded to the
// largest (zeros add nothing) and this rank's rows cut back out.
torch::Tensor Comm::reduce_scatter_nccl(const torch::Tensor& full, const std::vector<int64_t>& extents) {
  const int64_t max_extent = *std::max_element(extents.begin(), extents.end());
  std::vector<int64_t> chunk_shape = full.sizes().vec();
  chunk_shape[0] = max_extent;
  torch::Tensor input = full.contiguous();
  if (std::any_of(extents.begin(), extents.end(), [&](int64_t e) { return e != max_extent; })) {
    std::vector<int64_t> padded_shape = chunk_shape;
    padded_shape[0] = max_extent * size_;
    input = torch::zeros(padded_shape, full.options());
    int64_t row = 0;
    for (int r = 0; r < size_; ++r) {
      input.narrow(0, r * max_extent, extents[r]).copy_(full.narrow(0, row, extents[r]));
      row += extents[r];
    }
  }
  torch::Tensor output = torch::empty(chunk_shape, full.options());
  if (output.numel() > 0) {
    run("reduce_scatter", [&] {
      c10d::ReduceScatterOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      return group_->_reduce_scatter_base(output, input, options);
    });
  }
  return output.narrow(0, 0, extents[rank_]);
}

torch::Tensor Comm::all_to_all(const torch::Tensor& input, const std::vector<int64_t>& send_counts,
                               const std::vector<int64_t>& recv_counts, torch::Tensor out) {
  const int64_t rows = input.dim() == 0 ? 0 : input.size(0);
  int64_t sent = 0, received = 0;
  for (int64_t c : send_counts) sent += c;
  for (int64_t c : recv_counts) received += c;
  TORCH_CHECK(input.dim() >= 1 && static_cast<int>(send_counts.size()) == size_ &&
                  static_cast<int>(recv_counts.size()) == size_ && sent == rows,
              "Comm::all_to_all on group '", name_, "': ", send_counts.size(), " send and ", recv_counts.size(),
              " receive counts summing to ", sent, " for ", rows, " rows, in a group of ", size_);
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] = received;
  TORCH_CHECK(!out.defined() || (out.is_contiguous() && out.sizes().vec() == shape &&
                                 out.scalar_type() == input.scalar_type() && out.device() == input.device()),
              "Comm::all_to_all on group '", name_, "': the output must be a contiguous ", input.scalar_type(),
              " tensor of shape [", shape, "]");
  if (solo()) {
    if (!out.defined()) return input;
    out.copy_(input);
    return out;
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor in = input.contiguous();
  if (!out.defined()) out = torch::empty(shape, input.options());
  stats_.all_to_all_calls += 1;
  stats_.all_to_all_bytes += static_cast<int64_t>(in.nbytes());
  Stopwatch timed(stats_.seconds);
  wait_all();
  if (shm_ && !input.is_cuda()) {
    int64_t row_bytes = static_cast<int64_t>(in.element_size());
    for (size_t d = 1; d < shape.size(); ++d) row_bytes *= shape[d];
    std::vector<int64_t> send_bytes, recv_bytes;
    for (int64_t c : send_counts) send_bytes.push_back(c * row_bytes);
    for (int64_t c : recv_counts) recv_bytes.push_back(c * row_bytes);
    try {
      shm_->all_to_all(static_cast<const uint8_t*>(in.data_ptr()), send_bytes, static_cast<uint8_t*>(out.data_ptr()),
                       recv_bytes);
    } catch (const std::exception& error) {
      fail("all_to_all", error);
    }
    return out;
  }
  at::Tensor out_view = movement_view(out), in_view = movement_view(in);
  std::vector<int64_t> out_splits = recv_counts, in_splits = send_counts;
  run("all_to_all", [&] {
    c10d::AllToAllOptions options;
    return group_->alltoall_base(out_view, in_view, out_splits, in_splits, options);
  });
  return out;
}

void Comm::barrier() {
  if (solo()) return;
  wait_all();
  if (backend_ == Backend::kNccl) {
    // NCCL's barrier guesses a device from the rank; a CPU all-reduce (Gloo) needs none.
    auto token = torch::zeros({1}, torch::kInt32);
    run("barrier", [&] {
      std::vector<at::Tensor> tensors{token};
      return group_->allreduce(tensors);
    });
    return;
  }
  run("barrier", [&] { return group_->barrier(); });
}

}  // namespace autotp
