// Reading and writing single safetensors files; see autotp/io/safetensors.h.
#include "autotp/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "autotp/io/checksum.h"
#include "autotp/base/error.h"

namespace autotp::io {
namespace {

// ordered_json keeps the header's key order, so ties in file order are stable
// and the writer emits tensors in the caller's order.
using OrderedJson = nlohmann::ordered_json;

struct DtypeName {
  torch::ScalarType dtype;
  const char* name;
};

constexpr DtypeName kDtypeNames[] = {
    {torch::kFloat32, "F32"}, {torch::kFloat16, "F16"}, {torch::kBFloat16, "BF16"}, {torch::kFloat64, "F64"},
    {torch::kInt64, "I64"},   {torch::kInt32, "I32"},   {torch::kInt16, "I16"},     {torch::kInt8, "I8"},
    {torch::kUInt8, "U8"},    {torch::kBool, "BOOL"},
};

uint64_t element_size(torch::ScalarType dtype) { return c10::elementSize(dtype); }

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Reads and checks one header entry; `data_size` is the size of the data section.
TensorInfo parse_entry(const std::string& path, const std::string& name, const OrderedJson& entry,
                       uint64_t data_size) {
  AUTOTP_USER_CHECK(entry.is_object(), "{}: tensor '{}': header entry is not a JSON object", path, name);
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    AUTOTP_USER_CHECK(entry.contains(key), "{}: tensor '{}': header entry has no \"{}\"", path, name, key);
  }
  const auto& dtype = entry["dtype"];
  AUTOTP_USER_CHECK(dtype.is_string(), "{}: tensor '{}': \"dtype\" is not a string", path, name);

  TensorInfo info;
  info.name = name;
  info.dtype = dtype_from_safetensors(dtype.get<std::string>(), path + ": tensor '" + name + "'");

  const auto& shape = entry["shape"];
  AUTOTP_USER_CHECK(shape.is_array(), "{}: tensor '{}': \"shape\" is not an array", path, name);
  uint64_t numel = 1;
  bool numel_overflows = false;
  for (const auto& extent : shape) {
    AUTOTP_USER_CHECK(extent.is_number_unsigned() && extent.get<uint64_t>() <= uint64_t(INT64_MAX),
                      "{}: tensor '{}': \"shape\" {} holds something other than a non-negative integer", path,
                      name, extent.dump());
    info.shape.push_back(extent.get<int64_t>());
    numel_overflows |= __builtin_mul_overflow(numel, extent.get<uint64_t>(), &numel);
  }

  const auto& offsets = entry["data_offsets"];
  AUTOTP_USER_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                        offsets[1].is_number_unsigned(),
                    "{}: tensor '{}': \"data_offsets\" {} is not a pair of non-negative integers", path, name,
                    offsets.dump());
  info.begin = offsets[0].get<uint64_t>();
  info.end = offsets[1].get<uint64_t>();
  AUTOTP_USER_CHECK(info.begin <= info.end, "{}: tensor '{}': data_offsets [{}, {}] begin is past end", path,
                    name, info.begin, info.end);
  AUTOTP_USER_CHECK(
      info.end <= data_size,
      "{}: tensor '{}' data_offsets [{}, {}] end past the data section ({} bytes); the file may be "
      "truncated",
      path, name, info.begin, info.end, data_size);

  uint64_t expected_bytes = 0;
  numel_overflows |= __builtin_mul_overflow(numel, element_size(info.dtype), &expected_bytes);
  AUTOTP_USER_CHECK(!numel_overflows && expected_bytes == info.end - info.begin,
                    "{}: tensor '{}': byte size {} does not match shape {} x {} ({} bytes)", path, name,
                    info.end - info.begin, shape_text(info.shape), dtype.get<std::string>(),
                    numel_overflows ? std::string("overflow") : std::to_string(expected_bytes));
  return info;
}

std::map<std::string, std::string> parse_metadata(const std::string& path, const OrderedJson& metadata) {
  AUTOTP_USER_CHECK(metadata.is_object(), "{}: \"__metadata__\" is not a JSON object", path);
  std::map<std::string, std::string> result;
  for (const auto& [key, value] : metadata.items()) {
    AUTOTP_USER_CHECK(value.is_string(), "{}: \"__metadata__\" value of '{}' is not a string", path, key);
    result[key] = value.get<std::string>();
  }
  return result;
}

// Owns a file descriptor; closes it on every path out.
struct FileDescriptor {
  int fd = -1;
  explicit FileDescriptor(int descriptor) : fd(descriptor) {}
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
};

void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  while (size > 0) {
    ssize_t written = ::write(fd, bytes, size);
    if (written < 0 && errno == EINTR) continue;
    AUTOTP_USER_CHECK(written > 0, "{}: write failed: {}", path, std::strerror(errno));
    bytes += written;
    size -= static_cast<size_t>(written);
  }
}

// Writes through `path + ".tmp.<pid>"` and renames it over `path` once every
// byte is out, so readers never see a half-written file. `write_body` gets the fd.
template <typename WriteBody>
void write_file_atomic(const std::string& path, WriteBody&& write_body) {
  const std::string temporary = fmt::format("{}.tmp.{}", path, ::getpid());
  try {
    {
      FileDescriptor file(::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
      AUTOTP_USER_CHECK(file.fd >= 0, "{}: cannot create: {}", temporary, std::strerror(errno));
      write_body(file.fd, temporary);
      int closed = ::close(file.fd);
      file.fd = -1;
      AUTOTP_USER_CHECK(closed == 0, "{}: close failed: {}", temporary, std::strerror(errno));
    }
    AUTOTP_USER_CHECK(::rename(temporary.c_str(), path.c_str()) == 0, "{}: cannot rename {} to it: {}", path,
                      temporary, std::strerror(errno));
  } catch (...) {
    ::unlink(temporary.c_str());
    throw;
  }
}

}  // namespace

torch::ScalarType dtype_from_safetensors(const std::string& name, const std::string& file) {
  for (const auto& entry : kDtypeNames) {
    if (name == entry.name) return entry.dtype;
  }
  throw_user_error("{}: unknown dtype '{}' (supported: F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL)",
                   file, name);
}

std::string dtype_to_safetensors(torch::ScalarType dtype) {
  for (const auto& entry : kDtypeNames) {
    if (dtype == entry.dtype) return entry.name;
  }
  // A tensor of another dtype is a bug in the caller, not bad user input.
  TORCH_CHECK(false, "dtype_to_safetensors: safetensors has no name for dtype ", dtype);
}

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;

  FileDescriptor descriptor(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  AUTOTP_USER_CHECK(descriptor.fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  struct stat status {};
  AUTOTP_USER_CHECK(::fstat(descriptor.fd, &status) == 0, "{}: cannot stat: {}", path, std::strerror(errno));
  AUTOTP_USER_CHECK(S_ISREG(status.st_mode), "{}: not a regular file", path);
  const auto file_size = static_cast<uint64_t>(status.st_size);
  AUTOTP_USER_CHECK(file_size >= 8,
                    "{}: file is {} bytes, shorter than the 8-byte header length; not a safetensors file",
                    path, file_size);

  void* mapping = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, descriptor.fd, 0);
  AUTOTP_USER_CHECK(mapping != MAP_FAILED, "{}: cannot mmap: {}", path, std::strerror(errno));
  // From here the destructor unmaps, also when validation below throws.
  file->mapping_ = mapping;
  file->mapping_size_ = file_size;
  const auto* base = static_cast<const uint8_t*>(mapping);

  uint64_t header_size = 0;
  std::memcpy(&header_size, base, 8);  // little-endian host assumed
  AUTOTP_USER_CHECK(
      header_size <= file_size - 8,
      "{}: header length {} runs past the end of the file ({} bytes); not a safetensors file or "
      "truncated",
      path, header_size, file_size);
  const auto* header_begin = reinterpret_cast<const char*>(base + 8);
  OrderedJson header = OrderedJson::parse(header_begin, header_begin + header_size, nullptr, false);
  AUTOTP_USER_CHECK(!header.is_discarded(), "{}: header is not valid JSON", path);
  AUTOTP_USER_CHECK(header.is_object(), "{}: header is not a JSON object", path);

  file->data_ = base + 8 + header_size;
  const uint64_t data_size = file_size - 8 - header_size;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      file->metadata_ = parse_metadata(path, entry);
      continue;
    }
    file->tensors_.push_back(parse_entry(path, name, entry, data_size));
  }

  // File order is data order; stable so equal offsets (empty tensors) keep header order.
  std::stable_sort(file->tensors_.begin(), file->tensors_.end(),
                   [](const TensorInfo& a, const TensorInfo& b) { return a.begin < b.begin; });
  const TensorInfo* previous = nullptr;  // the non-empty tensor reaching furthest so far
  for (const auto& info : file->tensors_) {
    if (info.begin == info.end) continue;  // an empty tensor shares no bytes with anything
    AUTOTP_USER_CHECK(previous == nullptr || info.begin >= previous->end,
                      "{}: tensor '{}' data_offsets [{}, {}] overlap tensor '{}' [{}, {}]", path, info.name,
                      info.begin, info.end, previous ? previous->name : "", previous ? previous->begin : 0,
                      previous ? previous->end : 0);
    previous = &info;
  }
  for (size_t i = 0; i < file->tensors_.size(); ++i) file->index_[file->tensors_[i].name] = i;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

bool SafetensorsFile::contains(const std::string& name) const { return index_.count(name) > 0; }

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto found = index_.find(name);
  AUTOTP_USER_CHECK(found != index_.end(), "{}: no tensor named '{}'", path_, name);
  return tensors_[found->second];
}

torch::Tensor SafetensorsFile::read(const std::string& name, std::optional<torch::ScalarType> dtype) const {
  const TensorInfo& tensor_info = info(name);
  torch::Tensor tensor = torch::empty(tensor_info.shape, torch::TensorOptions().dtype(tensor_info.dtype));
  if (tensor_info.end > tensor_info.begin) {
    std::memcpy(tensor.data_ptr(), data_ + tensor_info.begin, tensor_info.end - tensor_info.begin);
  }
  return dtype && *dtype != tensor.scalar_type() ? tensor.to(*dtype) : tensor;
}

torch::Tensor SafetensorsFile::read_slice(const std::string& name, int64_t dim, int64_t start, int64_t length,
                                          std::optional<torch::ScalarType> dtype) const {
  const TensorInfo& tensor_info = info(name);
  const auto rank = static_cast<int64_t>(tensor_info.shape.size());
  AUTOTP_USER_CHECK(rank > 0, "{}: tensor '{}' is a scalar; it has no dim to slice", path_, name);
  AUTOTP_USER_CHECK(dim >= -rank && dim < rank, "{}: tensor '{}' of shape {}: slice dim {} is out of range",
                    path_, name, shape_text(tensor_info.shape), dim);
  if (dim < 0) dim += rank;
  const int64_t extent = tensor_info.shape[dim];
  AUTOTP_USER_CHECK(start >= 0 && length >= 0 && start <= extent && length <= extent - start,
                    "{}: tensor '{}' of shape {}: slice [{}, {}) along dim {} is out of range (size {})",
                    path_, name, shape_text(tensor_info.shape), start, start + length, dim, extent);

  // The tensor is `outer` blocks of `extent` rows of `inner` elements; take rows
  // [start, start + length) of every block.
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= tensor_info.shape[d];
  for (int64_t d = dim + 1; d < rank; ++d) inner *= tensor_info.shape[d];
  std::vector<int64_t> slice_shape = tensor_info.shape;
  slice_shape[dim] = length;
  torch::Tensor slice = torch::empty(slice_shape, torch::TensorOptions().dtype(tensor_info.dtype));

  const uint64_t row_bytes = static_cast<uint64_t>(inner) * element_size(tensor_info.dtype);
  const uint64_t chunk_bytes = static_cast<uint64_t>(length) * row_bytes;
  const uint64_t block_bytes = static_cast<uint64_t>(extent) * row_bytes;
  if (chunk_bytes > 0) {
    const uint8_t* source = data_ + tensor_info.begin + static_cast<uint64_t>(start) * row_bytes;
    auto* destination = static_cast<uint8_t*>(slice.data_ptr());
    for (int64_t block = 0; block < outer; ++block) {
      std::memcpy(destination + block * chunk_bytes, source + block * block_bytes, chunk_bytes);
    }
  }
  return dtype && *dtype != slice.scalar_type() ? slice.to(*dtype) : slice;
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<Entry> entries,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), entries_(std::move(entries)) {
  std::set<std::string> seen;
  OrderedJson header = OrderedJson::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& entry : entries_) {
    AUTOTP_USER_CHECK(seen.insert(entry.name).second, "{}: tensor name '{}' is given twice", path_, entry.name);
    AUTOTP_USER_CHECK(entry.name != "__metadata__", "{}: '__metadata__' is reserved, not a tensor name", path_);
    uint64_t bytes = element_size(entry.dtype);
    for (int64_t d : entry.shape) bytes *= static_cast<uint64_t>(d);
    header[entry.name] = {{"dtype", dtype_to_safetensors(entry.dtype)},
                          {"shape", entry.shape},
                          {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = header.dump();
  // Padding keeps the data section 8-byte aligned within the file (as the format recommends).
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  const uint64_t header_size = header_text.size();

  temporary_ = fmt::format("{}.tmp.{}", path_, ::getpid());
  fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  AUTOTP_USER_CHECK(fd_ >= 0, "{}: cannot create: {}", temporary_, std::strerror(errno));
  try {
    append(&header_size, 8);  // little-endian host assumed
    append(header_text.data(), header_text.size());
  } catch (...) {
    ::close(fd_);
    ::unlink(temporary_.c_str());
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temporary_.c_str());
}

void SafetensorsWriter::append(const void* data, size_t size) {
  write_all(fd_, data, size, temporary_);
  crc_ = crc32_update(crc_, data, size);
  bytes_ += size;
}

void SafetensorsWriter::write(const torch::Tensor& tensor) {
  TORCH_CHECK(next_ < entries_.size(), "SafetensorsWriter::write: ", path_, " has only ", entries_.size(),
              " tensors");
  const Entry& entry = entries_[next_++];
  TORCH_CHECK(tensor.sizes().vec() == entry.shape, "SafetensorsWriter::write: ", path_, ": tensor '", entry.name,
              "' has shape ", tensor.sizes(), ", the header says ", c10::IntArrayRef(entry.shape));
  torch::Tensor cpu = tensor.to(torch::kCPU, entry.dtype).contiguous();
  append(cpu.data_ptr(), cpu.numel() * cpu.element_size());
  if (hook_) hook_(bytes_);
}

uint32_t SafetensorsWriter::commit() {
  TORCH_CHECK(next_ == entries_.size(), "SafetensorsWriter::commit: ", path_, ": ", entries_.size() - next_,
              " tensors were not written");
  int closed = ::close(fd_);
  fd_ = -1;
  AUTOTP_USER_CHECK(closed == 0, "{}: close failed: {}", temporary_, std::strerror(errno));
  AUTOTP_USER_CHECK(::rename(temporary_.c_str(), path_.c_str()) == 0, "{}: cannot rename {} to it: {}", path_,
                    temporary_, std::strerror(errno));
  committed_ = true;
  return crc_;
}

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& [name, tensor] : tensors) entries.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  SafetensorsWriter writer(path, std::move(entries), metadata);
  for (const auto& entry : tensors) writer.write(entry.second);
  writer.commit();
}

void write_text_file_atomic(const std::string& path, const std::string& content) {
  write_file_atomic(path, [&](int fd, const std::string& temporary) {
    write_all(fd, content.data(), content.size(), temporary);
  });
}

uint64_t parse_byte_size(const std::string& text) {
  auto invalid = [&]() {
    throw_user_error(
        "invalid byte size '{}': expected a whole number with an optional unit B, KB, MB, GB, KiB, "
        "MiB or GiB (e.g. 2GB)",
        text);
  };
  size_t position = 0;
  while (position < text.size() && std::isspace(static_cast<unsigned char>(text[position]))) ++position;
  const size_t digits_begin = position;
  uint64_t number = 0;
  while (position < text.size() && std::isdigit(static_cast<unsigned char>(text[position]))) {
    if (__builtin_mul_overflow(number, 10, &number) ||
        __builtin_add_overflow(number, static_cast<uint64_t>(text[position] - '0'), &number)) {
      invalid();
    }
    ++position;
  }
  if (position == digits_begin) invalid();
  while (position < text.size() && std::isspace(static_cast<unsigned char>(text[position]))) ++position;
  size_t unit_end = text.size();
  while (unit_end > position && std::isspace(static_cast<unsigned char>(text[unit_end - 1]))) --unit_end;
  std::string unit = text.substr(position, unit_end - position);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::toupper(c); });

  static const std::map<std::string, uint64_t> kMultipliers = {
      {"", 1},
      {"B", 1},
      {"KB", 1000ull},
      {"MB", 1000ull * 1000},
      {"GB", 1000ull * 1000 * 1000},
      {"KIB", 1024ull},
      {"MIB", 1024ull * 1024},
      {"GIB", 1024ull * 1024 * 1024},
  };
  auto multiplier = kMultipliers.find(unit);
  if (multiplier == kMultipliers.end()) invalid();
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(number, multiplier->second, &bytes)) invalid();
  return bytes;
}

}  // namespace autotp::io
