// libautotp_cuda.so: the engine's CUDA calls over LibTorch's CUDA libraries
// (base/cuda_runtime.h says why they are a library of their own). Also the one
// c10d constructor that needs libtorch_cuda, ProcessGroupNCCL's; every other
// c10d constructor is in comm/process_group.cpp.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

// CUDA builds of LibTorch define USE_C10D_NCCL for code that uses ProcessGroupNCCL;
// the header is present but empty without it.
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "autotp/base/cuda_runtime.h"
#include "autotp/base/error.h"

namespace autotp {
namespace {

class TorchCopyStream final : public CudaCopyStream {
 public:
  explicit TorchCopyStream(int index)
      : index_(static_cast<c10::DeviceIndex>(index)), stream_(c10::cuda::getStreamFromPool(false, index_)) {}
  ~TorchCopyStream() override { stream_.synchronize(); }  // no copy may outlive its buffers

  void copy(const torch::Tensor& dst, const torch::Tensor& src) override {
    c10::cuda::CUDAGuard guard(index_);
    at::cuda::CUDAEvent queued;
    queued.record(c10::cuda::getCurrentCUDAStream(index_));
    queued.block(stream_);
    {
      c10::cuda::CUDAStreamGuard on_copy_stream(stream_);
      dst.copy_(src, /*non_blocking=*/true);
    }
    // The caching allocator must not hand the GPU side to another tensor before the copy has read or written it.
    for (const torch::Tensor* t : {&dst, &src})
      if (t->is_cuda()) c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), stream_);
  }

  void wait_host() override { stream_.synchronize(); }

  void wait_current() override {
    c10::cuda::CUDAGuard guard(index_);
    at::cuda::CUDAEvent done;
    done.record(stream_);
    done.block(c10::cuda::getCurrentCUDAStream(index_));
  }

 private:
  c10::DeviceIndex index_;
  c10::cuda::CUDAStream stream_;
};

class TorchEventClock final : public CudaEventClock {
 public:
  explicit TorchEventClock(int index) : index_(static_cast<c10::DeviceIndex>(index)) {}

  void mark() override {
    c10::cuda::CUDAGuard guard(index_);
    points_.emplace_back(cudaEventDefault);
    points_.back().record();
  }

  std::vector<double> seconds() override {
    std::vector<double> out;
    if (points_.empty()) return out;
    points_.back().synchronize();
    for (size_t i = 1; i < points_.size(); ++i) out.push_back(points_[i - 1].elapsed_time(points_[i]) / 1000.0);
    return out;
  }

 private:
  c10::DeviceIndex index_;
  std::vector<at::cuda::CUDAEvent> points_;
};

class TorchCudaRuntime final : public CudaRuntime {
 public:
  int device_count() const override {
    // device_count() reports 0 (not an error) when there is no driver or no GPU.
    return torch::cuda::is_available() ? static_cast<int>(c10::cuda::device_count()) : 0;
  }

  void set_device(int index) const override { c10::cuda::set_device(static_cast<c10::DeviceIndex>(index)); }

  DeviceMemory memory(int index) const override {
    DeviceMemory m;
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    m.allocated = stats.allocated_bytes[all].current;
    m.peak_allocated = stats.allocated_bytes[all].peak;
    m.reserved = stats.reserved_bytes[all].current;
    m.peak_reserved = stats.reserved_bytes[all].peak;
    return m;
  }

  void reset_peak(int index) const override {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
  }

  void synchronize(int index) const override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
    c10::cuda::device_synchronize();
  }

  std::string device_name(int index) const override {
    return at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index))->name;
  }

  std::unique_ptr<CudaCopyStream> copy_stream(int index) const override {
    return std::make_unique<TorchCopyStream>(index);
  }

  std::unique_ptr<CudaEventClock> event_clock(int index) const override {
    return std::make_unique<TorchEventClock>(index);
  }

  bool nccl_available() const override {
#ifdef USE_C10D_NCCL
    return true;
#else
    return false;
#endif
  }

  void add_nccl_backend(c10d::ProcessGroup& group, const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                        std::chrono::milliseconds timeout) const override {
#ifdef USE_C10D_NCCL
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    // Bound to the rank's GPU (bind_device made it current) before the backend
    // joins, so setBackend passes it on and NCCL never guesses a device.
    const c10::Device device(c10::kCUDA, c10::cuda::current_device());
    group.setBoundDeviceId(device);
    auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::make_intrusive<c10d::PrefixStore>("cuda", store),
                                                               rank, size, options);
    group.setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, backend);
    group.setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
    backend->eagerConnectSingleDevice(device);  // the communicator now, within `timeout`
#else
    throw UserError("ProcessGroupNCCL is not available in this LibTorch build (use backend gloo)");
#endif
  }
};

}  // namespace
}  // namespace autotp

extern "C" __attribute__((visibility("default"))) const autotp::CudaRuntime* autotp_cuda_runtime() {
  static const autotp::TorchCudaRuntime runtime;
  return &runtime;
}
