// SharedMemoryTransport: all-reduce, reduce-scatter, all-gather and all-to-all among the
// members of one group that all run on this host, through one POSIX
// shared-memory segment instead of loopback TCP (a reduce-scatter reads only
// its own range of every slot; an all-gather copies every slot out).
// Each rank copies a chunk of its tensor into its own slot, announces it with a
// per-rank generation counter, waits for every member, then sums (max, min) all
// slots in rank order into its tensor. Every rank therefore gets bit-identical
// results, as with Gloo. Two slot sets alternate, so one wait per chunk is
// enough: a rank that has announced generation g has finished reading g - 1.
//
// Waiting spins briefly, then yields; it throws when the group's timeout passes
// or when a member process is gone (dead peers fail fast, as with Gloo).
// Not thread safe: one caller at a time, and every member must issue the same
// sequence of all-reduces (the rule for any collective). Comm is its user.
#pragma once
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "autotp/comm/comm.h"

namespace autotp {

struct SharedMemoryOptions {
  int64_t slot_bytes = 4 << 20;                                // bytes per rank per chunk (two sets are kept)
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // one all-reduce, and the rendezvous
};

class SharedMemoryTransport {
 public:
  // Collective over the `size` members of a group meeting in `store` (a prefix
  // store of their own). Returns null on every member when they are not all on
  // this host (hostname and boot id differ), when AUTOTP_SHARED_MEMORY=0 is set
  // on rank 0, or when any member cannot map the segment; the caller then keeps
  // its process group. The segment is unlinked once every member has mapped it.
  static std::shared_ptr<SharedMemoryTransport> create(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                       int size, const SharedMemoryOptions& options = {});
  ~SharedMemoryTransport();
  SharedMemoryTransport(const SharedMemoryTransport&) = delete;
  SharedMemoryTransport& operator=(const SharedMemoryTransport&) = delete;

  // In place; `tensor` must be contiguous and of a dtype torch can add (the Comm
  // converts bfloat16 to float32 first, as for Gloo).
  void all_reduce(torch::Tensor& tensor, ReduceOp op);
  // Reduce-scatter: every member passes the same-length contiguous `full`; the
  // result is the sum over members of full[begin, begin + length) (this member's
  // range; ranges may differ per member). Each member reads only its own range
  // of the others' slots, summed in rank order. 16-bit floats travel as they
  // are and are summed in fp32: the result is then fp32.
  // `out` (optional, [length], contiguous, of the result's dtype) receives the result in place of a fresh tensor.
  torch::Tensor reduce_scatter(const torch::Tensor& full, int64_t begin, int64_t length,
                               torch::Tensor out = torch::Tensor());
  // All-gather of equal-length contiguous blocks: `out` (size x local.numel(),
  // contiguous) gets member r's block at r * local.numel().
  void all_gather(const torch::Tensor& local, torch::Tensor& out);
  // All-to-all of bytes: send_bytes[j] bytes from `send` (in member order) go to
  // member j; recv_bytes[j] bytes from member j land in `recv` in member order.
  // Each slot is cut into one sub-slot per receiver; a sender writes each piece
  // once, a receiver copies its sub-slot out of every member's slot. The number of
  // rounds (the largest piece over the sub-slot size) travels in the first round's
  // slot headers, so a call that fits one round synchronises once.
  void all_to_all(const uint8_t* send, const std::vector<int64_t>& send_bytes, uint8_t* recv,
                  const std::vector<int64_t>& recv_bytes);

  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  SharedMemoryTransport() = default;
  void wait_for_all(int64_t generation);
  // Publishes `bytes` of `data` in this member's slot of a new generation and
  // waits for every member's; returns the slot set to read.
  int64_t exchange(const void* data, int64_t bytes);
  // The same, leaving bytes [skip_begin, skip_end) of this member's slot unwritten (nobody reads them).
  int64_t exchange(const void* data, int64_t bytes, int64_t skip_begin, int64_t skip_end);
  // Announces a new generation whose slot `fill` has written, and waits for every member's; returns the set.
  int64_t publish(const std::function<void(uint8_t* slot)>& fill);
  uint8_t* slot(int64_t set, int member) const;

  int rank_ = 0, size_ = 1;
  SharedMemoryOptions options_;
  std::shared_ptr<void> segment_;  // one mapping per process, shared by its members (tests' rank threads)
  void* mapping_ = nullptr;        // segment_.get()
  int64_t generation_ = 0;
  std::vector<int64_t> member_pids_;
};

}  // namespace autotp
