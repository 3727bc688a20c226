#include "autotp/arch/model_config.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>

#include "autotp/base/error.h"
#include "autotp/base/json_file.h"

namespace autotp {
namespace {

using nlohmann::json;

int64_t require_int(const json& j, const char* key, const std::string& source) {
  AUTOTP_USER_CHECK(j.contains(key) && j[key].is_number_integer(), "{}: missing or non-integer key '{}'",
                    source, key);
  int64_t value = j[key].get<int64_t>();
  AUTOTP_USER_CHECK(value > 0, "{}: '{}' must be positive, got {}", source, key, value);
  return value;
}

template <typename T>
T get_or(const json& j, const char* key, T fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  return j[key].get<T>();
}

void reject_if_set(const json& j, const char* key, const std::string& source, const std::string& why) {
  if (j.contains(key) && !j[key].is_null() && j[key] != false)
    throw_user_error("{}: '{}' is not supported by autotp ({})", source, key, why);
}

// Which layers attend through a sliding window, as HF's Mistral and Qwen2 configs say.
void parse_sliding_window(const json& j, const std::string& source, ModelConfig& c) {
  const bool mistral = c.architecture == "MistralForCausalLM", qwen2 = c.architecture == "Qwen2ForCausalLM";
  if (!mistral && !qwen2) return;  // HF's Llama has no sliding window
  if (qwen2 && !get_or<bool>(j, "use_sliding_window", false)) return;  // Qwen2Config drops the window then
  if (j.contains("sliding_window") && j["sliding_window"].is_null()) return;
  // Absent: MistralConfig's and Qwen2Config's default, 4096.
  const json given = j.value("sliding_window", json(4096));
  AUTOTP_USER_CHECK(given.is_number_integer() && given.get<int64_t>() > 0,
                    "{}: sliding_window must be a positive integer or null, got {}", source, given.dump());
  const int64_t window = given.get<int64_t>();
  c.layer_sliding_window.assign(c.num_layers, mistral ? window : 0);
  if (mistral) return;
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const json& types = j["layer_types"];
    AUTOTP_USER_CHECK(types.is_array() && static_cast<int64_t>(types.size()) == c.num_layers,
                      "{}: layer_types must list num_hidden_layers ({}) entries", source, c.num_layers);
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string type = types[l].is_string() ? types[l].get<std::string>() : types[l].dump();
      AUTOTP_USER_CHECK(type == "sliding_attention" || type == "full_attention",
                        "{}: layer_types[{}] is '{}' (allowed: sliding_attention, full_attention)", source, l, type);
      if (type == "sliding_attention") c.layer_sliding_window[l] = window;
    }
    return;
  }
  const int64_t first = get_or<int64_t>(j, "max_window_layers", 28);  // Qwen2Config's default
  for (int64_t l = std::max<int64_t>(first, 0); l < c.num_layers; ++l) c.layer_sliding_window[l] = window;
}

void parse_llama(const json& j, const std::string& source, ModelConfig& c) {
  c.vocab_size = require_int(j, "vocab_size", source);
  c.hidden_size = require_int(j, "hidden_size", source);
  c.intermediate_size = require_int(j, "intermediate_size", source);
  c.num_layers = require_int(j, "num_hidden_layers", source);
  c.num_heads = require_int(j, "num_attention_heads", source);
  c.num_kv_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                       ? require_int(j, "num_key_value_heads", source)
                       : c.num_heads;
  c.head_dim = j.contains("head_dim") && !j["head_dim"].is_null() ? require_int(j, "head_dim", source)
                                                                  : c.hidden_size / c.num_heads;
  AUTOTP_USER_CHECK(j.contains("head_dim") || c.hidden_size % c.num_heads == 0,
                    "{}: hidden_size {} is not divisible by num_attention_heads {}", source, c.hidden_size,
                    c.num_heads);
  AUTOTP_USER_CHECK(c.num_heads % c.num_kv_heads == 0,
                    "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", source,
                    c.num_heads, c.num_kv_heads);
  AUTOTP_USER_CHECK(c.head_dim % 2 == 0, "{}: head_dim {} must be even for rotary embeddings", source,
                    c.head_dim);
  c.max_positions = get_or<int64_t>(j, "max_position_embeddings", 2048);
  c.norm_eps = get_or<double>(j, "rms_norm_eps", 1e-6);
  c.rope_theta = get_or<double>(j, "rope_theta", 10000.0);
  std::string act = get_or<std::string>(j, "hidden_act", "silu");
  AUTOTP_USER_CHECK(act == "silu", "{}: hidden_act '{}' is not supported (allowed: silu)", source, act);
  c.rope_scaling = RopeScaling::from_json(j.value("rope_scaling", json()), source);
  bool qwen2 = c.architecture == "Qwen2ForCausalLM";
  if (qwen2) {
    c.qkv_bias = true;
    c.o_bias = false;
  } else if (c.architecture == "MistralForCausalLM") {
    c.qkv_bias = c.o_bias = false;  // HF's Mistral layers have no biases whatever the config says
  } else {
    c.qkv_bias = c.o_bias = get_or<bool>(j, "attention_bias", false);
  }
  c.mlp_bias = c.architecture == "LlamaForCausalLM" && get_or<bool>(j, "mlp_bias", false);
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", false);
  parse_sliding_window(j, source, c);
  float pretraining_tp = get_or<float>(j, "pretraining_tp", 1.0f);
  AUTOTP_USER_CHECK(pretraining_tp == 1.0f, "{}: pretraining_tp {} is not supported (allowed: 1)", source,
                    pretraining_tp);
}

void parse_gpt2(const json& j, const std::string& source, ModelConfig& c) {
  c.vocab_size = require_int(j, "vocab_size", source);
  c.hidden_size = require_int(j, "n_embd", source);
  c.num_layers = require_int(j, "n_layer", source);
  c.num_heads = require_int(j, "n_head", source);
  c.num_kv_heads = c.num_heads;
  AUTOTP_USER_CHECK(c.hidden_size % c.num_heads == 0, "{}: n_embd {} is not divisible by n_head {}", source,
                    c.hidden_size, c.num_heads);
  c.head_dim = c.hidden_size / c.num_heads;
  c.max_positions = require_int(j, "n_positions", source);
  c.intermediate_size =
      j.contains("n_inner") && !j["n_inner"].is_null() ? require_int(j, "n_inner", source) : 4 * c.hidden_size;
  c.norm_eps = get_or<double>(j, "layer_norm_epsilon", 1e-5);
  std::string act = get_or<std::string>(j, "activation_function", "gelu_new");
  AUTOTP_USER_CHECK(act == "gelu_new", "{}: activation_function '{}' is not supported (allowed: gelu_new)",
                    source, act);
  AUTOTP_USER_CHECK(get_or<bool>(j, "scale_attn_weights", true),
                    "{}: scale_attn_weights=false is not supported", source);
  reject_if_set(j, "scale_attn_by_inverse_layer_idx", source, "not implemented");
  reject_if_set(j, "reorder_and_upcast_attn", source, "not implemented");
  reject_if_set(j, "add_cross_attention", source, "cross-attention is not implemented");
  c.qkv_bias = c.o_bias = c.mlp_bias = true;
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", true);
  AUTOTP_USER_CHECK(c.tie_word_embeddings, "{}: GPT-2 with untied lm_head is not supported", source);
}

}  // namespace

const std::vector<std::string>& supported_architectures() {
  static const std::vector<std::string> names = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                                 "GPT2LMHeadModel"};
  return names;
}

ModelConfig ModelConfig::from_json(const json& j, const std::string& source) {
  AUTOTP_USER_CHECK(j.is_object(), "{}: config must be a JSON object", source);
  AUTOTP_USER_CHECK(j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
                        j["architectures"][0].is_string(),
                    "{}: missing 'architectures' (allowed: {})", source,
                    fmt::join(supported_architectures(), ", "));
  ModelConfig c;
  c.architecture = j["architectures"][0].get<std::string>();
  c.raw = j;
  c.torch_dtype = get_or<std::string>(j, "torch_dtype", "float32");
  if (c.architecture == "GPT2LMHeadModel") {
    c.family = ModelFamily::kGpt2;
    parse_gpt2(j, source, c);
  } else if (c.architecture == "LlamaForCausalLM" || c.architecture == "MistralForCausalLM" ||
             c.architecture == "Qwen2ForCausalLM") {
    c.family = ModelFamily::kLlama;
    parse_llama(j, source, c);
  } else {
    throw_user_error("{}: architecture '{}' is not supported (allowed: {})", source, c.architecture,
                     fmt::join(supported_architectures(), ", "));
  }
  return c;
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  return from_json(read_json_file(path, "config file"), path);
}

}  // namespace autotp
