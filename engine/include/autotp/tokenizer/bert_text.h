// BERT's text rules in HF's tokenizer.json: the BertNormalizer (clean_text,
// handle_chinese_chars, strip_accents, lowercase) and the BertPreTokenizer (split
// at whitespace, each punctuation character a word). Their Unicode tables (general
// categories, NFD, lowercase) come from ICU; in a build without ICU, constructing
// either is a UserError saying so.
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

class BertPreTokenizer {
 public:
  explicit BertPreTokenizer(const std::string& where);
  // Appends the words of `text`.
  void split(std::string_view text, std::vector<std::string>& words) const;
};

}  // namespace autotp::tok
