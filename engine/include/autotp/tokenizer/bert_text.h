// The Unicode-table rules of HF's tokenizer.json: the BertNormalizer (clean_text,
// handle_chinese_chars, strip_accents, lowercase), the BertPreTokenizer (split at
// whitespace, each punctuation character a word), and the NFC / NFD / NFKC / NFKD and
// Lowercase normalizers. Their tables (general categories, normal forms, lowercase)
// come from ICU; in a build without ICU, using any is a UserError saying so.
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace autotp::tok {

class BertNormalizer {
 public:
  // `j`: the normalizer object; `where` names the file in errors.
  BertNormalizer(const nlohmann::json& j, const std::string& where);
  std::string normalize(std::string_view text) const;

 private:
  bool clean_text_ = true, handle_chinese_chars_ = true, strip_accents_ = true, lowercase_ = true;
};

// UserError naming `what` in a build without ICU.
void require_unicode_tables(const std::string& what);
// HF's NFD (its Unicode 9 data, as BertNormalizer's), NFC, NFKC, NFKD (ICU's current
// tables: a character assigned after Unicode 9 may compose where HF's does not).
std::string unicode_normal_form(std::string_view text, const std::string& form);
// HF's Lowercase: Rust's char::to_lowercase per character (no final-sigma rule).
std::string unicode_lowercase(std::string_view text);

class BertPreTokenizer {
 public:
  explicit BertPreTokenizer(const std::string& where);
  // Appends the words of `text`.
  void split(std::string_view text, std::vector<std::string>& words) const;
};

}  // namespace autotp::tok
