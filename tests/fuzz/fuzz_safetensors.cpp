// A safetensors file: header length, JSON header, offsets and every tensor read
// back (whole and sliced), as SafetensorsFile::open and its readers see it.
#include <torch/torch.h>

#include "autotp/io/safetensors.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace autotp;
  const auto path = fuzz::scratch_dir() / "input.safetensors";
  fuzz::write_file(path, data, size);
  fuzz::expect_user_error_only(path.string(), [&] {
    auto file = io::SafetensorsFile::open(path.string());
    for (const auto& info : file->tensors()) {
      torch::Tensor whole = file->read(info.name, torch::kFloat32);
      if (!info.shape.empty() && info.shape[0] > 0) {
        const int64_t extent = info.shape[0];
        torch::Tensor slice = file->read_slice(info.name, 0, extent / 2, extent - extent / 2);
        if (slice.numel() * slice.element_size() > static_cast<int64_t>(info.end - info.begin))
          fuzz::finding("slice", "a slice larger than its tensor: " + info.name);
      }
      (void)whole;
    }
  });
  return 0;
}
