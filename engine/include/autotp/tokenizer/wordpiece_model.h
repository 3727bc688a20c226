// The WordPiece model of HF's tokenizer.json ("model": {"type": "WordPiece"}), as
// BERT's: a word becomes its longest vocabulary prefix, then repeatedly the longest
// continuing_subword_prefix + rest match ("##ing"); a word with a part that matches
// nothing, or longer than max_input_chars_per_word characters, is one unk.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace autotp::tok {

class WordPieceModel {
 public:
  // `model`: the tokenizer.json "model" object; `where` names it in errors (UserError).
  WordPieceModel(const nlohmann::json& model, const std::string& where);

  // Appends the ids of one pre-tokenized word.
  void encode_word(std::string_view word, std::vector<int64_t>& ids) const;

  const std::unordered_map<std::string, int64_t>& vocab() const { return vocab_; }

 private:
  int64_t unk() const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::string prefix_, unk_token_;
  int64_t unk_id_ = -1;
  size_t max_chars_ = 100;
  // The longest pieces in bytes, at a word's start and after prefix_: longer candidates cannot match.
  size_t max_first_bytes_ = 0, max_next_bytes_ = 0;
};

}  // namespace autotp::tok
