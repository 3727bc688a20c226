// HF chat templates, rendered as transformers' apply_chat_template(messages,
// tokenize=False, add_generation_prompt=...) renders them: by Jinja2 itself, in an
// embedded CPython (Debian's libpython3 and python3-jinja2; the one place the
// product runs Python). The environment is HF's: ImmutableSandboxedEnvironment with
// trim_blocks and lstrip_blocks, loopcontrols, the {% generation %} extension, HF's
// tojson filter and its raise_exception / strftime_now / dict / namespace globals;
// the variables are messages, tools (None), documents (None), add_generation_prompt
// and the tokenizer's named special tokens (bos_token, eos_token, ...) as strings.
// Messages are normalized as transformers 5.x does: keys whose value is null are
// dropped, and reasoning under reasoning_content / thinking / reasoning is passed
// under reasoning_content and thinking.
//
// Threads: the interpreter is started once per process, lazily (first use), isolated
// from the environment (PYTHON* variables, user site, any virtual environment: its
// sys.path is the system's standard library and Debian's dist-packages only) and
// never finalized. Every call takes Python's GIL, so calls from several threads are
// safe but run one at a time; use one thread. A ChatTemplate is immutable and cheap
// to copy (the compiled template is shared).
#pragma once
#include <cstddef>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace autotp {

class ChatTemplate {
 public:
  // The model directory's template as transformers finds it: chat_template.jinja, else
  // tokenizer_config.json's "chat_template" (a string, or a list of {"name", "template"}
  // of which "default" is used), else chat_template.json's "chat_template". nullopt when
  // there is none. Special tokens come from the directory's tokenizer_config.json (and
  // special_tokens_map.json where transformers reads it). UserError for an unreadable
  // file or a template that does not compile (naming the file and Jinja's message).
  static std::optional<ChatTemplate> from_model_dir(const std::string& dir);
  // A template file (.json: {"chat_template": ...} as above; anything else: the template
  // text) with the special tokens of the tokenizer directory `tokenizer_dir` ("": none).
  static ChatTemplate from_file(const std::string& path, const std::string& tokenizer_dir);

  struct Rendered {
    std::string text;  // UTF-8
    // Each {% generation %} block's output, in order: [begin, end) UTF-8 byte offsets
    // into text (HF's assistant spans, there in code points).
    std::vector<std::pair<size_t, size_t>> generation_spans;
  };
  // `messages`: a JSON array of objects ({"role", "content", ...}), given to the
  // template as Python lists and dicts. UserError with the template's own message
  // (raise_exception's text, an undefined variable, a type error, ...; the template
  // line is added where Jinja knows it); the caller adds which record it was.
  Rendered render(const nlohmann::json& messages, bool add_generation_prompt) const;

  // Whether the source has {% generation %} marks (any whitespace control), as HF checks
  // before return_assistant_tokens_mask.
  bool has_generation_marks() const;
  // Where the template came from (a file path), for messages.
  const std::string& origin() const;
  const std::string& source() const;

 private:
  struct Impl;
  explicit ChatTemplate(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// Whether chat templates can be rendered here: the build has the embedded Python
// (libpython3-dev) and its interpreter imports jinja2 (python3-jinja2). When not,
// from_model_dir / from_file throw a UserError saying what to install. Starts the
// interpreter when it is not yet running.
bool chat_templates_available();

}  // namespace autotp
