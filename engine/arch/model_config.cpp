#include "autotp/arch/model_config.h"

#include <fmt/ranges.h>

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
    reject_if_set(j, "use_sliding_window", source, "sliding-window attention is not implemented");
    c.qkv_bias = true;
    c.o_bias = false;
  } else if (c.architecture == "MistralForCausalLM") {
    c.qkv_bias = c.o_bias = false;  // HF's Mistral layers have no biases whatever the config says
  } else {
    c.qkv_bias = c.o_bias = get_or<bool>(j, "attention_bias", false);
  }
  c.mlp_bias = c.architecture == "LlamaForCausalLM" && get_or<bool>(j, "mlp_bias", false);
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", false);
  if (c.architecture == "MistralForCausalLM" && j.contains("sliding_window") && !j["sliding_window"].is_null()) {
    // A window at least as long as any sequence we can run changes nothing; shorter ones would.
    int64_t window = j["sliding_window"].get<int64_t>();
    AUTOTP_USER_CHECK(window >= c.max_positions,
                      "{}: sliding_window {} < max_position_embeddings {} is not supported "
                      "(sliding-window attention is not implemented)",
                      source, window, c.max_positions);
  }
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
