#include "autotp/tokenizer/bpe_model.h"

#include <fmt/format.h>

#include <cstdint>
#include <limits>
#include <queue>

#include "autotp/base/error.h"
#include "autotp/tokenizer/utf8.h"

namespace autotp::tok {

BpeModel::BpeModel(const nlohmann::json& model, const std::string& where) {
  AUTOTP_USER_CHECK(model.contains("vocab") && model["vocab"].is_object(), "{}: model.vocab must be an object", where);
  for (auto& [token, id] : model["vocab"].items()) {
    AUTOTP_USER_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() <= UINT32_MAX,
                      "{}: model.vocab['{}'] is {} (allowed: an integer id 0..2^32-1)", where, token, id.dump());
    vocab_[token] = id.get<int64_t>();
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const bool set = model.contains(key) && !model[key].is_null() && model[key] != "";
    AUTOTP_USER_CHECK(!set, "{}: model.{} is not supported (allowed: null)", where, key);
  }
  AUTOTP_USER_CHECK(!model.contains("dropout") || model["dropout"].is_null() || model["dropout"] == 0,
                    "{}: model.dropout (BPE dropout) is not supported (allowed: null)", where);
  byte_fallback_ = model.value("byte_fallback", false);
  fuse_unk_ = model.value("fuse_unk", false);
  ignore_merges_ = model.value("ignore_merges", false);
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    const std::string unk = model["unk_token"];
    auto it = vocab_.find(unk);
    AUTOTP_USER_CHECK(it != vocab_.end(), "{}: model.unk_token '{}' is not in the vocabulary", where, unk);
    unk_id_ = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(fmt::format("<0x{:02X}>", b));
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }
  AUTOTP_USER_CHECK(model.contains("merges") && model["merges"].is_array(), "{}: model.merges must be an array", where);
  int64_t rank = 0;
  for (const auto& merge : model["merges"]) {
    // "a b" (tokenizers < 0.20) or ["a", "b"].
    std::string a, b;
    if (merge.is_string()) {
      const std::string text = merge;
      const auto space = text.find(' ');
      AUTOTP_USER_CHECK(space != std::string::npos, "{}: merge '{}' is not 'a b'", where, text);
      a = text.substr(0, space), b = text.substr(space + 1);
    } else {
      AUTOTP_USER_CHECK(merge.is_array() && merge.size() == 2, "{}: merge {} is not [a, b]", where, merge.dump());
      a = merge[0], b = merge[1];
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b), merged = vocab_.find(a + b);
    AUTOTP_USER_CHECK(ia != vocab_.end() && ib != vocab_.end() && merged != vocab_.end(),
                      "{}: merge '{} {}' names a token that is not in the vocabulary", where, a, b);
    // A repeated pair takes its last rank, as HF's map built in file order does.
    merges_[std::make_pair(ia->second, ib->second)] = Merge{rank++, merged->second};
  }
}

void BpeModel::encode_word(std::string_view word, std::vector<int64_t>& ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {  // Llama 3: a word that is a token is that token, whatever the merges would give
    auto it = vocab_.find(std::string(word));
    if (it != vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  // An unknown is held open as HF holds it: a vocabulary character closes it, byte
  // fallback tokens do not (they go before it), and with fuse_unk the next unknown
  // joins it. Without an unk_token HF drops the character.
  std::vector<int64_t> symbols;
  bool unk_open = false;
  for (size_t i = 0; i < word.size();) {
    const size_t n = std::min(utf8_length(static_cast<unsigned char>(word[i])), word.size() - i);
    auto it = vocab_.find(std::string(word.substr(i, n)));
    if (it != vocab_.end()) {
      if (unk_open) symbols.push_back(unk_id_);
      unk_open = false;
      symbols.push_back(it->second);
    } else if (byte_fallback_ && [&] {
                 for (size_t k = 0; k < n; ++k)
                   if (byte_ids_[static_cast<unsigned char>(word[i + k])] < 0) return false;
                 return true;
               }()) {
      for (size_t k = 0; k < n; ++k) symbols.push_back(byte_ids_[static_cast<unsigned char>(word[i + k])]);
    } else if (unk_id_ >= 0) {
      if (unk_open && !fuse_unk_) symbols.push_back(unk_id_);
      unk_open = true;
    }
    i += n;
  }
  if (unk_open) symbols.push_back(unk_id_);
  // Merge the adjacent pair of lowest rank (the leftmost among equals) until none is
  // left, with a heap over a linked list as HF's Word::merge_all does (linear
  // rescans are quadratic on the long words of a Metaspace without split). An
  // entry is stale when its left symbol is gone or the pair there now merges to
  // another token; HF compares the merged id only, and so does this.
  struct Candidate {
    int64_t rank, pos, id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  const int64_t n = static_cast<int64_t>(symbols.size());
  std::vector<int64_t> prev(n), next(n);
  std::vector<char> alive(n, 1);
  for (int64_t k = 0; k < n; ++k) prev[k] = k - 1, next[k] = k + 1 < n ? k + 1 : -1;
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto push = [&](int64_t left) {
    if (left < 0 || next[left] < 0) return;
    auto it = merges_.find({symbols[left], symbols[next[left]]});
    if (it != merges_.end()) heap.push({it->second.rank, left, it->second.id});
  };
  for (int64_t k = 0; k + 1 < n; ++k) push(k);
  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    if (!alive[top.pos] || next[top.pos] < 0) continue;
    const int64_t right = next[top.pos];
    auto it = merges_.find({symbols[top.pos], symbols[right]});
    if (it == merges_.end() || it->second.id != top.id) continue;
    symbols[top.pos] = top.id;
    alive[right] = 0;
    next[top.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = top.pos;
    push(prev[top.pos]);
    push(top.pos);
  }
  std::vector<int64_t> merged;
  for (int64_t k = n > 0 ? 0 : -1; k >= 0; k = next[k]) merged.push_back(symbols[k]);
  symbols.swap(merged);
  ids.insert(ids.end(), symbols.begin(), symbols.end());
}

}  // namespace autotp::tok
