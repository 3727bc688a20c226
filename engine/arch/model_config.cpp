#include "autotp/arch/model_config.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <type_traits>

#include "autotp/base/error.h"
#include "autotp/arch/rope_config.h"
#include "autotp/base/json_file.h"
#include "autotp/base/log.h"

namespace autotp {
namespace {

// The transformers config classes' max_position_embeddings defaults (only dynamic /
// llama3 / yarn rope scaling reads it; real config.json files set it).
int64_t default_max_positions(const std::string& architecture) {
  static const std::map<std::string, int64_t> defaults = {
      {"MistralForCausalLM", 131072}, {"MixtralForCausalLM", 131072}, {"Gemma3ForCausalLM", 131072},
      {"Qwen2ForCausalLM", 32768},    {"Qwen3ForCausalLM", 32768},    {"Qwen2MoeForCausalLM", 32768},
      {"Qwen3MoeForCausalLM", 32768}, {"Phi3ForCausalLM", 4096},      {"Gemma2ForCausalLM", 8192}};
  const auto it = defaults.find(architecture);
  return it == defaults.end() ? 2048 : it->second;  // LlamaConfig's
}

using nlohmann::json;

int64_t require_int(const json& j, const char* key, const std::string& source) {
  AUTOTP_USER_CHECK(j.contains(key) && j[key].is_number_integer(), "{}: missing or non-integer key '{}'",
                    source, key);
  int64_t value = j[key].get<int64_t>();
  AUTOTP_USER_CHECK(value > 0, "{}: '{}' must be positive, got {}", source, key, value);
  return value;
}

// What get_or<T> accepts, for its error message.
template <typename T>
bool has_type(const json& v, const char*& expected) {
  if constexpr (std::is_same_v<T, bool>) {
    expected = "true or false";
    return v.is_boolean();
  } else if constexpr (std::is_same_v<T, std::string>) {
    expected = "a string";
    return v.is_string();
  } else if constexpr (std::is_same_v<T, int64_t>) {
    expected = "an integer";
    return v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX));
  } else if constexpr (std::is_floating_point_v<T>) {
    expected = "a number";
    return v.is_number() && std::isfinite(v.get<double>()) &&
           std::fabs(v.get<double>()) <= double(std::numeric_limits<T>::max());
  } else {
    static_assert(std::is_same_v<T, std::vector<int64_t>>);
    expected = "a list of integers";
    const char* element = nullptr;
    return v.is_array() && std::all_of(v.begin(), v.end(), [&](const json& e) { return has_type<int64_t>(e, element); });
  }
}

// The value at `key`, `fallback` when absent or null; a value of another type
// is a UserError naming the key (never nlohmann's type_error).
// Per-layer settings are vectors of num_hidden_layers entries: a bound keeps a
// typo (or a corrupt file) from sizing them at terabytes before anything is built.
constexpr int64_t kMaxLayers = 65536;

int64_t require_layers(const json& j, const char* key, const std::string& source) {
  const int64_t layers = require_int(j, key, source);
  AUTOTP_USER_CHECK(layers <= kMaxLayers, "{}: '{}' is {} (allowed: 1 to {})", source, key, layers, kMaxLayers);
  return layers;
}

template <typename T>
T get_or(const json& j, const std::string& source, const char* key, T fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  const char* expected = "";
  AUTOTP_USER_CHECK(has_type<T>(j[key], expected), "{}: '{}' must be {}, got {}", source, key, expected,
                    j[key].dump());
  return j[key].get<T>();
}

void reject_if_set(const json& j, const char* key, const std::string& source, const std::string& why) {
  if (j.contains(key) && !j[key].is_null() && j[key] != false)
    throw_user_error("{}: '{}' is not supported by autotp ({})", source, key, why);
}

// `layer_types` (transformers 5): sliding_attention or full_attention per layer.
bool parse_layer_types(const json& j, const std::string& source, int64_t window, ModelConfig& c) {
  if (!j.contains("layer_types") || j["layer_types"].is_null()) return false;
  const json& types = j["layer_types"];
  AUTOTP_USER_CHECK(types.is_array() && static_cast<int64_t>(types.size()) == c.num_layers,
                    "{}: layer_types must list num_hidden_layers ({}) entries", source, c.num_layers);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string type = types[l].is_string() ? types[l].get<std::string>() : types[l].dump();
    AUTOTP_USER_CHECK(type == "sliding_attention" || type == "full_attention",
                      "{}: layer_types[{}] is '{}' (allowed: sliding_attention, full_attention)", source, l, type);
    if (type == "sliding_attention") c.layer_sliding_window[l] = window;
  }
  return true;
}

// Gemma 2 and 3: sliding layers alternate with global ones, as layer_types says,
// else every `pattern`-th layer is global (Gemma 2: 2, every odd layer; Gemma 3:
// sliding_window_pattern, default 6).
void parse_gemma_sliding_window(const json& j, const std::string& source, ModelConfig& c) {
  const json given = j.value("sliding_window", json(4096));
  AUTOTP_USER_CHECK(given.is_number_integer() && given.get<int64_t>() > 0,
                    "{}: sliding_window must be a positive integer, got {}", source, given.dump());
  const int64_t window = given.get<int64_t>();
  c.layer_sliding_window.assign(c.num_layers, 0);
  if (parse_layer_types(j, source, window, c)) return;
  const bool gemma3 = c.architecture == "Gemma3ForCausalLM";
  const int64_t pattern = gemma3 ? get_or<int64_t>(j, source, "sliding_window_pattern", 6) : 2;
  AUTOTP_USER_CHECK(pattern > 0, "{}: sliding_window_pattern must be positive, got {}", source, pattern);
  for (int64_t l = 0; l < c.num_layers; ++l)
    if ((l + 1) % pattern != 0) c.layer_sliding_window[l] = window;
}

// Which layers attend through a sliding window, as HF's Mistral and Qwen2 configs say.
void parse_sliding_window(const json& j, const std::string& source, ModelConfig& c) {
  if (c.gemma_norms) return parse_gemma_sliding_window(j, source, c);
  // Phi3Config: sliding_window (default none) on every layer, like Mistral's.
  // MixtralConfig's sliding_window defaults to none, Mistral's to 4096.
  const bool mixtral = c.architecture == "MixtralForCausalLM";
  const bool mistral = c.architecture == "MistralForCausalLM" || c.architecture == "Phi3ForCausalLM" || mixtral;
  const bool qwen = c.architecture == "Qwen2ForCausalLM" || c.architecture == "Qwen3ForCausalLM" ||
                    c.architecture == "Qwen2MoeForCausalLM" || c.architecture == "Qwen3MoeForCausalLM";
  if (!mistral && !qwen) return;  // HF's Llama has no sliding window
  if (qwen && !get_or<bool>(j, source, "use_sliding_window", false)) return;  // Qwen2/3Config drop the window then
  const bool qwen_moe = c.architecture == "Qwen2MoeForCausalLM" || c.architecture == "Qwen3MoeForCausalLM";
  AUTOTP_USER_CHECK(!qwen_moe || (j.contains("sliding_window") && j["sliding_window"].is_null()),
                    "{}: use_sliding_window is not supported for {} (transformers releases disagree on which of its "
                    "layers slide; allowed: use_sliding_window false)",
                    source, c.architecture);
  if (j.contains("sliding_window") && j["sliding_window"].is_null()) return;
  const bool phi3 = c.architecture == "Phi3ForCausalLM";
  if ((phi3 || mixtral) && !j.contains("sliding_window")) return;
  // Absent: MistralConfig's and Qwen2Config's default, 4096.
  const json given = j.value("sliding_window", json(4096));
  AUTOTP_USER_CHECK(given.is_number_integer() && given.get<int64_t>() > 0,
                    "{}: sliding_window must be a positive integer or null, got {}", source, given.dump());
  const int64_t window = given.get<int64_t>();
  c.layer_sliding_window.assign(c.num_layers, mistral ? window : 0);
  if (mistral || parse_layer_types(j, source, window, c)) return;
  const int64_t first = get_or<int64_t>(j, source, "max_window_layers", 28);  // Qwen2Config's default
  for (int64_t l = std::max<int64_t>(first, 0); l < c.num_layers; ++l) c.layer_sliding_window[l] = window;
}

double dropout_probability(const json& j, const char* key, double fallback, const std::string& source) {
  const double p = get_or<double>(j, source, key, fallback);
  AUTOTP_USER_CHECK(p >= 0 && p < 1, "{}: '{}' is {} (allowed: 0 <= p < 1)", source, key, p);
  return p;
}

// Mixtral, Qwen2-MoE, Qwen3-MoE: the sparse blocks, with the config classes' defaults.
void parse_experts(const json& j, const std::string& source, ModelConfig& c) {
  const bool mixtral = c.architecture == "MixtralForCausalLM";
  // transformers 5 writes num_local_experts for every MoE model (Qwen's were num_experts);
  // autotp accepts either spelling for every MoE architecture.
  const bool has_local = j.contains("num_local_experts") && !j["num_local_experts"].is_null();
  const bool has_plain = j.contains("num_experts") && !j["num_experts"].is_null();
  const char* experts_key = has_local || (!has_plain && mixtral) ? "num_local_experts" : "num_experts";
  c.num_experts = get_or<int64_t>(j, source, experts_key, mixtral ? 8 : c.architecture == "Qwen2MoeForCausalLM" ? 60 : 128);
  AUTOTP_USER_CHECK(!has_local || !has_plain || j["num_experts"] == j["num_local_experts"],
                    "{}: num_experts {} and num_local_experts {} disagree (they name the same setting; give one)",
                    source, j.value("num_experts", json()).dump(), j.value("num_local_experts", json()).dump());
  c.experts_per_token =
      get_or<int64_t>(j, source, "num_experts_per_tok", mixtral ? 2 : c.architecture == "Qwen2MoeForCausalLM" ? 4 : 8);
  AUTOTP_USER_CHECK(c.num_experts >= 0, "{}: '{}' must not be negative, got {}", source, experts_key, c.num_experts);
  AUTOTP_USER_CHECK(c.num_experts == 0 || (c.experts_per_token >= 1 && c.experts_per_token <= c.num_experts),
                    "{}: num_experts_per_tok {} must be in 1..{} ({})", source, c.experts_per_token, c.num_experts,
                    experts_key);
  c.output_router_logits = get_or<bool>(j, source, "output_router_logits", false);
  c.router_aux_loss_coef = get_or<double>(j, source, "router_aux_loss_coef", 0.001);
  c.sparse_layers.assign(c.num_layers, c.num_experts > 0);
  if (mixtral) {
    c.expert_intermediate_size = c.intermediate_size;
    c.norm_topk_prob = true;
    c.moe_block = "block_sparse_moe";
    c.expert_projections = {"w1", "w3", "w2"};
    const double jitter = get_or<double>(j, source, "router_jitter_noise", 0.0);
    AUTOTP_USER_CHECK(jitter == 0, "{}: router_jitter_noise {} is not supported (allowed: 0; it scales the "
                                   "router's input by random noise in training)", source, jitter);
    return;
  }
  // Qwen: sparse blocks on every decoder_sparse_step-th layer not in mlp_only_layers.
  c.expert_intermediate_size = get_or<int64_t>(j, source, "moe_intermediate_size",
                                               c.architecture == "Qwen2MoeForCausalLM" ? 1408 : 768);
  AUTOTP_USER_CHECK(c.expert_intermediate_size > 0, "{}: moe_intermediate_size must be positive", source);
  c.norm_topk_prob = get_or<bool>(j, source, "norm_topk_prob", false);
  const int64_t step = get_or<int64_t>(j, source, "decoder_sparse_step", 1);
  AUTOTP_USER_CHECK(step >= 1, "{}: decoder_sparse_step must be at least 1, got {}", source, step);
  std::vector<int64_t> dense = get_or<std::vector<int64_t>>(j, source, "mlp_only_layers", {});
  for (int64_t l = 0; l < c.num_layers; ++l)
    c.sparse_layers[l] = c.num_experts > 0 && (l + 1) % step == 0 &&
                         std::find(dense.begin(), dense.end(), l) == dense.end();
  if (c.architecture == "Qwen2MoeForCausalLM") {
    c.shared_expert_intermediate_size = get_or<int64_t>(j, source, "shared_expert_intermediate_size", 5632);
    AUTOTP_USER_CHECK(c.shared_expert_intermediate_size > 0, "{}: shared_expert_intermediate_size must be positive",
                      source);
  }
}

void parse_llama(const json& j, const std::string& source, ModelConfig& c) {
  c.vocab_size = require_int(j, "vocab_size", source);
  c.hidden_size = require_int(j, "hidden_size", source);
  c.intermediate_size = require_int(j, "intermediate_size", source);
  c.num_layers = require_layers(j, "num_hidden_layers", source);
  c.num_heads = require_int(j, "num_attention_heads", source);
  c.num_kv_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                       ? require_int(j, "num_key_value_heads", source)
                       : c.num_heads;
  const bool qwen3 = c.architecture == "Qwen3ForCausalLM";
  const bool gemma3 = c.architecture == "Gemma3ForCausalLM";
  const bool mixtral = c.architecture == "MixtralForCausalLM";
  const bool qwen_moe = c.architecture == "Qwen2MoeForCausalLM" || c.architecture == "Qwen3MoeForCausalLM";
  c.gemma_norms = gemma3 || c.architecture == "Gemma2ForCausalLM";
  const bool has_head_dim = j.contains("head_dim") && !j["head_dim"].is_null();
  // Qwen3Config's head_dim defaults to 128, Gemma's to 256; the others' to hidden / heads.
  const int64_t default_head_dim = qwen3 ? 128 : c.gemma_norms ? 256 : 0;
  c.head_dim = has_head_dim       ? require_int(j, "head_dim", source)
               : default_head_dim ? default_head_dim
                                  : c.hidden_size / c.num_heads;
  AUTOTP_USER_CHECK(has_head_dim || default_head_dim || c.hidden_size % c.num_heads == 0,
                    "{}: hidden_size {} is not divisible by num_attention_heads {}", source, c.hidden_size,
                    c.num_heads);
  AUTOTP_USER_CHECK(c.num_heads % c.num_kv_heads == 0,
                    "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", source,
                    c.num_heads, c.num_kv_heads);
  AUTOTP_USER_CHECK(c.head_dim % 2 == 0, "{}: head_dim {} must be even for rotary embeddings", source,
                    c.head_dim);
  c.max_positions = get_or<int64_t>(j, source, "max_position_embeddings", default_max_positions(c.architecture));
  c.norm_eps = get_or<double>(j, source, "rms_norm_eps", c.architecture == "Phi3ForCausalLM" || mixtral ? 1e-5 : 1e-6);
  // Gemma's MLP activation is hidden_activation (hidden_act in older configs).
  const char* act_key = c.gemma_norms && j.contains("hidden_activation") ? "hidden_activation" : "hidden_act";
  const std::string allowed_act = c.gemma_norms ? "gelu_pytorch_tanh" : "silu";
  c.activation = get_or<std::string>(j, source, act_key, allowed_act);
  AUTOTP_USER_CHECK(c.activation == allowed_act, "{}: {} '{}' is not supported for {} (allowed: {})", source, act_key,
                    c.activation, c.architecture, allowed_act);
  RopeConfigDefaults rope_defaults;
  rope_defaults.theta = gemma3 || mixtral ? 1000000.0 : 10000.0;
  rope_defaults.local_theta = gemma3 ? 10000.0 : 0.0;
  rope_defaults.per_layer_type = gemma3;
  rope_defaults.head_dim = c.head_dim;
  rope_defaults.max_position_embeddings = c.max_positions;
  const RopeConfig rope = read_rope_config(j, source, rope_defaults);
  c.rope_theta = rope.theta;
  c.rope_scaling = rope.scaling;
  c.local_rope_theta = rope.local_theta;
  bool qwen2 = c.architecture == "Qwen2ForCausalLM" || c.architecture == "Qwen2MoeForCausalLM";
  if (qwen2) {
    c.qkv_bias = true;
    c.o_bias = false;
  } else if (c.architecture == "MistralForCausalLM" || c.architecture == "Phi3ForCausalLM" || mixtral) {
    c.qkv_bias = c.o_bias = false;  // HF's Mistral and Phi-3 layers have no biases whatever the config says
  } else {
    c.qkv_bias = c.o_bias = get_or<bool>(j, source, "attention_bias", false);
  }
  c.mlp_bias = c.architecture == "LlamaForCausalLM" && get_or<bool>(j, source, "mlp_bias", false);
  c.qk_norm = qwen3 || gemma3 || c.architecture == "Qwen3MoeForCausalLM";
  if (mixtral || qwen_moe) parse_experts(j, source, c);
  if (c.architecture == "Qwen2MoeForCausalLM") {  // its attention is Qwen2's whatever newer keys say
    AUTOTP_USER_CHECK(c.head_dim * c.num_heads == c.hidden_size,
                      "{}: head_dim {} is not supported for Qwen2MoeForCausalLM (allowed: hidden_size / "
                      "num_attention_heads = {})",
                      source, c.head_dim, c.hidden_size / c.num_heads);
    AUTOTP_USER_CHECK(get_or<bool>(j, source, "qkv_bias", true),
                      "{}: qkv_bias false is not supported for Qwen2MoeForCausalLM (its q/k/v projections have "
                      "biases; allowed: true)",
                      source);
  }
  c.attention_dropout = dropout_probability(j, "attention_dropout", 0.0, source);
  // Phi-3 drops each block's output (resid_pdrop); its embd_pdrop is unused by HF's Phi3Model.
  if (c.architecture == "Phi3ForCausalLM") c.residual_dropout = dropout_probability(j, "resid_pdrop", 0.0, source);
  if (c.gemma_norms) {  // Gemma2Config's / Gemma3TextConfig's defaults
    const double scalar = get_or<double>(j, source, "query_pre_attn_scalar", 256.0);
    AUTOTP_USER_CHECK(scalar > 0, "{}: query_pre_attn_scalar must be positive, got {}", source, scalar);
    c.attention_scale = 1.0 / std::sqrt(scalar);
    // Absent: the config class's default; null: no capping.
    auto softcap = [&](const char* key, double absent) {
      return !j.contains(key) ? absent : j[key].is_null() ? 0.0 : get_or<double>(j, source, key, 0.0);
    };
    c.attn_softcap = softcap("attn_logit_softcapping", gemma3 ? 0.0 : 50.0);
    c.final_softcap = softcap("final_logit_softcapping", gemma3 ? 0.0 : 30.0);
    AUTOTP_USER_CHECK(c.attn_softcap >= 0 && c.final_softcap >= 0, "{}: softcapping values must be positive or null",
                      source);
  }
  c.fused_projections = c.architecture == "Phi3ForCausalLM";
  c.tie_word_embeddings = get_or<bool>(j, source, "tie_word_embeddings", c.gemma_norms);
  parse_sliding_window(j, source, c);
  float pretraining_tp = get_or<float>(j, source, "pretraining_tp", 1.0f);
  AUTOTP_USER_CHECK(pretraining_tp == 1.0f, "{}: pretraining_tp {} is not supported (allowed: 1)", source,
                    pretraining_tp);
}

void parse_gpt2(const json& j, const std::string& source, ModelConfig& c) {
  c.vocab_size = require_int(j, "vocab_size", source);
  c.hidden_size = require_int(j, "n_embd", source);
  c.num_layers = require_layers(j, "n_layer", source);
  c.num_heads = require_int(j, "n_head", source);
  c.num_kv_heads = c.num_heads;
  AUTOTP_USER_CHECK(c.hidden_size % c.num_heads == 0, "{}: n_embd {} is not divisible by n_head {}", source,
                    c.hidden_size, c.num_heads);
  c.head_dim = c.hidden_size / c.num_heads;
  c.max_positions = require_int(j, "n_positions", source);
  c.intermediate_size =
      j.contains("n_inner") && !j["n_inner"].is_null() ? require_int(j, "n_inner", source) : 4 * c.hidden_size;
  c.norm_eps = get_or<double>(j, source, "layer_norm_epsilon", 1e-5);
  std::string act = get_or<std::string>(j, source, "activation_function", "gelu_new");
  AUTOTP_USER_CHECK(act == "gelu_new", "{}: activation_function '{}' is not supported (allowed: gelu_new)",
                    source, act);
  AUTOTP_USER_CHECK(get_or<bool>(j, source, "scale_attn_weights", true),
                    "{}: scale_attn_weights=false is not supported", source);
  reject_if_set(j, "scale_attn_by_inverse_layer_idx", source, "not implemented");
  reject_if_set(j, "reorder_and_upcast_attn", source, "not implemented");
  reject_if_set(j, "add_cross_attention", source, "cross-attention is not implemented");
  c.qkv_bias = c.o_bias = c.mlp_bias = true;
  c.activation = act;
  c.attention_dropout = dropout_probability(j, "attn_pdrop", 0.1, source);  // GPT2Config's defaults
  c.residual_dropout = dropout_probability(j, "resid_pdrop", 0.1, source);
  c.embedding_dropout = dropout_probability(j, "embd_pdrop", 0.1, source);
  c.tie_word_embeddings = get_or<bool>(j, source, "tie_word_embeddings", true);
  AUTOTP_USER_CHECK(c.tie_word_embeddings, "{}: GPT-2 with untied lm_head is not supported", source);
}

}  // namespace

int config_generation(const json& config) {
  if (config.contains("rope_parameters") && !config["rope_parameters"].is_null()) return 5;
  if (config.contains("transformers_version") && config["transformers_version"].is_string()) {
    const std::string version = config["transformers_version"].get<std::string>();
    const int major = std::atoi(version.c_str());
    if (major >= 5) return 5;
  }
  return 4;
}

const std::vector<std::string>& supported_architectures() {
  static const std::vector<std::string> names = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                                 "Qwen3ForCausalLM", "Phi3ForCausalLM",  "Gemma2ForCausalLM",
                                                 "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                                 "Qwen3MoeForCausalLM", "GPT2LMHeadModel"};
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
  // transformers >= 4.56 writes dtype, older ones torch_dtype; with both, HF keeps dtype.
  c.torch_dtype = get_or<std::string>(j, source, "dtype", get_or<std::string>(j, source, "torch_dtype", "float32"));
  c.generation = config_generation(j);
  if (c.architecture == "GPT2LMHeadModel") {
    c.family = ModelFamily::kGpt2;
    parse_gpt2(j, source, c);
  } else if (c.architecture == "LlamaForCausalLM" || c.architecture == "MistralForCausalLM" ||
             c.architecture == "Qwen2ForCausalLM" || c.architecture == "Qwen3ForCausalLM" ||
             c.architecture == "Phi3ForCausalLM" || c.architecture == "Gemma2ForCausalLM" ||
             c.architecture == "Gemma3ForCausalLM" || c.architecture == "MixtralForCausalLM" ||
             c.architecture == "Qwen2MoeForCausalLM" || c.architecture == "Qwen3MoeForCausalLM") {
    c.family = ModelFamily::kLlama;
    parse_llama(j, source, c);
  } else {
    throw_user_error("{}: architecture '{}' is not supported (allowed: {})", source, c.architecture,
                     fmt::join(supported_architectures(), ", "));
  }
  return c;
}

std::string ModelConfig::moe_module(int64_t layer) const {
  return fmt::format("model.layers.{}.{}", layer, moe_block);
}

std::string ModelConfig::expert_module(int64_t layer, int64_t expert, int which) const {
  return fmt::format("model.layers.{}.{}.experts.{}.{}", layer, moe_block, expert, expert_projections.at(which));
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  return from_json(read_json_file(path, "config file"), path);
}

}  // namespace autotp
