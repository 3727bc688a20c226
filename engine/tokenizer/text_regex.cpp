#include "autotp/tokenizer/text_regex.h"

#include "autotp/base/error.h"

#ifdef AUTOTP_HAVE_PCRE2
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace autotp::tok {

struct TextRegex::Impl {
  pcre2_code* code = nullptr;
  std::string where;
  ~Impl() {
    if (code) pcre2_code_free(code);
  }
};

TextRegex::TextRegex(const std::string& pattern, const std::string& where) : impl_(std::make_unique<Impl>()) {
  impl_->where = where;
  int error = 0;
  PCRE2_SIZE offset = 0;
  // UCP: \s, \w, \d and the POSIX classes by Unicode properties, as Oniguruma's (HF's) do.
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error, &offset, nullptr);
  if (!impl_->code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    throw_user_error("{}: regex '{}' does not compile at offset {}: {}", where, pattern, offset,
                     reinterpret_cast<const char*>(message));
  }
  pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE);  // best effort: falls back to the interpreter
}

TextRegex::~TextRegex() = default;
TextRegex::TextRegex(TextRegex&&) noexcept = default;
TextRegex& TextRegex::operator=(TextRegex&&) noexcept = default;

std::vector<std::pair<size_t, size_t>> TextRegex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> out;
  pcre2_match_data* data = pcre2_match_data_create_from_pattern(impl_->code, nullptr);
  size_t start = 0;
  while (start <= text.size()) {
    const int rc = pcre2_match(impl_->code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start,
                               PCRE2_NO_UTF_CHECK, data, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {  // a match limit or memory: never a silently unsplit rest of the text
      pcre2_match_data_free(data);
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      throw_user_error("{}: the pre-tokenizer regex failed at byte {} of {}: {}", impl_->where, start, text.size(),
                       reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end == begin) {  // empty match: not a split; step one code point on
      size_t next = begin + 1;
      while (next < text.size() && (static_cast<unsigned char>(text[next]) & 0xC0) == 0x80) ++next;
      start = next;
      continue;
    }
    out.emplace_back(begin, end);
    start = end;
  }
  pcre2_match_data_free(data);
  return out;
}

}  // namespace autotp::tok

#else  // built without PCRE2

namespace autotp::tok {

struct TextRegex::Impl {};

TextRegex::TextRegex(const std::string& pattern, const std::string& where) {
  throw_user_error("{}: regex '{}' needs PCRE2, and this build has none (install libpcre2-dev and rebuild)", where,
                   pattern);
}
TextRegex::~TextRegex() = default;
TextRegex::TextRegex(TextRegex&&) noexcept = default;
TextRegex& TextRegex::operator=(TextRegex&&) noexcept = default;
std::vector<std::pair<size_t, size_t>> TextRegex::find_all(std::string_view) const { return {}; }

}  // namespace autotp::tok

#endif

namespace autotp::tok {

std::string regex_escape(const std::string& literal) {
  std::string out;
  for (char ch : literal) {
    if (std::string_view("\\^$.|?*+()[]{}").find(ch) != std::string_view::npos) out += '\\';
    out += ch;
  }
  return out;
}

}  // namespace autotp::tok
