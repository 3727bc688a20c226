// Supervised fine-tuning examples from records (docs/data.md):
//   {"text"}                               text, packed (not an SFT example)
//   {"instruction", "input"?, "output"}    through a prompt template (prompt_template.h)
//   {"messages": [{"role", "content"}]}    through the model's chat template, rendered by
//   {"conversations": [{"from", "value"}]} Jinja as HF's apply_chat_template does (ShareGPT:
//                                          human -> user, gpt -> assistant, system -> system)
// Each example is the record's tokens and which of them are learned. Errors are
// UserErrors without a location: the reader prefixes the file and the record.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "autotp/data/chat_template.h"
#include "autotp/data/prompt_template.h"
#include "autotp/tokenizer/text_tokenizer.h"

namespace autotp {

struct SftExample {
  std::vector<uint32_t> tokens;  // the whole record (the reader cuts it to seq_len + 1)
  std::vector<uint8_t> learned;  // per token: 1 = a training target (the label that predicts it is kept)
};

enum class RecordKind { kText, kInstruction, kChat };
const char* record_kind_name(RecordKind kind);
// The kind of one record; UserError for a record of none or of several kinds.
RecordKind record_kind(const nlohmann::json& record);

struct SftOptions {
  std::string prompt_template = PromptTemplate::kDefault;  // instruction records: alpaca | plain | FILE
  std::string chat_template_file;  // chat records: --chat-template FILE ("" = the model directory's)
  std::string chat_template_dir;   // the model directory: its chat template and special tokens
  bool assistant_only_loss = true; // chat records: learn the assistant turns only (false: every token)
};

class SftEncoder {
 public:
  SftEncoder(std::shared_ptr<const tok::TextTokenizer> tokenizer, SftOptions options);
  SftExample instruction(const nlohmann::json& record) const;
  SftExample chat(const nlohmann::json& record) const;
  // The messages of a chat record ({"messages"} as given; ShareGPT's mapped), checked.
  static nlohmann::json chat_messages(const nlohmann::json& record);

 private:
  const ChatTemplate& chat_template() const;  // loaded on the first chat record
  // Learns the tokens of text[begin, end) within `ids`, the ids of the whole `text`.
  void learn_span(const std::string& text, size_t begin, size_t end, const std::vector<int64_t>& ids,
                  std::vector<uint8_t>& learned) const;
  std::shared_ptr<const tok::TextTokenizer> tokenizer_;
  SftOptions options_;
  PromptTemplate prompt_;
  mutable std::optional<ChatTemplate> chat_;
};

}  // namespace autotp
