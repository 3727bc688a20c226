// Supervised fine-tuning data as people have it: Alpaca's JSON array with
// stanford_alpaca's prompt and mask, prompt template files, chat records (messages
// and ShareGPT) through a Jinja chat template with the loss on assistant turns.
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>

#include "autotp/base/error.h"
#include "autotp/data/dataset.h"
#include "autotp/io/safetensors.h"
#include "support/checks.h"
#include "support/cli_runner.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

using nlohmann::json;
using Ids = std::vector<int64_t>;

const std::string kTokenizers = AUTOTP_SOURCE_DIR "/tests/data/tokenizers/";

std::string write(const std::string& path, const std::string& text) {
  io::write_text_file_atomic(path, text);
  return path;
}

// A model directory with llama3_bpe's tokenizer (BOS <|begin_of_text|>, EOS
// <|end_of_text|>) and, when given, a chat template in tokenizer_config.json.
std::string tokenizer_dir(const std::string& chat_template = "") {
  const std::string dir = test::make_temp_dir("sft");
  std::filesystem::copy_file(kTokenizers + "llama3_bpe/tokenizer.json", dir + "/tokenizer.json");
  json config = json::parse(test::read_file(kTokenizers + "llama3_bpe/tokenizer_config.json"));
  if (!chat_template.empty()) config["chat_template"] = chat_template;
  write(dir + "/tokenizer_config.json", config.dump());
  return dir;
}

DataOptions options_for(const std::string& dir, int64_t seq_len = 128) {
  DataOptions o;
  o.seq_len = seq_len;
  o.vocab_size = 1000;
  o.tokenizer = tok::load_model_tokenizer(dir);
  o.sft.chat_template_dir = dir;
  return o;
}

// The learned tokens of an example (the targets its labels keep), as text.
std::string learned_text(const Example& e, const tok::TextTokenizer& tokenizer) {
  std::string text;
  for (int64_t label : e.labels)
    if (label != kIgnoreLabel) text += tokenizer.token_text(label);
  return text;
}

Ids ids_of(const tok::TextTokenizer& tokenizer, const std::string& text) {
  Ids ids;
  tokenizer.encode(text, ids);
  return ids;
}

TEST(SftData, AlpacaPromptIsStanfordAlpacasToTheByte) {
  const PromptTemplate alpaca = PromptTemplate::named("alpaca");
  EXPECT_EQ(alpaca.prompt("Add.", "2 and 3"),
            "Below is an instruction that describes a task, paired with an input that provides further context. "
            "Write a response that appropriately completes the request.\n\n### Instruction:\nAdd.\n\n### Input:\n2 and "
            "3\n\n### Response:");
  EXPECT_EQ(alpaca.prompt("Name a colour.", ""),
            "Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.\n\n### Instruction:\nName a colour.\n\n### Response:");
  // One pass, as format_map: an input that says "{instruction}" stays as written.
  EXPECT_NE(alpaca.prompt("I", "{instruction}").find("### Input:\n{instruction}\n"), std::string::npos);
}

// stanford_alpaca's preprocess: input_ids = tokenize(source + output + eos) with BOS,
// labels[:len(tokenize(source))] = -100 (then shifted by the model).
TEST(SftData, AlpacaRecordsInAJsonArrayAreMaskedAsStanfordAlpacaMasksThem) {
  const std::string dir = tokenizer_dir();
  const std::string path =
      write(dir + "/alpaca.json", R"([{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
                                      {"instruction": "Name a colour.", "input": "", "output": "Blue."}])");
  DataOptions options = options_for(dir);
  const auto data = open_dataset(path, options);
  ASSERT_EQ(data->size(), 2);
  const auto& tokenizer = *options.tokenizer;
  const PromptTemplate alpaca = PromptTemplate::named("alpaca");
  for (int64_t i = 0; i < 2; ++i) {
    const std::string source = i == 0 ? alpaca.prompt("Add the numbers.", "2 and 3") : alpaca.prompt("Name a colour.", "");
    const std::string output = i == 0 ? "5" : "Blue.";
    Ids want = {*tokenizer.bos_id};
    for (int64_t id : ids_of(tokenizer, source + output)) want.push_back(id);
    want.push_back(*tokenizer.eos_id);
    const size_t source_len = 1 + ids_of(tokenizer, source).size();
    const Example e = data->get(i);
    for (size_t t = 0; t < want.size() - 1; ++t) {
      EXPECT_EQ(e.input_ids[t], want[t]) << "record " << i << " position " << t;
      EXPECT_EQ(e.labels[t], t + 1 >= source_len ? want[t + 1] : kIgnoreLabel) << "record " << i << " position " << t;
    }
    for (size_t t = want.size() - 1; t < e.labels.size(); ++t) EXPECT_EQ(e.labels[t], kIgnoreLabel);
    EXPECT_EQ(learned_text(e, tokenizer), output + "<|end_of_text|>");
  }
  // The same records as .jsonl give the same examples.
  const std::string jsonl =
      write(dir + "/alpaca.jsonl", R"({"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"})"
                                   "\n"
                                   R"({"instruction": "Name a colour.", "input": "", "output": "Blue."})"
                                   "\n");
  const auto lines = open_dataset(jsonl, options);
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(lines->get(i).input_ids, data->get(i).input_ids);
    EXPECT_EQ(lines->get(i).labels, data->get(i).labels);
  }
}

TEST(SftData, PromptTemplateFilesAndTheirErrors) {
  const std::string dir = tokenizer_dir();
  const std::string tmpl = write(dir + "/prompt.json", R"({"prompt_input": "Q: {instruction} ({input})\nA:",
                                                           "prompt_no_input": "Q: {instruction}\nA:"})");
  EXPECT_EQ(PromptTemplate::named(tmpl).prompt("why", "sky"), "Q: why (sky)\nA:");
  DataOptions options = options_for(dir);
  options.sft.prompt_template = tmpl;
  const std::string path = write(dir + "/r.json", R"([{"instruction": "why", "output": " Light."}])");
  EXPECT_EQ(learned_text(open_dataset(path, options)->get(0), *options.tokenizer), " Light.<|end_of_text|>");
  const std::string no_instruction = write(dir + "/bad.json", R"({"prompt_input": "{input}", "prompt_no_input": "x"})");
  EXPECT_NE(test::user_error_of([&] { PromptTemplate::named(no_instruction); })
                .find(no_instruction + ": 'prompt_input' has no {instruction} placeholder"),
            std::string::npos);
  EXPECT_NE(test::user_error_of([&] { PromptTemplate::named("vicuna"); }).find("prompt template 'vicuna' is not known (allowed: "
                                                                    "alpaca, plain"),
            std::string::npos);
}

TEST(SftData, RecordArraysRefuseMixedKindsNamingTheRecord) {
  const std::string dir = tokenizer_dir();
  DataOptions options = options_for(dir);
  const std::string mixed = write(dir + "/mixed.json", R"([{"instruction": "a", "output": "b"}, {"text": "c"}])");
  const std::string error = test::user_error_of([&] { open_dataset(mixed, options); });
  EXPECT_NE(error.find(mixed + ": record 1: text record, but record 0 is a instruction record"), std::string::npos)
      << error;
  const std::string objects_and_ids = write(dir + "/both.json", R"([{"text": "a"}, [1, 2, 3]])");
  EXPECT_NE(test::user_error_of([&] { open_dataset(objects_and_ids, options); }).find("record 1: expected an object"),
            std::string::npos);
  const std::string no_content = write(dir + "/nocontent.json", R"([{"messages": [{"role": "user"}]}])");
  EXPECT_NE(test::user_error_of([&] { open_dataset(no_content, options); })
                .find("record 0: messages[0] (role \"user\") has no \"content\""),
            std::string::npos);
  const std::string bad_from =
      write(dir + "/sharegpt.json", R"([{"conversations": [{"from": "robot", "value": "hi"}]}])");
  EXPECT_NE(test::user_error_of([&] { open_dataset(bad_from, options); })
                .find("conversations[0]: \"from\": \"robot\" is not a ShareGPT role"),
            std::string::npos);
}

// A template in the shape of the common ones: no generation marks, the end-of-turn
// token after each turn, the assistant header as the generation prompt.
const char* kChatTemplate =
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}";

TEST(SftData, ChatRecordsLearnTheAssistantTurnsAndTheirEndOfTurn) {
  if (!chat_templates_available()) GTEST_SKIP() << "no embedded Python with jinja2 in this build";
  const std::string dir = tokenizer_dir(kChatTemplate);
  DataOptions options = options_for(dir);
  const json messages = {{{"role", "user"}, {"content", "Hi"}},
                         {{"role", "assistant"}, {"content", "Hello there"}},
                         {{"role", "user"}, {"content", "Bye"}},
                         {{"role", "assistant"}, {"content", "Goodbye"}}};
  const std::string path = write(dir + "/chat.jsonl", json({{"messages", messages}}).dump() + "\n");
  const auto data = open_dataset(path, options);
  const auto& tokenizer = *options.tokenizer;
  const Example e = data->get(0);
  // Rendered: <bos>user: Hi<eos>assistant: Hello there<eos>user: Bye<eos>assistant: Goodbye<eos>; no
  // special token is added (the template placed BOS). Each assistant turn is what it adds after
  // "...assistant:" (the generation prompt): its text and the end-of-turn token.
  const Ids ids = ids_of(tokenizer, "<|begin_of_text|>user: Hi<|end_of_text|>assistant: Hello there<|end_of_text|>"
                                    "user: Bye<|end_of_text|>assistant: Goodbye<|end_of_text|>");
  EXPECT_EQ(Ids(e.input_ids.begin(), e.input_ids.begin() + static_cast<long>(ids.size())), ids);
  EXPECT_EQ(learned_text(e, tokenizer), " Hello there<|end_of_text|> Goodbye<|end_of_text|>");
  // ShareGPT's conversations are the same conversation.
  const std::string sharegpt = write(dir + "/sharegpt.json", R"([{"conversations": [
      {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there"},
      {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Goodbye"}]}])");
  EXPECT_EQ(open_dataset(sharegpt, options)->get(0).labels, e.labels);
  // --chat-loss all: every token after the first.
  options.sft.assistant_only_loss = false;
  EXPECT_EQ(learned_text(open_dataset(path, options)->get(0), tokenizer),
            "user: Hi<|end_of_text|>assistant: Hello there<|end_of_text|>user: Bye<|end_of_text|>assistant: "
            "Goodbye<|end_of_text|>");
}

TEST(SftData, GenerationMarksDecideTheLearnedSpans) {
  if (!chat_templates_available()) GTEST_SKIP() << "no embedded Python with jinja2 in this build";
  const std::string dir = tokenizer_dir(
      "{% for m in messages %}{{ m['role'] }}:{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
      "{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}");
  DataOptions options = options_for(dir);
  const std::string path = write(dir + "/chat.json", R"([{"messages": [{"role": "system", "content": " Be brief."},
      {"role": "user", "content": " Hi"}, {"role": "assistant", "content": " Hello"}]}])");
  EXPECT_EQ(learned_text(open_dataset(path, options)->get(0), *options.tokenizer), " Hello<|end_of_text|>");
}

TEST(SftData, ChatTemplateErrorsNameTheRecordAndTheTemplatesMessage) {
  if (!chat_templates_available()) GTEST_SKIP() << "no embedded Python with jinja2 in this build";
  const std::string dir = tokenizer_dir(
      "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
      "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{{ m['content'] }}{% endfor %}");
  DataOptions options = options_for(dir);
  const std::string path = write(dir + "/chat.jsonl", R"({"messages": [{"role": "user", "content": "a"}]})"
                                                      "\n"
                                                      R"({"messages": [{"role": "tool", "content": "b"}]})"
                                                      "\n");
  const std::string error = test::user_error_of([&] { open_dataset(path, options); });
  EXPECT_NE(error.find(path + ": line 2: "), std::string::npos) << error;
  EXPECT_NE(error.find("Only user and assistant roles are supported!"), std::string::npos) << error;
  // A model directory without a template.
  const std::string plain = tokenizer_dir();
  DataOptions no_template = options_for(plain);
  const std::string chat = write(plain + "/chat.jsonl", R"({"messages": [{"role": "user", "content": "a"}]})"
                                                        "\n");
  const std::string missing = test::user_error_of([&] { open_dataset(chat, no_template); });
  EXPECT_NE(missing.find("has no chat template"), std::string::npos) << missing;
  EXPECT_NE(missing.find("give --chat-template FILE"), std::string::npos) << missing;
  // A template file that does not parse names the file.
  const std::string broken = write(plain + "/broken.jinja", "{% for m in messages %}{{ m['content'] }");
  no_template.sft.chat_template_file = broken;
  const std::string parse = test::user_error_of([&] { open_dataset(chat, no_template); });
  EXPECT_NE(parse.find(broken), std::string::npos) << parse;
}

// The real templates (tests/data/chat_templates, rendered by transformers 5.25 in
// expected.jsonl): the learned tokens of each conversation are exactly the assistant
// spans HF's renders give prefix by prefix (content and end-of-turn tokens).
TEST(SftData, RealTemplatesLearnTheAssistantSpansHfRenders) {
  if (!chat_templates_available()) GTEST_SKIP() << "no embedded Python with jinja2 in this build";
  const std::string root = AUTOTP_SOURCE_DIR "/tests/data/chat_templates/";
  std::istringstream lines(test::read_file(root + "expected.jsonl"));
  int checked = 0, refused = 0, straddling = 0;
  for (std::string line; std::getline(lines, line);) {
    const json c = json::parse(line);
    if (c.value("add_generation_prompt", false) || !c.contains("assistant_spans") || c.contains("error") ||
        c["assistant_spans"].empty())
      continue;
    const std::string dir = root + c["template"].get<std::string>() + "_tokenizer";
    const std::string tmp = test::make_temp_dir("spans");
    const std::string path = write(tmp + "/chat.jsonl", json({{"messages", c["messages"]}}).dump() + "\n");
    DataOptions options = options_for(dir, 1024);
    options.vocab_size = 2000;
    std::string want;
    bool no_prefix_span = false;  // HF's own prefix renders did not nest (null text)
    for (size_t k = 0; k < c["assistant_spans"].size(); ++k) {
      const json& span = c["assistant_spans"][k];
      if (span["text"].is_null()) {
        no_prefix_span = true;
        continue;
      }
      std::string text = span["text"].get<std::string>();
      // Phi-3 ends a conversation with EOS: an earlier turn's prefix render has it, the
      // whole conversation does not, and only what the conversation holds is learned.
      const std::string eos = "<|endoftext|>";
      if (c["template"] == "phi3" && k + 1 < c["assistant_spans"].size() && text.size() > eos.size() &&
          text.compare(text.size() - eos.size(), eos.size(), eos) == 0)
        text.resize(text.size() - eos.size());
      want += text;
    }
    // Qwen3 renders earlier assistant turns without their <think> block, and Mistral Nemo
    // moves the system message into the last user turn, so these conversations have no
    // prefix-rendered span in the whole text: refused, as documented.
    if (no_prefix_span || (c["template"] == "qwen3" && c["assistant_spans"].size() > 1)) {
      const std::string error = test::user_error_of([&] { open_dataset(path, options); });
      EXPECT_NE(error.find("cannot find the assistant turn"), std::string::npos) << error;
      ++refused;
      continue;
    }
    const Example e = open_dataset(path, options)->get(0);
    const std::string learned = learned_text(e, *options.tokenizer);
    // A token across the span's start is learned (the plain rule): one conversation's
    // answer starts with "\n" after the prompt's "\n", and the tokenizer merges them.
    const size_t extra = learned.size() - std::min(learned.size(), want.size());
    if (learned != want && c["assistant_spans"].size() == 1 && extra > 0 && extra <= 2 &&
        learned.compare(extra, want.size(), want) == 0 &&
        learned.find_first_not_of(" \n", 0) >= extra) {  // one merged token: whitespace from the prompt
      ++straddling;
    } else {
      EXPECT_EQ(learned, want) << c["template"] << " " << c["case"];
    }
    const auto ids = c["ids"].get<Ids>();
    EXPECT_EQ(Ids(e.input_ids.begin(), e.input_ids.begin() + static_cast<long>(ids.size())), ids)
        << c["template"] << " " << c["case"];
    ++checked;
  }
  EXPECT_GE(checked, 30);
  EXPECT_LE(straddling, 5);
  std::fprintf(stderr,
               "%d conversations: learned tokens = HF's prefix-rendered assistant spans (%d with a token across the "
               "span's start); %d conversations (Qwen3 multi-turn, Mistral with a system message) refused\n",
               checked, straddling, refused);
}

// `autotp data preview`: the examples training builds, as JSON and as marked text.
TEST(SftData, DataPreviewShowsWhatTrainingLearns) {
  const std::string dir = test::make_temp_dir("preview");
  const std::string path = write(dir + "/sft.json", R"([{"instruction": "Say hi.", "output": "hi"},
                                                        {"instruction": "Count.", "input": "1 2", "output": "3"}])");
  auto r = test::run_cli("data preview --model preset:llama-tiny --data " + path + " --seq-len 320 --n 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json shown = json::parse(r.output.substr(r.output.find('[')));
  DataOptions options;
  options.seq_len = 320;
  options.vocab_size = 259;
  const auto data = open_dataset(path, options);
  ASSERT_EQ(shown.size(), 2u);
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(shown[i]["input_ids"].get<std::vector<int64_t>>(), data->get(i).input_ids);
    EXPECT_EQ(shown[i]["labels"].get<std::vector<int64_t>>(), data->get(i).labels);
  }
  r = test::run_cli("data preview --model preset:llama-tiny --data " + path + " --seq-len 320 --n 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("### Instruction:\nSay hi.\n\n### Response:\u00abhi<eos>\u00bb"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("3 learned tokens"), std::string::npos) << r.output;
  r = test::run_cli("data preview --model preset:llama-tiny --data " + path + " --seq-len 320 --prompt-template nope");
  EXPECT_EQ(r.exit_code, 2) << r.output;
}

}  // namespace
}  // namespace autotp
