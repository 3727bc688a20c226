// model.safetensors.index.json of a sharded HF checkpoint, read by
// CheckpointReader::open from a directory that also holds one small valid shard
// (model-00001-of-00002.safetensors, tensors "a" and "b"); every tensor the
// reader lists is then read.
#include <torch/torch.h>

#include "autotp/io/safetensors.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace autotp;
  static const std::filesystem::path dir = [] {
    const auto d = fuzz::scratch_dir() / "hf_model";
    std::filesystem::create_directories(d);
    io::write_safetensors((d / "model-00001-of-00002.safetensors").string(),
                          {{"a", torch::arange(6, torch::kFloat32).view({2, 3})}, {"b", torch::ones({4}, torch::kInt64)}});
    io::write_safetensors((d / "model-00002-of-00002.safetensors").string(),
                          {{"c", torch::zeros({3}, torch::kBFloat16)}});
    return d;
  }();
  fuzz::write_file(dir / "model.safetensors.index.json", data, size);
  fuzz::expect_user_error_only(dir.string(), [&] {
    auto reader = io::CheckpointReader::open(dir.string());
    for (const auto& name : reader.names()) {
      torch::Tensor t = reader.read(name);
      const auto& info = reader.info(name);
      if (!info.shape.empty() && info.shape[0] > 0) (void)reader.read_slice(name, 0, 0, 1, torch::kFloat32);
      (void)t;
    }
  });
  return 0;
}
