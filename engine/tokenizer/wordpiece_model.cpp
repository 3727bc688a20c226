#include "autotp/tokenizer/wordpiece_model.h"

#include <algorithm>
#include <cstdint>

#include "autotp/base/error.h"

namespace autotp::tok {

namespace {

bool is_continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

}  // namespace

WordPieceModel::WordPieceModel(const nlohmann::json& model, const std::string& where) {
  AUTOTP_USER_CHECK(model.contains("vocab") && model["vocab"].is_object(),
                    "{}: model.vocab of a WordPiece model must be an object", where);
  prefix_ = model.value("continuing_subword_prefix", std::string("##"));
  unk_token_ = model.value("unk_token", std::string("[UNK]"));
  const auto& max_chars = model.value("max_input_chars_per_word", nlohmann::json(100));
  AUTOTP_USER_CHECK(max_chars.is_number_unsigned() || (max_chars.is_number_integer() && max_chars >= 0),
                    "{}: model.max_input_chars_per_word must be a non-negative integer", where);
  max_chars_ = max_chars.get<size_t>();
  for (auto& [token, id] : model["vocab"].items()) {
    AUTOTP_USER_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() <= UINT32_MAX,
                      "{}: model.vocab['{}'] is {} (allowed: an integer id 0..2^32-1)", where, token, id.dump());
    vocab_[token] = id.get<int64_t>();
    max_first_bytes_ = std::max(max_first_bytes_, token.size());
    if (token.compare(0, prefix_.size(), prefix_) == 0)
      max_next_bytes_ = std::max(max_next_bytes_, token.size() - prefix_.size());
  }
  // HF fails only when an unk is needed, so a vocabulary without it loads.
  auto it = vocab_.find(unk_token_);
  if (it != vocab_.end()) unk_id_ = it->second;
}

int64_t WordPieceModel::unk() const {
  AUTOTP_USER_CHECK(unk_id_ >= 0, "tokenizer: WordPiece needs its unk_token '{}', which is not in the vocabulary",
                    unk_token_);
  return unk_id_;
}

void WordPieceModel::encode_word(std::string_view word, std::vector<int64_t>& ids) const {
  const size_t n = word.size();
  if (n == 0) return;
  const size_t chars = static_cast<size_t>(std::count_if(word.begin(), word.end(), [](char c) {
    return !is_continuation(c);
  }));
  if (chars > max_chars_) {
    ids.push_back(unk());
    return;
  }
  const size_t mark = ids.size();
  thread_local std::string key;
  for (size_t start = 0; start < n;) {
    // Longest match first, shrinking by whole characters (HF's loop), from the longest piece's length down.
    size_t end = std::min(n, start + (start == 0 ? max_first_bytes_ : max_next_bytes_));
    while (end > start && end < n && is_continuation(word[end])) --end;
    int64_t found = -1;
    for (; end > start; --end) {
      key.assign(start == 0 ? "" : prefix_);
      key.append(word.substr(start, end - start));
      auto it = vocab_.find(key);
      if (it != vocab_.end()) {
        found = it->second;
        break;
      }
      while (end - 1 > start && is_continuation(word[end - 1])) --end;
    }
    if (found < 0) {  // a part matches nothing: the whole word is one unk
      ids.resize(mark);
      ids.push_back(unk());
      return;
    }
    ids.push_back(found);
    start = end;
  }
}

}  // namespace autotp::tok
