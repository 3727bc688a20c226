#include "autotp/tokenizer/sentencepiece_model.h"

#include "autotp/base/error.h"

#ifdef AUTOTP_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>

#include <exception>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <system_error>

namespace autotp::tok {

struct SentencePieceModel::Impl {
  sentencepiece::SentencePieceProcessor sp;
};

namespace {

std::optional<int64_t> id_or_none(int id) {
  if (id < 0) return std::nullopt;
  return id;
}

}  // namespace

bool SentencePieceModel::available() { return true; }

SentencePieceModel::SentencePieceModel(const std::string& path) : impl_(std::make_unique<Impl>()) {
  // Checked here: sentencepiece 0.1.97 reports a directory by letting std::ios_base::failure
  // escape Load(), and an unreadable file only as a status string.
  std::error_code ec;
  AUTOTP_USER_CHECK(std::filesystem::exists(path, ec), "{}: no such SentencePiece model file", path);
  AUTOTP_USER_CHECK(std::filesystem::is_regular_file(path, ec), "{}: not a file (expected a SentencePiece model)",
                    path);
  AUTOTP_USER_CHECK(std::ifstream(path, std::ios::binary).good(), "{}: cannot read the SentencePiece model file",
                    path);
  AUTOTP_USER_CHECK(std::filesystem::file_size(path, ec) != 0, "{}: empty file, not a SentencePiece model", path);
  sentencepiece::util::Status status;
  try {
    status = impl_->sp.Load(path);
  } catch (const std::exception& e) {
    throw_user_error("{}: cannot read the SentencePiece model file: {}", path, e.what());
  }
  // A file that is no model protobuf says "[model_proto->ParseFromArray(...)]"; an empty
  // one parses as an empty proto and says "unk is not defined".
  AUTOTP_USER_CHECK(status.ok(), "{}: not a SentencePiece model ({})", path, status.ToString());
}

SentencePieceModel::~SentencePieceModel() = default;
SentencePieceModel::SentencePieceModel(SentencePieceModel&&) noexcept = default;
SentencePieceModel& SentencePieceModel::operator=(SentencePieceModel&&) noexcept = default;

void SentencePieceModel::encode(std::string_view text, std::vector<int64_t>& ids) const {
  std::vector<int> out;
  const sentencepiece::util::Status status = impl_->sp.Encode(text, &out);
  // Only fails on a model that did not load, which the constructor rules out.
  if (!status.ok()) throw std::runtime_error("sentencepiece Encode failed: " + status.ToString());
  ids.insert(ids.end(), out.begin(), out.end());
}

int64_t SentencePieceModel::vocab_size() const { return impl_->sp.GetPieceSize(); }

std::optional<int64_t> SentencePieceModel::piece_id(const std::string& piece) const {
  // PieceToId maps an unknown piece to unk's id: a hit must spell the piece back.
  const int id = impl_->sp.PieceToId(piece);
  if (id < 0 || id >= impl_->sp.GetPieceSize() || impl_->sp.IdToPiece(id) != piece) return std::nullopt;
  return id;
}

std::optional<int64_t> SentencePieceModel::bos_id() const { return id_or_none(impl_->sp.bos_id()); }
std::optional<int64_t> SentencePieceModel::eos_id() const { return id_or_none(impl_->sp.eos_id()); }
std::optional<int64_t> SentencePieceModel::pad_id() const { return id_or_none(impl_->sp.pad_id()); }
std::optional<int64_t> SentencePieceModel::unk_id() const { return id_or_none(impl_->sp.unk_id()); }

}  // namespace autotp::tok

#else  // no libsentencepiece: the type exists, loading a model says what to install

namespace autotp::tok {

struct SentencePieceModel::Impl {};

bool SentencePieceModel::available() { return false; }

SentencePieceModel::SentencePieceModel(const std::string& path) {
  throw_user_error("{}: reading a SentencePiece model needs libsentencepiece; install libsentencepiece-dev "
                   "(tools/install-deps) and rebuild",
                   path);
}

SentencePieceModel::~SentencePieceModel() = default;
SentencePieceModel::SentencePieceModel(SentencePieceModel&&) noexcept = default;
SentencePieceModel& SentencePieceModel::operator=(SentencePieceModel&&) noexcept = default;

// Unreachable: no instance can be constructed.
void SentencePieceModel::encode(std::string_view, std::vector<int64_t>&) const {}
int64_t SentencePieceModel::vocab_size() const { return 0; }
std::optional<int64_t> SentencePieceModel::piece_id(const std::string&) const { return std::nullopt; }
std::optional<int64_t> SentencePieceModel::bos_id() const { return std::nullopt; }
std::optional<int64_t> SentencePieceModel::eos_id() const { return std::nullopt; }
std::optional<int64_t> SentencePieceModel::pad_id() const { return std::nullopt; }
std::optional<int64_t> SentencePieceModel::unk_id() const { return std::nullopt; }

}  // namespace autotp::tok

#endif
