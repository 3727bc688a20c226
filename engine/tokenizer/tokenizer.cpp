#include "autotp/tokenizer/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <unordered_map>

#include "autotp/base/error.h"
#include "autotp/base/json_file.h"
#include "autotp/tokenizer/bert_text.h"
#include "autotp/tokenizer/bpe_model.h"
#include "autotp/tokenizer/text_regex.h"
#include "autotp/tokenizer/utf8.h"
#include "autotp/tokenizer/unigram_model.h"
#include "autotp/tokenizer/wordpiece_model.h"

namespace autotp::tok {
namespace {

using nlohmann::json;

// GPT-2's pre-tokenization pattern (ByteLevel with use_regex).
const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's reversible map of bytes to printable code points (UTF-8 encoded).
std::vector<std::string> byte_to_unicode() {
  std::vector<std::string> out(256);
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const int cp = printable ? b : 256 + extra++;
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    out[b] = s;
  }
  return out;
}

// RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF (PCRE2 is
// told the text is valid and must not see such bytes). Returns the offset of the
// first invalid byte, or npos.
size_t invalid_utf8_at(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return i;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return i;
    if (n >= 3) {
      const auto c1 = static_cast<unsigned char>(s[i + 1]);
      if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 > 0x9F) || (c == 0xF0 && c1 < 0x90) || (c == 0xF4 && c1 > 0x8F))
        return i;
    }
    i += n;
  }
  return std::string_view::npos;
}

// Unicode White_Space (HF: Rust's char::is_whitespace): the length in bytes of the
// space character ending before `end` / starting at `at`, 0 if none.
bool is_space_code_point(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
uint32_t decode_at(std::string_view s, size_t at, size_t n) {
  uint32_t c = n == 1 ? static_cast<unsigned char>(s[at]) : static_cast<unsigned char>(s[at]) & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) c = (c << 6) | (static_cast<unsigned char>(s[at + k]) & 0x3F);
  return c;
}
size_t space_at(std::string_view s, size_t at) {
  if (at >= s.size()) return 0;
  const size_t n = std::min(utf8_length(static_cast<unsigned char>(s[at])), s.size() - at);
  return is_space_code_point(decode_at(s, at, n)) ? n : 0;
}
size_t space_before(std::string_view s, size_t end) {
  size_t b = end;
  while (b > 0 && (static_cast<unsigned char>(s[b - 1]) & 0xC0) == 0x80 && end - b < 3) --b;
  if (b == 0) return 0;
  --b;
  return end - b == utf8_length(static_cast<unsigned char>(s[b])) && is_space_code_point(decode_at(s, b, end - b))
             ? end - b
             : 0;
}

// A piece of text on its way through the pipeline; `first`: it starts the input
// (Metaspace's prepend_scheme "first").
struct Piece {
  std::string text;
  bool first = false;
};

using Normalizer = std::function<std::string(std::string)>;
using PreTokenizer = std::function<std::vector<Piece>(std::vector<Piece>)>;

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  if (from.empty()) return text;
  std::string out;
  size_t at = 0;
  for (size_t hit; (hit = text.find(from, at)) != std::string::npos; at = hit + from.size())
    out += text.substr(at, hit - at) + to;
  return out + text.substr(at);
}

// A Split-style pattern: {"String": s} or {"Regex": r}.
TextRegex pattern_regex(const json& pattern, const std::string& where) {
  AUTOTP_USER_CHECK(pattern.is_object(), "{}: pattern must be {{\"String\": ...}} or {{\"Regex\": ...}}", where);
  if (pattern.contains("String")) return TextRegex(regex_escape(pattern.at("String").get<std::string>()), where);
  AUTOTP_USER_CHECK(pattern.contains("Regex"), "{}: pattern must be {{\"String\": ...}} or {{\"Regex\": ...}}", where);
  return TextRegex(pattern.at("Regex").get<std::string>(), where);
}

Normalizer make_normalizer(const json& j, const std::string& where) {
  if (j.is_null()) return [](std::string s) { return s; };
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    std::vector<Normalizer> parts;
    for (const auto& n : j.at("normalizers")) parts.push_back(make_normalizer(n, where));
    return [parts](std::string s) {
      for (const auto& p : parts) s = p(std::move(s));
      return s;
    };
  }
  if (type == "Prepend") {
    const std::string prepend = j.at("prepend");
    return [prepend](std::string s) { return s.empty() ? s : prepend + s; };
  }
  if (type == "Replace") {
    const std::string content = j.at("content");
    if (j.at("pattern").contains("String")) {
      const std::string from = j.at("pattern").at("String");
      return [from, content](std::string s) { return replace_all(std::move(s), from, content); };
    }
    auto re = std::make_shared<TextRegex>(pattern_regex(j.at("pattern"), where + ": Replace"));
    return [re, content](std::string s) {
      std::string out;
      size_t at = 0;
      for (auto [b, e] : re->find_all(s)) out += s.substr(at, b - at) + content, at = e;
      return out + s.substr(at);
    };
  }
  if (type == "Strip") {
    const bool left = j.value("strip_left", true), right = j.value("strip_right", true);
    return [left, right](std::string s) {
      size_t b = 0, e = s.size();
      for (size_t n; left && b < e && (n = space_at(s, b)) > 0;) b += n;
      for (size_t n; right && e > b && (n = space_before(s, e)) > 0;) e -= n;
      return s.substr(b, e - b);
    };
  }
  if (type == "BertNormalizer") {
    auto bert = std::make_shared<BertNormalizer>(j, where);
    return [bert](std::string s) { return bert->normalize(s); };
  }
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    require_unicode_tables(where + ": normalizer '" + type + "'");
    return [type](std::string s) { return unicode_normal_form(s, type); };
  }
  if (type == "Lowercase") {
    require_unicode_tables(where + ": normalizer 'Lowercase'");
    return [](std::string s) { return unicode_lowercase(s); };
  }
  throw_user_error("{}: normalizer '{}' is not supported (allowed: Sequence, Prepend, Replace, Strip, NFC, NFD, NFKC, "
                   "NFKD, Lowercase, BertNormalizer)",
                   where, type);
}

// Splits `text` at the matches as `behavior` says (HF's SplitDelimiterBehavior).
std::vector<std::string> split_by(const std::string& text, const TextRegex& re, const std::string& behavior,
                                  bool invert, const std::string& where) {
  // Segments: (begin, end, is_match), covering the text.
  std::vector<std::tuple<size_t, size_t, bool>> segments;
  size_t at = 0;
  for (auto [b, e] : re.find_all(text)) {
    if (b > at) segments.emplace_back(at, b, false);
    segments.emplace_back(b, e, true);
    at = e;
  }
  if (at < text.size()) segments.emplace_back(at, text.size(), false);
  if (invert)
    for (auto& s : segments) std::get<2>(s) = !std::get<2>(s);
  std::vector<std::string> out;
  auto piece = [&](size_t b, size_t e) { return text.substr(b, e - b); };
  if (behavior == "Isolated") {
    for (auto [b, e, m] : segments) out.push_back(piece(b, e));
  } else if (behavior == "Removed") {
    for (auto [b, e, m] : segments)
      if (!m) out.push_back(piece(b, e));
  } else if (behavior == "MergedWithPrevious") {
    for (auto [b, e, m] : segments) {
      if (m && !out.empty()) out.back() += piece(b, e);
      else out.push_back(piece(b, e));
    }
  } else if (behavior == "MergedWithNext") {
    bool pending = false;
    for (auto [b, e, m] : segments) {
      if (pending) out.back() += piece(b, e);
      else out.push_back(piece(b, e));
      pending = m;
    }
  } else {
    throw_user_error("{}: split behavior '{}' is not supported (allowed: Isolated, Removed, MergedWithPrevious, "
                     "MergedWithNext)", where, behavior);
  }
  return out;
}

PreTokenizer make_pre_tokenizer(const json& j, const std::string& where) {
  if (j.is_null()) return [](std::vector<Piece> p) { return p; };
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    std::vector<PreTokenizer> parts;
    for (const auto& p : j.at("pretokenizers")) parts.push_back(make_pre_tokenizer(p, where));
    return [parts](std::vector<Piece> pieces) {
      for (const auto& p : parts) pieces = p(std::move(pieces));
      return pieces;
    };
  }
  if (type == "ByteLevel") {
    const bool prefix = j.value("add_prefix_space", false), use_regex = j.value("use_regex", true);
    auto re = std::make_shared<TextRegex>(kGpt2Pattern, where + ": ByteLevel");
    auto table = std::make_shared<std::vector<std::string>>(byte_to_unicode());
    return [prefix, use_regex, re, table](std::vector<Piece> pieces) {
      std::vector<Piece> out;
      for (auto& p : pieces) {
        std::string text = std::move(p.text);
        if (prefix && !text.empty() && text[0] != ' ') text = " " + text;  // HF prepends nothing to ""
        std::vector<std::string> words = use_regex ? split_by(text, *re, "Isolated", false, "") : std::vector{text};
        for (auto& w : words) {
          std::string mapped;
          for (unsigned char c : w) mapped += (*table)[c];
          out.push_back({mapped, p.first && out.empty()});
        }
      }
      return out;
    };
  }
  if (type == "Split") {
    auto re = std::make_shared<TextRegex>(pattern_regex(j.at("pattern"), where + ": Split"));
    const std::string behavior = j.value("behavior", "Isolated");
    const bool invert = j.value("invert", false);
    split_by("", *re, behavior, invert, where + ": Split");  // checks the behavior now
    return [re, behavior, invert, where](std::vector<Piece> pieces) {
      std::vector<Piece> out;
      for (auto& p : pieces) {
        bool first = p.first;
        for (auto& s : split_by(p.text, *re, behavior, invert, where)) {
          out.push_back({std::move(s), first});
          first = false;
        }
      }
      return out;
    };
  }
  if (type == "Metaspace") {
    const std::string replacement = j.value("replacement", "\xE2\x96\x81");
    std::string scheme = j.value("prepend_scheme", "");
    if (scheme.empty()) scheme = j.value("add_prefix_space", true) ? "always" : "never";
    AUTOTP_USER_CHECK(scheme == "always" || scheme == "first" || scheme == "never",
                      "{}: Metaspace prepend_scheme '{}' (allowed: always, first, never)", where, scheme);
    const bool split = j.value("split", true);
    auto re = std::make_shared<TextRegex>(regex_escape(replacement), where + ": Metaspace");
    return [replacement, scheme, split, re](std::vector<Piece> pieces) {
      std::vector<Piece> out;
      for (auto& p : pieces) {
        std::string text = replace_all(std::move(p.text), " ", replacement);
        const bool prepend = scheme == "always" || (scheme == "first" && p.first);
        if (prepend && text.rfind(replacement, 0) != 0) text = replacement + text;
        if (!split) {
          out.push_back({text, p.first});
          continue;
        }
        bool first = p.first;
        for (auto& s : split_by(text, *re, "MergedWithNext", false, "")) {
          out.push_back({std::move(s), first});
          first = false;
        }
      }
      return out;
    };
  }
  if (type == "BertPreTokenizer") {
    auto bert = std::make_shared<BertPreTokenizer>(where);
    return [bert](std::vector<Piece> pieces) {
      std::vector<Piece> out;
      std::vector<std::string> words;
      for (auto& p : pieces) {
        words.clear();
        bert->split(p.text, words);
        for (size_t k = 0; k < words.size(); ++k) out.push_back({std::move(words[k]), p.first && k == 0});
      }
      return out;
    };
  }
  throw_user_error("{}: pre-tokenizer '{}' is not supported (allowed: Sequence, ByteLevel, Split, Metaspace, "
                   "BertPreTokenizer)", where, type);
}

// The model behind one interface: the ids of a pre-tokenized word, and the vocabulary.
struct Model {
  virtual ~Model() = default;
  virtual void encode_word(std::string_view word, std::vector<int64_t>& ids) const = 0;
  virtual const std::unordered_map<std::string, int64_t>& vocab() const = 0;
};

template <typename M>
struct ModelOf : Model {
  ModelOf(const json& j, const std::string& where) : model(j, where) {}
  void encode_word(std::string_view word, std::vector<int64_t>& ids) const override { model.encode_word(word, ids); }
  const std::unordered_map<std::string, int64_t>& vocab() const override { return model.vocab(); }
  M model;
};

std::unique_ptr<Model> make_model(const json& j, const std::string& where) {
  const std::string type = j.value("type", "BPE");
  if (type == "BPE") return std::make_unique<ModelOf<BpeModel>>(j, where);
  if (type == "Unigram") return std::make_unique<ModelOf<UnigramModel>>(j, where);
  if (type == "WordPiece") return std::make_unique<ModelOf<WordPieceModel>>(j, where);
  throw_user_error("{}: model type '{}' is not supported (allowed: BPE, Unigram, WordPiece)", where, type);
}

struct AddedToken {
  std::string content;
  int64_t id = 0;
  bool lstrip = false, rstrip = false;
};

}  // namespace

struct Tokenizer::Impl {
  std::vector<AddedToken> added;                      // longest first
  std::map<unsigned char, std::vector<size_t>> added_by_first_byte;
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  std::unique_ptr<Model> model;
  std::vector<int64_t> prefix_ids, suffix_ids;  // the post-processor's, around the sequence
  int64_t vocab_size = 0;
  std::map<std::string, int64_t> added_ids;
  // For token_text: every id's string, and how the decoder turns it back into text.
  std::unordered_map<int64_t, std::string> pieces;  // by id (ids may be sparse: added tokens up to 2^32)
  std::map<std::string, unsigned char> unicode_to_byte;  // byte-level decoders
  bool metaspace = false;                                // "▁" is a space (Metaspace, Replace)
  std::set<int64_t> special_ids;

  // The post-processor: the special ids before and after a single sequence.
  void read_post_processor(const json& j, const std::string& where) {
    if (j.is_null()) return;
    const std::string type = j.value("type", "");
    if (type == "Sequence") {
      for (const auto& p : j.at("processors")) read_post_processor(p, where);
    } else if (type == "ByteLevel") {
      // offsets only
    } else if (type == "TemplateProcessing") {
      bool before = true;
      for (const auto& item : j.at("single")) {
        if (item.contains("Sequence")) {
          AUTOTP_USER_CHECK(before, "{}: TemplateProcessing with more than one sequence in 'single'", where);
          before = false;
          continue;
        }
        const std::string name = item.at("SpecialToken").at("id");
        AUTOTP_USER_CHECK(j.at("special_tokens").contains(name), "{}: TemplateProcessing names '{}' without ids", where,
                          name);
        for (const auto& id : j.at("special_tokens").at(name).at("ids")) {
          AUTOTP_USER_CHECK(id.is_number_integer() && id >= 0 && id <= UINT32_MAX,
                            "{}: TemplateProcessing special token '{}' has id {} (allowed: 0..2^32-1)", where, name,
                            id.dump());
          (before ? prefix_ids : suffix_ids).push_back(id.get<int64_t>());
        }
      }
    } else {
      throw_user_error("{}: post-processor '{}' is not supported (allowed: TemplateProcessing, ByteLevel, Sequence)",
                       where, type);
    }
  }

  void encode_piece(const std::string& text, bool first, std::vector<int64_t>& ids) const {
    std::vector<Piece> pieces{{normalizer(text), first}};
    for (const auto& p : pre_tokenizer(std::move(pieces))) model->encode_word(p.text, ids);
  }
};

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::from_file(const std::string& path) { return from_json(read_json_file(path, "tokenizer"), path); }

Tokenizer Tokenizer::from_json(const json& j, const std::string& source) {
  // A key missing or of the wrong type deep in the file: one error naming it.
  try {
    return read(j, source);
  } catch (const json::exception& e) {
    throw_user_error("{}: not a tokenizer.json this reader understands: {}", source, e.what());
  }
}

Tokenizer Tokenizer::read(const json& j, const std::string& source) {
  Tokenizer t;
  Impl& m = *t.impl_;
  AUTOTP_USER_CHECK(j.is_object() && j.contains("model") && j.at("model").is_object(), "{}: no 'model' object", source);
  m.model = make_model(j.at("model"), source);
  m.normalizer = make_normalizer(j.value("normalizer", json()), source);
  m.pre_tokenizer = make_pre_tokenizer(j.value("pre_tokenizer", json()), source);
  m.read_post_processor(j.value("post_processor", json()), source);
  for (const auto& [token, id] : m.model->vocab()) m.vocab_size = std::max(m.vocab_size, id + 1);
  // The post-processor's ids are ids the encoder gives too (a model must have room for them).
  for (const auto* ids : {&m.prefix_ids, &m.suffix_ids})
    for (int64_t id : *ids) m.vocab_size = std::max(m.vocab_size, id + 1);
  for (const auto& a : j.value("added_tokens", json::array())) {
    AddedToken token{a.at("content").get<std::string>(), a.at("id").get<int64_t>(), a.value("lstrip", false),
                     a.value("rstrip", false)};
    AUTOTP_USER_CHECK(token.id >= 0 && token.id <= UINT32_MAX, "{}: added token '{}' has id {} (allowed: 0..2^32-1)",
                      source, token.content, token.id);
    AUTOTP_USER_CHECK(!a.value("single_word", false), "{}: added token '{}' with single_word is not supported", source,
                      token.content);
    if (token.content.empty()) continue;
    m.vocab_size = std::max(m.vocab_size, token.id + 1);
    m.added_ids[token.content] = token.id;
    m.added.push_back(token);
  }
  for (const auto& [token, id] : m.model->vocab()) m.pieces[id] = token;
  for (const auto& a : m.added) m.pieces[a.id] = a.content;
  for (const auto& a : j.value("added_tokens", json::array()))
    if (a.value("special", false)) m.special_ids.insert(a.at("id").get<int64_t>());
  const std::string decoder = j.value("decoder", json()).dump();
  if (decoder.find("\"ByteLevel\"") != std::string::npos) {
    const auto table = byte_to_unicode();
    for (int b = 0; b < 256; ++b) m.unicode_to_byte[table[b]] = static_cast<unsigned char>(b);
  }
  m.metaspace = decoder.find("\"Metaspace\"") != std::string::npos || decoder.find("\u2581") != std::string::npos ||
                decoder.find("\xe2\x96\x81") != std::string::npos;
  std::stable_sort(m.added.begin(), m.added.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  for (size_t i = 0; i < m.added.size(); ++i)
    m.added_by_first_byte[static_cast<unsigned char>(m.added[i].content[0])].push_back(i);
  return t;
}

std::string Tokenizer::token_text(int64_t id) const {
  const Impl& m = *impl_;
  const auto found = m.pieces.find(id);
  if (found == m.pieces.end()) return "";
  const std::string& piece = found->second;
  if (m.added_ids.count(piece) && m.added_ids.at(piece) == id) return piece;  // added tokens are literal text
  // byte_fallback pieces: <0xXX>
  if (piece.size() == 6 && piece.rfind("<0x", 0) == 0 && piece.back() == '>')
    return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
  std::string out;
  if (!m.unicode_to_byte.empty()) {
    for (size_t i = 0; i < piece.size();) {
      const size_t n = (static_cast<unsigned char>(piece[i]) < 0x80) ? 1 : 2;
      const auto hit = m.unicode_to_byte.find(piece.substr(i, n));
      out += hit != m.unicode_to_byte.end() ? std::string(1, static_cast<char>(hit->second)) : piece.substr(i, n);
      i += n;
    }
    return out;
  }
  out = piece;
  if (m.metaspace)
    for (size_t at; (at = out.find("\xe2\x96\x81")) != std::string::npos;) out.replace(at, 3, " ");
  return out;
}

bool Tokenizer::is_special(int64_t id) const { return impl_->special_ids.count(id) > 0; }

std::vector<int64_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& m = *impl_;
  const size_t bad = invalid_utf8_at(text);
  AUTOTP_USER_CHECK(bad == std::string_view::npos, "the text is not valid UTF-8 (byte {} of {})", bad, text.size());
  std::vector<int64_t> ids;
  if (add_special_tokens) ids = m.prefix_ids;
  // Added tokens first (leftmost, then longest), the text between them through the pipeline.
  size_t start = 0, i = 0;
  auto flush = [&](size_t end) {
    if (end > start) m.encode_piece(std::string(text.substr(start, end - start)), start == 0, ids);
  };
  while (i < text.size()) {
    const AddedToken* hit = nullptr;
    auto bucket = m.added_by_first_byte.find(static_cast<unsigned char>(text[i]));
    if (bucket != m.added_by_first_byte.end())
      for (size_t k : bucket->second)
        if (text.compare(i, m.added[k].content.size(), m.added[k].content) == 0) {
          hit = &m.added[k];
          break;
        }
    if (!hit) {
      ++i;
      continue;
    }
    size_t b = i, e = i + hit->content.size();
    if (hit->lstrip)
      for (size_t n; b > start && (n = space_before(text, b)) > 0;) b -= n;
    if (hit->rstrip)
      for (size_t n; (n = space_at(text, e)) > 0;) e += n;
    flush(b);
    ids.push_back(hit->id);
    start = i = e;
  }
  flush(text.size());
  if (add_special_tokens) ids.insert(ids.end(), m.suffix_ids.begin(), m.suffix_ids.end());
  return ids;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
const std::vector<int64_t>& Tokenizer::special_prefix() const { return impl_->prefix_ids; }
const std::vector<int64_t>& Tokenizer::special_suffix() const { return impl_->suffix_ids; }

std::optional<int64_t> Tokenizer::token_id(const std::string& token) const {
  auto it = impl_->added_ids.find(token);
  if (it != impl_->added_ids.end()) return it->second;
  auto v = impl_->model->vocab().find(token);
  if (v != impl_->model->vocab().end()) return v->second;
  return std::nullopt;
}

}  // namespace autotp::tok
