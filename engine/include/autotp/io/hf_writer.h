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

// The files of an HF model directory besides config.json and the weights that a
// model's users load with it: generation_config.json, the tokenizer's files
// (tokenizer.json, tokenizer_config.json, special_tokens_map.json, added_tokens.json,
// tokenizer.model, vocab.json, merges.txt, vocab.txt) and the chat template
// (chat_template.jinja, chat_template.json).
const std::vector<std::string>& companion_file_names();
// Copies those of them present in `from_dir` into `to_dir`; returns their names.
std::vector<std::string> copy_companion_files(const std::string& from_dir, const std::string& to_dir);

// Sets the dtype of a config.json in its own generation's key: "dtype" and / or
// "torch_dtype" where present; else "dtype" for a transformers 5 config, "torch_dtype" otherwise.
void set_config_dtype(nlohmann::json& config, const std::string& dtype);

class HfModelWriter {
 public:
  // `tensors`: every tensor's HF name and shape, in the order write() will get them.
  // config.json is `config` with its dtype key set to `dtype` (set_config_dtype).
  // max_shard_bytes 0: one file.
  HfModelWriter(std::string dir, nlohmann::json config,
                std::vector<std::pair<std::string, std::vector<int64_t>>> tensors, torch::ScalarType dtype,
                uint64_t max_shard_bytes = 0);
  ~HfModelWriter();

  // The next tensor in order (any dtype; converted).
  void write(const std::string& name, const torch::Tensor& tensor);
  // The companion files (companion_file_names) found in `dir` are copied beside the
  // weights by finish(), so the export opens as the input did ("" = none).
  void copy_companions_from(const std::string& dir) { companion_dir_ = dir; }
  // Writes the index and config.json and moves the directory into place; returns the files' names.
  std::vector<std::string> finish();
  uint64_t total_bytes() const { return total_bytes_; }

 private:
  void open_shard(size_t shard);
  std::string dir_, staging_, companion_dir_;
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
