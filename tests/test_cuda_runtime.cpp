// The CUDA library (libautotp_cuda.so, engine/cuda/): a process without a driver
// never maps LibTorch's CUDA libraries, and the library itself links and answers
// on any host, so a broken one fails here, not first on a GPU machine.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "autotp/base/cuda_runtime.h"
#include "autotp/base/device.h"
#include "autotp/base/error.h"

namespace autotp {
namespace {

bool maps_library(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find(name) != std::string::npos) return true;
  return false;
}

// Runs first in the binary: ctest runs each test in a process of its own anyway.
TEST(CudaRuntime, WithoutADriverNothingOfCudaIsLoaded) {
  if (nvidia_driver_present()) GTEST_SKIP() << "this host has an NVIDIA driver: the library is loaded here by design";
  EXPECT_EQ(cuda_runtime(), nullptr);
  EXPECT_EQ(cuda_device_count(), 0);
  EXPECT_EQ(cuda_unavailable_reason(), "no NVIDIA driver on this host: no /dev/nvidiactl");
  for (const char* library : {"libautotp_cuda.so", "libtorch_cuda.so", "libc10_cuda.so", "libnccl", "libcudnn"})
    EXPECT_FALSE(maps_library(library)) << library << " is mapped in a process on a host without a GPU driver";
  EXPECT_EQ(bind_device(DeviceKind::kAuto, 0, 1, false), torch::Device(torch::kCPU));
  EXPECT_THROW(cuda_memory(torch::Device(torch::kCUDA, 0)), c10::Error);  // an error, not a null runtime
  try {
    bind_device(DeviceKind::kCuda, 0, 1, false);
    ADD_FAILURE() << "device cuda was bound without a GPU";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), "device cuda: no GPU is visible to this process (no NVIDIA driver on this "
                                     "host: no /dev/nvidiactl); use device cpu");
  }
}

TEST(CudaRuntime, TheLibraryLoadsAndAnswersOnAnyHost) {
  std::string error;
  const CudaRuntime* cuda = load_cuda_library(cuda_library_path(), &error);
  ASSERT_NE(cuda, nullptr) << error;
  EXPECT_TRUE(maps_library("libtorch_cuda.so"));
  EXPECT_TRUE(cuda->nccl_available()) << "the torch wheel is a CUDA build with NCCL";
  if (!nvidia_driver_present()) {
    EXPECT_EQ(cuda->device_count(), 0);
  }
  // A second load is the same library, the same runtime.
  EXPECT_EQ(load_cuda_library(cuda_library_path(), &error), cuda);
}

TEST(CudaRuntime, AMissingLibraryIsAnErrorNamingIt) {
  std::string error;
  EXPECT_EQ(load_cuda_library("/nonexistent/libautotp_cuda.so", &error), nullptr);
  EXPECT_NE(error.find("/nonexistent/libautotp_cuda.so did not load: "), std::string::npos) << error;
}

}  // namespace
}  // namespace autotp
