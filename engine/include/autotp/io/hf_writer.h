// HfModelWriter: writes a consolidated HF model directory (config.json plus
// model.safetensors, or model-0000K-of-0000N.safetensors shards and
// model.safetensors.index.json) one tensor at a time, so the writer holds at
// most one tensor. Everything goes into a temporary sibling directory that is
// renamed to `dir` by finish(): a reader never sees a half-written model. An
// existing `dir` is replaced only if it holds nothing but an HF model's files.
// Not thread safe.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "autotp/io/safetensors.h"

namespace autotp::io {

class HfModelWriter {
 public:
  // `tensors`: every tensor's HF name and shape, in the order write() will get them.
  // config.json is `config` with "torch_dtype" set to `dtype`. max_shard_bytes 0: one file.
  HfModelWriter(std::string dir, nlohmann::json config,
                std::vector<std::pair<std::string, std::vector<int64_t>>> tensors, torch::ScalarType dtype,
                uint64_t max_shard_bytes = 0);
  ~HfModelWriter();

  // The next tensor in order (any dtype; converted).
  void write(const std::string& name, const torch::Tensor& tensor);
  // Writes the index and config.json and moves the directory into place; returns the files' names.
  std::vector<std::string> finish();
  uint64_t total_bytes() const { return total_bytes_; }

 private:
  void open_shard(size_t shard);
  std::string dir_, staging_;
  nlohmann::json config_;
  torch::ScalarType dtype_;
  std::vector<std::pair<std::string, std::vector<int64_t>>> tensors_;
  std::vector<size_t> shard_of_;    // per tensor
  std::vector<size_t> shard_begin_; // first tensor of each shard
  std::vector<std::string> shard_names_;
  size_t next_ = 0;
  std::unique_ptr<SafetensorsWriter> writer_;
  uint64_t total_bytes_ = 0;
  bool finished_ = false;
};

}  // namespace autotp::io
