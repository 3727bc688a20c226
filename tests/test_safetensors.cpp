// safetensors reader/writer and HF checkpoint directories: round trips of every
// dtype, slices, sharding, and one test per kind of malformed file.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "autotp/io/safetensors.h"
#include "autotp/base/error.h"

namespace autotp::io {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "autotp-test-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr) << std::strerror(errno);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }
  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  std::string dir_;
};

// Distinct values per element, so a misplaced chunk shows up.
torch::Tensor distinct_values(std::vector<int64_t> shape, torch::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t extent : shape) numel *= extent;
  torch::Tensor values = torch::arange(numel, torch::kFloat64).reshape(shape);
  if (dtype == torch::kBool) return values.remainder(3).eq(1);
  if (dtype == torch::kInt8) return values.remainder(251).sub(125).to(dtype);
  if (dtype == torch::kUInt8) return values.remainder(256).to(dtype);
  if (torch::isFloatingType(dtype)) return values.mul(0.37).sub(3.1).to(dtype);
  return values.mul(7).sub(50).to(dtype);
}

std::string read_file(const std::string& path) {
  std::ifstream stream(path, std::ios::binary);
  std::ostringstream content;
  content << stream.rdbuf();
  return content.str();
}

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream stream(path, std::ios::binary | std::ios::trunc);
  stream.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file with the given header text (unpadded) and `data_bytes` zero bytes of data.
std::string safetensors_bytes(const std::string& header, size_t data_bytes) {
  uint64_t header_size = header.size();
  std::string bytes(reinterpret_cast<const char*>(&header_size), 8);
  return bytes + header + std::string(data_bytes, '\0');
}

// The message of the UserError `action` throws ("" when it throws nothing).
template <typename Action>
std::string user_error_message(Action&& action) {
  try {
    action();
  } catch (const UserError& error) {
    return error.what();
  }
  return "";
}

// Expects a UserError whose message names the file and contains every phrase.
void expect_bad_file(const std::string& file, const std::vector<std::string>& phrases) {
  EXPECT_THROW(SafetensorsFile::open(file), UserError);
  const std::string message = user_error_message([&] { SafetensorsFile::open(file); });
  EXPECT_NE(message.find(file), std::string::npos) << message;
  for (const auto& phrase : phrases) EXPECT_NE(message.find(phrase), std::string::npos) << message;
}

const std::vector<torch::ScalarType> kAllDtypes = {
    torch::kFloat32, torch::kFloat16, torch::kBFloat16, torch::kFloat64, torch::kInt64,
    torch::kInt32,   torch::kInt16,   torch::kInt8,     torch::kUInt8,   torch::kBool};

TEST(SafetensorsDtype, NamesRoundTrip) {
  const std::vector<std::string> names = {"F32", "F16", "BF16", "F64", "I64",
                                          "I32", "I16", "I8",   "U8",  "BOOL"};
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(dtype_from_safetensors(names[i], "f"), kAllDtypes[i]) << names[i];
    EXPECT_EQ(dtype_to_safetensors(kAllDtypes[i]), names[i]);
  }
  EXPECT_THROW(dtype_from_safetensors("F8_E4M3", "f"), UserError);
  EXPECT_THROW(dtype_to_safetensors(torch::kComplexFloat), c10::Error);
}

TEST_F(SafetensorsTest, EveryDtypeRoundTripsBitExact) {
  NamedTensors tensors;
  for (auto dtype : kAllDtypes) {
    tensors.emplace_back(dtype_to_safetensors(dtype), distinct_values({3, 5}, dtype));
  }
  // Values whose bits matter: the extremes and specials of the 16-bit formats.
  tensors.emplace_back(
      "bf16_specials",
      torch::tensor({1e-40f, 3.0e38f, -0.0f, INFINITY, -INFINITY, 1.0f / 3}).to(torch::kBFloat16));
  tensors.emplace_back("f16_specials",
                       torch::tensor({6e-8f, 65504.0f, -0.0f, INFINITY, 1.0f / 3}).to(torch::kFloat16));
  const std::string file = path("all.safetensors");
  write_safetensors(file, tensors);

  auto reader = SafetensorsFile::open(file);
  ASSERT_EQ(reader->tensors().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, expected] = tensors[i];
    EXPECT_EQ(reader->tensors()[i].name, name) << "file order is the write order";
    torch::Tensor actual = reader->read(name);
    EXPECT_EQ(actual.scalar_type(), expected.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(actual, expected)) << name;
    // Bit-exact, also for -0.0 (which torch::equal does not tell from +0.0).
    EXPECT_EQ(std::memcmp(actual.data_ptr(), expected.data_ptr(), expected.numel() * expected.element_size()),
              0)
        << name;
  }
  EXPECT_TRUE(reader->metadata().empty());
}

TEST_F(SafetensorsTest, ReadReturnsOwnedMemoryThatOutlivesTheFile) {
  const std::string file = path("owned.safetensors");
  torch::Tensor expected = distinct_values({4, 4}, torch::kFloat32);
  write_safetensors(file, {{"w", expected}});
  torch::Tensor read;
  {
    auto reader = SafetensorsFile::open(file);
    read = reader->read("w");
  }
  fs::remove(file);
  read.add_(1);  // the copy is writable, not the read-only mapping
  EXPECT_TRUE(torch::equal(read, expected + 1));
}

TEST_F(SafetensorsTest, ScalarAndEmptyTensors) {
  const std::string file = path("odd_shapes.safetensors");
  NamedTensors tensors = {
      {"scalar", torch::tensor(2.5, torch::kFloat32).reshape({})},
      {"empty_rows", torch::empty({0, 4}, torch::kFloat16)},
      {"empty_1d", torch::empty({0}, torch::kInt64)},
      {"after", torch::tensor({int32_t(7), int32_t(8)})},
  };
  write_safetensors(file, tensors);
  auto reader = SafetensorsFile::open(file);

  torch::Tensor scalar = reader->read("scalar");
  EXPECT_EQ(scalar.dim(), 0);
  EXPECT_EQ(scalar.item<float>(), 2.5f);
  EXPECT_EQ(reader->info("scalar").shape, std::vector<int64_t>{});

  torch::Tensor empty_rows = reader->read("empty_rows");
  EXPECT_EQ(empty_rows.sizes(), torch::IntArrayRef({0, 4}));
  EXPECT_EQ(empty_rows.scalar_type(), torch::kFloat16);
  EXPECT_EQ(reader->info("empty_rows").begin, reader->info("empty_rows").end);
  EXPECT_EQ(reader->read("empty_1d").numel(), 0);
  EXPECT_TRUE(torch::equal(reader->read("after"), tensors[3].second));

  // Slices of empty tensors and empty slices.
  EXPECT_EQ(reader->read_slice("empty_rows", 1, 1, 2).sizes(), torch::IntArrayRef({0, 2}));
  EXPECT_EQ(reader->read_slice("after", 0, 2, 0).numel(), 0);
  EXPECT_THROW(reader->read_slice("scalar", 0, 0, 1), UserError);
}

TEST_F(SafetensorsTest, MetadataRoundTrips) {
  const std::string file = path("meta.safetensors");
  std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "quotes \" and \\ and ünïcode"}};
  write_safetensors(file, {{"x", torch::ones({2})}}, metadata);
  EXPECT_EQ(SafetensorsFile::open(file)->metadata(), metadata);

  // No "__metadata__" key at all when there is none.
  write_safetensors(file, {{"x", torch::ones({2})}});
  EXPECT_EQ(read_file(file).find("__metadata__"), std::string::npos);
}

TEST_F(SafetensorsTest, HeaderIsPaddedTo8BytesWithSpacesAndOffsetsAreConsecutive) {
  for (const std::string name : {"a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg", "abcdefgh"}) {
    const std::string file = path("pad.safetensors");
    write_safetensors(file, {{name, torch::ones({3}, torch::kInt8)}, {"b", torch::ones({2}, torch::kInt16)}});
    const std::string bytes = read_file(file);
    uint64_t header_size = 0;
    std::memcpy(&header_size, bytes.data(), 8);
    EXPECT_EQ(header_size % 8, 0u) << name;
    EXPECT_EQ(bytes.size(), 8 + header_size + 3 + 4) << name;
    const std::string header = bytes.substr(8, header_size);
    const size_t json_end = header.find_last_not_of(' ') + 1;
    EXPECT_EQ(header.substr(json_end), std::string(header_size - json_end, ' '));
    auto json = nlohmann::json::parse(header);
    EXPECT_EQ(json[name]["data_offsets"], nlohmann::json({0, 3}));
    EXPECT_EQ(json["b"]["data_offsets"], nlohmann::json({3, 7}));
    EXPECT_EQ(json["b"]["dtype"], "I16");
    EXPECT_EQ(json["b"]["shape"], nlohmann::json({2}));
  }
}

// The bytes the reference implementation (huggingface/safetensors, Python
// test_serialization) produces for {"test": int32 zeros [2, 2]}.
TEST_F(SafetensorsTest, WriterMatchesReferenceBytes) {
  const std::string file = path("reference.safetensors");
  write_safetensors(file, {{"test", torch::zeros({2, 2}, torch::kInt32)}});
  const std::string expected = std::string("@\0\0\0\0\0\0\0", 8) +
                               R"({"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}})" + "    " +
                               std::string(16, '\0');
  EXPECT_EQ(read_file(file), expected);
}

// A file as the reference implementation writes it with metadata (header
// length 'f' = 102, padded with spaces).
TEST_F(SafetensorsTest, ReadsReferenceFileWithMetadata) {
  const std::string file = path("reference_meta.safetensors");
  write_raw(
      file,
      std::string("f\0\0\0\0\0\0\0", 8) +
          R"({"__metadata__":{"framework":"pt"},"test1":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}})" +
          "       " + std::string(16, '\0'));
  auto reader = SafetensorsFile::open(file);
  EXPECT_EQ(reader->metadata(), (std::map<std::string, std::string>{{"framework", "pt"}}));
  EXPECT_TRUE(torch::equal(reader->read("test1"), torch::zeros({2, 2}, torch::kInt32)));
}

TEST_F(SafetensorsTest, NonContiguousInputsAreWrittenAsTheirValues) {
  const std::string file = path("views.safetensors");
  torch::Tensor base = distinct_values({4, 6}, torch::kFloat32);
  torch::Tensor transposed = base.t();
  torch::Tensor strided =
      base.index({torch::indexing::Slice(), torch::indexing::Slice(0, torch::indexing::None, 2)});
  write_safetensors(file, {{"t", transposed}, {"s", strided}});
  auto reader = SafetensorsFile::open(file);
  EXPECT_TRUE(torch::equal(reader->read("t"), transposed));
  EXPECT_TRUE(torch::equal(reader->read("s"), strided));
}

TEST_F(SafetensorsTest, SliceAlongEachDimEqualsNarrow) {
  const std::string file = path("slices.safetensors");
  torch::Tensor tensor = distinct_values({3, 5, 7}, torch::kBFloat16);
  write_safetensors(file, {{"pad", torch::ones({3}, torch::kInt8)}, {"w", tensor}});
  auto reader = SafetensorsFile::open(file);
  for (int64_t dim = 0; dim < 3; ++dim) {
    const int64_t extent = tensor.size(dim);
    for (int64_t start = 0; start <= extent; ++start) {
      for (int64_t length = 0; start + length <= extent; ++length) {
        torch::Tensor slice = reader->read_slice("w", dim, start, length);
        EXPECT_TRUE(slice.is_contiguous());
        EXPECT_TRUE(torch::equal(slice, tensor.narrow(dim, start, length)))
            << "dim " << dim << " start " << start << " length " << length;
      }
    }
  }
  // Negative dims count from the back, as in torch.
  EXPECT_TRUE(torch::equal(reader->read_slice("w", -1, 2, 3), tensor.narrow(2, 2, 3)));
}

TEST_F(SafetensorsTest, SliceOutOfRangeNamesTheTensor) {
  const std::string file = path("slices.safetensors");
  write_safetensors(file, {{"w", torch::zeros({4, 6})}});
  auto reader = SafetensorsFile::open(file);
  for (auto [dim, start, length] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {0, 3, 2}, {1, 0, 7}, {1, -1, 2}, {0, 0, -1}, {0, 5, 0}, {2, 0, 1}, {-3, 0, 1}}) {
    const std::string message = user_error_message([&] { reader->read_slice("w", dim, start, length); });
    EXPECT_NE(message.find("'w'"), std::string::npos)
        << dim << " " << start << " " << length << ": " << message;
    EXPECT_NE(message.find("out of range"), std::string::npos) << message;
    EXPECT_NE(message.find(file), std::string::npos) << message;
  }
  EXPECT_NO_THROW(reader->read_slice("w", 0, 4, 0));  // an empty slice at the end is fine
}

TEST_F(SafetensorsTest, ReadConvertsDtypeWhenAsked) {
  const std::string file = path("convert.safetensors");
  torch::Tensor bf16 = distinct_values({4, 3}, torch::kBFloat16);
  write_safetensors(file, {{"w", bf16}});
  auto reader = SafetensorsFile::open(file);

  torch::Tensor as_float = reader->read("w", torch::kFloat32);
  EXPECT_EQ(as_float.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(as_float, bf16.to(torch::kFloat32)));
  EXPECT_EQ(reader->read("w", torch::kBFloat16).scalar_type(), torch::kBFloat16);

  torch::Tensor slice = reader->read_slice("w", 1, 1, 2, torch::kFloat64);
  EXPECT_EQ(slice.scalar_type(), torch::kFloat64);
  EXPECT_TRUE(torch::equal(slice, bf16.narrow(1, 1, 2).to(torch::kFloat64)));
}

TEST_F(SafetensorsTest, InfoContainsAndMissingTensor) {
  const std::string file = path("info.safetensors");
  write_safetensors(file,
                    {{"a", torch::zeros({2, 3}, torch::kFloat16)}, {"b", torch::zeros({5}, torch::kInt64)}});
  auto reader = SafetensorsFile::open(file);
  EXPECT_TRUE(reader->contains("a"));
  EXPECT_FALSE(reader->contains("c"));
  const TensorInfo& b = reader->info("b");
  EXPECT_EQ(b.dtype, torch::kInt64);
  EXPECT_EQ(b.shape, std::vector<int64_t>{5});
  EXPECT_EQ(b.begin, 12u);
  EXPECT_EQ(b.end, 52u);
  EXPECT_EQ(reader->path(), file);
  const std::string message = user_error_message([&] { reader->read("c"); });
  EXPECT_NE(message.find("'c'"), std::string::npos) << message;
  EXPECT_NE(message.find(file), std::string::npos) << message;
}

TEST_F(SafetensorsTest, WriteLeavesNoTemporaryFileAndReplacesAtomically) {
  const std::string file = path("model.safetensors");
  write_safetensors(file, {{"x", torch::ones({8})}});
  write_safetensors(file, {{"y", torch::zeros({2})}});  // overwrite in place
  write_text_file_atomic(path("config.json"), "{}\n");
  std::vector<std::string> entries;
  for (const auto& entry : fs::directory_iterator(dir_)) entries.push_back(entry.path().filename().string());
  std::sort(entries.begin(), entries.end());
  EXPECT_EQ(entries, (std::vector<std::string>{"config.json", "model.safetensors"}));
  EXPECT_EQ(read_file(path("config.json")), "{}\n");
  auto reader = SafetensorsFile::open(file);
  EXPECT_FALSE(reader->contains("x"));
  EXPECT_TRUE(reader->contains("y"));
}

TEST_F(SafetensorsTest, WriteErrorsAreUserErrorsAndLeaveNothingBehind) {
  EXPECT_THROW(write_safetensors(path("dup.safetensors"), {{"x", torch::ones({1})}, {"x", torch::ones({1})}}),
               UserError);
  EXPECT_THROW(write_safetensors(path("no/such/dir/x.safetensors"), {{"x", torch::ones({1})}}), UserError);
  EXPECT_THROW(write_text_file_atomic(path("no/such/dir/x.json"), "{}"), UserError);
  EXPECT_TRUE(fs::is_empty(dir_));
}

// ---- malformed files ---------------------------------------------------------

TEST_F(SafetensorsTest, BadFileShorterThan8Bytes) {
  const std::string file = path("short.safetensors");
  write_raw(file, "abc");
  expect_bad_file(file, {"shorter than the 8-byte header length"});
  write_raw(file, "");
  expect_bad_file(file, {"shorter than the 8-byte header length"});
}

TEST_F(SafetensorsTest, BadFileMissingOrADirectory) {
  expect_bad_file(path("absent.safetensors"), {"cannot open"});
  fs::create_directories(path("dir.safetensors"));
  expect_bad_file(path("dir.safetensors"), {"not a regular file"});
}

TEST_F(SafetensorsTest, BadFileHeaderLengthPastEnd) {
  const std::string file = path("header.safetensors");
  std::string bytes = safetensors_bytes("{}", 0);
  bytes[0] = 100;  // claims 100 header bytes; the file has 2
  write_raw(file, bytes);
  expect_bad_file(file, {"header length 100", "past the end of the file"});
  uint64_t huge = ~uint64_t(0);
  std::memcpy(bytes.data(), &huge, 8);  // must not wrap around
  write_raw(file, bytes);
  expect_bad_file(file, {"past the end of the file"});
}

TEST_F(SafetensorsTest, BadFileHeaderNotJson) {
  const std::string file = path("json.safetensors");
  write_raw(file, safetensors_bytes("{\"x\": {\"dtype\": ", 16));
  expect_bad_file(file, {"not valid JSON"});
  write_raw(file, safetensors_bytes("[1, 2]", 0));
  expect_bad_file(file, {"not a JSON object"});
}

TEST_F(SafetensorsTest, BadFileEntryMissingKey) {
  const std::string file = path("keys.safetensors");
  write_raw(file, safetensors_bytes(R"({"x": {"shape": [2], "data_offsets": [0, 8]}})", 8));
  expect_bad_file(file, {"'x'", "no \"dtype\""});
  write_raw(file, safetensors_bytes(R"({"x": {"dtype": "F32", "data_offsets": [0, 8]}})", 8));
  expect_bad_file(file, {"'x'", "no \"shape\""});
  write_raw(file, safetensors_bytes(R"({"x": {"dtype": "F32", "shape": [2]}})", 8));
  expect_bad_file(file, {"'x'", "no \"data_offsets\""});
  write_raw(file, safetensors_bytes(R"({"x": 3})", 8));
  expect_bad_file(file, {"'x'", "not a JSON object"});
  write_raw(file, safetensors_bytes(R"({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8));
  expect_bad_file(file, {"'x'", "\"shape\""});
  write_raw(file, safetensors_bytes(R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", 8));
  expect_bad_file(file, {"'x'", "\"data_offsets\""});
  write_raw(file, safetensors_bytes(R"({"__metadata__": {"a": 1}})", 0));
  expect_bad_file(file, {"__metadata__", "not a string"});
}

TEST_F(SafetensorsTest, BadFileUnknownDtype) {
  const std::string file = path("dtype.safetensors");
  write_raw(file,
            safetensors_bytes(R"({"x": {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [0, 2]}})", 2));
  expect_bad_file(file, {"'x'", "unknown dtype 'F8_E5M2'"});
}

TEST_F(SafetensorsTest, BadFileOffsetsPastDataSection) {
  const std::string file = path("model.safetensors");
  write_raw(file,
            safetensors_bytes(R"({"x": {"dtype": "F32", "shape": [25], "data_offsets": [0, 100]}})", 64));
  expect_bad_file(
      file,
      {"tensor 'x' data_offsets [0, 100] end past the data section (64 bytes); the file may be truncated"});
}

TEST_F(SafetensorsTest, BadFileTruncatedAfterWrite) {
  const std::string file = path("truncated.safetensors");
  write_safetensors(file, {{"a", torch::ones({4})}, {"b", torch::ones({16})}});
  fs::resize_file(file, fs::file_size(file) - 1);
  expect_bad_file(file, {"'b'", "the file may be truncated"});
}

TEST_F(SafetensorsTest, BadFileBeginAfterEnd) {
  const std::string file = path("order.safetensors");
  write_raw(file, safetensors_bytes(R"({"x": {"dtype": "U8", "shape": [0], "data_offsets": [8, 4]}})", 8));
  expect_bad_file(file, {"'x'", "[8, 4]", "begin is past end"});
}

TEST_F(SafetensorsTest, BadFileOverlappingTensors) {
  const std::string file = path("overlap.safetensors");
  write_raw(file, safetensors_bytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                    12));
  expect_bad_file(file, {"'b'", "overlap", "'a'"});
  // Header order does not matter: the check is on data order.
  write_raw(file, safetensors_bytes(R"({"b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                                        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
                                    12));
  expect_bad_file(file, {"overlap"});
  // An empty tensor inside another shares no bytes; touching ranges do not overlap.
  write_raw(file, safetensors_bytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                        "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
                                        "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
                                    12));
  auto reader = SafetensorsFile::open(file);
  EXPECT_EQ(reader->tensors().size(), 3u);
  EXPECT_EQ(reader->tensors()[1].name, "e") << "file order is data order";
}

TEST_F(SafetensorsTest, BadFileByteSizeMismatch) {
  const std::string file = path("size.safetensors");
  write_raw(file,
            safetensors_bytes(R"({"x": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]}})", 8));
  expect_bad_file(file, {"'x'", "byte size 8", "[2, 3]", "12 bytes"});
  // A shape whose byte count overflows 64 bits must not wrap into a match.
  write_raw(file,
            safetensors_bytes(
                R"({"x": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}})", 0));
  expect_bad_file(file, {"'x'", "byte size"});
}

// ---- checkpoint directories ---------------------------------------------------

NamedTensors checkpoint_tensors() {
  return {
      {"model.embed_tokens.weight", distinct_values({10, 4}, torch::kFloat32)},  // 160 bytes
      {"model.layers.0.weight", distinct_values({8, 4}, torch::kBFloat16)},      // 64
      {"model.layers.1.weight", distinct_values({8, 4}, torch::kBFloat16)},      // 64
      {"model.norm.weight", distinct_values({4}, torch::kFloat32)},              // 16
      {"lm_head.weight", distinct_values({10, 4}, torch::kFloat32)},             // 160
  };
}

TEST_F(SafetensorsTest, CheckpointSingleFileRoundTrip) {
  NamedTensors tensors = checkpoint_tensors();
  for (uint64_t limit : {uint64_t(0), uint64_t(464), uint64_t(1) << 40}) {
    const std::string ckpt = path("single" + std::to_string(limit));
    auto written = write_checkpoint(ckpt, tensors, limit);
    EXPECT_EQ(written, std::vector<std::string>{(fs::path(ckpt) / "model.safetensors").string()});
    auto reader = CheckpointReader::open(ckpt);
    EXPECT_EQ(reader.names(), (std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight",
                                                        "model.layers.0.weight", "model.layers.1.weight",
                                                        "model.norm.weight"}));
    for (const auto& [name, tensor] : tensors) EXPECT_TRUE(torch::equal(reader.read(name), tensor)) << name;
  }
}

TEST_F(SafetensorsTest, CheckpointShardedRoundTripAndIndex) {
  NamedTensors tensors = checkpoint_tensors();
  const std::string ckpt = path("nested/sharded");  // created on demand
  // Greedy with a 230-byte limit: [embed 160 + layer0 64 = 224], [layer1 64 + norm 16 = 80], [lm_head 160].
  auto written = write_checkpoint(ckpt, tensors, 230);
  const auto in_dir = [&](const std::string& name) { return (fs::path(ckpt) / name).string(); };
  EXPECT_EQ(written,
            (std::vector<std::string>{
                in_dir("model-00001-of-00003.safetensors"), in_dir("model-00002-of-00003.safetensors"),
                in_dir("model-00003-of-00003.safetensors"), in_dir("model.safetensors.index.json")}));

  auto index = nlohmann::json::parse(read_file(in_dir("model.safetensors.index.json")));
  EXPECT_EQ(index["metadata"]["total_size"], 464);
  EXPECT_EQ(index["weight_map"],
            nlohmann::json({{"model.embed_tokens.weight", "model-00001-of-00003.safetensors"},
                            {"model.layers.0.weight", "model-00001-of-00003.safetensors"},
                            {"model.layers.1.weight", "model-00002-of-00003.safetensors"},
                            {"model.norm.weight", "model-00002-of-00003.safetensors"},
                            {"lm_head.weight", "model-00003-of-00003.safetensors"}}));
  EXPECT_FALSE(fs::exists(in_dir("model.safetensors")));

  auto reader = CheckpointReader::open(ckpt);
  EXPECT_EQ(reader.names().size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    EXPECT_TRUE(reader.contains(name));
    EXPECT_EQ(reader.info(name).dtype, tensor.scalar_type());
    EXPECT_TRUE(torch::equal(reader.read(name), tensor)) << name;
  }
  EXPECT_TRUE(torch::equal(reader.read_slice("lm_head.weight", 0, 3, 4), tensors[4].second.narrow(0, 3, 4)));
  EXPECT_TRUE(torch::equal(reader.read("model.layers.0.weight", torch::kFloat32),
                           tensors[1].second.to(torch::kFloat32)));
  EXPECT_FALSE(reader.contains("nope"));
  EXPECT_THROW(reader.read("nope"), UserError);
}

TEST_F(SafetensorsTest, CheckpointTensorLargerThanShardLimitGetsItsOwnShard) {
  NamedTensors tensors = checkpoint_tensors();
  const std::string ckpt = path("tiny_shards");
  auto written = write_checkpoint(ckpt, tensors, 100);
  // embed(160) | layer0+layer1 (128 > 100, so split) -> layer0 | layer1+norm (80) | lm_head(160)
  ASSERT_EQ(written.size(), 5u);
  EXPECT_EQ(fs::path(written[0]).filename(), "model-00001-of-00004.safetensors");
  auto index = nlohmann::json::parse(read_file(written.back()));
  EXPECT_EQ(index["weight_map"]["model.layers.1.weight"], "model-00003-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["model.norm.weight"], "model-00003-of-00004.safetensors");
  auto reader = CheckpointReader::open(ckpt);
  for (const auto& [name, tensor] : tensors) EXPECT_TRUE(torch::equal(reader.read(name), tensor)) << name;
}

TEST_F(SafetensorsTest, CheckpointSwitchingLayoutRemovesTheOtherEntryPoint) {
  NamedTensors tensors = checkpoint_tensors();
  const std::string ckpt = path("switch");
  write_checkpoint(ckpt, tensors, 0);
  write_checkpoint(ckpt, tensors, 230);
  EXPECT_FALSE(fs::exists(fs::path(ckpt) / "model.safetensors"));
  NamedTensors smaller = {{"only", torch::ones({2})}};
  write_checkpoint(ckpt, smaller, 0);
  EXPECT_FALSE(fs::exists(fs::path(ckpt) / "model.safetensors.index.json"));
  EXPECT_EQ(CheckpointReader::open(ckpt).names(), std::vector<std::string>{"only"});
}

TEST_F(SafetensorsTest, CheckpointDuplicateNamesAcrossShards) {
  NamedTensors tensors = {{"a", torch::ones({64})}, {"b", torch::ones({64})}, {"a", torch::ones({64})}};
  const std::string message = user_error_message([&] { write_checkpoint(path("dup"), tensors, 300); });
  EXPECT_NE(message.find("'a'"), std::string::npos) << message;
  EXPECT_NE(message.find("twice"), std::string::npos) << message;
}

TEST_F(SafetensorsTest, CheckpointOpenErrors) {
  const std::string empty_dir = path("empty");
  fs::create_directories(empty_dir);
  std::string message = user_error_message([&] { CheckpointReader::open(empty_dir); });
  EXPECT_EQ(message, empty_dir + ": no model.safetensors or model.safetensors.index.json");

  // The index names a shard file that is not there.
  const std::string ckpt = path("broken");
  write_checkpoint(ckpt, checkpoint_tensors(), 230);
  fs::remove(fs::path(ckpt) / "model-00002-of-00003.safetensors");
  message = user_error_message([&] { CheckpointReader::open(ckpt); });
  EXPECT_NE(message.find("model-00002-of-00003.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find("does not exist"), std::string::npos) << message;

  // The index maps a tensor to a shard that does not hold it.
  const std::string index_path = (fs::path(ckpt) / "model.safetensors.index.json").string();
  auto index = nlohmann::json::parse(read_file(index_path));
  index["weight_map"] = {{"lm_head.weight", "model-00001-of-00003.safetensors"}};
  write_raw(index_path, index.dump());
  message = user_error_message([&] { CheckpointReader::open(ckpt); });
  EXPECT_NE(message.find("'lm_head.weight'"), std::string::npos) << message;
  EXPECT_NE(message.find("model-00001-of-00003.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find("does not contain it"), std::string::npos) << message;

  // An index that is not JSON, or has no weight_map.
  write_raw(index_path, "{not json");
  message = user_error_message([&] { CheckpointReader::open(ckpt); });
  EXPECT_NE(message.find(index_path), std::string::npos) << message;
  write_raw(index_path, R"({"metadata": {}})");
  message = user_error_message([&] { CheckpointReader::open(ckpt); });
  EXPECT_NE(message.find("weight_map"), std::string::npos) << message;

  // A malformed shard reports the shard's own path.
  index["weight_map"] = {{"model.embed_tokens.weight", "model-00001-of-00003.safetensors"}};
  write_raw(index_path, index.dump());
  write_raw((fs::path(ckpt) / "model-00001-of-00003.safetensors").string(), "xy");
  message = user_error_message([&] { CheckpointReader::open(ckpt); });
  EXPECT_NE(message.find("model-00001-of-00003.safetensors"), std::string::npos) << message;
}

TEST(ParseByteSize, UnitsAndPlainNumbers) {
  EXPECT_EQ(parse_byte_size("1024"), 1024u);
  EXPECT_EQ(parse_byte_size("0"), 0u);
  EXPECT_EQ(parse_byte_size("7B"), 7u);
  EXPECT_EQ(parse_byte_size("3KB"), 3000u);
  EXPECT_EQ(parse_byte_size("500MB"), 500'000'000u);
  EXPECT_EQ(parse_byte_size("2GB"), 2'000'000'000u);
  EXPECT_EQ(parse_byte_size("3KiB"), 3u * 1024);
  EXPECT_EQ(parse_byte_size("5MiB"), 5u * 1024 * 1024);
  EXPECT_EQ(parse_byte_size("10GiB"), 10ull * 1024 * 1024 * 1024);
  EXPECT_EQ(parse_byte_size(" 2 gb "), 2'000'000'000u);  // case and spaces are forgiven
  EXPECT_EQ(parse_byte_size("18446744073709551615"), UINT64_MAX);
}

TEST(ParseByteSize, BadTextIsAUserError) {
  for (const std::string text :
       {"", "GB", "-1", "1.5GB", "12XB", "1 2", "0x10", "18446744073709551616", "20000000000GB", "5 G B"}) {
    const std::string message = user_error_message([&] { parse_byte_size(text); });
    EXPECT_NE(message.find("invalid byte size '" + text + "'"), std::string::npos)
        << "'" << text << "': " << message;
  }
}

}  // namespace
}  // namespace autotp::io
