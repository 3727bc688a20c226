#include "autotp/data/sft_examples.h"

#include <algorithm>

#include "autotp/base/error.h"

namespace autotp {
namespace {

using nlohmann::json;

std::string string_field(const json& record, const char* key) {
  const auto it = record.find(key);
  AUTOTP_USER_CHECK(it != record.end(), "the record has no \"{}\" field", key);
  AUTOTP_USER_CHECK(it->is_string(), "\"{}\" must be a string, got {}", key, it->type_name());
  return it->get<std::string>();
}

void append_ids(const std::vector<int64_t>& ids, std::vector<uint32_t>& out) {
  for (int64_t id : ids) out.push_back(static_cast<uint32_t>(id));
}

size_t common_prefix(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  return static_cast<size_t>(std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin());
}

}  // namespace

const char* record_kind_name(RecordKind kind) {
  return kind == RecordKind::kText ? "text" : kind == RecordKind::kInstruction ? "instruction" : "chat";
}

RecordKind record_kind(const json& record) {
  AUTOTP_USER_CHECK(record.is_object(), "expected a JSON object, got {}", record.type_name());
  const bool text = record.contains("text"), instruction = record.contains("instruction");
  const bool chat = record.contains("messages") || record.contains("conversations");
  const int kinds = int(text) + int(instruction) + int(chat);
  AUTOTP_USER_CHECK(kinds <= 1,
                    "a record is one of text (\"text\"), instruction (\"instruction\", \"output\") or chat "
                    "(\"messages\" or \"conversations\"), not several");
  AUTOTP_USER_CHECK(kinds == 1,
                    "the record has none of \"text\", \"instruction\" (with \"output\"), \"messages\" or "
                    "\"conversations\"");
  return text ? RecordKind::kText : instruction ? RecordKind::kInstruction : RecordKind::kChat;
}

SftEncoder::SftEncoder(std::shared_ptr<const tok::TextTokenizer> tokenizer, SftOptions options)
    : tokenizer_(std::move(tokenizer)),
      options_(std::move(options)),
      prompt_(PromptTemplate::named(options_.prompt_template)) {}

SftExample SftEncoder::instruction(const json& record) const {
  const std::string instruction = string_field(record, "instruction");
  const std::string output = string_field(record, "output");
  std::string input;
  if (record.contains("input") && !record["input"].is_null()) input = string_field(record, "input");
  const std::string prompt = prompt_.prompt(instruction, input);
  std::vector<int64_t> prompt_ids, ids;
  tokenizer_->encode(prompt, prompt_ids);
  tokenizer_->encode(prompt + output, ids);
  SftExample example;
  if (tokenizer_->add_bos) example.tokens.push_back(static_cast<uint32_t>(*tokenizer_->bos_id));
  const size_t bos = example.tokens.size();
  // plain: the longest prefix the prompt alone encodes to, so a token spanning the
  // boundary is learned; alpaca and files: the prompt's own token count, as
  // stanford_alpaca masks label[:len(tokenizer(source))].
  const size_t prompt_tokens = bos + (prompt_.prefix_rule() ? common_prefix(prompt_ids, ids) : prompt_ids.size());
  append_ids(ids, example.tokens);
  if (tokenizer_->eos_id) example.tokens.push_back(static_cast<uint32_t>(*tokenizer_->eos_id));
  example.learned.assign(example.tokens.size(), 0);
  for (size_t t = prompt_tokens; t < example.tokens.size(); ++t) example.learned[t] = 1;
  return example;
}

json SftEncoder::chat_messages(const json& record) {
  json messages;
  if (record.contains("messages")) {
    messages = record["messages"];
    AUTOTP_USER_CHECK(messages.is_array() && !messages.empty(), "\"messages\" must be a non-empty array of "
                                                                 "{{\"role\", \"content\"}} objects");
    for (size_t i = 0; i < messages.size(); ++i) {
      const json& m = messages[i];
      AUTOTP_USER_CHECK(m.is_object(), "messages[{}] must be an object with \"role\" and \"content\"", i);
      AUTOTP_USER_CHECK(m.contains("role") && m["role"].is_string(), "messages[{}] has no \"role\" string", i);
      AUTOTP_USER_CHECK(m.contains("content"), "messages[{}] (role \"{}\") has no \"content\"", i,
                        m["role"].get<std::string>());
    }
    return messages;
  }
  const json& turns = record["conversations"];
  AUTOTP_USER_CHECK(turns.is_array() && !turns.empty(),
                    "\"conversations\" must be a non-empty array of {{\"from\", \"value\"}} objects");
  messages = json::array();
  for (size_t i = 0; i < turns.size(); ++i) {
    const json& t = turns[i];
    AUTOTP_USER_CHECK(t.is_object() && t.contains("from") && t["from"].is_string(),
                      "conversations[{}] has no \"from\" string", i);
    AUTOTP_USER_CHECK(t.contains("value"), "conversations[{}] (from \"{}\") has no \"value\"", i,
                      t["from"].get<std::string>());
    const std::string from = t["from"].get<std::string>();
    const std::string role = from == "human"    ? "user"
                             : from == "gpt"    ? "assistant"
                             : from == "system" ? "system"
                             : from == "user" || from == "assistant" ? from
                                                                     : "";
    AUTOTP_USER_CHECK(!role.empty(),
                      "conversations[{}]: \"from\": \"{}\" is not a ShareGPT role (allowed: human, gpt, system; "
                      "user and assistant are taken as they are)",
                      i, from);
    messages.push_back({{"role", role}, {"content", t["value"]}});
  }
  return messages;
}

const ChatTemplate& SftEncoder::chat_template() const {
  if (chat_) return *chat_;
  if (!options_.chat_template_file.empty()) {
    chat_ = ChatTemplate::from_file(options_.chat_template_file, options_.chat_template_dir);
    return *chat_;
  }
  AUTOTP_USER_CHECK(!options_.chat_template_dir.empty(),
                    "chat records need a chat template, and this run has no model directory to take it from "
                    "(tokenizer_config.json \"chat_template\", chat_template.jinja or chat_template.json): give "
                    "--chat-template FILE");
  chat_ = ChatTemplate::from_model_dir(options_.chat_template_dir);
  AUTOTP_USER_CHECK(chat_.has_value(),
                    "{} has no chat template (tokenizer_config.json \"chat_template\", chat_template.jinja or "
                    "chat_template.json): give --chat-template FILE",
                    options_.chat_template_dir);
  return *chat_;
}

void SftEncoder::learn_span(const std::string& text, size_t begin, size_t end, const std::vector<int64_t>& ids,
                            std::vector<uint8_t>& learned) const {
  // The tokens of text[begin, end): those after the ids text[0, begin) encodes to and up
  // to those text[0, end) encodes to (a token across the start is learned, one across the
  // end is not).
  std::vector<int64_t> before, through;
  tokenizer_->encode(std::string_view(text).substr(0, begin), before);
  tokenizer_->encode(std::string_view(text).substr(0, end), through);
  const size_t first = common_prefix(before, ids), last = common_prefix(through, ids);
  for (size_t t = first; t < last && t < learned.size(); ++t) learned[t] = 1;
}

SftExample SftEncoder::chat(const json& record) const {
  const json messages = chat_messages(record);
  const ChatTemplate& tmpl = chat_template();
  const ChatTemplate::Rendered full = tmpl.render(messages, false);
  std::vector<int64_t> ids;
  tokenizer_->encode(full.text, ids);  // the template places BOS / EOS: nothing is added
  SftExample example;
  append_ids(ids, example.tokens);
  example.learned.assign(example.tokens.size(), options_.assistant_only_loss ? 0 : 1);
  if (!options_.assistant_only_loss) return example;
  if (tmpl.has_generation_marks()) {
    for (const auto& [begin, end] : full.generation_spans) learn_span(full.text, begin, end, ids, example.learned);
    return example;
  }
  // Each assistant turn is the text it adds after the conversation before it, rendered
  // with the generation prompt: its content and the end-of-turn tokens after it, up to
  // where the rendering through it leaves the whole conversation's (a template may end a
  // conversation with EOS, as Phi-3's does, which a later turn does not follow).
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i]["role"] != "assistant") continue;
    const json before_turn(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(i));
    const json through_turn(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(i + 1));
    const std::string before = i == 0 ? std::string() : tmpl.render(before_turn, true).text;
    const std::string through = tmpl.render(through_turn, false).text;
    const size_t begin = before.size();
    size_t end = begin;
    const bool nested = through.compare(0, begin, before) == 0 && full.text.compare(0, begin, before) == 0;
    while (nested && end < through.size() && end < full.text.size() && through[end] == full.text[end]) ++end;
    // The turn's own text must lie in the span, else this turn renders differently inside
    // the whole conversation (Qwen3 drops earlier turns' reasoning blocks).
    const json& content = messages[i]["content"];
    bool holds_content = nested && end > begin;
    if (holds_content && content.is_string()) {
      // Templates may trim the content (Llama 3's `| trim`).
      std::string text = content.get<std::string>();
      const size_t first = text.find_first_not_of(" \t\r\n"), last = text.find_last_not_of(" \t\r\n");
      text = first == std::string::npos ? "" : text.substr(first, last - first + 1);
      const size_t at = text.empty() ? begin : full.text.find(text, begin);
      holds_content = at != std::string::npos && at + text.size() <= end;
    }
    AUTOTP_USER_CHECK(holds_content,
                      "messages[{}]: cannot find the assistant turn in {}'s rendering: the template renders the "
                      "conversation before it (with add_generation_prompt) or this turn differently from the whole "
                      "conversation; use a template with {{% generation %}} marks, or --chat-loss all",
                      i, tmpl.origin());
    learn_span(full.text, begin, end, ids, example.learned);
  }
  return example;
}

}  // namespace autotp
