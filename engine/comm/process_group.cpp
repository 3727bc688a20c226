// The translation unit that calls c10d constructors (see process_group.h); the one
// that needs libtorch_cuda, ProcessGroupNCCL's, is in libautotp_cuda.so
// (engine/cuda/torch_cuda_runtime.cpp).
#include "autotp/comm/process_group.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <thread>

#include "autotp/base/cuda_runtime.h"
#include "autotp/base/device.h"
#include "autotp/base/error.h"

namespace autotp {
namespace {

std::string error_text(const std::exception& error) {
  if (auto* c10_error = dynamic_cast<const c10::Error*>(&error)) return c10_error->what_without_backtrace();
  return error.what();
}

// TCPStore clients that find no server yet retry only after a full second.
// Ranks start together, so rank 0's server is usually a few milliseconds late;
// probing the port briefly first saves that second on every launch. It also
// bounds the rendezvous by the timeout: TCPStore's own connect, tried after a
// whole timeout of probing, would retry with growing delays for another
// timeout and more (a rank cut off from rank 0 took 2.6x --timeout to exit).
// Returns why nothing answered within `timeout`, or nullopt (connected, or the
// address does not resolve: TCPStore then says so itself).
std::optional<std::string> wait_for_listener(const std::string& host, int port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &addresses) != 0) return std::nullopt;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool connected = false;
  int last_error = 0;
  while (!connected && std::chrono::steady_clock::now() < deadline) {
    for (addrinfo* address = addresses; address != nullptr && !connected; address = address->ai_next) {
      // Non-blocking: a blocking connect into a link that drops packets would
      // wait for the kernel's SYN retries (about two minutes), past the deadline.
      const int fd =
          socket(address->ai_family, address->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, address->ai_protocol);
      if (fd < 0) continue;
      connected = connect(fd, address->ai_addr, address->ai_addrlen) == 0;
      if (!connected) last_error = errno;
      if (!connected && last_error == EINPROGRESS) {
        // At most a second per address: one that drops packets (a filtered IPv6) must
        // not use up the deadline before the next address is tried.
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        const int64_t wait_ms = std::clamp<int64_t>(left.count(), 0, 1000);
        pollfd writable{fd, POLLOUT, 0};
        if (poll(&writable, 1, static_cast<int>(wait_ms)) == 1) {
          int error = 0;
          socklen_t length = sizeof(error);
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
          connected = error == 0;
          last_error = error;
        } else {
          last_error = ETIMEDOUT;
        }
      }
      close(fd);
    }
    if (!connected) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  freeaddrinfo(addresses);
  if (connected) return std::nullopt;
  return fmt::format("no connection within the timeout of {} ms (last error: {})", timeout.count(),
                     last_error != 0 ? std::strerror(last_error) : "none");
}

}  // namespace

Backend parse_backend(const std::string& name) {
  if (name == "gloo") return Backend::kGloo;
  if (name == "nccl") return Backend::kNccl;
  throw_user_error("unknown communication backend '{}' (allowed: gloo, nccl)", name);
}

bool nccl_available() {
  const CudaRuntime* cuda = cuda_runtime();
  return cuda && cuda->nccl_available();
}

c10::intrusive_ptr<c10d::Store> create_tcp_store(const DistEnv& env, const StoreOptions& options) {
  AUTOTP_USER_CHECK(env.master_port > 0, "MASTER_PORT must be set for a world of {} ranks", env.world_size);
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(env.master_port);
  store_options.isServer = env.rank == 0;
  store_options.numWorkers = env.world_size;
  // The process-group rendezvous waits for every rank anyway; not waiting here
  // keeps rank 0's constructor from blocking on ranks that never come.
  store_options.waitWorkers = false;
  store_options.timeout = options.timeout;
  // The inherited socket serves the first store only (the store owns and closes it);
  // a later one binds the port itself.
  static std::atomic<bool> listen_fd_taken{false};
  if (store_options.isServer && env.master_listen_fd >= 0 && !listen_fd_taken.exchange(true))
    store_options.masterListenFd = env.master_listen_fd;
  try {
    if (!store_options.isServer)
      if (auto failure = wait_for_listener(env.master_addr, env.master_port, options.timeout))
        throw std::runtime_error(*failure);
    return c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  } catch (const std::exception& error) {
    throw std::runtime_error(fmt::format("rank {} of {}: TCPStore rendezvous at {}:{} failed: {}", env.rank,
                                         env.world_size, env.master_addr, env.master_port,
                                         error_text(error)));
  }
}

c10::intrusive_ptr<c10d::Store> create_file_store(const std::string& path, int world_size) {
  return c10::make_intrusive<c10d::FileStore>(path, world_size);
}

c10::intrusive_ptr<c10d::Store> prefix_store(const std::string& prefix,
                                             c10::intrusive_ptr<c10d::Store> store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, std::move(store));
}

c10::intrusive_ptr<c10d::ProcessGroup> create_process_group(Backend backend,
                                                            c10::intrusive_ptr<c10d::Store> store, int rank,
                                                            int size, std::chrono::milliseconds timeout) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "create_process_group: rank ", rank,
              " is not in a group of size ", size);
  // Since LibTorch 2.0 Gloo and NCCL are c10d::Backends; a ProcessGroup
  // dispatches each op to the backend registered for its tensors' device.
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  // Gloo serves CPU tensors in every group (with NCCL: the small control
  // traffic, data hashes, token counts, metrics) and, without NCCL, CUDA
  // tensors too (staged through host memory), so several ranks can share a GPU.
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // Loopback by default (the local launcher's worlds); GLOO_SOCKET_IFNAME picks
  // a real interface for multi-host Gloo, as in PyTorch.
  if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME"); interface && *interface) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  }
  const bool nccl = backend == Backend::kNccl;
  if (nccl && cuda_device_count() == 0)
    throw UserError(fmt::format("backend nccl needs a GPU, and none is visible to this process ({}); use backend gloo",
                                cuda_unavailable_reason()));
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(nccl ? prefix_store("cpu", store) : store, rank, size,
                                                          options);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  if (!nccl) {
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    return group;
  }
  cuda_runtime()->add_nccl_backend(*group, store, rank, size, timeout);
  return group;
}

void close_process_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group, bool abort) {
  if (!group) return;
  try {
    if (abort)
      group->abort();
    else
      group->shutdown();
  } catch (const std::exception& error) {
    // Teardown goes on: the group is gone either way.
    std::fprintf(stderr, "autotp: closing a process group failed: %s\n", error_text(error).c_str());
  }
}

}  // namespace autotp
