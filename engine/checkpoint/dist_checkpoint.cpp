#include "autotp/checkpoint/dist_checkpoint.h"

#include <algorithm>

#include <unistd.h>

#include <filesystem>
#include <limits>
#include <map>

#include "autotp/io/checksum.h"
#include "autotp/base/error.h"
#include "autotp/base/json_file.h"

namespace autotp::io {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

}  // namespace

std::string rank_file_name(int tp_rank, int dp_rank) { return fmt::format("tp{}_dp{}.safetensors", tp_rank, dp_rank); }
std::string step_dir_name(int64_t step) { return fmt::format("step_{}", step); }

json CheckpointMetadata::to_json() const {
  json tensor_list = json::array();
  for (const auto& t : tensors)
    tensor_list.push_back({{"name", t.name}, {"spec", t.spec.to_json()}, {"unit", t.unit}});
  json file_list = json::array();
  for (const auto& f : files)
    file_list.push_back(
        {{"name", f.name}, {"tp_rank", f.tp_rank}, {"dp_rank", f.dp_rank}, {"crc32", f.crc32}, {"bytes", f.bytes}});
  json j = {{"format", "autotp-checkpoint"},
          {"version", kCheckpointFormatVersion},
          {"step", step},
          {"topology", {{"tp", tp}, {"dp", dp}, {"world", tp * dp}, {"zero_stage", stage}}},
          {"dtype", dtype},
          {"optimizer_states", optimizer_states},
          {"trainer", trainer},
          {"sampler", sampler},
          {"loss_scaler", loss_scaler},
          {"files", file_list},
          {"tensors", tensor_list},
          {"model_config", model_config},
          {"train_config", train_config}};
  if (!expert_parts.empty()) j["expert_parts"] = expert_parts;
  return j;
}

namespace {

// get<T> of an integer key, checked: nlohmann casts a float (1e30) or an integer
// out of T's range silently or with undefined behaviour.
template <typename T>
T checked_integer(const json& v, const std::string& source) {
  const bool fits = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())
                    : v.is_number_integer() ? v.get<int64_t>() >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
                                                  (v.get<int64_t>() < 0 || static_cast<uint64_t>(v.get<int64_t>()) <=
                                                                               static_cast<uint64_t>(std::numeric_limits<T>::max()))
                                            : false;
  AUTOTP_USER_CHECK(fits, "{}: malformed checkpoint metadata: {} is not an integer in [{}, {}]", source, v.dump(),
                    std::numeric_limits<T>::min(), std::numeric_limits<T>::max());
  return v.get<T>();
}

}  // namespace

CheckpointMetadata CheckpointMetadata::from_json(const json& j, const std::string& source) {
  // Compared as JSON values: a key of another type is a mismatch, never nlohmann's type_error.
  AUTOTP_USER_CHECK(j.is_object() && j.contains("format") && j["format"] == "autotp-checkpoint",
                    "{}: not an autotp checkpoint metadata file", source);
  const json version_value = j.contains("version") ? j["version"] : json();
  const bool known_version = version_value.is_number_integer() &&
                             version_value >= kOldestCheckpointFormatVersion && version_value <= kCheckpointFormatVersion;
  AUTOTP_USER_CHECK(known_version, "{}: checkpoint format version {} (this build reads {} to {})", source,
                    version_value.dump(), kOldestCheckpointFormatVersion, kCheckpointFormatVersion);
  const int version = version_value.get<int>();
  CheckpointMetadata m;
  try {
    m.step = checked_integer<int64_t>(j.at("step"), source);
    const json& topo = j.at("topology");
    m.tp = checked_integer<int>(topo.at("tp"), source);
    m.dp = checked_integer<int>(topo.at("dp"), source);
    m.stage = checked_integer<int>(topo.at("zero_stage"), source);
    m.dtype = j.at("dtype").get<std::string>();
    m.optimizer_states = j.at("optimizer_states").get<std::vector<std::string>>();
    m.trainer = j.at("trainer");
    m.sampler = j.at("sampler");
    m.loss_scaler = j.at("loss_scaler");
    for (const auto& f : j.at("files"))
      m.files.push_back({f.at("name").get<std::string>(), checked_integer<int>(f.at("tp_rank"), source),
                         checked_integer<int>(f.at("dp_rank"), source), checked_integer<uint32_t>(f.at("crc32"), source),
                         checked_integer<uint64_t>(f.at("bytes"), source)});
    for (const auto& t : j.at("tensors"))
      m.tensors.push_back({t.at("name").get<std::string>(), ShardSpec::from_json(t.at("spec")),
                           version >= 2 ? checked_integer<int>(t.at("unit"), source) : 0});
    m.model_config = j.at("model_config");
    m.train_config = j.at("train_config");
    if (j.contains("expert_parts")) m.expert_parts = j.at("expert_parts").get<std::vector<std::string>>();
  } catch (const json::exception& e) {
    throw_user_error("{}: malformed checkpoint metadata: {}", source, e.what());
  } catch (const c10::Error& e) {
    throw_user_error("{}: malformed checkpoint metadata: {}", source, e.what_without_backtrace());
  }
  AUTOTP_USER_CHECK(m.tp >= 1 && m.dp >= 1 && m.stage >= 0 && m.stage <= 3,
                    "{}: topology tp {} dp {} stage {} is not valid", source, m.tp, m.dp, m.stage);
  // Every rank has a file, so tp * dp is at most the files listed (this also bounds the per-rank loops).
  AUTOTP_USER_CHECK(int64_t{m.tp} * m.dp <= static_cast<int64_t>(m.files.size()),
                    "{}: topology tp {} x dp {} needs {} rank files, {} are listed", source, m.tp, m.dp,
                    int64_t{m.tp} * m.dp, m.files.size());
  // Units are the model's (embeddings, each layer, head, persistent): a LoRA
  // checkpoint holds fewer tensors than units. Bounded so a bad file cannot ask for
  // billions of units.
  int64_t layers = 0;
  for (const char* key : {"num_hidden_layers", "n_layer"})
    if (m.model_config.is_object() && m.model_config.contains(key) && m.model_config[key].is_number_integer())
      layers = std::clamp<int64_t>(m.model_config[key].get<int64_t>(), 0, int64_t{1} << 20);
  const int64_t units = std::max<int64_t>(static_cast<int64_t>(m.tensors.size()), layers + 3);
  for (const auto& t : m.tensors)
    AUTOTP_USER_CHECK(t.unit >= 0 && t.unit < units,
                      "{}: tensor '{}' has ZeRO unit {} (allowed: 0 to {}: the embeddings, each layer, the head, the "
                      "persistent tensors)",
                      source, t.name, t.unit, units - 1);
  for (const auto& t : m.tensors)
    AUTOTP_USER_CHECK(t.spec.tp_size() == m.tp, "{}: tensor '{}' is cut for tp {}, the checkpoint has tp {}", source,
                      t.name, t.spec.tp_size(), m.tp);
  return m;
}

FlatLayout CheckpointMetadata::layout(int tp_rank) const {
  std::vector<const ShardSpec*> specs;
  std::vector<int> units;
  for (const auto& t : tensors) specs.push_back(&t.spec), units.push_back(t.unit);
  return FlatLayout::build(specs, units, tp_rank, dp, stage);
}

std::optional<size_t> CheckpointMetadata::find(const std::string& name) const {
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].name == name) return i;
  return std::nullopt;
}

NamedTensors rank_file_tensors(const torch::Tensor& params, const torch::Tensor& master_weights,
                               const std::vector<std::pair<std::string, torch::Tensor>>& optimizer,
                               const torch::Tensor& rng_state) {
  NamedTensors tensors;
  if (params.defined()) tensors.emplace_back("params", params);
  if (master_weights.defined()) tensors.emplace_back("master_weights", master_weights);
  for (const auto& [name, t] : optimizer) tensors.emplace_back("optimizer." + name, t);
  tensors.emplace_back("rng_state", rng_state);
  return tensors;
}

SavedCheckpoint SavedCheckpoint::open(const std::string& path) {
  AUTOTP_USER_CHECK(fs::is_directory(path), "checkpoint {}: no such directory", path);
  std::string dir = path;
  const fs::path latest = fs::path(path) / kCheckpointLatestFile;
  if (!fs::exists(fs::path(path) / kCheckpointMetadataFile)) {
    AUTOTP_USER_CHECK(fs::exists(latest), "checkpoint {}: neither {} (a step directory) nor {} (a checkpoint root)",
                      path, kCheckpointMetadataFile, kCheckpointLatestFile);
    const std::string step = trim(read_text_file(latest.string()));
    AUTOTP_USER_CHECK(!step.empty() && step.find('/') == std::string::npos, "{}: does not name a step directory",
                      latest.string());
    dir = (fs::path(path) / step).string();
    AUTOTP_USER_CHECK(fs::is_directory(dir), "{}: names {}, which does not exist", latest.string(), dir);
  }
  SavedCheckpoint ckpt;
  ckpt.dir_ = dir;
  const std::string meta_path = (fs::path(dir) / kCheckpointMetadataFile).string();
  AUTOTP_USER_CHECK(fs::exists(meta_path), "checkpoint {}: no {} (an incomplete save?)", dir, kCheckpointMetadataFile);
  ckpt.meta_ = CheckpointMetadata::from_json(read_json_file(meta_path, "checkpoint metadata"), meta_path);
  for (int t = 0; t < ckpt.meta_.tp; ++t) ckpt.layouts_.push_back(ckpt.meta_.layout(t));
  for (int t = 0; t < ckpt.meta_.tp; ++t)
    for (int d = 0; d < ckpt.meta_.dp; ++d) {
      bool listed = false;
      for (const auto& f : ckpt.meta_.files) listed |= f.tp_rank == t && f.dp_rank == d;
      AUTOTP_USER_CHECK(listed, "{}: lists no file for tp rank {} dp rank {}", meta_path, t, d);
    }
  for (const auto& part : ckpt.meta_.expert_parts) {
    AUTOTP_USER_CHECK(!part.empty() && part.find('/') == std::string::npos && part.find("..") == std::string::npos,
                      "{}: expert part '{}' is not a sub-directory name", meta_path, part);
    const fs::path part_dir = fs::path(dir) / part;
    AUTOTP_USER_CHECK(fs::exists(part_dir / kCheckpointMetadataFile), "{}: lists expert part {}, which has no {}",
                      meta_path, part_dir.string(), kCheckpointMetadataFile);
    ckpt.parts_.push_back(std::make_shared<SavedCheckpoint>(open(part_dir.string())));
  }
  return ckpt;
}

size_t SavedCheckpoint::file_count() const {
  size_t n = meta_.files.size();
  for (const auto& part : parts_) n += part->file_count();
  return n;
}

bool SavedCheckpoint::holds(const std::string& name) const {
  if (meta_.find(name)) return true;
  for (const auto& part : parts_)
    if (part->holds(name)) return true;
  return false;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> SavedCheckpoint::all_tensors(
    const std::vector<std::string>& order) const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> list;
  for (const auto& t : meta_.tensors) list.emplace_back(t.name, t.spec.global_shape());
  for (const auto& part : parts_)
    for (const auto& t : part->all_tensors({})) list.push_back(t);
  std::map<std::string, size_t> rank;
  for (size_t i = 0; i < order.size(); ++i) rank.emplace(order[i], i);
  std::stable_sort(list.begin(), list.end(), [&](const auto& a, const auto& b) {
    const auto ra = rank.find(a.first), rb = rank.find(b.first);
    return (ra == rank.end() ? order.size() : ra->second) < (rb == rank.end() ? order.size() : rb->second);
  });
  return list;
}

torch::Tensor SavedCheckpoint::read_full(const std::string& name, const std::string& state) const {
  if (auto found = meta_.find(name)) return read_full(*found, state);
  for (const auto& part : parts_)
    if (part->holds(name)) return part->read_full(name, state);
  TORCH_CHECK(false, "SavedCheckpoint::read_full: no tensor '", name, "'");
}

std::string SavedCheckpoint::check_file(size_t index) const {
  if (index >= meta_.files.size()) {
    index -= meta_.files.size();
    for (const auto& part : parts_) {
      if (index < part->file_count()) return part->check_file(index);
      index -= part->file_count();
    }
    TORCH_CHECK(false, "SavedCheckpoint::check_file: no file ", index);
  }
  const CheckpointFile& f = meta_.files.at(index);
  const std::string path = (fs::path(dir_) / f.name).string();
  if (!fs::exists(path)) return fmt::format("{}: missing (the checkpoint lists it in {})", path, kCheckpointMetadataFile);
  const uint64_t size = fs::file_size(path);
  if (size != f.bytes)
    return fmt::format("{}: {} bytes, the checkpoint recorded {} (truncated or overwritten)", path, size, f.bytes);
  const FileChecksum sum = checksum_file(path);
  if (sum.crc32 != f.crc32)
    return fmt::format("{}: CRC-32 {:08x} does not match the recorded {:08x} (the file is corrupt)", path, sum.crc32,
                       f.crc32);
  return "";
}

void SavedCheckpoint::verify() const {
  for (size_t i = 0; i < file_count(); ++i) {
    std::string problem = check_file(i);
    if (!problem.empty()) throw UserError(problem);
  }
}

const SafetensorsFile& SavedCheckpoint::file(int tp_rank, int dp_rank) const {
  const std::string name = rank_file_name(tp_rank, dp_rank);
  auto& slot = open_[name];
  if (!slot) slot = SafetensorsFile::open((fs::path(dir_) / name).string());
  return *slot;
}

std::string SavedCheckpoint::state_name(const std::string& state) const {
  if (state == "master") return meta_.mixed_precision() ? "master_weights" : "params";
  return state;
}

torch::Tensor SavedCheckpoint::read_flat(int tp_rank, const std::string& state, int64_t begin, int64_t length) const {
  const std::string name = state_name(state);
  const FlatLayout& layout = layouts_.at(tp_rank);
  TORCH_CHECK(begin >= 0 && begin + length <= layout.padded, "SavedCheckpoint::read_flat: [", begin, ", +", length,
              ") outside the flat buffer of ", layout.padded);
  if (meta_.stage == 0) {  // dp 0 holds the whole buffer
    const SafetensorsFile& f = file(tp_rank, 0);
    AUTOTP_USER_CHECK(f.contains(name), "{}: has no tensor '{}'", f.path(), name);
    return f.read_slice(name, 0, begin, length, torch::kFloat32);
  }
  // Each dp rank holds its slice of every unit; the span may cross units.
  std::vector<torch::Tensor> pieces;
  for (int64_t at = begin; at < begin + length;) {
    const FlatUnit& u = layout.units[layout.unit_at(at)];
    const int64_t unit_end = std::min(begin + length, u.begin + u.length);
    const int64_t s = u.length / layout.dp;
    for (int d = 0; d < layout.dp; ++d) {
      const int64_t own = u.begin + d * s;
      const int64_t lo = std::max(at, own), hi = std::min(unit_end, own + s);
      if (hi <= lo) continue;
      const SafetensorsFile& f = file(tp_rank, d);
      AUTOTP_USER_CHECK(f.contains(name), "{}: has no tensor '{}'", f.path(), name);
      AUTOTP_USER_CHECK(f.info(name).shape == std::vector<int64_t>{layout.part},
                        "{}: tensor '{}' does not have the partition size {} of the metadata", f.path(), name,
                        layout.part);
      pieces.push_back(f.read_slice(name, 0, u.begin / layout.dp + (lo - own), hi - lo, torch::kFloat32));
    }
    at = unit_end;
  }
  if (pieces.empty()) return torch::zeros({0}, torch::kFloat32);
  return pieces.size() == 1 ? pieces[0] : torch::cat(pieces);
}

torch::Tensor SavedCheckpoint::read_local(size_t index, int tp_rank, const std::string& state) const {
  const ShardSpec& spec = meta_.tensors.at(index).spec;
  return read_flat(tp_rank, state, layouts_.at(tp_rank).offsets[index], spec.local_numel(tp_rank))
      .view(spec.local_shape(tp_rank));
}

torch::Tensor SavedCheckpoint::read_full(size_t index, const std::string& state) const {
  const ShardSpec& spec = meta_.tensors.at(index).spec;
  if (spec.is_replicated()) return read_local(index, 0, state);
  auto full = torch::empty(spec.global_shape(), torch::kFloat32);
  for (int t = 0; t < meta_.tp; ++t) spec.place(full, read_local(index, t, state), t);
  return full;
}

torch::Tensor SavedCheckpoint::read_rng_state(int rank) const {
  const int world = meta_.tp * meta_.dp;
  const int r = rank < world ? rank : 0;
  return file(r % meta_.tp, r / meta_.tp).read("rng_state");
}

std::optional<torch::Tensor> SavedCheckpoint::shard_of(const std::string& name, const ShardSpec& spec, int tp_rank,
                                                      const std::string& state) const {
  if (auto found = meta_.find(name)) {
    if (meta_.tensors[*found].spec == spec) return read_local(*found, tp_rank, state);  // same cut: the saved shard
    return spec.slice(read_full(*found, state), tp_rank);
  }
  for (const auto& part : parts_)
    if (auto shard = part->shard_of(name, spec, tp_rank, state)) return shard;
  return std::nullopt;
}

torch::Tensor SavedCheckpoint::assemble(const std::string& state,
                                        const std::vector<std::pair<std::string, const ShardSpec*>>& specs,
                                        int tp_rank, const FlatLayout& layout, int64_t begin, int64_t end) const {
  auto out = torch::zeros({end - begin}, torch::kFloat32);
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t lo = std::max(begin, layout.offsets[i]);
    const int64_t hi = std::min(end, layout.offsets[i] + layout.numels[i]);
    if (hi <= lo) continue;
    const auto& [name, spec] = specs[i];
    auto local = shard_of(name, *spec, tp_rank, state);
    TORCH_CHECK(local, "SavedCheckpoint::assemble: no tensor '", name, "' (compatibility is checked before)");
    out.narrow(0, lo - begin, hi - lo).copy_(local->reshape({-1}).narrow(0, lo - layout.offsets[i], hi - lo));
  }
  return out;
}

std::string prepare_staging(const std::string& root, int64_t step) {
  std::error_code error;
  fs::create_directories(root, error);
  AUTOTP_USER_CHECK(!error, "{}: cannot create directory: {}", root, error.message());
  for (const auto& entry : fs::directory_iterator(root)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(".step_", 0) == 0 && name.size() > 8 && name.substr(name.size() - 8) == ".partial")
      fs::remove_all(entry.path(), error);  // an interrupted save
  }
  const std::string staging = (fs::path(root) / fmt::format(".{}.partial", step_dir_name(step))).string();
  fs::create_directories(staging, error);
  AUTOTP_USER_CHECK(!error, "{}: cannot create directory: {}", staging, error.message());
  return staging;
}

void commit_checkpoint(const std::string& root, const std::string& staging, const CheckpointMetadata& metadata,
                       const std::function<void()>& after_metadata, const std::function<void()>& after_rename) {
  write_text_file_atomic((fs::path(staging) / kCheckpointMetadataFile).string(), metadata.to_json().dump(1) + "\n");
  if (after_metadata) after_metadata();
  const std::string name = step_dir_name(metadata.step);
  const fs::path final_dir = fs::path(root) / name;
  std::error_code error;
  if (fs::exists(final_dir)) {
    // Re-saving a step (e.g. after a resume): the old one goes only once the new one is complete.
    const fs::path old = fs::path(root) / fmt::format(".{}.old.{}", name, ::getpid());
    fs::rename(final_dir, old, error);
    AUTOTP_USER_CHECK(!error, "{}: cannot move aside: {}", final_dir.string(), error.message());
    fs::rename(staging, final_dir, error);
    AUTOTP_USER_CHECK(!error, "{}: cannot rename {} to it: {}", final_dir.string(), staging, error.message());
    fs::remove_all(old, error);
  } else {
    fs::rename(staging, final_dir, error);
    AUTOTP_USER_CHECK(!error, "{}: cannot rename {} to it: {}", final_dir.string(), staging, error.message());
  }
  if (after_rename) after_rename();
  write_text_file_atomic((fs::path(root) / kCheckpointLatestFile).string(), name + "\n");
}

}  // namespace autotp::io
