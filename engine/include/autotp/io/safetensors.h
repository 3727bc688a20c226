// safetensors files: an 8-byte little-endian header length, a JSON header
// {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the raw little-endian data. The reader memory-maps the file and reads
// one tensor, or a range along one dim of it, without touching the rest.
// Every malformed file is a UserError naming the file and what is wrong.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace autotp::io {

struct TensorInfo {
  std::string name;
  torch::ScalarType dtype;        // F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;    // byte offsets relative to the start of the data section
};

// "F32" <-> torch::kFloat32 etc. Unknown names are a UserError.
torch::ScalarType dtype_from_safetensors(const std::string& name, const std::string& file);
std::string dtype_to_safetensors(torch::ScalarType dtype);

class SafetensorsFile {
 public:
  // Maps and validates the file (header length, JSON, dtypes, offsets within the
  // data section and not overlapping, size = numel * element size).
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in file order
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;  // UserError if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // A copy of the tensor (owned memory), converted to `dtype` when given.
  torch::Tensor read(const std::string& name, std::optional<torch::ScalarType> dtype = std::nullopt) const;
  // Elements [start, start + length) along `dim`; reads only those bytes.
  torch::Tensor read_slice(const std::string& name, int64_t dim, int64_t start, int64_t length,
                           std::optional<torch::ScalarType> dtype = std::nullopt) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* data_ = nullptr;   // start of the data section inside the mapping
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Writes `tensors` (contiguous copies are made as needed) to `path` through a
// temporary file in the same directory renamed on success.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Streams tensors into a safetensors file whose header (names, dtypes, shapes,
// in order) is known up front, so memory stays at one tensor however large the
// file. Bytes go to `path + ".tmp.<pid>"`; commit() renames it into place; an
// uncommitted writer removes its temporary file when destroyed. The CRC-32 of
// every byte written is kept as it goes. Not thread safe.
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(std::string path, std::vector<Entry> entries,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The next tensor in header order; converted to the entry's dtype. Its shape must match.
  void write(const torch::Tensor& tensor);
  // Called after the header and after each tensor with the bytes written so far
  // (tests use it to kill a writer half way).
  void set_progress_hook(std::function<void(uint64_t bytes)> hook) { hook_ = std::move(hook); }
  // Closes and renames the file into place; returns the CRC-32 of the whole file.
  uint32_t commit();
  uint64_t bytes_written() const { return bytes_; }
  const std::string& path() const { return path_; }

 private:
  void append(const void* data, size_t size);
  std::string path_, temporary_;
  std::vector<Entry> entries_;
  size_t next_ = 0;
  int fd_ = -1;
  uint64_t bytes_ = 0;
  uint32_t crc_ = 0;
  bool committed_ = false;
  std::function<void(uint64_t)> hook_;
};

// The whole content of a small text file; UserError "PATH: cannot open".
std::string read_text_file(const std::string& path);

// Atomic write of a small text file (temporary name + rename).
void write_text_file_atomic(const std::string& path, const std::string& content);

// An HF checkpoint directory: model.safetensors, or shards listed by
// model.safetensors.index.json ({"metadata": {"total_size": N}, "weight_map": {name: file}}).
class CheckpointReader {
 public:
  static CheckpointReader open(const std::string& dir);  // UserError when no weights are found
  std::vector<std::string> names() const;                // sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;
  torch::Tensor read(const std::string& name, std::optional<torch::ScalarType> dtype = std::nullopt) const;
  torch::Tensor read_slice(const std::string& name, int64_t dim, int64_t start, int64_t length,
                           std::optional<torch::ScalarType> dtype = std::nullopt) const;

 private:
  std::map<std::string, std::shared_ptr<SafetensorsFile>> file_of_;  // tensor name -> file
};

// Writes tensors into `dir` as model.safetensors, or as
// model-0000K-of-0000N.safetensors + model.safetensors.index.json when the total
// exceeds max_shard_bytes (0 = never shard). Returns the files written.
std::vector<std::string> write_checkpoint(const std::string& dir, const NamedTensors& tensors,
                                          uint64_t max_shard_bytes = 0);

// "2GB", "500MB", "1024" (bytes); KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024.
uint64_t parse_byte_size(const std::string& text);

}  // namespace autotp::io
