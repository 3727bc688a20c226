// The BPE model of HF's tokenizer.json ("model": {"type": "BPE"}): a word becomes
// its characters' ids (or, with byte_fallback, <0xXX> byte tokens; else unk),
// then the adjacent pair of lowest merge rank is merged until none applies.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace autotp::tok {

class BpeModel {
 public:
  // `model`: the tokenizer.json "model" object; `where` names it in errors (UserError).
  BpeModel(const nlohmann::json& model, const std::string& where);

  // Appends the ids of one pre-tokenized word.
  void encode_word(std::string_view word, std::vector<int64_t>& ids) const;

  const std::unordered_map<std::string, int64_t>& vocab() const { return vocab_; }

 private:
  struct PairHash {
    size_t operator()(const std::pair<int64_t, int64_t>& p) const {
      return std::hash<int64_t>()(p.first * 1000003 + p.second);
    }
  };
  struct Merge {
    int64_t rank = 0, id = 0;
  };
  std::unordered_map<std::string, int64_t> vocab_;
  std::unordered_map<std::pair<int64_t, int64_t>, Merge, PairHash> merges_;
  int64_t unk_id_ = -1;
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false;
  int64_t byte_ids_[256];
};

}  // namespace autotp::tok
