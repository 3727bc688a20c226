#include "autotp/data/dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "autotp/data/sft_examples.h"
#include "autotp/data/token_sequences.h"
#include "autotp/base/error.h"

// .bin files are little-endian and read in place through mmap.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "autotp's .bin token reader assumes a little-endian host"
#endif

namespace autotp {

Dataset::~Dataset() = default;

namespace {

std::string extension_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  const auto dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return "";
  return path.substr(dot);
}

// ---------------------------------------------------------------- token streams

// The flat token sequence a packed dataset cuts into examples.
class TokenStream {
 public:
  virtual ~TokenStream() = default;
  virtual int64_t size() const = 0;
  virtual void copy(int64_t begin, int64_t count, int64_t* out) const = 0;
};

// Tokens produced by the byte-level tokenizer (small files: held in memory).
class InMemoryTokens : public TokenStream {
 public:
  explicit InMemoryTokens(std::vector<uint32_t> tokens) : tokens_(std::move(tokens)) {}
  int64_t size() const override { return static_cast<int64_t>(tokens_.size()); }
  void copy(int64_t begin, int64_t count, int64_t* out) const override {
    std::copy(tokens_.begin() + begin, tokens_.begin() + begin + count, out);
  }

 private:
  std::vector<uint32_t> tokens_;
};

// A read-only memory mapping of a whole file, unmapped on destruction.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    AUTOTP_USER_CHECK(fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
    struct stat status {};
    const bool stat_ok = ::fstat(fd, &status) == 0;
    const int stat_errno = errno;
    if (!stat_ok || !S_ISREG(status.st_mode)) {
      ::close(fd);
      AUTOTP_USER_CHECK(stat_ok, "{}: cannot stat: {}", path, std::strerror(stat_errno));
      throw_user_error("{}: not a regular file", path);
    }
    size_ = static_cast<size_t>(status.st_size);
    if (size_ > 0) {
      void* mapping = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      const int map_errno = errno;
      ::close(fd);  // the mapping keeps the file alive
      AUTOTP_USER_CHECK(mapping != MAP_FAILED, "{}: cannot mmap: {}", path, std::strerror(map_errno));
      data_ = static_cast<const uint8_t*>(mapping);
    } else {
      ::close(fd);
    }
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// A .bin file read in place: several ranks on one host share the page cache
// instead of each holding a private copy of a possibly large corpus.
template <typename T>
class MappedTokens : public TokenStream {
 public:
  explicit MappedTokens(std::unique_ptr<MappedFile> file)
      : file_(std::move(file)), tokens_(reinterpret_cast<const T*>(file_->data())) {}
  int64_t size() const override { return static_cast<int64_t>(file_->size() / sizeof(T)); }
  void copy(int64_t begin, int64_t count, int64_t* out) const override {
    std::copy(tokens_ + begin, tokens_ + begin + count, out);
  }

 private:
  std::unique_ptr<MappedFile> file_;
  const T* tokens_;  // page-aligned, so aligned for T
};

// ---------------------------------------------------------------- tokenizers

// The tokenizer of the text formats: the options' (a model's own), else the
// byte-level one with the options' ids. Checks that its ids fit the model.
std::shared_ptr<const tok::TextTokenizer> text_tokenizer(const std::string& path, const DataOptions& options) {
  if (!options.tokenizer) {
    for (const auto& [name, id] : {std::pair<const char*, int64_t>{"bos_id", options.bos_id},
                                   {"eos_id", options.eos_id},
                                   {"pad_id", options.pad_id}}) {
      AUTOTP_USER_CHECK(id >= 0, "{}: {} is {}; token ids cannot be negative", path, name, id);
    }
    const int64_t needed = std::max({int64_t{256}, options.bos_id + 1, options.eos_id + 1, options.pad_id + 1});
    AUTOTP_USER_CHECK(options.vocab_size >= needed,
                      "{}: byte-level text needs vocab_size >= {} (256 byte ids, BOS {}, EOS {}, pad {}), but "
                      "vocab_size is {}",
                      path, needed, options.bos_id, options.eos_id, options.pad_id, options.vocab_size);
    return tok::byte_level_tokenizer(options.bos_id, options.eos_id, options.pad_id);
  }
  AUTOTP_USER_CHECK(options.tokenizer->vocab_size() <= options.vocab_size,
                    "{}: the tokenizer {} has {} ids, more than the model's vocab_size {} (config.json): they do "
                    "not belong to this model",
                    path, options.tokenizer->describe(), options.tokenizer->vocab_size(), options.vocab_size);
  return options.tokenizer;
}

// The options with the tokenizer's padding id.
DataOptions with_padding(DataOptions options, const tok::TextTokenizer& tokenizer) {
  if (tokenizer.pad_id) options.pad_id = *tokenizer.pad_id;
  return options;
}

void append_ids(const std::vector<int64_t>& ids, std::vector<uint32_t>& out) {
  for (int64_t id : ids) out.push_back(static_cast<uint32_t>(id));
}

// [BOS] + the text's ids + EOS: BOS where the tokenizer adds it (add_bos_token),
// EOS always when it has one (packed documents need a boundary).
void append_document(std::string_view text, const tok::TextTokenizer& tokenizer, std::vector<uint32_t>& out) {
  if (tokenizer.add_bos) out.push_back(static_cast<uint32_t>(*tokenizer.bos_id));
  std::vector<int64_t> ids;
  tokenizer.encode(text, ids);
  append_ids(ids, out);
  if (tokenizer.eos_id) out.push_back(static_cast<uint32_t>(*tokenizer.eos_id));
}

std::string with_time(const std::string& what, size_t bytes, double seconds) {
  return fmt::format("{} ({:.1f} MB tokenized in {:.2f} s)", what, static_cast<double>(bytes) / 1e6, seconds);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int64_t required_seq_len(const std::string& path, const DataOptions& options, const char* format) {
  AUTOTP_USER_CHECK(options.seq_len > 0,
                    "{}: {} data needs a positive seq_len (tokens per example), but seq_len is {}", path,
                    format, options.seq_len);
  return options.seq_len;
}

// ---------------------------------------------------------------- packed datasets

// A token stream cut into consecutive chunks of seq_len + 1 tokens; chunk k
// gives input chunk[:-1] and labels chunk[1:]. The last partial chunk is padded
// (pad inputs, ignored labels); one of a single token has no target and is dropped.
class PackedDataset : public Dataset {
 public:
  PackedDataset(std::string path, std::string what, std::unique_ptr<TokenStream> tokens,
                const DataOptions& options)
      : path_(std::move(path)),
        what_(std::move(what)),
        tokens_(std::move(tokens)),
        seq_len_(options.seq_len),
        pad_id_(options.pad_id) {
    const int64_t total = tokens_->size();
    const int64_t chunk = seq_len_ + 1;
    AUTOTP_USER_CHECK(total >= 2, "{}: {} holds {} token(s); one example needs at least 2", path_, what_,
                      total);
    tail_ = total % chunk;
    size_ = total / chunk + (tail_ >= 2 ? 1 : 0);
    // Only a padded example ever feeds pad_id to the model.
    AUTOTP_USER_CHECK(tail_ < 2 || (pad_id_ >= 0 && pad_id_ < options.vocab_size),
                      "{}: the last example needs padding, but pad_id {} is outside the vocabulary [0, {})",
                      path_, pad_id_, options.vocab_size);
  }

  int64_t size() const override { return size_; }
  int64_t seq_len() const override { return seq_len_; }

  Example get(int64_t index) const override {
    TORCH_CHECK(index >= 0 && index < size_, "PackedDataset::get: index ", index, " outside [0, ", size_,
                ") for ", path_);
    const int64_t chunk = seq_len_ + 1;
    const int64_t begin = index * chunk;
    const int64_t count = std::min(chunk, tokens_->size() - begin);
    std::vector<int64_t> window(static_cast<size_t>(chunk), pad_id_);
    tokens_->copy(begin, count, window.data());
    Example example;
    example.input_ids.assign(window.begin(), window.end() - 1);
    example.labels.assign(window.begin() + 1, window.end());
    for (int64_t t = count - 1; t < seq_len_; ++t) example.labels[static_cast<size_t>(t)] = kIgnoreLabel;
    return example;
  }

  std::string describe() const override {
    return fmt::format("{}: {}, {} tokens packed into {} examples of {} tokens{}", path_, what_,
                       tokens_->size(), size_, seq_len_,
                       tail_ >= 2 ? fmt::format(" (the last padded after {} tokens)", tail_ - 1) : "");
  }

 private:
  std::string path_;
  std::string what_;
  std::unique_ptr<TokenStream> tokens_;
  int64_t seq_len_;
  int64_t pad_id_;
  int64_t tail_ = 0;  // tokens in the last, partial chunk (0 if none)
  int64_t size_ = 0;
};

std::unique_ptr<Dataset> open_text(const std::string& path, const DataOptions& options) {
  required_seq_len(path, options, "text (.txt)");
  const auto tokenizer = text_tokenizer(path, options);
  TokenizedText text = tokenize_documents(path, options);
  return std::make_unique<PackedDataset>(path, with_time(text.what, text.bytes, text.seconds),
                                         std::make_unique<InMemoryTokens>(std::move(text.tokens)),
                                         with_padding(options, *tokenizer));
}

std::unique_ptr<Dataset> open_bin(const std::string& path, const DataOptions& options) {
  required_seq_len(path, options, "token (.bin)");
  AUTOTP_USER_CHECK(options.bin_dtype == "uint16" || options.bin_dtype == "uint32",
                    "{}: bin_dtype must be uint16 or uint32, got '{}'", path, options.bin_dtype);
  const size_t width = options.bin_dtype == "uint16" ? 2 : 4;
  auto file = std::make_unique<MappedFile>(path);
  AUTOTP_USER_CHECK(file->size() > 0, "{}: the file is empty; there is nothing to train on", path);
  AUTOTP_USER_CHECK(
      file->size() % width == 0,
      "{}: {} bytes is not a whole number of {}-byte {} tokens (wrong bin_dtype or truncated file)", path,
      file->size(), width, options.bin_dtype);
  auto check_ids = [&](auto* tokens) {
    const size_t count = file->size() / width;
    for (size_t i = 0; i < count; ++i) {
      AUTOTP_USER_CHECK(static_cast<int64_t>(tokens[i]) < options.vocab_size,
                        "{}: token {} is {}, outside the vocabulary [0, {}) (wrong bin_dtype or vocab?)",
                        path, i, tokens[i], options.vocab_size);
    }
  };
  std::unique_ptr<TokenStream> tokens;
  if (width == 2) {
    check_ids(reinterpret_cast<const uint16_t*>(file->data()));
    tokens = std::make_unique<MappedTokens<uint16_t>>(std::move(file));
  } else {
    check_ids(reinterpret_cast<const uint32_t*>(file->data()));
    tokens = std::make_unique<MappedTokens<uint32_t>>(std::move(file));
  }
  return std::make_unique<PackedDataset>(path, options.bin_dtype + " token stream", std::move(tokens),
                                         options);
}

// ---------------------------------------------------------------- .json token arrays

// One example per array, never packed or cut: s[:-1] predicts s[1:].
class TokenArraysDataset : public Dataset {
 public:
  TokenArraysDataset(std::string path, torch::Tensor sequences)
      : path_(std::move(path)), sequences_(std::move(sequences)) {}

  int64_t size() const override { return sequences_.size(0); }
  int64_t seq_len() const override { return sequences_.size(1) - 1; }

  Example get(int64_t index) const override {
    TORCH_CHECK(index >= 0 && index < size(), "TokenArraysDataset::get: index ", index, " outside [0, ",
                size(), ") for ", path_);
    const int64_t* row = sequences_.data_ptr<int64_t>() + index * sequences_.size(1);
    Example example;
    example.input_ids.assign(row, row + seq_len());
    example.labels.assign(row + 1, row + seq_len() + 1);
    return example;
  }

  std::string describe() const override {
    return fmt::format("{}: {} token arrays, {} examples of {} tokens", path_, size(), size(), seq_len());
  }

 private:
  std::string path_;
  torch::Tensor sequences_;  // int64 [examples, seq_len + 1], contiguous
};

std::unique_ptr<Dataset> open_token_arrays(const std::string& path, const DataOptions& options) {
  torch::Tensor sequences = read_token_sequences(path, options.vocab_size).contiguous();
  const int64_t length = sequences.size(1);
  AUTOTP_USER_CHECK(options.seq_len == 0 || options.seq_len == length - 1,
                    "{}: the token arrays hold {} tokens each, i.e. seq_len {}, but seq_len {} was requested "
                    "(.json arrays are never cut or padded; use seq_len 0 to take it from the file)",
                    path, length, length - 1, options.seq_len);
  return std::make_unique<TokenArraysDataset>(path, std::move(sequences));
}

// ---------------------------------------------------------------- records (.jsonl, .json arrays)

// Supervised fine-tuning examples: one per record, not packed. Only the learned
// tokens (an instruction's output and EOS, a chat's assistant turns) are targets.
class SftDataset : public Dataset {
 public:
  SftDataset(std::string path, std::string kind, std::vector<SftExample> examples, const DataOptions& options,
             int64_t record_count, int64_t truncated, int64_t skipped)
      : path_(std::move(path)),
        kind_(std::move(kind)),
        examples_(std::move(examples)),
        seq_len_(options.seq_len),
        pad_id_(options.pad_id),
        record_count_(record_count),
        truncated_(truncated),
        skipped_(skipped) {}

  int64_t size() const override { return static_cast<int64_t>(examples_.size()); }
  int64_t seq_len() const override { return seq_len_; }

  Example get(int64_t index) const override {
    TORCH_CHECK(index >= 0 && index < size(), "SftDataset::get: index ", index, " outside [0, ", size(), ") for ",
                path_);
    const SftExample& record = examples_[static_cast<size_t>(index)];
    const auto count = static_cast<int64_t>(record.tokens.size());
    Example example;
    example.input_ids.assign(static_cast<size_t>(seq_len_), pad_id_);
    example.labels.assign(static_cast<size_t>(seq_len_), kIgnoreLabel);
    for (int64_t t = 0; t < seq_len_ && t < count; ++t) {
      example.input_ids[static_cast<size_t>(t)] = record.tokens[static_cast<size_t>(t)];
      // labels[t] is token t + 1: kept where that token is learned.
      if (t + 1 < count && record.learned[static_cast<size_t>(t + 1)])
        example.labels[static_cast<size_t>(t)] = record.tokens[static_cast<size_t>(t + 1)];
    }
    return example;
  }

  std::string describe() const override {
    return fmt::format(
        "{}: {} {} records, {} examples of {} tokens ({} of them truncated; {} records skipped: no learned token "
        "left after truncation)",
        path_, record_count_, kind_, size(), seq_len_, truncated_, skipped_);
  }

 private:
  std::string path_, kind_;
  std::vector<SftExample> examples_;
  int64_t seq_len_;
  int64_t pad_id_;
  int64_t record_count_;
  int64_t truncated_;
  int64_t skipped_;
};

// What a records file holds: packed text, or SFT examples of one kind.
struct RecordsContent {
  RecordKind kind = RecordKind::kText;
  std::vector<uint32_t> text_tokens;
  std::vector<SftExample> examples;
  int64_t record_count = 0, truncated = 0, skipped = 0;
};

// Reads records one by one (a .jsonl line, or an element of a .json array); `where`
// names the record in messages ("line 3", "record 3").
class RecordReader {
 public:
  // `stream_only`: text records only (a token file has no place for a learned mask).
  RecordReader(const std::string& path, const DataOptions& options,
               std::shared_ptr<const tok::TextTokenizer> tokenizer, bool stream_only)
      : path_(path),
        tokenizer_(tokenizer),
        encoder_(std::move(tokenizer), options.sft),
        max_tokens_(static_cast<size_t>(options.seq_len + 1)),
        stream_only_(stream_only) {}

  void add(const nlohmann::json& record, const std::string& where) {
    try {
      add_record(record, where);
    } catch (const UserError& e) {
      if (std::string(e.what()).rfind(path_, 0) == 0) throw;  // names the file already
      throw_user_error("{}: {}: {}", path_, where, e.what());
    }
  }
  RecordsContent finish() {
    AUTOTP_USER_CHECK(c_.record_count > 0, "{}: the file holds no records; there is nothing to train on", path_);
    return std::move(c_);
  }

 private:
  void add_record(const nlohmann::json& record, const std::string& where) {
    const RecordKind kind = record_kind(record);
    if (first_.empty()) {
      c_.kind = kind;
      first_ = where;
    }
    AUTOTP_USER_CHECK(kind == c_.kind, "{} record, but {} is a {} record; a file holds one kind of record",
                      record_kind_name(kind), first_, record_kind_name(c_.kind));
    AUTOTP_USER_CHECK(!stream_only_ || kind == RecordKind::kText,
                      "{} records keep their learned tokens only when trained from the records file itself; a token "
                      "file holds text records (\"text\") only",
                      record_kind_name(kind));
    ++c_.record_count;
    if (kind == RecordKind::kText) {
      const auto text = record.find("text");
      AUTOTP_USER_CHECK(text->is_string(), "\"text\" must be a string, got {}", text->type_name());
      append_document(text->get<std::string>(), *tokenizer_, c_.text_tokens);
      return;
    }
    SftExample example = kind == RecordKind::kInstruction ? encoder_.instruction(record) : encoder_.chat(record);
    const bool cut = example.tokens.size() > max_tokens_;
    if (cut) {
      example.tokens.resize(max_tokens_);
      example.learned.resize(max_tokens_);
    }
    // Nothing left to learn (a prompt that fills the window, a chat without assistant turns).
    if (example.learned.size() < 2 ||
        std::find(example.learned.begin() + 1, example.learned.end(), 1) == example.learned.end()) {
      ++c_.skipped;
      return;
    }
    c_.truncated += cut ? 1 : 0;
    c_.examples.push_back(std::move(example));
  }

  std::string path_;
  std::shared_ptr<const tok::TextTokenizer> tokenizer_;
  SftEncoder encoder_;
  size_t max_tokens_;
  bool stream_only_;
  std::string first_;  // where the first record is
  RecordsContent c_;
};

nlohmann::json parse_record_json(const std::string& text, const std::string& path, const std::string& where) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw_user_error("{}: {}invalid JSON at byte {}{}", path, where.empty() ? "" : where + ": ", e.byte,
                     where.empty() ? "" : " of the line");
  } catch (const nlohmann::json::exception& e) {  // e.g. out_of_range: a number too large for a double
    throw_user_error("{}: {}invalid JSON ({})", path, where.empty() ? "" : where + ": ", e.what());
  }
}

RecordsContent read_jsonl(const std::string& path, const DataOptions& options,
                          std::shared_ptr<const tok::TextTokenizer> tokenizer, bool stream_only,
                          const TokenizeProgress& progress) {
  std::ifstream in(path, std::ios::binary);
  AUTOTP_USER_CHECK(in.good(), "{}: cannot open: {}", path, std::strerror(errno));
  in.seekg(0, std::ios::end);
  const auto total = static_cast<size_t>(std::max<std::streamoff>(in.tellg(), 0));
  in.seekg(0);
  RecordReader reader(path, options, std::move(tokenizer), stream_only);
  size_t done = 0;
  std::string line;
  for (int64_t line_number = 1; std::getline(in, line); ++line_number) {
    done += line.size() + 1;
    if (progress) progress(std::min(done, total), total);
    // Blank lines (a trailing newline, spacing between records) are not records.
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("line {}", line_number);
    reader.add(parse_record_json(line, path, where), where);
  }
  AUTOTP_USER_CHECK(in.eof(), "{}: read error: {}", path, std::strerror(errno));
  return reader.finish();
}

std::unique_ptr<Dataset> records_dataset(const std::string& path, const DataOptions& options, RecordsContent c,
                                         const tok::TextTokenizer& tokenizer,
                                         std::chrono::steady_clock::time_point start) {
  const DataOptions padded = with_padding(options, tokenizer);
  const auto bytes = static_cast<size_t>(std::filesystem::file_size(path));
  if (c.kind == RecordKind::kText) {
    return std::make_unique<PackedDataset>(
        path,
        with_time(fmt::format("{} text records via {}", c.record_count, tokenizer.describe()), bytes,
                  seconds_since(start)),
        std::make_unique<InMemoryTokens>(std::move(c.text_tokens)), padded);
  }
  AUTOTP_USER_CHECK(!c.examples.empty(),
                    "{}: none of the {} {} records has a learned token within seq_len {} (prompts that fill the "
                    "window, or chats without assistant turns); raise seq_len",
                    path, c.record_count, record_kind_name(c.kind), options.seq_len);
  return std::make_unique<SftDataset>(path, record_kind_name(c.kind), std::move(c.examples), padded, c.record_count,
                                      c.truncated, c.skipped);
}

std::unique_ptr<Dataset> open_jsonl(const std::string& path, const DataOptions& options) {
  required_seq_len(path, options, "JSON lines (.jsonl)");
  const auto tokenizer = text_tokenizer(path, options);
  const auto start = std::chrono::steady_clock::now();
  RecordsContent c = read_jsonl(path, options, tokenizer, false, {});
  return records_dataset(path, options, std::move(c), *tokenizer, start);
}

// A .json file: an array of records (objects), or token-id arrays.
bool holds_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char ch = 0;
  int brackets = 0;
  while (in.get(ch)) {
    if (std::isspace(static_cast<unsigned char>(ch))) continue;
    if (ch == '[' && brackets == 0) {
      ++brackets;
      continue;
    }
    return brackets == 1 && ch == '{';
  }
  return false;
}

std::unique_ptr<Dataset> open_json_records(const std::string& path, const DataOptions& options) {
  required_seq_len(path, options, "JSON records (.json array of objects)");
  const auto tokenizer = text_tokenizer(path, options);
  const auto start = std::chrono::steady_clock::now();
  std::ifstream in(path, std::ios::binary);
  AUTOTP_USER_CHECK(in.good(), "{}: cannot open: {}", path, std::strerror(errno));
  std::ostringstream content;
  content << in.rdbuf();
  const nlohmann::json records = parse_record_json(content.str(), path, "");
  AUTOTP_USER_CHECK(records.is_array(), "{}: expected a JSON array of records", path);
  RecordReader reader(path, options, tokenizer, false);
  for (size_t i = 0; i < records.size(); ++i) {
    AUTOTP_USER_CHECK(records[i].is_object(),
                      "{}: record {}: expected an object, got {}; an array holds records (objects) or token-id "
                      "arrays, not both",
                      path, i, records[i].type_name());
    reader.add(records[i], fmt::format("record {}", i));
  }
  return records_dataset(path, options, reader.finish(), *tokenizer, start);
}

}  // namespace

TokenizedText tokenize_documents(const std::string& path, const DataOptions& options,
                                 const TokenizeProgress& progress) {
  const std::string extension = extension_of(path);
  AUTOTP_USER_CHECK(extension == ".txt" || extension == ".jsonl",
                    "{}: only text is tokenized (.txt, or .jsonl of text records), not '{}'", path, extension);
  const auto tokenizer = text_tokenizer(path, options);
  const auto start = std::chrono::steady_clock::now();
  TokenizedText out;
  if (extension == ".jsonl") {
    RecordsContent c = read_jsonl(path, options, tokenizer, true, progress);
    out.tokens = std::move(c.text_tokens);
    out.what = fmt::format("{} text records", c.record_count);
  } else {
    std::ifstream in(path, std::ios::binary);
    AUTOTP_USER_CHECK(in.good(), "{}: cannot open: {}", path, std::strerror(errno));
    std::ostringstream content;
    content << in.rdbuf();
    const std::string text = content.str();
    AUTOTP_USER_CHECK(!text.empty(), "{}: the file is empty; there is nothing to train on", path);
    out.tokens.reserve(text.size() / 3 + 2);
    try {
      append_document(text, *tokenizer, out.tokens);  // the whole file is one document
    } catch (const UserError& e) {
      throw_user_error("{}: {}", path, e.what());
    }
    if (progress) progress(text.size(), text.size());
    out.what = "text";
  }
  out.bytes = static_cast<size_t>(std::filesystem::file_size(path));
  out.seconds = seconds_since(start);
  out.what = fmt::format("{} via {}", out.what, tokenizer->describe());
  return out;
}

bool holds_text(const std::string& path) {
  const std::string extension = extension_of(path);
  return extension == ".txt" || extension == ".jsonl" || (extension == ".json" && holds_records(path));
}

std::unique_ptr<Dataset> open_dataset(const std::string& path, const DataOptions& options) {
  AUTOTP_USER_CHECK(options.vocab_size > 0, "{}: vocab_size must be positive, got {}", path,
                    options.vocab_size);
  AUTOTP_USER_CHECK(options.seq_len >= 0, "{}: seq_len must not be negative, got {}", path, options.seq_len);
  const std::string extension = extension_of(path);
  if (extension == ".txt") return open_text(path, options);
  if (extension == ".jsonl") return open_jsonl(path, options);
  if (extension == ".json") return holds_records(path) ? open_json_records(path, options) : open_token_arrays(path, options);
  if (extension == ".bin") return open_bin(path, options);
  throw_user_error("{}: unknown data format '{}'; expected .txt, .jsonl, .json or .bin", path, extension);
}

}  // namespace autotp
