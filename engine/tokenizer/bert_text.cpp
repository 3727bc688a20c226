#include "autotp/tokenizer/bert_text.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <utility>

#include "autotp/base/error.h"

#ifdef AUTOTP_HAVE_ICU
#include <unicode/uchar.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>
#include <unicode/utf16.h>
#endif

namespace autotp::tok {
namespace {

// The code point at s[i] (valid UTF-8: the tokenizer checked), advancing i.
char32_t next_code_point(std::string_view s, size_t& i) {
  const auto lead = static_cast<unsigned char>(s[i]);
  if (lead < 0x80) return s[i++];
  const size_t n = (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : 4;
  char32_t c = lead & (0x7F >> n);
  for (size_t k = 1; k < n && i + k < s.size(); ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n;
  return c;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

// HF's is_chinese_char: the CJK ideograph blocks (not Hangul, kana).
bool is_chinese_char(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

char ascii_lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; }

#ifdef AUTOTP_HAVE_ICU

bool is_ascii_punctuation(char32_t c) {
  return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) || (c >= 0x7B && c <= 0x7E);
}

// HF's general categories (the unicode_categories crate) are Unicode 8.0's: a character assigned
// later has none, and a few characters had another category then. ICU's, pinned back to 8.0.
int8_t category_v8(char32_t c) {
  const auto cp = static_cast<UChar32>(c);
  switch (cp) {
    case 0x166D: return U_OTHER_PUNCTUATION;   // So since Unicode 12
    case 0x111C9: return U_OTHER_PUNCTUATION;  // Mn since Unicode 11
    case 0x1734: return U_NON_SPACING_MARK;    // Mc since Unicode 14
    case 0x1885:
    case 0x1886: return U_OTHER_LETTER;        // Mn since Unicode 9
    case 0xA9BD: return U_COMBINING_SPACING_MARK;  // Mn since Unicode 12
    default: break;
  }
  UVersionInfo age;
  u_charAge(cp, age);
  return age[0] > 8 ? static_cast<int8_t>(U_UNASSIGNED) : u_charType(cp);
}

// Rust's char::is_whitespace (HF's test): the White_Space property.
bool is_whitespace(char32_t c) {
  return c < 0x80 ? c == ' ' || (c >= 0x09 && c <= 0x0D) : u_isUWhiteSpace(static_cast<UChar32>(c));
}

// HF's is_control: general category Cc, Cf or Co, except \t \n \r (whitespace there).
bool is_control(char32_t c) {
  if (c == '\t' || c == '\n' || c == '\r') return false;
  if (c < 0x80) return c < 0x20 || c == 0x7F;
  const int8_t type = category_v8(c);
  return type == U_CONTROL_CHAR || type == U_FORMAT_CHAR || type == U_PRIVATE_USE_CHAR;
}

// HF's is_bert_punc: ASCII punctuation (symbols like $ + < = included) or general category P*.
bool is_punctuation(char32_t c) {
  return c < 0x80 ? is_ascii_punctuation(c) : (U_MASK(category_v8(c)) & U_GC_P_MASK) != 0;
}

bool is_nonspacing_mark(char32_t c) { return c >= 0x80 && category_v8(c) == U_NON_SPACING_MARK; }

// Lowercase mappings Rust's std has (Unicode 16 and 17) and ICU 72 (Unicode 15) lacks:
// [first, last] maps to first + delta ...; used only where ICU maps a character to itself.
struct LowerRange {
  char32_t first, last;
  int32_t delta;
};
constexpr LowerRange kNewerLowercase[] = {
    {0x1C89, 0x1C89, 1}, {0xA7CB, 0xA7CB, 0x264 - 0xA7CB}, {0xA7CC, 0xA7CC, 1},     {0xA7CE, 0xA7CE, 1},
    {0xA7D2, 0xA7D2, 1}, {0xA7D4, 0xA7D4, 1},              {0xA7DA, 0xA7DA, 1},     {0xA7DC, 0xA7DC, 0x19B - 0xA7DC},
    {0x10D50, 0x10D65, 0x20}, {0x16EA0, 0x16EB8, 0x1B},
};

// Rust's char::to_lowercase, which HF applies per character: the simple mapping, except U+0130
// (SpecialCasing's one unconditional lowercase entry, "i" + U+0307). No final-sigma context.
void append_lowercase(std::string& out, char32_t c) {
  if (c == 0x130) {
    out += 'i';
    append_utf8(out, 0x307);
    return;
  }
  auto lower = static_cast<char32_t>(u_tolower(static_cast<UChar32>(c)));
  if (lower == c && c >= 0x1C89)
    for (const auto& r : kNewerLowercase)
      if (c >= r.first && c <= r.last) lower = static_cast<char32_t>(static_cast<int32_t>(c) + r.delta);
  append_utf8(out, lower);
}

// Calls emit(code point) for each code point of NFD(utf8) as HF computes it: its tables
// (unicode-normalization-alignments) are Unicode 9.0's, so a character assigned later neither
// decomposes nor reorders (class 0 there; ICU 72 would split U+11938 and reorder ~100 newer
// marks). The decompositions and classes of the older characters are ICU's (stable since).
template <typename Emit>
void for_each_nfd(std::string_view utf8, Emit&& emit) {
  UErrorCode error = U_ZERO_ERROR;
  const UNormalizer2* nfd = unorm2_getNFDInstance(&error);
  if (U_FAILURE(error)) throw std::runtime_error(std::string("tokenizer: ICU NFD: ") + u_errorName(error));
  thread_local std::vector<std::pair<uint8_t, char32_t>> out;  // (combining class, code point)
  out.clear();
  for (size_t i = 0; i < utf8.size();) {
    const auto c = static_cast<UChar32>(next_code_point(utf8, i));
    UVersionInfo age;
    u_charAge(c, age);
    if (age[0] > 9) {
      out.emplace_back(0, static_cast<char32_t>(c));
      continue;
    }
    UChar mapping[32];
    UErrorCode status = U_ZERO_ERROR;
    const int32_t length = unorm2_getDecomposition(nfd, c, mapping, 32, &status);
    if (length < 0 || U_FAILURE(status)) {
      out.emplace_back(u_getCombiningClass(c), static_cast<char32_t>(c));
      continue;
    }
    for (int32_t k = 0; k < length;) {
      UChar32 d;
      U16_NEXT(mapping, k, length, d);
      out.emplace_back(u_getCombiningClass(d), static_cast<char32_t>(d));
    }
  }
  // Canonical ordering: each run of non-zero classes sorted by class, stably.
  for (size_t i = 0; i < out.size();) {
    size_t end = i;
    while (end < out.size() && out[end].first != 0) ++end;
    if (end - i > 1)
      std::stable_sort(out.begin() + static_cast<std::ptrdiff_t>(i), out.begin() + static_cast<std::ptrdiff_t>(end),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
    i = end == i ? i + 1 : end;
  }
  for (const auto& [ccc, c] : out) emit(c);
}

// NFC / NFKC / NFKD of `utf8` by ICU's tables, through UTF-16.
std::string icu_normal_form(std::string_view utf8, const std::string& form) {
  UErrorCode status = U_ZERO_ERROR;
  const UNormalizer2* normalizer = form == "NFC"    ? unorm2_getNFCInstance(&status)
                                   : form == "NFKC" ? unorm2_getNFKCInstance(&status)
                                                    : unorm2_getNFKDInstance(&status);
  auto check = [&](const char* what) {
    if (U_FAILURE(status)) throw std::runtime_error(std::string("tokenizer: ICU ") + what + ": " + u_errorName(status));
  };
  check("normalizer");
  // ICU counts in int32: a piece that long (2 GB between added tokens) is refused, not truncated.
  if (utf8.size() >= static_cast<size_t>(INT32_MAX) / 4)
    throw_user_error("tokenizer: {} of a {}-byte piece of text: too long for ICU (split the text)", form, utf8.size());
  std::u16string in(utf8.size() + 1, u'\0');
  int32_t in_length = 0;
  u_strFromUTF8(in.data(), static_cast<int32_t>(in.size()), &in_length, utf8.data(), static_cast<int32_t>(utf8.size()),
                &status);
  check("UTF-8 to UTF-16");
  std::u16string out(static_cast<size_t>(in_length) * 4 + 16, u'\0');  // NFKD expands by at most 18 in theory
  int32_t out_length = unorm2_normalize(normalizer, in.data(), in_length, out.data(), static_cast<int32_t>(out.size()),
                                        &status);
  if (status == U_BUFFER_OVERFLOW_ERROR) {
    status = U_ZERO_ERROR;
    out.assign(static_cast<size_t>(out_length) + 1, u'\0');
    out_length = unorm2_normalize(normalizer, in.data(), in_length, out.data(), static_cast<int32_t>(out.size()), &status);
  }
  check(form.c_str());
  std::string result(static_cast<size_t>(out_length) * 3 + 1, '\0');
  int32_t result_length = 0;
  u_strToUTF8(result.data(), static_cast<int32_t>(result.size()), &result_length, out.data(), out_length, &status);
  check("UTF-16 to UTF-8");
  result.resize(static_cast<size_t>(result_length));
  return result;
}

#else

[[noreturn]] void no_icu() { throw std::logic_error("tokenizer: BERT text rules need ICU"); }
bool is_whitespace(char32_t) { no_icu(); }
bool is_control(char32_t) { no_icu(); }
bool is_punctuation(char32_t) { no_icu(); }
bool is_nonspacing_mark(char32_t) { no_icu(); }
void append_lowercase(std::string&, char32_t) { no_icu(); }
template <typename Emit>
void for_each_nfd(std::string_view, Emit&&) {
  no_icu();
}
std::string icu_normal_form(std::string_view, const std::string&) { no_icu(); }

#endif

void require_icu([[maybe_unused]] const std::string& what) {
#ifndef AUTOTP_HAVE_ICU
  throw_user_error("{} needs ICU for its Unicode tables, and this build of autotp has none (install libicu-dev, "
                   "as tools/install-deps does, and rebuild)", what);
#endif
}

}  // namespace

void require_unicode_tables(const std::string& what) { require_icu(what); }

std::string unicode_normal_form(std::string_view text, const std::string& form) {
  if (form != "NFD") return icu_normal_form(text, form);
  std::string out;
  for_each_nfd(text, [&](char32_t c) { append_utf8(out, c); });
  return out;
}

std::string unicode_lowercase(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size();) append_lowercase(out, next_code_point(text, i));
  return out;
}

BertNormalizer::BertNormalizer(const nlohmann::json& j, const std::string& where) {
  require_icu(where + ": normalizer 'BertNormalizer'");
  auto flag = [&](const char* key, bool fallback) {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    AUTOTP_USER_CHECK(j[key].is_boolean(), "{}: BertNormalizer.{} must be true, false or null", where, key);
    return j[key].get<bool>();
  };
  clean_text_ = flag("clean_text", true);
  handle_chinese_chars_ = flag("handle_chinese_chars", true);
  lowercase_ = flag("lowercase", true);
  strip_accents_ = flag("strip_accents", lowercase_);  // null: as lowercase (HF, BERT's uncased models)
}

std::string BertNormalizer::normalize(std::string_view text) const {
  // In HF's order: clean_text, handle_chinese_chars, strip_accents (NFD, drop Mn), lowercase.
  std::string s;
  s.reserve(text.size() + text.size() / 8);
  for (size_t i = 0; i < text.size();) {
    const size_t begin = i;
    const char32_t c = next_code_point(text, i);
    if (clean_text_) {
      if (c == 0 || c == 0xFFFD || is_control(c)) continue;
      if (is_whitespace(c)) {
        s += ' ';
        continue;
      }
    }
    const bool pad = handle_chinese_chars_ && is_chinese_char(c);
    if (pad) s += ' ';
    s.append(text.substr(begin, i - begin));
    if (pad) s += ' ';
  }
  if (!strip_accents_ && !lowercase_) return s;
  std::string out;
  out.reserve(s.size());
  auto emit = [&](char32_t c) {
    if (strip_accents_ && is_nonspacing_mark(c)) return;
    if (lowercase_) append_lowercase(out, c);
    else append_utf8(out, c);
  };
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      out += lowercase_ ? ascii_lower(s[i]) : s[i];
      ++i;
      continue;
    }
    // A run of non-ASCII characters: NFD never reorders across an ASCII character (a starter).
    size_t end = i;
    while (end < s.size() && static_cast<unsigned char>(s[end]) >= 0x80) ++end;
    const std::string_view run(s.data() + i, end - i);
    if (strip_accents_) {
      for_each_nfd(run, emit);
    } else {
      for (size_t k = 0; k < run.size();) emit(next_code_point(run, k));
    }
    i = end;
  }
  return out;
}

BertPreTokenizer::BertPreTokenizer(const std::string& where) {
  require_icu(where + ": pre-tokenizer 'BertPreTokenizer'");
}

void BertPreTokenizer::split(std::string_view text, std::vector<std::string>& words) const {
  // Whitespace ends a word and is dropped; a punctuation character ends a word and is one itself.
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    const size_t begin = i;
    const char32_t c = next_code_point(text, i);
    const bool space = is_whitespace(c);
    if (!space && !is_punctuation(c)) continue;
    if (start < begin) words.emplace_back(text.substr(start, begin - start));
    if (!space) words.emplace_back(text.substr(begin, i - begin));
    start = i;
  }
  if (start < text.size()) words.emplace_back(text.substr(start));
}

}  // namespace autotp::tok
