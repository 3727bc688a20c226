// The adapter over c10d constructors (stores and process groups). Their
// signatures change between LibTorch versions: only process_group.cpp touches
// them, save ProcessGroupNCCL's, which lives in libtorch_cuda and so in the CUDA
// library (engine/cuda/torch_cuda_runtime.cpp, reached through base/cuda_runtime.h).
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "autotp/comm/dist_env.h"

namespace autotp {

enum class Backend { kGloo, kNccl };

// "gloo" | "nccl"; anything else is a UserError listing the allowed values.
Backend parse_backend(const std::string& name);
bool nccl_available();  // CUDA is loaded here (base/cuda_runtime.h) and its LibTorch was built with NCCL

struct StoreOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // rendezvous and collective timeout
};

// TCPStore rendezvous: rank 0 hosts it at master_addr:master_port.
c10::intrusive_ptr<c10d::Store> create_tcp_store(const DistEnv& env, const StoreOptions& options = {});
// FileStore in a shared file (tests).
c10::intrusive_ptr<c10d::Store> create_file_store(const std::string& path, int world_size);
// Namespaces keys so several groups can share one store.
c10::intrusive_ptr<c10d::Store> prefix_store(const std::string& prefix, c10::intrusive_ptr<c10d::Store> store);

// A process group over `store` for `size` ranks; this process is `rank`.
// `timeout` bounds the rendezvous and every collective (NCCL's watchdog reports a
// stuck collective after it). With NCCL the group is bound to this rank's GPU
// (the current CUDA device) and its communicator is created here, eagerly (what
// `device_id=` does in Python), so a rank that cannot join fails now, not
// inside its first collective.
c10::intrusive_ptr<c10d::ProcessGroup> create_process_group(Backend backend,
                                                            c10::intrusive_ptr<c10d::Store> store,
                                                            int rank, int size,
                                                            std::chrono::milliseconds timeout);

// Ends a group's backends explicitly: shutdown (NCCL: finishes and frees its
// communicators) or, after an error, abort (NCCL: aborts them at once, so a
// peer that died cannot hold this rank in a collective).
void close_process_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group, bool abort);

}  // namespace autotp
