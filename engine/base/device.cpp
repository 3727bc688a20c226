#include "autotp/base/device.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include "autotp/base/error.h"
#include "autotp/base/log.h"

namespace autotp {

DeviceKind parse_device(const std::string& name) {
  if (name == "cpu") return DeviceKind::kCpu;
  if (name == "cuda") return DeviceKind::kCuda;
  if (name == "auto") return DeviceKind::kAuto;
  throw_user_error("unknown device '{}' (allowed: cpu, cuda, auto)", name);
}

int cuda_device_count() {
  // device_count() reports 0 (not an error) when there is no driver or no GPU.
  return torch::cuda::is_available() ? static_cast<int>(c10::cuda::device_count()) : 0;
}

torch::Device bind_device(DeviceKind kind, int local_rank, int local_world_size, bool shared) {
  if (kind == DeviceKind::kCpu) return torch::Device(torch::kCPU);
  const int gpus = cuda_device_count();
  if (kind == DeviceKind::kAuto && (gpus == 0 || gpus < local_world_size)) return torch::Device(torch::kCPU);
  AUTOTP_USER_CHECK(gpus > 0, "device cuda: no GPU is visible to this process (torch::cuda::is_available() is "
                              "false); use device cpu");
  AUTOTP_USER_CHECK(shared || local_world_size <= gpus,
                    "device cuda with NCCL: {} local ranks but {} GPU(s) on this host (NCCL takes one rank per GPU; "
                    "start at most {} ranks per host, or use backend gloo to share GPUs)",
                    local_world_size, gpus, gpus);
  const auto index = static_cast<c10::DeviceIndex>(local_rank % gpus);
  c10::cuda::set_device(index);
  return torch::Device(torch::kCUDA, index);
}

DeviceMemory cuda_memory(const torch::Device& device) {
  DeviceMemory m;
  if (!device.is_cuda()) return m;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  m.allocated = stats.allocated_bytes[all].current;
  m.peak_allocated = stats.allocated_bytes[all].peak;
  m.reserved = stats.reserved_bytes[all].current;
  m.peak_reserved = stats.reserved_bytes[all].peak;
  return m;
}

void reset_cuda_peak(const torch::Device& device) {
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) c10::cuda::device_synchronize();
}

std::string cuda_device_name(const torch::Device& device) {
  if (!device.is_cuda()) return "";
  return at::cuda::getDeviceProperties(device.index())->name;
}

double bf16_peak_flops(const std::string& gpu_name) {
  // Dense bf16 figures of the SXM parts (PCIe / NVL variants are lower).
  static const std::pair<const char*, double> known[] = {
      {"H200", 989e12}, {"H100", 989e12}, {"GH200", 989e12}, {"A100", 312e12},
      {"B200", 2250e12}, {"L40S", 362e12}, {"A10G", 70e12},
  };
  for (const auto& [name, flops] : known)
    if (gpu_name.find(name) != std::string::npos) return flops;
  return 0;
}

torch::Tensor host_buffer(int64_t numel, torch::ScalarType dtype, const torch::Device& device, bool pin) {
  const auto options = torch::TensorOptions().dtype(dtype).device(torch::kCPU);
  if (!pin || !device.is_cuda()) return torch::empty({numel}, options);
  try {
    return torch::empty({numel}, options.pinned_memory(true));
  } catch (const c10::Error& e) {
    static bool warned = false;
    if (!warned)
      log().warn("pin_memory: page-locked host memory could not be granted ({}); offload buffers are pageable, "
                 "so their copies are synchronous",
                 e.what_without_backtrace());
    warned = true;
    return torch::empty({numel}, options);
  }
}

struct CopyStream::Stream {
  c10::cuda::CUDAStream stream;
};

CopyStream::CopyStream(const torch::Device& device) : device_(device) {
  if (device_.is_cuda()) stream_ = std::make_unique<Stream>(Stream{c10::cuda::getStreamFromPool(false, device_.index())});
}

CopyStream::~CopyStream() {
  if (stream_) stream_->stream.synchronize();  // no copy may outlive its buffers
}

void CopyStream::copy(const torch::Tensor& dst, const torch::Tensor& src) {
  if (!stream_) {
    dst.copy_(src);
    return;
  }
  c10::cuda::CUDAGuard guard(device_.index());
  at::cuda::CUDAEvent queued;
  queued.record(c10::cuda::getCurrentCUDAStream(device_.index()));
  queued.block(stream_->stream);
  {
    c10::cuda::CUDAStreamGuard on_copy_stream(stream_->stream);
    dst.copy_(src, /*non_blocking=*/true);
  }
  // The caching allocator must not hand the GPU side to another tensor before the copy has read or written it.
  for (const torch::Tensor* t : {&dst, &src})
    if (t->is_cuda()) c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), stream_->stream);
}

void CopyStream::wait_host() {
  if (stream_) stream_->stream.synchronize();
}

void CopyStream::wait_current() {
  if (!stream_) return;
  c10::cuda::CUDAGuard guard(device_.index());
  at::cuda::CUDAEvent done;
  done.record(stream_->stream);
  done.block(c10::cuda::getCurrentCUDAStream(device_.index()));
}

struct StepClock::Events {
  std::vector<at::cuda::CUDAEvent> points;
};

StepClock::StepClock(const torch::Device& device) : device_(device) {
  if (device_.is_cuda()) events_ = std::make_unique<Events>();
}

StepClock::~StepClock() = default;

void StepClock::mark() {
  if (!events_) {
    host_.push_back(std::chrono::steady_clock::now());
    return;
  }
  c10::cuda::CUDAGuard guard(device_.index());
  events_->points.emplace_back(cudaEventDefault);
  events_->points.back().record();
}

std::vector<double> StepClock::seconds() {
  std::vector<double> out;
  if (!events_) {
    for (size_t i = 1; i < host_.size(); ++i)
      out.push_back(std::chrono::duration<double>(host_[i] - host_[i - 1]).count());
    return out;
  }
  auto& points = events_->points;
  if (points.empty()) return out;
  points.back().synchronize();
  for (size_t i = 1; i < points.size(); ++i) out.push_back(points[i - 1].elapsed_time(points[i]) / 1000.0);
  return out;
}

}  // namespace autotp
