// The Unigram model of HF's tokenizer.json ("model": {"type": "Unigram"}), as
// SentencePiece's unigram runtime: a word becomes the segmentation into vocabulary
// pieces of highest summed score (Viterbi), a character with no piece of its own
// scores min_score - 10 as unk, runs of unks fuse into one, and with byte_fallback
// a fused unk becomes its UTF-8 bytes' <0xXX> pieces.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace autotp::tok {

class UnigramModel {
 public:
  // `model`: the tokenizer.json "model" object; `where` names it in errors (UserError).
  UnigramModel(const nlohmann::json& model, const std::string& where);

  // Appends the ids of one pre-tokenized word.
  void encode_word(std::string_view word, std::vector<int64_t>& ids) const;

  const std::unordered_map<std::string, int64_t>& vocab() const { return vocab_; }

 private:
  // A byte trie over the pieces: edges of node n are edge_bytes_/edge_nodes_[first, first + count),
  // sorted by byte; the root's children are also in a direct 256-entry table.
  struct Node {
    uint32_t first = 0, count = 0;
    int32_t id = -1;  // the piece ending here, -1 for none
  };
  int32_t child(int32_t node, unsigned char byte) const;

  std::unordered_map<std::string, int64_t> vocab_;  // a repeated piece maps to its last id, as HF
  std::vector<double> scores_;                      // by id
  std::vector<Node> nodes_;
  std::vector<unsigned char> edge_bytes_;
  std::vector<int32_t> edge_nodes_;
  int32_t root_children_[256];
  int64_t unk_id_ = -1;
  double unk_score_ = 0;
  bool byte_fallback_ = false;
  int64_t byte_ids_[256];
};

}  // namespace autotp::tok
