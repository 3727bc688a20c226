// A SentencePiece model file (`tokenizer.model`, as HF model directories without a
// tokenizer.json ship it), read by libsentencepiece (Debian's libsentencepiece-dev).
// Without the library the engine still builds; loading a model is then a UserError.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace autotp::tok {

class SentencePieceModel {
 public:
  // Whether this build has libsentencepiece.
  static bool available();

  // UserError naming `path` when it is missing, unreadable or not a SentencePiece
  // model, or when this build has no libsentencepiece.
  explicit SentencePieceModel(const std::string& path);
  ~SentencePieceModel();
  SentencePieceModel(SentencePieceModel&&) noexcept;
  SentencePieceModel& operator=(SentencePieceModel&&) noexcept;

  // Appends the ids of `text`, without BOS/EOS (sentencepiece's EncodeAsIds; HF's slow
  // LlamaTokenizer with add_special_tokens=False gives the same for plain text).
  void encode(std::string_view text, std::vector<int64_t>& ids) const;

  int64_t vocab_size() const;
  // The id of `piece`; nullopt when it is not one of the model's pieces.
  std::optional<int64_t> piece_id(const std::string& piece) const;
  // The special ids; nullopt where the model has none.
  std::optional<int64_t> bos_id() const;
  std::optional<int64_t> eos_id() const;
  std::optional<int64_t> pad_id() const;
  std::optional<int64_t> unk_id() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace autotp::tok
