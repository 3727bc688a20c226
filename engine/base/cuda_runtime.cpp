#include "autotp/base/cuda_runtime.h"

#include <dlfcn.h>
#include <unistd.h>

#include <filesystem>

#include "autotp/base/log.h"

namespace autotp {
bool nvidia_driver_present() {
  for (const char* node : {"/dev/nvidiactl", "/dev/dxg"})
    if (access(node, F_OK) == 0) return true;
  return false;
}

namespace {

struct Loaded {
  const CudaRuntime* runtime = nullptr;
  std::string reason;
};

Loaded load() {
  Loaded out;
  if (!nvidia_driver_present()) {
    out.reason = "no NVIDIA driver on this host: no /dev/nvidiactl";
    return out;
  }
  out.runtime = load_cuda_library(cuda_library_path(), &out.reason);
  if (!out.runtime) log().warn("CUDA is unavailable: {}", out.reason);
  return out;
}

const Loaded& loaded() {
  static const Loaded instance = load();
  return instance;
}

}  // namespace

std::string cuda_library_path() {
  // Next to libautotp.so, wherever the build put both.
  Dl_info self{};
  if (dladdr(reinterpret_cast<const void*>(&cuda_library_path), &self) == 0 || self.dli_fname == nullptr)
    return "libautotp_cuda.so";
  return (std::filesystem::path(self.dli_fname).parent_path() / "libautotp_cuda.so").string();
}

const CudaRuntime* load_cuda_library(const std::string& path, std::string* error) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* text = dlerror();
    *error = fmt::format("{} did not load: {}", path, text ? text : "unknown error");
    return nullptr;
  }
  using Entry = const CudaRuntime* (*)();
  auto entry = reinterpret_cast<Entry>(dlsym(handle, "autotp_cuda_runtime"));
  if (entry == nullptr) {
    *error = fmt::format("{} has no autotp_cuda_runtime", path);
    return nullptr;
  }
  return entry();  // the handle stays open for the process's life
}

const CudaRuntime* cuda_runtime() { return loaded().runtime; }

std::string cuda_unavailable_reason() {
  const Loaded& l = loaded();
  if (!l.runtime) return l.reason;
  return l.runtime->device_count() > 0 ? "" : "CUDA reports no device";
}

}  // namespace autotp
