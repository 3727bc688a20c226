// The tokenizer a run's text goes through: a model directory's own (tokenizer.json
// with tokenizer_config.json, or SentencePiece's tokenizer.model) or the byte-level
// one of the presets. The data layer builds documents and instruction records from
// it (docs/data.md says how BOS / EOS are placed).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace autotp::tok {

class TextTokenizer {
 public:
  virtual ~TextTokenizer();
  // Appends the ids of `text` with no special token added. tokenizer.json: added and
  // special tokens written in the text are still matched, as HF does; tokenizer.model:
  // sentencepiece's EncodeAsIds, which reads "<s>" in text as plain text.
  virtual void encode(std::string_view text, std::vector<int64_t>& ids) const = 0;
  // The text one token stands for, best effort, for showing data ("" when unknown:
  // callers print the id).
  virtual std::string token_text(int64_t id) const;
  // One more than the largest id it can produce.
  virtual int64_t vocab_size() const = 0;
  // One line for the log: kind and file.
  virtual std::string describe() const = 0;

  std::optional<int64_t> bos_id, eos_id, pad_id;
  bool add_bos = false;  // a document starts with BOS (HF: add_bos_token, or the post-processor's template)
};

// 256 byte ids, then BOS and EOS; padding uses pad (its labels are ignored).
std::shared_ptr<const TextTokenizer> byte_level_tokenizer(int64_t bos = 256, int64_t eos = 257, int64_t pad = 257);

// The files a model directory's tokenizer is read from, in the order they are tried.
inline constexpr const char* kTokenizerFiles[] = {"tokenizer.json", "tokenizer.model"};

// Whether `dir` holds one of kTokenizerFiles.
bool has_tokenizer_files(const std::string& dir);

// The tokenizer of the model directory `dir`: tokenizer.json (with tokenizer_config.json's
// special tokens when present), else tokenizer.model. UserError naming the directory and
// the files looked for when there is none, and naming the file for a bad one.
std::shared_ptr<const TextTokenizer> load_model_tokenizer(const std::string& dir);

}  // namespace autotp::tok
