// The engine's CUDA calls live in a library of their own, libautotp_cuda.so
// (engine/cuda/), the only one linked to LibTorch's CUDA libraries. A process
// loads it when this host has an NVIDIA driver; on a host without one, no
// process maps libtorch_cuda, cuDNN, cuBLAS and NCCL (0.19 s and 235 MB of
// resident memory each, ranks and test processes alike, for nothing).
//
// Load it before LibTorch is asked anything about CUDA: LibTorch decides once
// per process whether CUDA exists (at::detail::getCUDAHooks), at the first
// question. The CLI's and the tests' main() call cuda_runtime() first.
#pragma once
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "autotp/base/device.h"

namespace c10d {
class Store;
class ProcessGroup;
}  // namespace c10d

namespace autotp {

// Copies on a CUDA stream of their own (CopyStream's GPU side).
class CudaCopyStream {
 public:
  virtual ~CudaCopyStream() = default;
  virtual void copy(const torch::Tensor& dst, const torch::Tensor& src) = 0;
  virtual void wait_host() = 0;
  virtual void wait_current() = 0;
};

// CUDA events on the current stream (StepClock's GPU side).
class CudaEventClock {
 public:
  virtual ~CudaEventClock() = default;
  virtual void mark() = 0;
  virtual std::vector<double> seconds() = 0;
};

class CudaRuntime {
 public:
  virtual ~CudaRuntime() = default;
  virtual int device_count() const = 0;  // 0 when the driver sees no GPU
  virtual void set_device(int index) const = 0;
  virtual DeviceMemory memory(int index) const = 0;
  virtual void reset_peak(int index) const = 0;
  virtual void synchronize(int index) const = 0;
  virtual std::string device_name(int index) const = 0;
  virtual std::unique_ptr<CudaCopyStream> copy_stream(int index) const = 0;
  virtual std::unique_ptr<CudaEventClock> event_clock(int index) const = 0;
  virtual bool nccl_available() const = 0;  // this LibTorch was built with NCCL
  // Adds a ProcessGroupNCCL for CUDA tensors to `group`, bound to the current
  // device and connected now (within `timeout`); it becomes the default backend.
  virtual void add_nccl_backend(c10d::ProcessGroup& group, const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                int size, std::chrono::milliseconds timeout) const = 0;
};

// The loaded library's runtime, or nullptr: no NVIDIA driver on this host, or
// the library did not load. Loads once.
const CudaRuntime* cuda_runtime();
// Why this process has no GPU (no driver, the library did not load, CUDA reports
// no device), for messages; "" when it has one.
std::string cuda_unavailable_reason();

// Whether a device node of NVIDIA's driver exists (/dev/nvidiactl; /dev/dxg, WSL 2's
// GPU). Without one CUDA can see no GPU, and cuda_runtime() does not load the library.
bool nvidia_driver_present();

// The library beside libautotp.so, and loading it whatever the host (cuda_runtime()
// does so only with a driver; tests load it anyway: it must link and answer
// without a GPU). nullptr with `error` set when it does not load.
std::string cuda_library_path();
const CudaRuntime* load_cuda_library(const std::string& path, std::string* error);

}  // namespace autotp
