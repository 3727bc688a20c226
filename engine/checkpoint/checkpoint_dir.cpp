// HF checkpoint directories: one model.safetensors, or shards listed by
// model.safetensors.index.json; see autotp/io/safetensors.h.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "autotp/io/safetensors.h"
#include "autotp/base/error.h"

namespace autotp::io {
namespace {

namespace fs = std::filesystem;

constexpr const char* kSingleFileName = "model.safetensors";
constexpr const char* kIndexFileName = "model.safetensors.index.json";

uint64_t tensor_bytes(const torch::Tensor& tensor) { return tensor.numel() * tensor.element_size(); }

const SafetensorsFile& file_holding(const std::map<std::string, std::shared_ptr<SafetensorsFile>>& file_of,
                                    const std::string& name) {
  auto found = file_of.find(name);
  AUTOTP_USER_CHECK(found != file_of.end(), "checkpoint has no tensor named '{}'", name);
  return *found->second;
}

}  // namespace

std::string read_text_file(const std::string& path) {
  std::ifstream stream(path, std::ios::binary);
  AUTOTP_USER_CHECK(stream.good(), "{}: cannot open", path);
  std::ostringstream content;
  content << stream.rdbuf();
  return content.str();
}

CheckpointReader CheckpointReader::open(const std::string& dir) {
  CheckpointReader reader;
  const fs::path index_path = fs::path(dir) / kIndexFileName;
  const fs::path single_path = fs::path(dir) / kSingleFileName;

  // The index wins when both exist, as it names every shard explicitly.
  if (fs::exists(index_path)) {
    const std::string index_file = index_path.string();
    nlohmann::json index = nlohmann::json::parse(read_text_file(index_file), nullptr, false);
    AUTOTP_USER_CHECK(!index.is_discarded() && index.is_object(), "{}: not a valid JSON object", index_file);
    AUTOTP_USER_CHECK(index.contains("weight_map") && index["weight_map"].is_object(),
                      "{}: no \"weight_map\" object", index_file);

    std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;  // file name -> opened once
    for (const auto& [name, file_name] : index["weight_map"].items()) {
      AUTOTP_USER_CHECK(file_name.is_string(), "{}: weight_map entry for '{}' is not a file name", index_file,
                        name);
      const std::string shard_name = file_name.get<std::string>();
      // A shard is a file of this directory (or a subfolder): an absolute path or
      // '..' would read weights from elsewhere (and fs::path's / would drop `dir`).
      const fs::path relative(shard_name);
      const bool inside = !shard_name.empty() && relative.is_relative() && !relative.has_root_name() &&
                          std::none_of(relative.begin(), relative.end(), [](const fs::path& part) { return part == ".."; });
      AUTOTP_USER_CHECK(inside, "{}: weight_map entry for '{}' is '{}' (allowed: a file name relative to {})",
                        index_file, name, shard_name, dir);
      auto& shard = shards[shard_name];
      if (shard == nullptr) {
        const fs::path shard_path = fs::path(dir) / shard_name;
        // The error_code form: a name the file system refuses (too long) is the same user error.
        std::error_code error;
        AUTOTP_USER_CHECK(fs::is_regular_file(shard_path, error),
                          "{}: weight_map names file {} (for tensor '{}'), which does not exist{}", index_file,
                          shard_path.string(), name, error ? " (" + error.message() + ")" : "");
        shard = SafetensorsFile::open(shard_path.string());
      }
      AUTOTP_USER_CHECK(shard->contains(name),
                        "{}: weight_map puts tensor '{}' in {}, which does not contain it", index_file, name,
                        shard->path());
      reader.file_of_[name] = shard;
    }
    return reader;
  }

  AUTOTP_USER_CHECK(fs::exists(single_path), "{}: no {} or {}", dir, kSingleFileName, kIndexFileName);
  auto file = SafetensorsFile::open(single_path.string());
  for (const auto& info : file->tensors()) reader.file_of_[info.name] = file;
  return reader;
}

std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> result;
  result.reserve(file_of_.size());
  for (const auto& entry : file_of_) result.push_back(entry.first);  // std::map: already sorted
  return result;
}

bool CheckpointReader::contains(const std::string& name) const { return file_of_.count(name) > 0; }

const TensorInfo& CheckpointReader::info(const std::string& name) const {
  return file_holding(file_of_, name).info(name);
}

torch::Tensor CheckpointReader::read(const std::string& name, std::optional<torch::ScalarType> dtype) const {
  return file_holding(file_of_, name).read(name, dtype);
}

torch::Tensor CheckpointReader::read_slice(const std::string& name, int64_t dim, int64_t start,
                                           int64_t length, std::optional<torch::ScalarType> dtype) const {
  return file_holding(file_of_, name).read_slice(name, dim, start, length, dtype);
}

// Layout switches: writing one layout deletes the other layout's entry point
// (model.safetensors vs the index) so neither we (index first) nor HF
// (model.safetensors first) pick up stale weights. Old shard files that the new
// index does not name are left in place; nothing references them.
std::vector<std::string> write_checkpoint(const std::string& dir, const NamedTensors& tensors,
                                          uint64_t max_shard_bytes) {
  std::error_code error;
  fs::create_directories(dir, error);
  AUTOTP_USER_CHECK(!error, "{}: cannot create directory: {}", dir, error.message());
  const fs::path index_path = fs::path(dir) / kIndexFileName;
  const fs::path single_path = fs::path(dir) / kSingleFileName;

  // Checked up front: across shards, write_safetensors would not see a repeat.
  std::set<std::string> seen;
  uint64_t total_bytes = 0;
  for (const auto& [name, tensor] : tensors) {
    AUTOTP_USER_CHECK(seen.insert(name).second, "{}: tensor name '{}' is given twice", dir, name);
    total_bytes += tensor_bytes(tensor);
  }

  if (max_shard_bytes == 0 || total_bytes <= max_shard_bytes) {
    write_safetensors(single_path.string(), tensors);
    fs::remove(index_path, error);
    return {single_path.string()};
  }

  // Greedy in the given order; a tensor larger than the limit gets a shard of its own.
  std::vector<NamedTensors> shards;
  uint64_t shard_bytes = 0;
  for (const auto& entry : tensors) {
    const uint64_t bytes = tensor_bytes(entry.second);
    if (shards.empty() || (!shards.back().empty() && shard_bytes + bytes > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(entry);
    shard_bytes += bytes;
  }

  std::vector<std::string> written;
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string shard_name = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    const fs::path shard_path = fs::path(dir) / shard_name;
    write_safetensors(shard_path.string(), shards[i]);
    for (const auto& entry : shards[i]) weight_map[entry.first] = shard_name;
    written.push_back(shard_path.string());
  }
  // The index goes last, so it never names a shard that is not fully written.
  nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  write_text_file_atomic(index_path.string(), index.dump(2) + "\n");
  written.push_back(index_path.string());
  fs::remove(single_path, error);
  return written;
}

}  // namespace autotp::io
