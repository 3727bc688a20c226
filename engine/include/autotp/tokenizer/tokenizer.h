// An HF tokenizer read from a model directory's tokenizer.json (the `tokenizers`
// library's format), encoding text to the same ids: added and special tokens
// matched first, then per remaining piece the normalizer, the pre-tokenizer and
// the model, then the post-processor's special tokens. What is implemented:
//   normalizers    Sequence, Prepend, Replace, Strip, BertNormalizer (needs ICU)
//   pre-tokenizers Sequence, ByteLevel, Split (regex or string; isolated, removed,
//                  merged_with_previous, merged_with_next; invert), Metaspace,
//                  BertPreTokenizer (needs ICU)
//   models         BPE (merges, byte_fallback, unk / fuse_unk, ignore_merges),
//                  Unigram (Viterbi over piece scores, fused unk, byte_fallback),
//                  WordPiece (continuing_subword_prefix, max_input_chars_per_word, unk)
//   post-processors TemplateProcessing (single sequences), ByteLevel, Sequence
// Anything else is a UserError naming the component, never a different tokenizer.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace autotp::tok {

class Tokenizer {
 public:
  // `source` names the file in errors.
  static Tokenizer from_json(const nlohmann::json& json, const std::string& source);
  static Tokenizer from_file(const std::string& path);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // The ids of `text` (UTF-8 as RFC 3629 defines it; anything else is a UserError). add_special_tokens: the
  // post-processor's tokens (BOS ...), as HF's encode(add_special_tokens=True).
  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = true) const;

  // One more than the largest id of the vocabulary, the added tokens and the post-processor.
  int64_t vocab_size() const;
  std::optional<int64_t> token_id(const std::string& token) const;
  // The text one token stands for, as the decoder would give it (byte-level pieces
  // back to bytes, "<0xXX>" byte-fallback pieces, "▁" as a space, added tokens as
  // written); best effort, for showing data (autotp data preview), not a full decoder.
  std::string token_text(int64_t id) const;
  bool is_special(int64_t id) const;  // an added token marked special

  // The post-processor's ids before and after the sequence (BOS ..., ... EOS).
  const std::vector<int64_t>& special_prefix() const;
  const std::vector<int64_t>& special_suffix() const;

 private:
  Tokenizer();
  static Tokenizer read(const nlohmann::json& json, const std::string& source);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace autotp::tok
