#include "autotp/tokenizer/unigram_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>

#include "autotp/base/error.h"
#include "autotp/tokenizer/utf8.h"

namespace autotp::tok {

namespace {

// HF's (and SentencePiece's) kUnkPenalty: an unknown character scores this much below the lowest piece.
constexpr double kUnkPenalty = 10.0;

}  // namespace

UnigramModel::UnigramModel(const nlohmann::json& model, const std::string& where) {
  AUTOTP_USER_CHECK(model.contains("vocab") && model["vocab"].is_array(),
                    "{}: model.vocab of a Unigram model must be an array of [piece, score]", where);
  const auto& vocab = model["vocab"];
  double min_score = std::numeric_limits<double>::infinity();
  // The trie is built with ordered children, then flattened into sorted edge arrays.
  std::vector<std::map<unsigned char, int32_t>> children(1);
  std::vector<int32_t> piece_at(1, -1);
  for (size_t id = 0; id < vocab.size(); ++id) {
    const auto& entry = vocab[id];
    AUTOTP_USER_CHECK(entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_number(),
                      "{}: model.vocab[{}] is not [piece, score]", where, id);
    const std::string piece = entry[0];
    const double score = entry[1].get<double>();
    scores_.push_back(score);
    min_score = std::min(min_score, score);
    vocab_[piece] = static_cast<int64_t>(id);
    if (piece.empty()) continue;  // HF's trie never yields an empty piece
    int32_t node = 0;
    for (unsigned char c : piece) {
      auto it = children[node].find(c);
      if (it == children[node].end()) {
        it = children[node].emplace(c, static_cast<int32_t>(children.size())).first;
        children.emplace_back();
        piece_at.push_back(-1);
      }
      node = it->second;
    }
    piece_at[node] = static_cast<int32_t>(id);  // a repeated piece keeps its last id, as HF's token_to_ids
  }
  AUTOTP_USER_CHECK(vocab.size() < static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                    "{}: model.vocab is too large", where);
  nodes_.resize(children.size());
  for (size_t n = 0; n < children.size(); ++n) {
    nodes_[n] = {static_cast<uint32_t>(edge_bytes_.size()), static_cast<uint32_t>(children[n].size()), piece_at[n]};
    for (auto [byte, next] : children[n]) edge_bytes_.push_back(byte), edge_nodes_.push_back(next);
  }
  for (int b = 0; b < 256; ++b) {
    auto it = children[0].find(static_cast<unsigned char>(b));
    root_children_[b] = it == children[0].end() ? -1 : it->second;
  }
  if (model.contains("unk_id") && !model["unk_id"].is_null()) {
    AUTOTP_USER_CHECK(model["unk_id"].is_number_integer(), "{}: model.unk_id must be an integer or null", where);
    unk_id_ = model["unk_id"].get<int64_t>();
    AUTOTP_USER_CHECK(unk_id_ >= 0 && unk_id_ < static_cast<int64_t>(vocab.size()),
                      "{}: model.unk_id {} is not an index of model.vocab ({} pieces)", where, unk_id_, vocab.size());
  }
  unk_score_ = min_score - kUnkPenalty;
  byte_fallback_ = model.value("byte_fallback", false);
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(fmt::format("<0x{:02X}>", b));
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }
}

inline int32_t UnigramModel::child(int32_t node, unsigned char byte) const {
  const Node& n = nodes_[node];
  const unsigned char* bytes = edge_bytes_.data() + n.first;
  if (n.count <= 8) {
    for (uint32_t k = 0; k < n.count && bytes[k] <= byte; ++k)
      if (bytes[k] == byte) return edge_nodes_[n.first + k];
    return -1;
  }
  const unsigned char* hit = std::lower_bound(bytes, bytes + n.count, byte);
  return hit != bytes + n.count && *hit == byte ? edge_nodes_[n.first + (hit - bytes)] : -1;
}

void UnigramModel::encode_word(std::string_view word, std::vector<int64_t>& ids) const {
  const size_t n = word.size();
  if (n == 0) return;
  // best[e]: the best segmentation of word[0, e); its last piece is word[start, e) with id `id`.
  struct Best {
    double score;
    int64_t start, id;
  };
  thread_local std::vector<Best> best;
  best.assign(n + 1, Best{0.0, -1, -1});
  for (size_t s = 0; s < n;) {
    const double here = best[s].score;
    const size_t char_len = std::min(utf8_length(static_cast<unsigned char>(word[s])), n - s);
    bool has_char_piece = false;
    // Every piece starting at s, shortest first (HF's common_prefix_search order; ties keep the earlier one).
    int32_t node = root_children_[static_cast<unsigned char>(word[s])];
    for (size_t e = s + 1; node >= 0; ++e) {
      const int32_t id = nodes_[node].id;
      if (id >= 0) {
        const double score = scores_[id] + here;
        Best& to = best[e];
        if (to.start < 0 || score > to.score) to = {score, static_cast<int64_t>(s), id};
        if (e - s == char_len) has_char_piece = true;
      }
      if (e == n) break;
      node = child(node, static_cast<unsigned char>(word[e]));
    }
    if (!has_char_piece) {
      const double score = unk_score_ + here;
      Best& to = best[s + char_len];
      if (to.start < 0 || score > to.score) {
        AUTOTP_USER_CHECK(unk_id_ >= 0,
                          "tokenizer: '{}' is not in the vocabulary and the Unigram model has no unk_id",
                          std::string(word.substr(s, char_len)));
        to = {score, static_cast<int64_t>(s), unk_id_};
      }
    }
    s += char_len;
  }
  // The path, back to front, as piece end positions.
  thread_local std::vector<size_t> ends;
  ends.clear();
  for (size_t e = n; e > 0; e = static_cast<size_t>(best[e].start)) ends.push_back(e);
  // A run of unk pieces is one string (HF's fuse_unk, always on for Unigram), which HF then looks up
  // as a whole, else takes as bytes (byte_fallback), else as one unk.
  auto emit_unk = [&](size_t b, size_t e) {
    const std::string text(word.substr(b, e - b));
    auto it = vocab_.find(text);
    if (it != vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
    if (byte_fallback_ && std::all_of(text.begin(), text.end(),
                                      [&](char c) { return byte_ids_[static_cast<unsigned char>(c)] >= 0; })) {
      for (char c : text) ids.push_back(byte_ids_[static_cast<unsigned char>(c)]);
      return;
    }
    ids.push_back(unk_id_);
  };
  size_t unk_begin = 0;
  bool in_unk = false;
  for (size_t k = ends.size(); k-- > 0;) {
    const size_t e = ends[k];
    const Best& piece = best[e];
    const size_t b = static_cast<size_t>(piece.start);
    if (piece.id == unk_id_) {
      if (!in_unk) unk_begin = b, in_unk = true;
      continue;
    }
    if (in_unk) emit_unk(unk_begin, b), in_unk = false;
    ids.push_back(piece.id);
  }
  if (in_unk) emit_unk(unk_begin, n);
}

}  // namespace autotp::tok
