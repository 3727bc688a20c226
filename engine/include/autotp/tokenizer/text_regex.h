// A compiled regular expression over UTF-8 text (PCRE2 with Unicode classes), as
// the pre-tokenizers of HF's tokenizer.json need (\p{L}, \p{N}, lookahead, (?i:)).
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace autotp::tok {

class TextRegex {
 public:
  // UserError naming `where` when the pattern does not compile.
  TextRegex(const std::string& pattern, const std::string& where);
  ~TextRegex();
  TextRegex(TextRegex&&) noexcept;
  TextRegex& operator=(TextRegex&&) noexcept;

  // Every non-overlapping match of `text`, left to right, as [begin, end) byte offsets.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Escapes a literal string for use in a pattern.
std::string regex_escape(const std::string& literal);

}  // namespace autotp::tok
