#include "autotp/base/device.h"

#include "autotp/base/cuda_runtime.h"
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
  const CudaRuntime* cuda = cuda_runtime();
  return cuda ? cuda->device_count() : 0;
}

torch::Device bind_device(DeviceKind kind, int local_rank, int local_world_size, bool shared) {
  if (kind == DeviceKind::kCpu) return torch::Device(torch::kCPU);
  const int gpus = cuda_device_count();
  if (kind == DeviceKind::kAuto && (gpus == 0 || gpus < local_world_size)) return torch::Device(torch::kCPU);
  AUTOTP_USER_CHECK(gpus > 0, "device cuda: no GPU is visible to this process ({}); use device cpu",
                    cuda_unavailable_reason());
  AUTOTP_USER_CHECK(shared || local_world_size <= gpus,
                    "device cuda with NCCL: {} local ranks but {} GPU(s) on this host (NCCL takes one rank per GPU; "
                    "start at most {} ranks per host, or use backend gloo to share GPUs)",
                    local_world_size, gpus, gpus);
  const int index = local_rank % gpus;
  cuda_runtime()->set_device(index);
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

namespace {

// The runtime behind a CUDA device, which exists only where it loaded (bind_device made it).
const CudaRuntime& cuda_of(const torch::Device& device) {
  const CudaRuntime* cuda = cuda_runtime();
  TORCH_CHECK(cuda != nullptr, "a CUDA device (", device.str(), ") in a process without CUDA: ",
              cuda_unavailable_reason());
  return *cuda;
}

}  // namespace

DeviceMemory cuda_memory(const torch::Device& device) {
  return device.is_cuda() ? cuda_of(device).memory(device.index()) : DeviceMemory{};
}

void reset_cuda_peak(const torch::Device& device) {
  if (device.is_cuda()) cuda_of(device).reset_peak(device.index());
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) cuda_of(device).synchronize(device.index());
}

std::string cuda_device_name(const torch::Device& device) {
  return device.is_cuda() ? cuda_of(device).device_name(device.index()) : "";
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

CopyStream::CopyStream(const torch::Device& device) : device_(device) {
  if (device_.is_cuda()) stream_ = cuda_of(device_).copy_stream(device_.index());
}

CopyStream::~CopyStream() = default;  // the CUDA stream waits for its copies: none may outlive its buffers

void CopyStream::copy(const torch::Tensor& dst, const torch::Tensor& src) {
  if (stream_)
    stream_->copy(dst, src);
  else
    dst.copy_(src);
}

void CopyStream::wait_host() {
  if (stream_) stream_->wait_host();
}

void CopyStream::wait_current() {
  if (stream_) stream_->wait_current();
}

StepClock::StepClock(const torch::Device& device) : device_(device) {
  if (device_.is_cuda()) events_ = cuda_of(device_).event_clock(device_.index());
}

StepClock::~StepClock() = default;

void StepClock::mark() {
  if (events_)
    events_->mark();
  else
    host_.push_back(std::chrono::steady_clock::now());
}

std::vector<double> StepClock::seconds() {
  if (events_) return events_->seconds();
  std::vector<double> out;
  for (size_t i = 1; i < host_.size(); ++i)
    out.push_back(std::chrono::duration<double>(host_[i] - host_[i - 1]).count());
  return out;
}

}  // namespace autotp
