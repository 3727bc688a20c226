// Prompt templates of instruction records ({"instruction", "input", "output"}):
//   alpaca  stanford_alpaca's PROMPT_DICT (prompt_input when "input" is non-empty,
//           else prompt_no_input); target = output + EOS; the prompt's own tokens
//           (with BOS) are masked, as stanford_alpaca's preprocess masks them
//   plain   instruction, "\n" + input when there is one, "\n"; the prompt is the
//           longest prefix of the whole record's ids that the prompt alone encodes to
//   FILE    a JSON file {"prompt_input": "...{instruction}...{input}...",
//           "prompt_no_input": "...{instruction}..."}, masked like alpaca
// docs/data.md says which is the default and why.
#pragma once
#include <string>

namespace autotp {

class PromptTemplate {
 public:
  static constexpr const char* kDefault = "alpaca";
  // "alpaca", "plain" or a template file; UserError naming the file and the key for a
  // bad one (not JSON, a missing key, no {instruction}, {input} missing from prompt_input).
  static PromptTemplate named(const std::string& name_or_file);

  const std::string& name() const { return name_; }
  // plain's mask: the longest common prefix of the prompt's ids and the record's.
  bool prefix_rule() const { return prefix_rule_; }
  // The prompt of one record ({instruction} and {input} substituted; nothing else is).
  std::string prompt(const std::string& instruction, const std::string& input) const;

 private:
  std::string name_;
  std::string with_input_, without_input_;
  bool prefix_rule_ = false;
};

}  // namespace autotp
