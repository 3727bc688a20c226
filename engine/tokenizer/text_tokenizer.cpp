#include "autotp/tokenizer/text_tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>

#include "autotp/base/error.h"
#include "autotp/base/json_file.h"
#include "autotp/tokenizer/sentencepiece_model.h"
#include "autotp/tokenizer/tokenizer.h"

namespace autotp::tok {

TextTokenizer::~TextTokenizer() = default;

std::string TextTokenizer::token_text(int64_t) const { return ""; }

namespace {

class ByteLevelTokenizer : public TextTokenizer {
 public:
  ByteLevelTokenizer(int64_t bos, int64_t eos, int64_t pad) {
    bos_id = bos, eos_id = eos, pad_id = pad;
    add_bos = true;
    vocab_size_ = std::max({int64_t{256}, bos + 1, eos + 1, pad + 1});
  }
  void encode(std::string_view text, std::vector<int64_t>& ids) const override {
    for (unsigned char byte : text) ids.push_back(byte);
  }
  std::string token_text(int64_t id) const override {
    if (id >= 0 && id < 256) return std::string(1, static_cast<char>(id));
    return id == bos_id ? "<bos>" : id == eos_id ? "<eos>" : "";
  }
  int64_t vocab_size() const override { return vocab_size_; }
  std::string describe() const override { return "byte-level tokenizer"; }

 private:
  int64_t vocab_size_ = 0;
};

class JsonTokenizer : public TextTokenizer {
 public:
  JsonTokenizer(Tokenizer tokenizer, std::string path) : tokenizer_(std::move(tokenizer)), path_(std::move(path)) {}
  void encode(std::string_view text, std::vector<int64_t>& ids) const override {
    const auto piece = tokenizer_.encode(text, false);
    ids.insert(ids.end(), piece.begin(), piece.end());
  }
  std::string token_text(int64_t id) const override { return tokenizer_.token_text(id); }
  int64_t vocab_size() const override { return tokenizer_.vocab_size(); }
  std::string describe() const override { return path_; }
  const Tokenizer& tokenizer() const { return tokenizer_; }

 private:
  Tokenizer tokenizer_;
  std::string path_;
};

class SentencePieceTokenizer : public TextTokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : model_(path), path_(path) {
    bos_id = model_.bos_id(), eos_id = model_.eos_id(), pad_id = model_.pad_id();
    add_bos = bos_id.has_value();  // the sentencepiece-based HF tokenizers' default (add_bos_token true)
  }
  void encode(std::string_view text, std::vector<int64_t>& ids) const override { model_.encode(text, ids); }
  int64_t vocab_size() const override { return model_.vocab_size(); }
  std::string describe() const override { return path_; }
  const SentencePieceModel& model() const { return model_; }

 private:
  SentencePieceModel model_;
  std::string path_;
};

// tokenizer_config.json names special tokens as a string or as an AddedToken object.
std::optional<std::string> token_content(const nlohmann::json& config, const char* key) {
  if (!config.contains(key)) return std::nullopt;
  const auto& value = config.at(key);
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value.at("content").is_string())
    return value.at("content").get<std::string>();
  return std::nullopt;
}

// config.json's numeric id of a special token (an int, or the first of a list as Llama 3.1 has).
std::optional<int64_t> config_token_id(const nlohmann::json& config, const char* key) {
  if (!config.contains(key)) return std::nullopt;
  const auto& value = config.at(key);
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_array() && !value.empty() && value.front().is_number_integer()) return value.front().get<int64_t>();
  return std::nullopt;
}

nlohmann::json optional_json(const std::string& path, const char* what) {
  return std::filesystem::exists(path) ? read_json_file(path, what) : nlohmann::json::object();
}

// Special tokens, in order: tokenizer_config.json's token names, config.json's ids,
// then what the tokenizer itself says (its model or its post-processor's template).
void resolve_special_tokens(const std::string& dir, TextTokenizer& t,
                            const std::function<std::optional<int64_t>(const std::string&)>& id_of,
                            const std::vector<int64_t>& prefix, const std::vector<int64_t>& suffix) {
  const std::string config_path = dir + "/tokenizer_config.json";
  const nlohmann::json tokenizer_config = optional_json(config_path, "tokenizer config");
  const nlohmann::json model_config = optional_json(dir + "/config.json", "model config");
  struct Special {
    const char* token_key;
    const char* id_key;
    std::optional<int64_t>* id;
  };
  for (const Special& s : {Special{"bos_token", "bos_token_id", &t.bos_id}, Special{"eos_token", "eos_token_id", &t.eos_id},
                           Special{"pad_token", "pad_token_id", &t.pad_id}}) {
    if (auto content = token_content(tokenizer_config, s.token_key)) {
      const auto id = id_of(*content);
      AUTOTP_USER_CHECK(id.has_value(), "{}: {} '{}' is not a token of the tokenizer", config_path, s.token_key,
                        *content);
      *s.id = id;
    } else if (auto id = config_token_id(model_config, s.id_key)) {
      *s.id = id;
    }
  }
  // A template that puts tokens around the text (Llama's <s> ..., BERT's [CLS] ... [SEP]):
  // BOS from before the text only, EOS from after it only.
  if (!t.bos_id && !prefix.empty()) t.bos_id = prefix.front();
  if (!t.eos_id && !suffix.empty()) t.eos_id = suffix.back();
  if (tokenizer_config.contains("add_bos_token") && tokenizer_config.at("add_bos_token").is_boolean())
    t.add_bos = tokenizer_config.at("add_bos_token").get<bool>() && t.bos_id.has_value();
  else if (!prefix.empty())
    t.add_bos = t.bos_id && prefix.front() == *t.bos_id;
  if (!t.pad_id) t.pad_id = t.eos_id ? *t.eos_id : 0;
  for (const auto* id : {&t.bos_id, &t.eos_id, &t.pad_id})
    AUTOTP_USER_CHECK(!*id || (**id >= 0 && **id < t.vocab_size()),
                      "{}: special token id {} is outside the tokenizer's vocabulary [0, {})", dir, **id,
                      t.vocab_size());
}

}  // namespace

std::shared_ptr<const TextTokenizer> byte_level_tokenizer(int64_t bos, int64_t eos, int64_t pad) {
  return std::make_shared<ByteLevelTokenizer>(bos, eos, pad);
}

bool has_tokenizer_files(const std::string& dir) {
  for (const char* file : kTokenizerFiles)
    if (std::filesystem::exists(dir + "/" + file)) return true;
  return false;
}

std::shared_ptr<const TextTokenizer> load_model_tokenizer(const std::string& dir) {
  const std::string json_path = dir + "/tokenizer.json", model_path = dir + "/tokenizer.model";
  if (std::filesystem::exists(json_path)) {
    auto t = std::make_shared<JsonTokenizer>(Tokenizer::from_file(json_path), json_path);
    const Tokenizer& inner = t->tokenizer();
    resolve_special_tokens(
        dir, *t, [&](const std::string& token) { return inner.token_id(token); }, inner.special_prefix(),
        inner.special_suffix());
    return t;
  }
  if (std::filesystem::exists(model_path)) {
    auto t = std::make_shared<SentencePieceTokenizer>(model_path);
    const SentencePieceModel& inner = t->model();
    resolve_special_tokens(
        dir, *t, [&](const std::string& token) { return inner.piece_id(token); }, {}, {});
    return t;
  }
  throw_user_error(
      "{}: the model directory has no tokenizer (looked for tokenizer.json and tokenizer.model); copy the model's "
      "tokenizer files there, or train on byte ids with --tokenizer bytes (a scenario: \"tokenizer\": \"bytes\")",
      dir);
}

}  // namespace autotp::tok
