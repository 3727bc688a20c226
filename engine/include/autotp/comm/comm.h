// Comm: synchronous collectives over one process group (a tp group, a dp group
// or the world). A group of size 1 performs no communication. Every call blocks
// until done or the group's timeout fires (then it throws naming the op); with
// NCCL, CUDA tensors' collectives are ordered on the current stream instead (the
// host does not wait for the GPU), and CPU tensors still go through Gloo.
// Not thread safe: one caller per Comm. Operations are not recorded by autograd
// (see autograd_collectives.h). The start_* collectives return at once and run
// on the group's lane (comm_lane.h) for CPU tensors or on NCCL's stream for CUDA
// tensors; a synchronous call first waits for the lane, so a group's
// collectives always run in the order they were issued. On a size-1 group all_gather and reduce_scatter
// return their argument itself; otherwise results are fresh tensors.
#pragma once
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "autotp/comm/process_group.h"

namespace autotp {

enum class ReduceOp { kSum, kMax, kMin };

class SharedMemoryTransport;  // comm/shared_memory_transport.h
class CommLane;               // comm/comm_lane.h
class LaneJob;
class Comm;

// Counts what went through a Comm (benchmarks and communication-volume checks).
struct CommStats {
  int64_t all_reduce_calls = 0, all_reduce_bytes = 0;
  int64_t all_gather_calls = 0, all_gather_bytes = 0;          // bytes of the gathered output
  int64_t reduce_scatter_calls = 0, reduce_scatter_bytes = 0;  // bytes of the full input
  int64_t broadcast_calls = 0, broadcast_bytes = 0;
  int64_t all_to_all_calls = 0, all_to_all_bytes = 0;          // bytes this rank sent (its own rows included)
  double seconds = 0;        // wall time the caller spent blocked in collectives (exposed communication)
  double settle_seconds = 0;  // of `seconds`, waiting for Gloo to drop an uneven gather's buffers (Comm::run)
  double async_seconds = 0;  // wall time started collectives ran on the lane (hidden or not)
  int64_t calls() const {
    return all_reduce_calls + all_gather_calls + reduce_scatter_calls + broadcast_calls + all_to_all_calls;
  }
  int64_t bytes() const {
    return all_reduce_bytes + all_gather_bytes + reduce_scatter_bytes + broadcast_bytes + all_to_all_bytes;
  }
};

// A collective started by Comm::start_*: its tensors must stay untouched until
// wait() returns. wait() blocks until it has run (with NCCL: orders the current
// stream after it), adds the blocked time to the group's exposed communication
// and rethrows a failure naming the op and the group. Waiting twice is a no-op;
// a default CommWork has nothing pending. Must not outlive its Comm.
class CommWork {
 public:
  CommWork() = default;
  void wait();
  bool pending() const { return job_ != nullptr || work_.defined(); }

 private:
  friend class Comm;
  Comm* comm_ = nullptr;
  const char* op_ = "";
  std::shared_ptr<LaneJob> job_;         // CPU tensors: a job on the group's lane
  c10::intrusive_ptr<c10d::Work> work_;  // CUDA tensors on NCCL
};

class Comm {
 public:
  // A single-process group (no communication).
  Comm();
  // ranks: the global ranks of the members, in group-rank order (for messages).
  // `group` may be null only for a one-member group. `backend`: what serves
  // CUDA tensors in `group` (create_process_group's backend).
  Comm(c10::intrusive_ptr<c10d::ProcessGroup> group, std::vector<int> global_ranks, std::string name,
       Backend backend = Backend::kGloo);
  ~Comm();  // waits for this group's started collectives

  int rank() const { return rank_; }  // rank within this group
  int size() const { return size_; }
  const std::string& name() const { return name_; }  // "tp", "dp", "world"
  const std::vector<int>& global_ranks() const { return global_ranks_; }

  // In place.
  void all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  void broadcast(torch::Tensor& tensor, int root = 0);
  // Concatenates each rank's `local` along `dim`; ranks may hold different sizes
  // along dim (`sizes` gives every rank's size; empty = all equal to local's).
  torch::Tensor all_gather(const torch::Tensor& local, int64_t dim = 0,
                           const std::vector<int64_t>& sizes = {});
  // all_gather of equal 1-D blocks straight into `out` (contiguous, size() x
  // local.numel() elements; rank r's block at r * local.numel()), without the
  // fresh result tensor. `local` may be exactly this rank's block of `out` (in
  // place); any other overlap is an error.
  void all_gather_into(torch::Tensor& out, const torch::Tensor& local);
  // Sums `full` over ranks and returns this rank's chunk along dim 0 (`sizes`:
  // every rank's chunk length; empty = equal chunks). NCCL (CUDA tensors) runs
  // its reduce-scatter. Gloo's reduce_scatter is an all-reduce underneath, so on
  // Gloo this is an all-to-all (each rank receives every rank's copy of its own
  // chunk: the traffic of a true reduce-scatter) and a local sum in rank order;
  // over shared memory each rank sums only its own rows of every member's copy.
  torch::Tensor reduce_scatter(const torch::Tensor& full, const std::vector<int64_t>& sizes = {});
  // The same with equal chunks, this rank's chunk written into `out` (contiguous,
  // full.numel() / size() elements of full's dtype, not inside `full`); over
  // shared memory without any temporary (16-bit floats excepted).
  void reduce_scatter_into(torch::Tensor& out, const torch::Tensor& full);
  void barrier();
  // All-to-all of rows (dim 0; the other dims as `input`'s): rank r's rows
  // [send_counts[0] + ... + send_counts[j - 1], +send_counts[j]) go to rank j,
  // and the result holds recv_counts[j] rows from each rank j in rank order.
  // Rank r's send_counts[j] must equal rank j's recv_counts[r] (exchange the
  // counts first: an all_to_all of one row per rank). Gloo and NCCL run their
  // all-to-all; the shared-memory transport, where the group has one, moves the
  // rows through its segment (each rank writes its rows once).
  // `out` (optional: contiguous, the result's shape and dtype, not overlapping
  // `input`) receives the rows in place of a fresh tensor.
  torch::Tensor all_to_all(const torch::Tensor& input, const std::vector<int64_t>& send_counts,
                           const std::vector<int64_t>& recv_counts, torch::Tensor out = torch::Tensor());

  // all_gather_into and reduce_scatter_into started asynchronously (same
  // arguments, checks and results; the tensors are held until the work is
  // waited). On a size-1 group they complete before returning.
  CommWork start_all_gather_into(const torch::Tensor& out, const torch::Tensor& local);
  CommWork start_reduce_scatter_into(const torch::Tensor& out, const torch::Tensor& full);
  // all_reduce (sum, in place), all_gather along dim and reduce_scatter of rows
  // started asynchronously (tensor-parallel overlap): the blocking calls' checks,
  // results and counting; `out` is allocated at once and holds the result after
  // wait(). CUDA tensors: all_reduce on NCCL's stream; the gathers and scatters
  // are ordered on the current stream at once, as the blocking calls are.
  CommWork start_all_reduce(const torch::Tensor& tensor);
  CommWork start_all_gather(torch::Tensor& out, const torch::Tensor& local, int64_t dim,
                            const std::vector<int64_t>& sizes = {});
  CommWork start_reduce_scatter(torch::Tensor& out, const torch::Tensor& full, const std::vector<int64_t>& sizes = {});
  // Blocks until every collective started on this group's lane has run.
  void wait_all();
  // A group of one returns from every collective at once; after this call it
  // runs them through its process group and lane like any group (tests of the
  // NCCL and Gloo code paths where one GPU allows one rank). Needs a group.
  void communicate_alone();
  // True when collectives return at once: a group of one that did not call communicate_alone.
  bool solo() const { return size_ == 1 && alone_shortcut_; }
  // Comms over the same process group must share one lane (Topology does this).
  void share_lane_with(const Comm& other);

  CommStats stats() const;
  void reset_stats();

  // All-reduces, all-gathers and reduce-scatters of CPU tensors of this group go
  // through `transport` (every member on this host, see shared_memory_transport.h)
  // instead of the process group; null restores the process group. Every member
  // must make the same choice.
  void use_shared_memory(std::shared_ptr<SharedMemoryTransport> transport);
  bool uses_shared_memory() const { return shm_ != nullptr; }
  const std::shared_ptr<SharedMemoryTransport>& shared_memory() const { return shm_; }

 private:
  // Starts one c10d op and waits; failures rethrown naming the op and the group.
  // `settle`: also wait until Gloo's worker has dropped the work (and the tensors it holds).
  template <typename Start>
  void run(const char* op, Start&& start, bool settle = false);
  [[noreturn]] void fail(const char* op, const std::exception& error) const;
  void all_reduce_in_place(torch::Tensor& tensor, ReduceOp op, const char* op_name);
  // all_reduce_in_place without waiting for the lane (also run on the lane).
  void reduce_in_place(torch::Tensor& tensor, ReduceOp op, const char* op_name);
  // all_gather's checked shapes, and the gather itself into `out` (also run on the lane).
  struct GatherLayout {
    int64_t dim = 0;
    std::vector<int64_t> extents, gathered_shape, padded_shape;
    bool even = true;
  };
  GatherLayout gather_layout(const torch::Tensor& local, int64_t dim, const std::vector<int64_t>& sizes) const;
  void gather_along(torch::Tensor& out, const torch::Tensor& local, const GatherLayout& layout);
  // reduce_scatter's checked row counts per rank.
  std::vector<int64_t> scatter_extents(const torch::Tensor& full, const std::vector<int64_t>& sizes) const;
  // Both all-gathers: `input` (this rank's block) into row r of `stacked` on every rank.
  void gather_blocks(const torch::Tensor& input, torch::Tensor& stacked, bool settle);
  // reduce_scatter without the checks and the counting (also run on the lane).
  torch::Tensor reduce_scatter_rows(const torch::Tensor& full, const std::vector<int64_t>& extents);
  // reduce_scatter_into's collective, written into `out`.
  void reduce_scatter_chunk(const torch::Tensor& out, const torch::Tensor& full);
  void check_into(const char* op, const torch::Tensor& out, const torch::Tensor& in, bool gather) const;
  // Runs `body` on the lane (CPU) and returns its work; `op` names it in errors.
  CommWork post(const char* op, std::function<void()> body);
  // Starts one c10d op on NCCL (CUDA tensors) on this thread; CommWork orders the stream at its wait.
  template <typename Start>
  CommWork start_on_nccl(const char* op, Start&& start);
  friend class CommWork;
  torch::Tensor reduce_scatter_nccl(const torch::Tensor& full, const std::vector<int64_t>& extents);
  torch::Tensor reduce_scatter_shared_memory(const torch::Tensor& full, const std::vector<int64_t>& extents);
  // True when `tensor`'s collectives run on NCCL (a CUDA tensor in an NCCL group).
  bool on_nccl(const torch::Tensor& tensor) const { return backend_ == Backend::kNccl && tensor.is_cuda(); }
  bool alone_shortcut_ = true;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::vector<int> global_ranks_;
  std::string name_ = "self";
  Backend backend_ = Backend::kGloo;
  int rank_ = 0;
  int size_ = 1;
  CommStats stats_;
  std::shared_ptr<std::atomic<int64_t>> async_ns_ = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<SharedMemoryTransport> shm_;
  std::shared_ptr<CommLane> lane_;
};

}  // namespace autotp
