// Where a rank's tensors live, and the CUDA facilities the engine uses: device
// binding, the caching allocator's statistics and event-based step timing.
// Their CUDA side is in libautotp_cuda.so (base/cuda_runtime.h), loaded where
// this host has an NVIDIA driver; elsewhere the CUDA paths answer "not available".
#pragma once
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace autotp {

class CudaCopyStream;
class CudaEventClock;

enum class DeviceKind { kCpu, kCuda, kAuto };

// "cpu" | "cuda" | "auto"; anything else is a UserError listing the allowed values.
DeviceKind parse_device(const std::string& name);
int cuda_device_count();  // 0 without a GPU (or without a driver)

// The device of local rank `local_rank` of `local_world_size` ranks on this host:
// cpu; cuda binds GPU local_rank (shared = several ranks may share one GPU, as
// Gloo allows: GPU local_rank % count; otherwise fewer GPUs than local ranks is a
// UserError naming both counts); auto = cuda when every local rank gets a GPU of
// its own, else cpu. A CUDA device becomes this thread's current device.
torch::Device bind_device(DeviceKind kind, int local_rank, int local_world_size, bool shared);

// The CUDA caching allocator's view of one GPU (bytes).
struct DeviceMemory {
  int64_t allocated = 0, peak_allocated = 0;  // live tensor bytes; their peak since the last reset
  int64_t reserved = 0, peak_reserved = 0;    // bytes the allocator holds from the driver; peak
};
DeviceMemory cuda_memory(const torch::Device& device);
// Starts a new peak window on the GPU (allocated and reserved).
void reset_cuda_peak(const torch::Device& device);
void synchronize(const torch::Device& device);  // waits for the GPU's work (no-op on CPU)
std::string cuda_device_name(const torch::Device& device);  // "NVIDIA H200"; "" on CPU
// The dense bf16 tensor-core peak of a known GPU from its name (FLOP/s; the
// vendor's spec, no sparsity), 0 when unknown.
double bf16_peak_flops(const std::string& gpu_name);

// A host tensor of `numel` elements for a rank on `device` (ZeRO-Offload's
// buffers): page-locked when `pin` and the device is CUDA, so that copies to and
// from the GPU run asynchronously; pinning that cannot be granted logs one
// warning and falls back to pageable memory. On CPU devices a plain tensor.
torch::Tensor host_buffer(int64_t numel, torch::ScalarType dtype, const torch::Device& device, bool pin);

// Copies between a GPU and host memory on a stream of their own, so that they run
// beside the compute stream. Each copy starts after the work queued so far on
// the current stream; tensors on the GPU are kept alive until their copy is done.
// On CPU devices copies happen at once and the waits are no-ops.
class CopyStream {
 public:
  explicit CopyStream(const torch::Device& device);
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;
  void copy(const torch::Tensor& dst, const torch::Tensor& src);
  void wait_host();     // the host waits for every copy issued so far
  void wait_current();  // the current stream waits for them (before its kernels read copied data)

 private:
  torch::Device device_;
  std::unique_ptr<CudaCopyStream> stream_;  // CUDA devices only
};

// Times phases of GPU work with CUDA events on the current stream (host clocks
// around asynchronous kernels would time their launch). On CPU it reads the
// steady clock. mark() records a point; seconds() waits for the last point and
// returns the intervals between consecutive points.
class StepClock {
 public:
  explicit StepClock(const torch::Device& device);
  ~StepClock();
  void mark();
  std::vector<double> seconds();

 private:
  torch::Device device_;
  std::vector<std::chrono::steady_clock::time_point> host_;
  std::unique_ptr<CudaEventClock> events_;  // CUDA devices only
};

}  // namespace autotp
