// HF chat templates (autotp/data/chat_template.h) against transformers 5.25's
// apply_chat_template on the shipped templates (tests/data/chat_templates, made by
// make_fixtures.py there): the text byte for byte, its ids through autotp's tokenizer id
// for id, the templates' own errors, and {% generation %} spans; then how templates are
// found in a model directory, syntax errors, and one-thread rendering throughput.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>

#include "autotp/base/error.h"
#include "autotp/data/chat_template.h"
#include "autotp/tokenizer/text_tokenizer.h"
#include "support/checks.h"

namespace autotp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kData = fs::path(AUTOTP_SOURCE_DIR) / "tests" / "data" / "chat_templates";

#define SKIP_WITHOUT_PYTHON()                                                                          \
  do {                                                                                                 \
    if (!chat_templates_available())                                                                   \
      GTEST_SKIP() << "chat templates unavailable here (install libpython3-dev and python3-jinja2)"; \
  } while (0)

std::vector<json> expected_lines() {
  std::ifstream in(kData / "expected.jsonl");
  std::vector<json> lines;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(json::parse(line));
  return lines;
}

fs::path temp_dir(const std::string& name) {
  const auto dir = fs::temp_directory_path() / fmt::format("autotp_chat_{}_{}", name, ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

TEST(ChatTemplate, MatchesTransformersTextAndIds) {
  SKIP_WITHOUT_PYTHON();
  const auto lines = expected_lines();
  ASSERT_GE(lines.size(), 60u);
  std::map<std::string, ChatTemplate> templates;
  std::map<std::string, std::shared_ptr<const tok::TextTokenizer>> tokenizers;
  size_t texts = 0, ids = 0, errors = 0;
  for (const auto& line : lines) {
    const std::string name = line["template"], where = fmt::format("{} / {}", name, line["case"].get<std::string>());
    const std::string dir = (kData / (name + "_tokenizer")).string();
    if (!templates.count(name)) {
      auto found = ChatTemplate::from_model_dir(dir);
      ASSERT_TRUE(found.has_value()) << dir;
      templates.emplace(name, *found);
      tokenizers[name] = tok::load_model_tokenizer(dir);
    }
    const auto& chat = templates.at(name);
    if (line.contains("error")) {
      const auto message = test::user_error_of([&] { chat.render(line["messages"], line["add_generation_prompt"]); });
      EXPECT_NE(message.find(line["error"].get<std::string>()), std::string::npos) << where << ": " << message;
      ++errors;
      continue;
    }
    const auto rendered = chat.render(line["messages"], line["add_generation_prompt"]);
    EXPECT_EQ(rendered.text, line["text"].get<std::string>()) << where;
    texts += rendered.text == line["text"].get<std::string>();
    std::vector<int64_t> got;
    tokenizers.at(name)->encode(rendered.text, got);
    EXPECT_EQ(got, line["ids"].get<std::vector<int64_t>>()) << where;
    ids += got == line["ids"].get<std::vector<int64_t>>();
    if (line.contains("generation_spans")) {
      std::vector<std::pair<size_t, size_t>> spans;
      for (const auto& span : line["generation_spans"]) spans.emplace_back(span[0], span[1]);
      EXPECT_EQ(rendered.generation_spans, spans) << where;
      // Each span is the assistant text the prefix-by-prefix renders found.
      ASSERT_EQ(spans.size(), line["assistant_spans"].size()) << where;
      for (size_t i = 0; i < spans.size(); ++i)
        EXPECT_EQ(rendered.text.substr(spans[i].first, spans[i].second - spans[i].first),
                  line["assistant_spans"][i]["text"].get<std::string>())
            << where;
    } else {
      EXPECT_TRUE(rendered.generation_spans.empty()) << where;
    }
  }
  std::cout << fmt::format("{} renders byte for byte, {} id for id, {} template errors, of {} fixtures\n", texts, ids,
                           errors, lines.size());
  EXPECT_EQ(texts + errors, lines.size());
  EXPECT_EQ(ids, texts);
}

TEST(ChatTemplate, SpecialTokensAndGenerationMarks) {
  SKIP_WITHOUT_PYTHON();
  const auto llama = ChatTemplate::from_model_dir((kData / "llama3_tokenizer").string());
  ASSERT_TRUE(llama.has_value());
  EXPECT_FALSE(llama->has_generation_marks());
  EXPECT_EQ(llama->origin(), (kData / "llama3_tokenizer" / "tokenizer_config.json").string());
  const auto text = llama->render(json::parse(R"([{"role": "user", "content": "x"}])"), true).text;
  EXPECT_EQ(text.rfind("<|begin_of_text|>", 0), 0u) << text;  // bos_token from tokenizer_config.json

  const auto dir = temp_dir("marks");
  // AddedToken objects for special tokens; every whitespace-control form of the marks.
  write(dir / "tokenizer_config.json", R"({"bos_token": {"content": "<B>", "special": true}, "eos_token": "<E>"})");
  write(dir / "t.jinja",
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {%- generation -%} {{ m.content }}{{ eos_token }}"
        "{%+ endgeneration %}|{% endfor %}");
  const auto marked = ChatTemplate::from_file((dir / "t.jinja").string(), dir.string());
  EXPECT_TRUE(marked.has_generation_marks());
  const auto out =
      marked.render(json::parse(R"([{"role": "user", "content": "héllo"}, {"role": "a", "content": "wörld ✨"}])"), false);
  EXPECT_EQ(out.text, "<B>user:héllo<E>|a:wörld ✨<E>|");
  ASSERT_EQ(out.generation_spans.size(), 2u);
  // Byte offsets: é, ö are 2 bytes, ✨ 3.
  EXPECT_EQ(out.generation_spans[0], std::make_pair(size_t{8}, size_t{17}));
  EXPECT_EQ(out.text.substr(8, 9), "héllo<E>");
  EXPECT_EQ(out.text.substr(out.generation_spans[1].first,
                            out.generation_spans[1].second - out.generation_spans[1].first),
            "wörld ✨<E>");
  fs::remove_all(dir);
}

TEST(ChatTemplate, ErrorsNameTheTemplateAndJinjasMessage) {
  SKIP_WITHOUT_PYTHON();
  const auto dir = temp_dir("errors");
  write(dir / "bad.jinja", "line one\n{% for m in messages %}{{ m.content }\n{% endfor %}");
  const auto syntax = test::user_error_of([&] { ChatTemplate::from_file((dir / "bad.jinja").string(), ""); });
  EXPECT_NE(syntax.find((dir / "bad.jinja").string()), std::string::npos) << syntax;
  EXPECT_NE(syntax.find("line 2"), std::string::npos) << syntax;
  EXPECT_NE(syntax.find("unexpected '}'"), std::string::npos) << syntax;

  write(dir / "undefined.jinja", "{{ messages[0].content }}\n{{ nothing.here }}");
  const auto undefined = ChatTemplate::from_file((dir / "undefined.jinja").string(), "");
  const auto message = test::user_error_of([&] { undefined.render(json::parse(R"([{"role": "user", "content": "x"}])"), false); });
  EXPECT_NE(message.find("'nothing' is undefined"), std::string::npos) << message;
  EXPECT_NE(message.find("line 2"), std::string::npos) << message;

  write(dir / "raise.jinja", "{{ raise_exception('No ' + messages[0].role + ' here') }}");
  const auto raising = ChatTemplate::from_file((dir / "raise.jinja").string(), "");
  EXPECT_NE(test::user_error_of([&] { raising.render(json::parse(R"([{"role": "tool"}])"), false); }).find("No tool here"),
            std::string::npos);
  // The sandbox: no attribute escapes, no underscore names on namespaces.
  write(dir / "escape.jinja", "{{ messages.__class__.__mro__ }}");
  EXPECT_NE(test::user_error_of([&] {
              ChatTemplate::from_file((dir / "escape.jinja").string(), "")
                  .render(json::parse(R"([{"role": "user"}])"), false);
            }),
            "(no error)");
  write(dir / "ns.jinja", "{% set ns = namespace(_x=1) %}{{ ns._x }}");
  EXPECT_NE(test::user_error_of([&] {
              ChatTemplate::from_file((dir / "ns.jinja").string(), "")
                  .render(json::parse(R"([{"role": "user"}])"), false);
            }).find("underscore-prefixed"),
            std::string::npos);
  EXPECT_NE(test::user_error_of([&] { raising.render(json::array(), false); }).find("empty conversation"), std::string::npos);
  EXPECT_NE(test::user_error_of([&] { raising.render(json::parse("[1]"), false); }).find("JSON objects"), std::string::npos);
  fs::remove_all(dir);
}

TEST(ChatTemplate, FoundWhereTransformersLooks) {
  SKIP_WITHOUT_PYTHON();
  const auto dir = temp_dir("find");
  const json one = json::parse(R"([{"role": "user", "content": "x"}])");
  EXPECT_FALSE(ChatTemplate::from_model_dir(dir.string()).has_value());
  write(dir / "chat_template.json", R"({"chat_template": "json:{{ messages[0].content }}"})");
  EXPECT_EQ(ChatTemplate::from_model_dir(dir.string())->render(one, false).text, "json:x");
  write(dir / "tokenizer_config.json",
        R"({"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "config:{{ bos_token }}"}], "bos_token": "<s>"})");
  EXPECT_EQ(ChatTemplate::from_model_dir(dir.string())->render(one, false).text, "config:<s>");
  write(dir / "chat_template.jinja", "jinja:{{ bos_token }}\n");
  const auto jinja = ChatTemplate::from_model_dir(dir.string());
  EXPECT_EQ(jinja->render(one, false).text, "jinja:<s>");  // Jinja drops one trailing newline, as in HF
  EXPECT_EQ(jinja->origin(), (dir / "chat_template.jinja").string());
  write(dir / "tokenizer_config.json", R"({"chat_template": [{"name": "tool_use", "template": "t"}]})");
  fs::remove(dir / "chat_template.jinja");
  EXPECT_NE(test::user_error_of([&] { ChatTemplate::from_model_dir(dir.string()); }).find("none named \"default\""),
            std::string::npos);
  fs::remove_all(dir);
}

// Records per second, one thread, over the fixture conversations (README.md there
// records it beside transformers').
TEST(ChatTemplate, Throughput) {
  SKIP_WITHOUT_PYTHON();
  std::vector<std::pair<ChatTemplate, json>> work;
  std::map<std::string, ChatTemplate> templates;
  for (const auto& line : expected_lines()) {
    if (line.contains("error")) continue;
    const std::string name = line["template"];
    if (!templates.count(name))
      templates.emplace(name, *ChatTemplate::from_model_dir((kData / (name + "_tokenizer")).string()));
    json record = line;
    work.emplace_back(templates.at(name), record);
  }
  ASSERT_FALSE(work.empty());
  constexpr int kRenders = 2000;
  size_t bytes = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kRenders; ++i) {
    const auto& [chat, line] = work[static_cast<size_t>(i) % work.size()];
    bytes += chat.render(line["messages"], line["add_generation_prompt"]).text.size();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << fmt::format("autotp ChatTemplate::render: {} renders over {} conversations in {:.3f} s = {:.0f} records/s "
                           "(one thread; {} bytes)\n",
                           kRenders, work.size(), seconds, kRenders / seconds, bytes);
}

}  // namespace
}  // namespace autotp
