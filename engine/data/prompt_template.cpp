#include "autotp/data/prompt_template.h"

#include "autotp/base/error.h"
#include "autotp/base/json_file.h"

namespace autotp {
namespace {

// stanford_alpaca's PROMPT_DICT, to the byte.
const char* kAlpacaInput =
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:";
const char* kAlpacaNoInput =
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:";

}  // namespace

PromptTemplate PromptTemplate::named(const std::string& name) {
  PromptTemplate t;
  t.name_ = name;
  if (name == "alpaca") {
    t.with_input_ = kAlpacaInput;
    t.without_input_ = kAlpacaNoInput;
    return t;
  }
  if (name == "plain") {
    t.with_input_ = "{instruction}\n{input}\n";
    t.without_input_ = "{instruction}\n";
    t.prefix_rule_ = true;
    return t;
  }
  AUTOTP_USER_CHECK(name.find('/') != std::string::npos || name.find('.') != std::string::npos,
                    "prompt template '{}' is not known (allowed: alpaca, plain, or a JSON file with prompt_input and "
                    "prompt_no_input)",
                    name);
  const nlohmann::json j = read_json_file(name, "prompt template");
  AUTOTP_USER_CHECK(j.is_object(), "{}: a prompt template must be a JSON object with prompt_input and prompt_no_input",
                    name);
  for (const auto& [key, value] : j.items())
    AUTOTP_USER_CHECK(key == "prompt_input" || key == "prompt_no_input",
                      "{}: unknown key '{}' (allowed: prompt_input, prompt_no_input)", name, key);
  for (const char* key : {"prompt_input", "prompt_no_input"}) {
    AUTOTP_USER_CHECK(j.contains(key) && j[key].is_string(), "{}: '{}' is missing or not a string", name, key);
    AUTOTP_USER_CHECK(j[key].get<std::string>().find("{instruction}") != std::string::npos,
                      "{}: '{}' has no {{instruction}} placeholder", name, key);
  }
  t.with_input_ = j["prompt_input"].get<std::string>();
  t.without_input_ = j["prompt_no_input"].get<std::string>();
  AUTOTP_USER_CHECK(t.with_input_.find("{input}") != std::string::npos,
                    "{}: 'prompt_input' has no {{input}} placeholder (it is used for records with a non-empty input)",
                    name);
  return t;
}

std::string PromptTemplate::prompt(const std::string& instruction, const std::string& input) const {
  const std::string& text = input.empty() ? without_input_ : with_input_;
  // One pass, as Python's format_map: the values' own braces stay as written.
  std::string out;
  for (size_t i = 0; i < text.size();) {
    if (text.compare(i, 13, "{instruction}") == 0) {
      out += instruction;
      i += 13;
    } else if (text.compare(i, 7, "{input}") == 0) {
      out += input;
      i += 7;
    } else {
      out += text[i++];
    }
  }
  return out;
}

}  // namespace autotp
