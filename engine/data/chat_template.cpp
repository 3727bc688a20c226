// Python.h first: it may set feature macros that the standard headers read.
#ifdef AUTOTP_HAVE_EMBEDDED_PYTHON
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif

#include "autotp/data/chat_template.h"

#include <fmt/ranges.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <regex>
#include <sstream>

#include "autotp/base/error.h"

namespace autotp {

namespace {
void* compile(const std::string& source, const std::string& origin);
void release(void* compiled);
}  // namespace

struct ChatTemplate::Impl {
  std::string source, origin;
  std::string variables;  // the special tokens, a JSON object of strings
  bool generation_marks = false;
  void* compiled = nullptr;  // the jinja2 Template (a PyObject*, one reference)

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() { release(compiled); }
  static ChatTemplate make(std::string source, std::string origin, const std::string& tokenizer_dir);
};

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  AUTOTP_USER_CHECK(in.good(), "chat template: cannot read {}", path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

nlohmann::json read_json(const std::string& path) {
  try {
    return nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw_user_error("{}: not valid JSON: {}", path, e.what());
  }
}

// transformers: a string, or a list of {"name", "template"} of which "default" is used.
std::optional<std::string> template_of(const nlohmann::json& value, const std::string& path) {
  if (value.is_null()) return std::nullopt;
  if (value.is_string()) return value.get<std::string>();
  AUTOTP_USER_CHECK(value.is_array(), "{}: \"chat_template\" is neither a string nor a list of named templates", path);
  std::vector<std::string> names;
  for (const auto& entry : value) {
    AUTOTP_USER_CHECK(entry.is_object() && entry.contains("name") && entry["name"].is_string() &&
                          entry.contains("template") && entry["template"].is_string(),
                      "{}: \"chat_template\" list entries must be {{\"name\": ..., \"template\": ...}} strings", path);
    if (entry["name"] == "default") return entry["template"].get<std::string>();
    names.push_back(entry["name"].get<std::string>());
  }
  throw_user_error("{}: several chat templates and none named \"default\" (names: {})", path, fmt::join(names, ", "));
}

// The string of a special token: a string, or an AddedToken object {"content": ...}.
std::optional<std::string> token_string(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string())
    return value["content"].get<std::string>();
  return std::nullopt;
}

constexpr const char* kNamedSpecialTokens[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                               "pad_token", "cls_token", "mask_token"};

// The template variables transformers 5.x adds from the tokenizer (special_tokens_map):
// the named special tokens and a dict extra_special_tokens' model-specific ones, from
// tokenizer_config.json; special_tokens_map.json's override them when the config has no
// added_tokens_decoder (transformers reads it only then).
nlohmann::json special_tokens(const std::string& dir) {
  nlohmann::json tokens = nlohmann::json::object();
  if (dir.empty()) return tokens;
  const auto add_from = [&](const nlohmann::json& config) {
    if (!config.is_object()) return;
    for (const char* key : kNamedSpecialTokens)
      if (config.contains(key))
        if (auto s = token_string(config[key])) tokens[key] = *s;
    if (config.contains("extra_special_tokens") && config["extra_special_tokens"].is_object())
      for (const auto& [key, value] : config["extra_special_tokens"].items())
        if (auto s = token_string(value)) tokens[key] = *s;
  };
  const auto config_path = std::filesystem::path(dir) / "tokenizer_config.json";
  const auto map_path = std::filesystem::path(dir) / "special_tokens_map.json";
  bool has_decoder = false;
  if (std::filesystem::exists(config_path)) {
    const auto config = read_json(config_path.string());
    add_from(config);
    has_decoder = config.is_object() && config.contains("added_tokens_decoder");
  }
  if (!has_decoder && std::filesystem::exists(map_path)) add_from(read_json(map_path.string()));
  return tokens;
}

bool source_has_generation_marks(const std::string& source) {
  static const std::regex mark(R"(\{%[-+]?\s*generation\s*[-+]?%\})");
  return std::regex_search(source, mark);
}

ChatTemplate::Rendered render_compiled(void* compiled, const std::string& messages, bool add_generation_prompt,
                                       const std::string& variables);

}  // namespace

std::optional<ChatTemplate> ChatTemplate::from_model_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path root(dir);
  if (fs::exists(root / "chat_template.jinja")) return from_file((root / "chat_template.jinja").string(), dir);
  const auto config_path = root / "tokenizer_config.json";
  if (fs::exists(config_path)) {
    const auto config = read_json(config_path.string());
    if (config.is_object() && config.contains("chat_template"))
      if (auto text = template_of(config["chat_template"], config_path.string()))
        return Impl::make(std::move(*text), config_path.string(), dir);
  }
  if (fs::exists(root / "chat_template.json")) return from_file((root / "chat_template.json").string(), dir);
  return std::nullopt;
}

ChatTemplate ChatTemplate::from_file(const std::string& path, const std::string& tokenizer_dir) {
  if (std::filesystem::path(path).extension() == ".json") {
    const auto json = read_json(path);
    AUTOTP_USER_CHECK(json.is_object() && json.contains("chat_template"), "{}: no \"chat_template\" key", path);
    auto text = template_of(json["chat_template"], path);
    AUTOTP_USER_CHECK(text.has_value(), "{}: \"chat_template\" is null", path);
    return Impl::make(std::move(*text), path, tokenizer_dir);
  }
  return Impl::make(read_file(path), path, tokenizer_dir);
}

ChatTemplate ChatTemplate::Impl::make(std::string source, std::string origin, const std::string& tokenizer_dir) {
  auto impl = std::make_shared<ChatTemplate::Impl>();
  impl->variables = special_tokens(tokenizer_dir).dump();
  impl->generation_marks = source_has_generation_marks(source);
  impl->compiled = compile(source, origin);
  impl->source = std::move(source);
  impl->origin = std::move(origin);
  return ChatTemplate(std::move(impl));
}

ChatTemplate::Rendered ChatTemplate::render(const nlohmann::json& messages, bool add_generation_prompt) const {
  AUTOTP_USER_CHECK(messages.is_array(), "chat messages must be a JSON array of objects, got {}", messages.type_name());
  AUTOTP_USER_CHECK(!messages.empty(), "cannot apply a chat template to an empty conversation");
  for (const auto& message : messages)
    AUTOTP_USER_CHECK(message.is_object(), "chat messages must be JSON objects, got {}", message.type_name());
  std::string text;
  try {
    text = messages.dump();
  } catch (const nlohmann::json::exception& e) {
    throw_user_error("chat messages: {}", e.what());
  }
  return render_compiled(impl_->compiled, text, add_generation_prompt, impl_->variables);
}

bool ChatTemplate::has_generation_marks() const { return impl_->generation_marks; }
const std::string& ChatTemplate::origin() const { return impl_->origin; }
const std::string& ChatTemplate::source() const { return impl_->source; }

#ifdef AUTOTP_HAVE_EMBEDDED_PYTHON

namespace {

// The Python side: HF's rendering environment, written for autotp. Errors come back
// as ValueError("autotp: <message>") for the C++ side to turn into a UserError.
constexpr const char* kModule = R"PY(
import datetime
import json

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils


class GenerationMarks(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: renders its body, and while a render is
    tracked records the body's [start, end) in code points of the output so far."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.tracked = None  # (blocks rendered so far, spans) during a render

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        text = caller()
        if self.tracked is not None:
            blocks, spans = self.tracked
            start = sum(len(block) for block in blocks)
            spans.append((start, start + len(text)))
        return text


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format):
    return datetime.datetime.now().strftime(format)


class _Dict:
    # dict() for templates without the class itself (its attributes stay out of reach).
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    # namespace() refusing underscore-prefixed names, as transformers 5.x does.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


def _template_line(tb):
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _describe(error):
    if isinstance(error, jinja2.exceptions.TemplateSyntaxError):
        return f"{error.message} (line {error.lineno})"
    if isinstance(error, jinja2.exceptions.TemplateError):
        message = error.message if error.message is not None else str(error)
    else:
        message = f"{type(error).__name__}: {error}"
    line = _template_line(error.__traceback__)
    return message if line is None else f"{message} (template line {line})"


def compile_template(source):
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationMarks, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except Exception as error:
        raise ValueError("autotp: " + _describe(error)) from None


_REASONING = ("reasoning_content", "thinking", "reasoning")


def _normalize(message):
    # transformers 5.x: keys whose value is None are dropped; reasoning under any of its
    # names is passed as reasoning_content and as thinking.
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING if message.get(key) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _byte_offsets(text, spans):
    if text.isascii():
        return spans
    cache = {}

    def at(i):
        if i not in cache:
            cache[i] = len(text[:i].encode("utf-8"))
        return cache[i]

    return [(at(start), at(end)) for start, end in spans]


def render(template, messages_json, add_generation_prompt, variables_json):
    try:
        messages = [_normalize(message) for message in json.loads(messages_json)]
        variables = json.loads(variables_json)
        marks = template.environment.extensions[GenerationMarks.identifier]
        blocks, spans = [], []
        marks.tracked = (blocks, spans)
        try:
            for block in template.generate(
                messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
            ):
                blocks.append(block)
        finally:
            marks.tracked = None
        text = "".join(blocks)
        return text.encode("utf-8"), _byte_offsets(text, spans)
    except Exception as error:
        raise ValueError("autotp: " + _describe(error)) from None
)PY";

constexpr const char* kInstall = "install python3-jinja2 (and libpython3-dev to build with it; tools/install-deps)";

// Takes the GIL for the calling thread.
class Gil {
 public:
  Gil() : state_(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state_); }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;

 private:
  PyGILState_STATE state_;
};

// An owned reference.
struct Ref {
  PyObject* p = nullptr;
  explicit Ref(PyObject* o = nullptr) : p(o) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

// The pending Python exception as text (cleared); "autotp: " messages lose the prefix.
std::string take_error() {
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  Ref t(type), v(value), tb(traceback);
  std::string text = "unknown Python error";
  if (v.p) {
    Ref s(PyObject_Str(v.p));
    if (s.p) {
      Py_ssize_t size = 0;
      if (const char* c = PyUnicode_AsUTF8AndSize(s.p, &size)) text.assign(c, static_cast<size_t>(size));
    }
    PyErr_Clear();
    if (t.p && PyErr_GivenExceptionMatches(t.p, PyExc_ValueError) && text.rfind("autotp: ", 0) == 0)
      return text.substr(8);
    if (t.p) {
      const char* name = reinterpret_cast<PyTypeObject*>(t.p)->tp_name;
      text = fmt::format("{}: {}", name ? name : "error", text);
    }
  }
  return text;
}

struct Interpreter {
  std::string failure;  // why chat templates cannot be rendered; empty when they can
  PyObject* compile = nullptr;
  PyObject* render = nullptr;
};

std::wstring widen(const std::string& s) { return std::wstring(s.begin(), s.end()); }  // ASCII paths

void start(Interpreter& py) {
  const std::string prefix = AUTOTP_EMBEDDED_PYTHON_PREFIX;
  const std::string version = fmt::format("python{}.{}", PY_MAJOR_VERSION, PY_MINOR_VERSION);
  if (!Py_IsInitialized()) {
    PyConfig config;
    PyConfig_InitIsolatedConfig(&config);  // no PYTHON* variables, no user site, no argv
    config.install_signal_handlers = 0;
    config.site_import = 0;  // no site: no .pth files, no venv or /usr/local paths
    config.write_bytecode = 0;
    config.module_search_paths_set = 1;
    const std::string paths[] = {prefix + "/lib/" + version, prefix + "/lib/" + version + "/lib-dynload",
                                 prefix + "/lib/python3/dist-packages"};
    PyStatus status = PyConfig_SetBytesString(&config, &config.home, prefix.c_str());
    const std::string program = prefix + "/bin/python3";
    if (!PyStatus_Exception(status)) status = PyConfig_SetBytesString(&config, &config.program_name, program.c_str());
    for (const auto& path : paths) {
      if (PyStatus_Exception(status)) break;
      status = PyWideStringList_Append(&config.module_search_paths, widen(path).c_str());
    }
    if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) {
      py.failure = fmt::format("the embedded Python ({} under {}) did not start: {}", version, prefix,
                               status.err_msg ? status.err_msg : "unknown error");
      return;
    }
    PyEval_SaveThread();  // release the GIL: every call takes it (Gil)
  }
  Gil gil;
  Ref module(PyModule_New("autotp_chat_template"));
  PyObject* globals = module.p ? PyModule_GetDict(module.p) : nullptr;  // borrowed
  if (globals) PyDict_SetItemString(globals, "__builtins__", PyEval_GetBuiltins());
  Ref result(globals ? PyRun_String(kModule, Py_file_input, globals, globals) : nullptr);
  if (!result.p) {
    py.failure = fmt::format("chat templates need Jinja2 in the embedded Python ({}: {}): {}", version,
                             prefix + "/lib/python3/dist-packages", take_error()) +
                 "; " + kInstall;
    return;
  }
  py.compile = PyDict_GetItemString(globals, "compile_template");
  py.render = PyDict_GetItemString(globals, "render");
  Py_XINCREF(py.compile);
  Py_XINCREF(py.render);
  Py_INCREF(module.p);  // kept for the process's lifetime, like the interpreter
}

Interpreter& interpreter() {
  static Interpreter py;
  static std::once_flag once;
  std::call_once(once, [] { start(py); });
  return py;
}

[[noreturn]] void throw_unavailable(const std::string& why) {
  throw_user_error("cannot render chat templates: {}", why);
}

void* compile(const std::string& source, const std::string& origin) {
  auto& py = interpreter();
  if (!py.failure.empty()) throw_unavailable(py.failure);
  Gil gil;
  Ref text(PyUnicode_DecodeUTF8(source.data(), static_cast<Py_ssize_t>(source.size()), "strict"));
  if (!text.p) throw_user_error("chat template {}: not UTF-8 text: {}", origin, take_error());
  PyObject* compiled = PyObject_CallOneArg(py.compile, text.p);
  if (!compiled) throw_user_error("chat template {}: {}", origin, take_error());
  return compiled;
}

void release(void* compiled) {
  if (!compiled) return;
  Gil gil;
  Py_DECREF(static_cast<PyObject*>(compiled));
}

ChatTemplate::Rendered render_compiled(void* compiled, const std::string& messages, bool add_generation_prompt,
                                       const std::string& variables) {
  auto& py = interpreter();
  Gil gil;
  Ref result(PyObject_CallFunction(py.render, "Os#Os#", static_cast<PyObject*>(compiled), messages.data(),
                                   static_cast<Py_ssize_t>(messages.size()), add_generation_prompt ? Py_True : Py_False,
                                   variables.data(), static_cast<Py_ssize_t>(variables.size())));
  if (!result.p) throw UserError(take_error());
  ChatTemplate::Rendered out;
  PyObject* bytes = PyTuple_GetItem(result.p, 0);  // borrowed
  PyObject* spans = PyTuple_GetItem(result.p, 1);
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (!bytes || PyBytes_AsStringAndSize(bytes, &data, &size) != 0 || !spans || !PyList_Check(spans))
    throw std::runtime_error("chat template: unexpected result from the Python side: " + take_error());
  out.text.assign(data, static_cast<size_t>(size));
  const Py_ssize_t n = PyList_Size(spans);
  out.generation_spans.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* span = PyList_GetItem(spans, i);
    const auto begin = PyLong_AsSize_t(PyTuple_GetItem(span, 0));
    const auto end = PyLong_AsSize_t(PyTuple_GetItem(span, 1));
    out.generation_spans.emplace_back(begin, end);
  }
  return out;
}

}  // namespace

bool chat_templates_available() { return interpreter().failure.empty(); }

#else  // no embedded Python in this build

namespace {

constexpr const char* kMissing =
    "this build has no embedded Python: install libpython3-dev and python3-jinja2 (tools/install-deps) and rebuild";

[[noreturn]] void throw_unavailable(const std::string& why) {
  throw_user_error("cannot render chat templates: {}", why);
}

void* compile(const std::string&, const std::string&) { throw_unavailable(kMissing); }

void release(void*) {}

ChatTemplate::Rendered render_compiled(void*, const std::string&, bool, const std::string&) {
  throw_unavailable(kMissing);
}

}  // namespace

bool chat_templates_available() { return false; }

#endif

}  // namespace autotp
