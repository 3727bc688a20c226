// Training datasets: files of text or token ids turned into fixed-length
// next-token examples. open_dataset picks the format by the file's extension
// (.txt, .jsonl, .json, .bin; see docs/data.md for the exact rules).
//
// A Dataset is immutable after open_dataset returns: get() and size() are const
// and safe to call from several threads. Every problem with the file (bad JSON,
// ids out of range, nothing left to train on) is a UserError naming the file,
// and the line or record where there is one, raised by open_dataset, so a bad
// file fails before the first step.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "autotp/data/sft_examples.h"
#include "autotp/tokenizer/text_tokenizer.h"

namespace autotp {

// Label value that takes a position out of the loss (as in PyTorch / HF).
constexpr int64_t kIgnoreLabel = -100;

// One training example: input_ids[t] predicts labels[t]; kIgnoreLabel = not in the loss.
// Both vectors have the dataset's seq_len entries.
struct Example {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> labels;
};

struct DataOptions {
  int64_t seq_len = 0;     // input tokens per example; 0 = from the data (.json only), else required
  int64_t vocab_size = 0;  // every id must be < vocab_size; required (> 0)
  std::string bin_dtype = "uint16";  // element type of .bin token files: uint16 | uint32
  // The text formats' tokenizer (a model directory's own); null = the byte-level one
  // with the ids below (docs/data.md).
  std::shared_ptr<const tok::TextTokenizer> tokenizer;
  int64_t bos_id = 256;              // byte-level tokenizer: begin-of-text id (after the 256 byte ids)
  int64_t eos_id = 257;              // byte-level tokenizer: end-of-text id
  int64_t pad_id = 257;              // input id of padded positions (their labels are kIgnoreLabel); a
                                     // tokenizer's own pad id replaces it
  SftOptions sft;                    // instruction and chat records: prompt / chat template, loss mask
};

class Dataset {
 public:
  virtual ~Dataset();
  // Number of examples (> 0).
  virtual int64_t size() const = 0;
  // Tokens per example (inputs and labels alike).
  virtual int64_t seq_len() const = 0;
  // Example `index` in [0, size()); the same index always gives the same example.
  virtual Example get(int64_t index) const = 0;
  // One line for the log: file, format, token and example counts.
  virtual std::string describe() const = 0;
};

// Opens `path` by extension: .txt (text, one document), .jsonl (text, instruction or
// chat records, one a line), .json (an array of such records, or token-id arrays,
// one example each), .bin (flat little-endian token stream). UserError naming the file for an unknown extension, a malformed
// or empty file, ids outside [0, vocab_size), a missing seq_len where the format
// needs one, or a vocab_size too small for the tokenizer.
std::unique_ptr<Dataset> open_dataset(const std::string& path, const DataOptions& options);

// Whether `path` holds text the tokenizer reads: .txt, .jsonl, or a .json array of
// records (not token-id arrays).
bool holds_text(const std::string& path);

// A .txt file (one document) or a .jsonl file of text records as the packed token
// stream a training run reads from it, for `autotp tokenize`. Instruction records
// are a UserError (a token file has no prompt mask).
struct TokenizedText {
  std::vector<uint32_t> tokens;
  std::string what;  // records and tokenizer, for the log
  size_t bytes = 0;
  double seconds = 0;
};
using TokenizeProgress = std::function<void(size_t bytes_done, size_t bytes_total)>;
TokenizedText tokenize_documents(const std::string& path, const DataOptions& options,
                                 const TokenizeProgress& progress = {});

}  // namespace autotp
