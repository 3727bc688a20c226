#include "autotp/io/hf_writer.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "autotp/base/error.h"

namespace autotp::io {
namespace {

namespace fs = std::filesystem;

std::string hf_dtype(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat32: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    default: throw_user_error("export dtype {} is not supported (allowed: f32, bf16, f16)", c10::toString(dtype));
  }
}

bool is_companion_file(const std::string& name) {
  const auto& names = companion_file_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

// The files an HF model directory written by us (or by HF) consists of.
bool is_model_file(const std::string& name) {
  return name == "config.json" || name == "model.safetensors.index.json" || is_companion_file(name) ||
         (name.rfind("model", 0) == 0 && name.size() > 12 && name.substr(name.size() - 12) == ".safetensors");
}

}  // namespace

const std::vector<std::string>& companion_file_names() {
  static const std::vector<std::string> names = {
      "generation_config.json", "tokenizer.json",     "tokenizer_config.json", "special_tokens_map.json",
      "added_tokens.json",      "tokenizer.model",    "vocab.json",            "merges.txt",
      "vocab.txt",              "chat_template.jinja", "chat_template.json"};
  return names;
}

std::vector<std::string> copy_companion_files(const std::string& from_dir, const std::string& to_dir) {
  std::vector<std::string> copied;
  if (from_dir.empty()) return copied;
  for (const auto& name : companion_file_names()) {
    const fs::path from = fs::path(from_dir) / name;
    std::error_code error;
    if (!fs::is_regular_file(from, error)) continue;
    fs::copy_file(from, fs::path(to_dir) / name, fs::copy_options::overwrite_existing, error);
    AUTOTP_USER_CHECK(!error, "{}: cannot copy {} into {}: {}", from.string(), name, to_dir, error.message());
    copied.push_back(name);
  }
  return copied;
}

void set_config_dtype(nlohmann::json& config, const std::string& dtype) {
  const bool has_dtype = config.contains("dtype"), has_torch_dtype = config.contains("torch_dtype");
  if (has_dtype) config["dtype"] = dtype;
  if (has_torch_dtype) config["torch_dtype"] = dtype;
  if (has_dtype || has_torch_dtype) return;
  const bool transformers5 = config.contains("transformers_version") && config["transformers_version"].is_string() &&
                             std::atoi(config["transformers_version"].get<std::string>().c_str()) >= 5;
  config[transformers5 || config.contains("rope_parameters") ? "dtype" : "torch_dtype"] = dtype;
}

HfModelWriter::HfModelWriter(std::string dir, nlohmann::json config,
                             std::vector<std::pair<std::string, std::vector<int64_t>>> tensors,
                             torch::ScalarType dtype, uint64_t max_shard_bytes)
    : dir_(std::move(dir)), config_(std::move(config)), dtype_(dtype), tensors_(std::move(tensors)) {
  set_config_dtype(config_, hf_dtype(dtype_));
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  std::error_code error;
  if (fs::exists(dir_)) {
    AUTOTP_USER_CHECK(fs::is_directory(dir_), "{}: exists and is not a directory", dir_);
    for (const auto& entry : fs::directory_iterator(dir_))
      AUTOTP_USER_CHECK(is_model_file(entry.path().filename().string()),
                        "{}: exists and holds {}, which is not part of an HF model; choose an empty or new "
                        "directory",
                        dir_, entry.path().string());
  }
  // Greedy in order; a tensor larger than the limit gets a shard of its own.
  uint64_t shard_bytes = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    uint64_t bytes = c10::elementSize(dtype_);
    for (int64_t d : tensors_[i].second) bytes *= static_cast<uint64_t>(d);
    total_bytes_ += bytes;
    if (shard_begin_.empty() || (max_shard_bytes > 0 && shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes)) {
      shard_begin_.push_back(i);
      shard_bytes = 0;
    }
    shard_of_.push_back(shard_begin_.size() - 1);
    shard_bytes += bytes;
  }
  const size_t shards = shard_begin_.size();
  for (size_t k = 0; k < shards; ++k)
    shard_names_.push_back(shards == 1 ? std::string("model.safetensors")
                                       : fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, shards));
  staging_ = fmt::format("{}.partial.{}", dir_, ::getpid());
  fs::remove_all(staging_, error);
  fs::create_directories(staging_, error);
  AUTOTP_USER_CHECK(!error, "{}: cannot create directory: {}", staging_, error.message());
  if (!tensors_.empty()) open_shard(0);
}

HfModelWriter::~HfModelWriter() {
  writer_.reset();
  if (!finished_) {
    std::error_code error;
    fs::remove_all(staging_, error);
  }
}

void HfModelWriter::open_shard(size_t shard) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (size_t i = shard_begin_[shard]; i < tensors_.size() && shard_of_[i] == shard; ++i)
    entries.push_back({tensors_[i].first, dtype_, tensors_[i].second});
  writer_ = std::make_unique<SafetensorsWriter>(staging_ + "/" + shard_names_[shard], std::move(entries),
                                                std::map<std::string, std::string>{{"format", "pt"}});
}

void HfModelWriter::write(const std::string& name, const torch::Tensor& tensor) {
  TORCH_CHECK(next_ < tensors_.size() && tensors_[next_].first == name, "HfModelWriter::write: got '", name,
              "', expected '", next_ < tensors_.size() ? tensors_[next_].first : "(nothing)", "'");
  writer_->write(tensor);
  const size_t shard = shard_of_[next_++];
  if (next_ == tensors_.size() || shard_of_[next_] != shard) {
    writer_->commit();
    writer_.reset();
    if (next_ < tensors_.size()) open_shard(shard + 1);
  }
}

std::vector<std::string> HfModelWriter::finish() {
  TORCH_CHECK(next_ == tensors_.size(), "HfModelWriter::finish: ", tensors_.size() - next_,
              " tensors were not written");
  std::vector<std::string> files = shard_names_;
  if (shard_names_.size() > 1) {
    nlohmann::json weight_map = nlohmann::json::object();
    for (size_t i = 0; i < tensors_.size(); ++i) weight_map[tensors_[i].first] = shard_names_[shard_of_[i]];
    nlohmann::json index = {{"metadata", {{"total_size", total_bytes_}}}, {"weight_map", weight_map}};
    write_text_file_atomic(staging_ + "/model.safetensors.index.json", index.dump(2) + "\n");
    files.push_back("model.safetensors.index.json");
  }
  write_text_file_atomic(staging_ + "/config.json", config_.dump(2) + "\n");
  files.push_back("config.json");
  for (const auto& name : copy_companion_files(companion_dir_, staging_)) files.push_back(name);
  std::error_code error;
  if (fs::exists(dir_)) {
    const std::string old = fmt::format("{}.old.{}", dir_, ::getpid());
    fs::rename(dir_, old, error);
    AUTOTP_USER_CHECK(!error, "{}: cannot move the previous export aside: {}", dir_, error.message());
    fs::rename(staging_, dir_, error);
    AUTOTP_USER_CHECK(!error, "{}: cannot move {} into place: {}", dir_, staging_, error.message());
    fs::remove_all(old, error);
  } else {
    fs::rename(staging_, dir_, error);
    AUTOTP_USER_CHECK(!error, "{}: cannot move {} into place: {}", dir_, staging_, error.message());
  }
  finished_ = true;
  return files;
}

}  // namespace autotp::io
