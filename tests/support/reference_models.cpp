// Reference HF forward passes in plain LibTorch ops. Deliberately simple and
// independent of engine/: one function per architecture family, written top to
// bottom the way modeling_llama.py / modeling_gemma2.py / modeling_gpt2.py read.
#include "support/reference_models.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

namespace autotp::test {
namespace {

using json = nlohmann::json;
using Shape = std::vector<int64_t>;

[[noreturn]] void fail(const std::string& message) {
  throw std::runtime_error("reference_models: " + message);
}

bool has(const json& config, const char* key) {
  return config.contains(key) && !config.at(key).is_null();
}

// config[key] when present and non-null, otherwise fallback.
template <typename T>
T get_or(const json& config, const char* key, T fallback) {
  return has(config, key) ? config.at(key).get<T>() : fallback;
}

// For keys where null means "off": absent -> fallback, null -> nullopt, else the value.
std::optional<double> nullable_number(const json& config, const char* key, std::optional<double> fallback) {
  if (!config.contains(key)) return fallback;
  if (config.at(key).is_null()) return std::nullopt;
  return config.at(key).get<double>();
}

template <typename T>
T require(const json& config, const char* key) {
  if (!has(config, key)) fail(std::string("config lacks required key '") + key + "'");
  return config.at(key).get<T>();
}

std::string architecture(const json& config) {
  if (has(config, "architectures") && config.at("architectures").is_array() &&
      !config.at("architectures").empty()) {
    return config.at("architectures").at(0).get<std::string>();
  }
  return "";
}

std::string shape_str(const Shape& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// Keys every path rejects: transformers v5 moves rope_theta / rope_scaling into
// "rope_parameters" (per layer type for Gemma 3), which the reference does not read.
void reject_unmodelled_common(const json& config) {
  if (has(config, "rope_parameters"))
    fail("config key 'rope_parameters' is not supported (use rope_theta / rope_scaling)");
  if (get_or<double>(config, "partial_rotary_factor", 1.0) != 1.0) fail("partial_rotary_factor != 1 is not supported");
}

std::string rope_type_of(const json& rope_scaling) {
  return rope_scaling.value("rope_type", rope_scaling.value("type", std::string("default")));
}

// ---------------------------------------------------------------------------
// Parameter specifications
// ---------------------------------------------------------------------------

// kNorm: a weight the norm multiplies by (1 + normal(0, 0.1) when random);
// kGemmaNorm: Gemma's norm multiplies by (1 + weight), so normal(0, 0.1) when random;
// kGate: an MoE router or Qwen2-MoE's shared-expert gate, normal(0, 0.5) when random
// so routing is clearly non-uniform and the gate varies between tokens.
enum class Init { kMatrix, kNorm, kGemmaNorm, kBias, kGate };

struct ParamSpec {
  std::string name;
  Shape shape;
  Init init;
};

// Checks that weights hold exactly the parameters in specs (plus buffers HF
// checkpoints sometimes carry), with the right shapes and one floating dtype.
// Returns that dtype.
torch::ScalarType validate_weights(const std::map<std::string, torch::Tensor>& weights,
                                   const std::vector<ParamSpec>& specs,
                                   const std::string& tied_lm_head_source) {
  std::set<std::string> expected;
  std::optional<torch::ScalarType> dtype;
  for (const auto& spec : specs) {
    expected.insert(spec.name);
    auto it = weights.find(spec.name);
    if (it == weights.end()) fail("missing weight '" + spec.name + "'");
    const torch::Tensor& t = it->second;
    if (!t.defined()) fail("weight '" + spec.name + "' is undefined");
    if (t.sizes().vec() != spec.shape) {
      fail("weight '" + spec.name + "' has shape " + shape_str(t.sizes().vec()) + ", expected " +
           shape_str(spec.shape));
    }
    if (!torch::isFloatingType(t.scalar_type())) fail("weight '" + spec.name + "' is not floating point");
    if (!dtype) dtype = t.scalar_type();
    if (t.scalar_type() != *dtype) fail("weights have mixed dtypes (at '" + spec.name + "')");
  }
  auto ends_with = [](const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  for (const auto& [name, tensor] : weights) {
    if (expected.count(name)) continue;
    // Non-parameter buffers found in some HF checkpoints.
    if (ends_with(name, "rotary_emb.inv_freq") || ends_with(name, ".attn.bias") ||
        ends_with(name, ".attn.masked_bias")) {
      continue;
    }
    // A tied lm_head may appear in a state_dict as an alias of the embedding.
    if (name == "lm_head.weight" && !tied_lm_head_source.empty() &&
        torch::equal(tensor, weights.at(tied_lm_head_source))) {
      continue;
    }
    fail("unexpected weight '" + name + "' for this config");
  }
  return dtype.value_or(torch::kFloat);
}

torch::Tensor embed(const torch::Tensor& table, const torch::Tensor& input_ids) {
  const int64_t batch = input_ids.size(0), seq = input_ids.size(1);
  return table.index_select(0, input_ids.reshape({-1})).view({batch, seq, table.size(1)});
}

void check_input_ids(const torch::Tensor& input_ids, int64_t vocab) {
  if (!input_ids.defined() || input_ids.dim() != 2) fail("input_ids must be a 2-D [batch, seq] tensor");
  if (input_ids.scalar_type() != torch::kLong) fail("input_ids must be int64");
  if (input_ids.size(1) < 1) fail("input_ids must have at least one position");
  if (input_ids.numel() > 0 &&
      (input_ids.min().item<int64_t>() < 0 || input_ids.max().item<int64_t>() >= vocab)) {
    fail("input_ids out of range [0, vocab_size)");
  }
}

// Boolean [T, T] mask, true where a key is hidden: after the query, or with
// window > 0 window or more positions before it (HF's sliding_window_overlay keeps
// kv > q - window).
torch::Tensor hidden_keys_mask(int64_t seq, int64_t window) {
  torch::Tensor mask = torch::ones({seq, seq}, torch::kBool).triu(1);
  if (window > 0) {
    auto distance = torch::arange(seq).view({-1, 1}) - torch::arange(seq).view({1, -1});  // query - key
    mask = mask.logical_or(distance >= window);
  }
  return mask;
}

}  // namespace

// HF's rope_scaling types (transformers' modeling_rope_utils), one frequency at a
// time in double precision.
RopeReference reference_rope(const json& rs, double theta, int64_t dim, int64_t max_positions, int64_t seq) {
  const std::string type = rope_type_of(rs);
  if (type != "default" && type != "linear" && type != "dynamic" && type != "yarn" && type != "llama3" &&
      type != "longrope") {
    fail("rope_scaling type '" + type + "' is not supported");
  }
  auto number = [&](const char* key, double fallback) {
    return rs.contains(key) && !rs[key].is_null() ? rs[key].get<double>() : fallback;
  };
  const double factor = number("factor", 1), original = number("original_max_position_embeddings", max_positions);
  double base = theta;
  if (type == "dynamic" && seq > max_positions)
    base = theta * std::pow(factor * seq / max_positions - (factor - 1), static_cast<double>(dim) / (dim - 2));
  RopeReference r;
  const double pi = std::acos(-1.0);
  // yarn's ramp between the dimensions that turn beta_fast and beta_slow times over the context.
  double low = 0, high = 1;
  if (type == "yarn") {
    auto dim_of = [&](double turns) { return dim * std::log(original / (turns * 2 * pi)) / (2 * std::log(theta)); };
    low = dim_of(number("beta_fast", 32));
    high = dim_of(number("beta_slow", 1));
    if (!rs.contains("truncate") || rs["truncate"].get<bool>()) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0);
    high = std::min(high, dim - 1.0);
    if (low == high) high += 0.001;
    auto mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
    const double m = number("mscale", 0), m_all = number("mscale_all_dim", 0);
    r.attention_factor = rs.contains("attention_factor") && !rs["attention_factor"].is_null()
                             ? rs["attention_factor"].get<double>()
                             : (m != 0 && m_all != 0 ? mscale(factor, m) / mscale(factor, m_all) : mscale(factor, 1));
  }
  // longrope: per-frequency extension factors, long ones once the sequence
  // outgrows the pretraining context (HF: max(position_ids) + 1 > original).
  std::vector<double> extension;
  if (type == "longrope") {
    if (original <= 0) fail("longrope: original_max_position_embeddings must be positive");
    // A given factor wins (transformers 5; 4.5x used the ratio whenever the config
    // had a top-level original_max_position_embeddings).
    const double scale = number("factor", max_positions / original);
    r.attention_factor = rs.contains("attention_factor") && !rs["attention_factor"].is_null()
                             ? rs["attention_factor"].get<double>()
                             : (scale <= 1 ? 1.0 : std::sqrt(1 + std::log(scale) / std::log(original)));
    for (const char* key : {"short_factor", "long_factor"}) {  // both required, as in HF
      if (!rs.contains(key) || !rs[key].is_array())
        fail(std::string("longrope: rope_scaling lacks the list '") + key + "'");
      if (static_cast<int64_t>(rs[key].size()) != dim / 2)
        fail(std::string("longrope: ") + key + " has " + std::to_string(rs[key].size()) + " entries, expected " +
             std::to_string(dim / 2));
    }
    extension = rs[seq > original ? "long_factor" : "short_factor"].get<std::vector<double>>();
  }
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double plain = 1.0 / std::pow(base, 2.0 * i / dim);
    double f = plain;
    if (type == "linear") f = plain / factor;
    if (type == "llama3") {
      const double low_factor = number("low_freq_factor", 1), high_factor = number("high_freq_factor", 4);
      const double wavelen = 2 * pi / plain;
      if (wavelen > original / low_factor) {
        f = plain / factor;  // long wavelengths: interpolated
      } else if (wavelen >= original / high_factor) {
        const double smooth = (original / wavelen - low_factor) / (high_factor - low_factor);
        f = (1 - smooth) * plain / factor + smooth * plain;
      }
    }
    if (type == "yarn") {
      const double extrapolate = 1 - std::clamp((i - low) / (high - low), 0.0, 1.0);
      f = plain / factor * (1 - extrapolate) + plain * extrapolate;
    }
    if (type == "longrope") f = plain / extension[i];
    r.inv_freq.push_back(f);
  }
  return r;
}

namespace {

// cos / sin tables [T, head_dim] as LlamaRotaryEmbedding builds them: in fp32
// (default rope straight from theta as HF computes it, scaled types from
// reference_rope), times the attention factor, cast to the model dtype.
std::pair<torch::Tensor, torch::Tensor> rotary_tables(const json& rope_scaling, double theta, int64_t head_dim,
                                                      int64_t max_positions, int64_t seq, torch::ScalarType dtype) {
  torch::Tensor inv_freq;
  double attention_factor = 1;
  if (rope_scaling.is_null()) {
    inv_freq = torch::reciprocal(torch::pow(
        theta, torch::arange(0, head_dim, 2, torch::kLong).to(torch::kFloat) / static_cast<double>(head_dim)));
  } else {
    const RopeReference r = reference_rope(rope_scaling, theta, head_dim, max_positions, seq);
    inv_freq = torch::tensor(r.inv_freq, torch::kDouble).to(torch::kFloat);
    attention_factor = r.attention_factor;
  }
  torch::Tensor positions = torch::arange(seq, torch::kLong).to(torch::kFloat);
  torch::Tensor freqs = torch::outer(positions, inv_freq);  // [T, head_dim/2]
  torch::Tensor emb = torch::cat({freqs, freqs}, -1);      // [T, head_dim]
  return {(emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)};
}

// nn.Linear: y = x @ W^T + b, W is [out, in].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  torch::Tensor y = torch::matmul(x, weight.t());
  if (bias.defined()) y = y + bias;
  return y;
}

// LlamaRMSNorm: in fp32, x * rsqrt(mean(x^2) + eps), cast back, times weight.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const auto input_dtype = x.scalar_type();
  torch::Tensor xf = x.to(torch::kFloat);
  torch::Tensor variance = xf.pow(2).mean(-1, /*keepdim=*/true);
  xf = xf * torch::rsqrt(variance + eps);
  return weight * xf.to(input_dtype);
}

// Gemma2RMSNorm / Gemma3RMSNorm: in fp32 x * rsqrt(mean(x^2) + eps) * (1 + weight),
// then cast back (Llama casts before the weight, Gemma after).
torch::Tensor gemma_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  torch::Tensor xf = x.to(torch::kFloat);
  xf = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (xf * (1.0 + weight.to(torch::kFloat))).to(x.scalar_type());
}

torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  torch::Tensor x1 = x.narrow(-1, 0, half);
  torch::Tensor x2 = x.narrow(-1, half, half);
  return torch::cat({-x2, x1}, -1);
}

// repeat_kv: kv head j serves query heads j*groups .. (j+1)*groups-1. x: [B, KV, T, D].
torch::Tensor repeat_kv(const torch::Tensor& x, int64_t groups) {
  const int64_t batch = x.size(0), kv_heads = x.size(1), seq = x.size(2), dim = x.size(3);
  return x.unsqueeze(2).expand({batch, kv_heads, groups, seq, dim}).reshape({batch, kv_heads * groups, seq, dim});
}

// cap * tanh(x / cap): Gemma's soft-capping of attention scores and final logits.
torch::Tensor soft_cap(const torch::Tensor& x, double cap) { return torch::tanh(x / cap) * cap; }

}  // namespace

// ---------------------------------------------------------------------------
// Llama / Mistral / Qwen2 / Qwen3 / Phi-3, and the MoE models built on them
// (Mixtral, Qwen2-MoE, Qwen3-MoE)
// ---------------------------------------------------------------------------

namespace {

enum class LlamaVariant { kLlama, kMistral, kQwen2, kQwen3, kPhi3, kMixtral, kQwen2Moe, kQwen3Moe };

struct LlamaSpec {
  LlamaVariant variant = LlamaVariant::kLlama;
  int64_t vocab = 0, hidden = 0, intermediate = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 1e-6, theta = 10000.0;
  int64_t max_positions = 2048;
  json rope_scaling;  // null: plain rotary
  bool qkv_bias = false, o_bias = false, mlp_bias = false, tie = false;
  bool qk_norm = false;  // Qwen3: self_attn.q_norm / k_norm over each head
  bool fused = false;    // Phi-3: self_attn.qkv_proj and mlp.gate_up_proj
  std::vector<int64_t> window;  // per layer: keys at most window - 1 positions back (0: all earlier keys)
  // Mixture of experts (Mixtral / Qwen2-MoE / Qwen3-MoE): per layer whether the MLP
  // is a sparse block; experts of width expert_ffn, top_k of them per token.
  std::vector<bool> sparse;
  int64_t experts = 0, top_k = 0, expert_ffn = 0;
  int64_t shared_ffn = 0;   // Qwen2-MoE's gated shared expert (0: none)
  bool norm_topk = false;   // renormalise the top-k routing weights to sum 1
  bool moe() const { return variant == LlamaVariant::kMixtral || variant == LlamaVariant::kQwen2Moe ||
                            variant == LlamaVariant::kQwen3Moe; }
  bool is_sparse(int64_t layer) const { return !sparse.empty() && sparse[layer]; }
};

// Where a sparse layer's parameters live: "model.layers.L.block_sparse_moe." for
// Mixtral, "model.layers.L.mlp." for the Qwen MoE models.
std::string moe_prefix(const LlamaSpec& s, int64_t layer) {
  return "model.layers." + std::to_string(layer) +
         (s.variant == LlamaVariant::kMixtral ? ".block_sparse_moe." : ".mlp.");
}

// An expert's gate, up and down projections: Mixtral's w1 / w3 / w2, Qwen's *_proj.
struct ExpertNames {
  std::string gate, up, down;
};
ExpertNames expert_names(const LlamaSpec& s) {
  if (s.variant == LlamaVariant::kMixtral) return {"w1", "w3", "w2"};
  return {"gate_proj", "up_proj", "down_proj"};
}

// The sparse blocks of MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock /
// Qwen3MoeSparseMoeBlock, with the config classes' defaults.
void parse_moe(const json& config, LlamaSpec& s) {
  const bool mixtral = s.variant == LlamaVariant::kMixtral, qwen2_moe = s.variant == LlamaVariant::kQwen2Moe;
  s.experts = mixtral ? get_or<int64_t>(config, "num_local_experts", 8)
                      : get_or<int64_t>(config, "num_experts", qwen2_moe ? 60 : 128);
  s.top_k = get_or<int64_t>(config, "num_experts_per_tok", mixtral ? 2 : qwen2_moe ? 4 : 8);
  s.sparse.assign(s.layers, false);
  if (mixtral) {
    // MixtralSparseMoeBlock: every layer, experts as wide as intermediate_size,
    // top-k weights always renormalised. Jitter noise multiplies the inputs by
    // random factors while training, which the reference does not model.
    if (get_or<double>(config, "router_jitter_noise", 0.0) != 0.0)
      fail("router_jitter_noise != 0 is not supported");
    if (s.experts <= 0) fail("num_local_experts must be positive");
    s.expert_ffn = s.intermediate;
    s.norm_topk = true;
    s.sparse.assign(s.layers, true);
  } else {
    // Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer: sparse unless listed in
    // mlp_only_layers, when num_experts > 0 and (layer + 1) % decoder_sparse_step == 0;
    // the other layers keep a dense MLP of width intermediate_size.
    s.expert_ffn = get_or<int64_t>(config, "moe_intermediate_size", qwen2_moe ? 1408 : 768);
    if (qwen2_moe) s.shared_ffn = get_or<int64_t>(config, "shared_expert_intermediate_size", 5632);
    s.norm_topk = get_or<bool>(config, "norm_topk_prob", false);
    const auto dense_only = get_or<std::vector<int64_t>>(config, "mlp_only_layers", {});
    const int64_t step = get_or<int64_t>(config, "decoder_sparse_step", 1);
    if (s.experts < 0) fail("num_experts must not be negative");
    if (s.experts > 0 && step <= 0) fail("decoder_sparse_step must be positive");
    for (int64_t l = 0; l < s.layers; ++l) {
      const bool listed = std::find(dense_only.begin(), dense_only.end(), l) != dense_only.end();
      s.sparse[l] = !listed && s.experts > 0 && (l + 1) % step == 0;
    }
  }
  if (std::find(s.sparse.begin(), s.sparse.end(), true) == s.sparse.end()) return;
  if (s.top_k < 1 || s.top_k > s.experts) fail("num_experts_per_tok must be in [1, number of experts]");
  if (s.expert_ffn <= 0) fail("expert intermediate size must be positive");
  if (qwen2_moe && s.shared_ffn <= 0) fail("shared_expert_intermediate_size must be positive");
}

LlamaSpec parse_llama(const json& config) {
  LlamaSpec s;
  const std::string arch = architecture(config);
  const std::string model_type = get_or<std::string>(config, "model_type", "");
  if (arch == "LlamaForCausalLM" || (arch.empty() && (model_type.empty() || model_type == "llama"))) {
    s.variant = LlamaVariant::kLlama;
  } else if (arch == "MistralForCausalLM" || (arch.empty() && model_type == "mistral")) {
    s.variant = LlamaVariant::kMistral;
  } else if (arch == "Qwen2ForCausalLM" || (arch.empty() && model_type == "qwen2")) {
    s.variant = LlamaVariant::kQwen2;
  } else if (arch == "Qwen3ForCausalLM" || (arch.empty() && model_type == "qwen3")) {
    s.variant = LlamaVariant::kQwen3;
  } else if (arch == "Phi3ForCausalLM" || (arch.empty() && model_type == "phi3")) {
    s.variant = LlamaVariant::kPhi3;
  } else if (arch == "MixtralForCausalLM" || (arch.empty() && model_type == "mixtral")) {
    s.variant = LlamaVariant::kMixtral;
  } else if (arch == "Qwen2MoeForCausalLM" || (arch.empty() && model_type == "qwen2_moe")) {
    s.variant = LlamaVariant::kQwen2Moe;
  } else if (arch == "Qwen3MoeForCausalLM" || (arch.empty() && model_type == "qwen3_moe")) {
    s.variant = LlamaVariant::kQwen3Moe;
  } else {
    fail("llama path does not handle architecture '" + arch + "' / model_type '" + model_type + "'");
  }
  const bool qwen3 = s.variant == LlamaVariant::kQwen3, phi3 = s.variant == LlamaVariant::kPhi3;
  const bool mixtral = s.variant == LlamaVariant::kMixtral, qwen2_moe = s.variant == LlamaVariant::kQwen2Moe,
             qwen3_moe = s.variant == LlamaVariant::kQwen3Moe;
  reject_unmodelled_common(config);
  s.vocab = require<int64_t>(config, "vocab_size");
  s.hidden = require<int64_t>(config, "hidden_size");
  s.intermediate = require<int64_t>(config, "intermediate_size");
  s.layers = require<int64_t>(config, "num_hidden_layers");
  s.heads = require<int64_t>(config, "num_attention_heads");
  // Absent num_key_value_heads takes the config class's default (Qwen3Config 32,
  // MixtralConfig 8, Qwen2MoeConfig 16, Qwen3MoeConfig 4); None means num_attention_heads.
  const int64_t kv_default = qwen3 ? 32 : mixtral ? 8 : qwen2_moe ? 16 : qwen3_moe ? 4 : s.heads;
  s.kv_heads = !config.contains("num_key_value_heads") ? kv_default
                                                       : get_or<int64_t>(config, "num_key_value_heads", s.heads);
  if (s.heads <= 0 || s.kv_heads <= 0 || s.heads % s.kv_heads != 0) {
    fail("num_attention_heads must be a positive multiple of num_key_value_heads");
  }
  if (qwen3) {
    s.head_dim = get_or<int64_t>(config, "head_dim", 128);  // Qwen3Config default
  } else {  // Qwen3MoeConfig has no head_dim default: hidden_size / heads
    if (!has(config, "head_dim") && s.hidden % s.heads != 0) fail("hidden_size not divisible by heads");
    s.head_dim = get_or<int64_t>(config, "head_dim", s.hidden / s.heads);
  }
  // Qwen2-MoE's attention read head_dim in some 4.5x releases and not in others.
  if (qwen2_moe && s.head_dim * s.heads != s.hidden) fail("Qwen2-MoE: head_dim must be hidden_size / heads");
  if (s.head_dim <= 0 || s.head_dim % 2 != 0) fail("head_dim must be positive and even for rotary");
  s.eps = get_or<double>(config, "rms_norm_eps", phi3 || mixtral ? 1e-5 : 1e-6);
  s.theta = get_or<double>(config, "rope_theta", mixtral ? 1e6 : 10000.0);
  s.tie = get_or<bool>(config, "tie_word_embeddings", false);

  const std::string act = get_or<std::string>(config, "hidden_act", "silu");
  if (act != "silu") fail("hidden_act '" + act + "' is not supported (only silu)");
  s.max_positions = get_or<int64_t>(config, "max_position_embeddings",
                                    phi3 ? 4096 : qwen3 || qwen2_moe || qwen3_moe ? 32768 : mixtral ? 131072 : 2048);
  if (has(config, "rope_scaling")) {
    s.rope_scaling = config.at("rope_scaling");
    std::string type = rope_type_of(s.rope_scaling);
    // Phi3Config renames the legacy "su" / "yarn" types to longrope.
    if (phi3 && (type == "su" || type == "yarn")) {
      type = "longrope";
      s.rope_scaling["rope_type"] = type;
      s.rope_scaling.erase("type");
    }
    if (type != "linear" && type != "dynamic" && type != "yarn" && type != "llama3" && type != "longrope" &&
        type != "default")
      fail("rope_scaling type '" + type + "' is not supported");
    if (phi3 && type != "longrope" && type != "default") fail("Phi3 rope_scaling must be longrope, got '" + type + "'");
    if (get_or<double>(s.rope_scaling, "partial_rotary_factor", 1.0) != 1.0)
      fail("partial_rotary_factor != 1 is not supported");
    // HF's standardize_rope_params: a top-level original_max_position_embeddings wins
    // over the one in rope_scaling; Phi3Config always has one (default 4096).
    if (type == "longrope" && (phi3 || has(config, "original_max_position_embeddings")))
      s.rope_scaling["original_max_position_embeddings"] =
          get_or<int64_t>(config, "original_max_position_embeddings", 4096);
  }

  if (s.variant == LlamaVariant::kQwen2 || qwen2_moe) {
    // Qwen2Attention / Qwen2MoeAttention: q/k/v always biased, o_proj never; no MLP biases.
    // (transformers 5 adds Qwen2MoeConfig.qkv_bias; false is not 4.5x.)
    if (qwen2_moe && !get_or<bool>(config, "qkv_bias", true)) fail("Qwen2-MoE: qkv_bias false is not supported");
    s.qkv_bias = true;
    s.o_bias = false;
    s.mlp_bias = false;
  } else if (qwen3 || qwen3_moe) {
    // Qwen3Attention: all four projections biased iff attention_bias; Qwen3MLP has none.
    s.qkv_bias = s.o_bias = get_or<bool>(config, "attention_bias", false);
    s.mlp_bias = false;
    s.qk_norm = true;
  } else if (phi3) {
    s.fused = true;  // Phi3 has no biases at all
  } else if (mixtral) {
    // MixtralAttention and the experts have no biases; attention_bias is not read.
  } else {
    s.qkv_bias = s.o_bias = get_or<bool>(config, "attention_bias", false);
    s.mlp_bias = get_or<bool>(config, "mlp_bias", false);
  }
  // Sliding windows. MistralAttention: every layer, absent means the default
  // 4096. Qwen2Config / Qwen3Config: only with use_sliding_window, on the layers
  // layer_types marks, by default those from max_window_layers on. Phi3Config:
  // every layer when sliding_window is set (default None). Null is no window.
  // MixtralConfig: like Phi-3, every layer when sliding_window is set (default None).
  // Qwen2-MoE / Qwen3-MoE with use_sliding_window: refused, since which layers
  // slide differs between transformers releases (one mask for every layer,
  // max_window_layers, layer_types).
  s.window.assign(s.layers, 0);
  const bool qwen = s.variant == LlamaVariant::kQwen2 || qwen3;
  const bool null_window = config.contains("sliding_window") && config.at("sliding_window").is_null();
  if ((qwen2_moe || qwen3_moe) && !null_window && get_or<bool>(config, "use_sliding_window", false))
    fail("use_sliding_window is not supported for Qwen2-MoE / Qwen3-MoE");
  const bool windowed = !null_window && (s.variant == LlamaVariant::kMistral ||
                                         (qwen && get_or<bool>(config, "use_sliding_window", false)) ||
                                         ((phi3 || mixtral) && has(config, "sliding_window")));
  if (windowed) {
    const int64_t window = get_or<int64_t>(config, "sliding_window", 4096);
    if (window <= 0) fail("sliding_window must be positive");
    if (qwen && has(config, "layer_types") && static_cast<int64_t>(config.at("layer_types").size()) != s.layers)
      fail("layer_types must have num_hidden_layers entries");
    for (int64_t l = 0; l < s.layers; ++l) {
      bool sliding = true;
      if (qwen)
        sliding = has(config, "layer_types") ? config.at("layer_types").at(l) == "sliding_attention"
                                             : l >= get_or<int64_t>(config, "max_window_layers", 28);
      if (sliding) s.window[l] = window;
    }
  }
  if (s.moe()) parse_moe(config, s);
  return s;
}

std::vector<ParamSpec> llama_params(const LlamaSpec& s) {
  std::vector<ParamSpec> p;
  p.push_back({"model.embed_tokens.weight", {s.vocab, s.hidden}, Init::kMatrix});
  const int64_t q_dim = s.heads * s.head_dim, kv_dim = s.kv_heads * s.head_dim;
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    p.push_back({pre + "input_layernorm.weight", {s.hidden}, Init::kNorm});
    if (s.fused) {
      p.push_back({pre + "self_attn.qkv_proj.weight", {q_dim + 2 * kv_dim, s.hidden}, Init::kMatrix});
    } else {
      p.push_back({pre + "self_attn.q_proj.weight", {q_dim, s.hidden}, Init::kMatrix});
      p.push_back({pre + "self_attn.k_proj.weight", {kv_dim, s.hidden}, Init::kMatrix});
      p.push_back({pre + "self_attn.v_proj.weight", {kv_dim, s.hidden}, Init::kMatrix});
    }
    p.push_back({pre + "self_attn.o_proj.weight", {s.hidden, q_dim}, Init::kMatrix});
    if (s.qkv_bias) {
      p.push_back({pre + "self_attn.q_proj.bias", {q_dim}, Init::kBias});
      p.push_back({pre + "self_attn.k_proj.bias", {kv_dim}, Init::kBias});
      p.push_back({pre + "self_attn.v_proj.bias", {kv_dim}, Init::kBias});
    }
    if (s.o_bias) p.push_back({pre + "self_attn.o_proj.bias", {s.hidden}, Init::kBias});
    if (s.qk_norm) {
      p.push_back({pre + "self_attn.q_norm.weight", {s.head_dim}, Init::kNorm});
      p.push_back({pre + "self_attn.k_norm.weight", {s.head_dim}, Init::kNorm});
    }
    p.push_back({pre + "post_attention_layernorm.weight", {s.hidden}, Init::kNorm});
    if (s.is_sparse(l)) {
      const std::string moe = moe_prefix(s, l);
      const ExpertNames names = expert_names(s);
      p.push_back({moe + "gate.weight", {s.experts, s.hidden}, Init::kGate});
      for (int64_t e = 0; e < s.experts; ++e) {
        const std::string expert = moe + "experts." + std::to_string(e) + ".";
        p.push_back({expert + names.gate + ".weight", {s.expert_ffn, s.hidden}, Init::kMatrix});
        p.push_back({expert + names.up + ".weight", {s.expert_ffn, s.hidden}, Init::kMatrix});
        p.push_back({expert + names.down + ".weight", {s.hidden, s.expert_ffn}, Init::kMatrix});
      }
      if (s.shared_ffn > 0) {
        p.push_back({moe + "shared_expert.gate_proj.weight", {s.shared_ffn, s.hidden}, Init::kMatrix});
        p.push_back({moe + "shared_expert.up_proj.weight", {s.shared_ffn, s.hidden}, Init::kMatrix});
        p.push_back({moe + "shared_expert.down_proj.weight", {s.hidden, s.shared_ffn}, Init::kMatrix});
        p.push_back({moe + "shared_expert_gate.weight", {1, s.hidden}, Init::kGate});
      }
      continue;
    }
    if (s.fused) {
      p.push_back({pre + "mlp.gate_up_proj.weight", {2 * s.intermediate, s.hidden}, Init::kMatrix});
    } else {
      p.push_back({pre + "mlp.gate_proj.weight", {s.intermediate, s.hidden}, Init::kMatrix});
      p.push_back({pre + "mlp.up_proj.weight", {s.intermediate, s.hidden}, Init::kMatrix});
    }
    p.push_back({pre + "mlp.down_proj.weight", {s.hidden, s.intermediate}, Init::kMatrix});
    if (s.mlp_bias) {
      p.push_back({pre + "mlp.gate_proj.bias", {s.intermediate}, Init::kBias});
      p.push_back({pre + "mlp.up_proj.bias", {s.intermediate}, Init::kBias});
      p.push_back({pre + "mlp.down_proj.bias", {s.hidden}, Init::kBias});
    }
  }
  p.push_back({"model.norm.weight", {s.hidden}, Init::kNorm});
  if (!s.tie) p.push_back({"lm_head.weight", {s.vocab, s.hidden}, Init::kMatrix});
  return p;
}

// MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock on the
// normed hidden states x [B, T, hidden]: route each token to its top-k experts,
// sum their outputs weighted by the (renormalised when norm_topk) softmax
// probabilities; Qwen2-MoE adds its shared expert through a sigmoid gate. Appends
// the router logits [B*T, E] to router_logits when given.
torch::Tensor moe_block(const LlamaSpec& s, const std::map<std::string, torch::Tensor>& weights, int64_t layer,
                        const torch::Tensor& x, std::vector<torch::Tensor>* router_logits) {
  const std::string pre = moe_prefix(s, layer);
  const ExpertNames names = expert_names(s);
  auto w = [&](const std::string& name) -> const torch::Tensor& { return weights.at(pre + name); };
  auto mlp = [&](const torch::Tensor& in, const std::string& prefix, const std::string& gate, const std::string& up,
                 const std::string& down) {
    torch::Tensor g = linear(in, w(prefix + gate + ".weight"), torch::Tensor());
    torch::Tensor u = linear(in, w(prefix + up + ".weight"), torch::Tensor());
    return linear(torch::silu(g) * u, w(prefix + down + ".weight"), torch::Tensor());
  };
  const torch::Tensor flat = x.reshape({-1, s.hidden});                          // [N, hidden]
  const torch::Tensor logits = linear(flat, w("gate.weight"), torch::Tensor());  // [N, E], model dtype
  if (router_logits) router_logits->push_back(logits);
  // Probabilities in fp32, top-k, optionally renormalised, then cast to the model dtype.
  torch::Tensor probs = torch::softmax(logits, /*dim=*/1, torch::kFloat);
  auto [top_weights, chosen] = torch::topk(probs, s.top_k, /*dim=*/-1);  // [N, k] each
  if (s.norm_topk) top_weights = top_weights / top_weights.sum(-1, /*keepdim=*/true);
  top_weights = top_weights.to(x.scalar_type());

  torch::Tensor out = torch::zeros_like(flat);
  for (int64_t e = 0; e < s.experts; ++e) {  // in expert order, as HF adds them
    const torch::Tensor hits = (chosen == e).nonzero();  // [M, 2]: (token, slot) pairs routed to e
    if (hits.size(0) == 0) continue;
    const torch::Tensor tokens = hits.select(1, 0), slots = hits.select(1, 1);
    const std::string expert = "experts." + std::to_string(e) + ".";
    torch::Tensor y = mlp(flat.index_select(0, tokens), expert, names.gate, names.up, names.down);
    y = y * top_weights.index({tokens, slots}).unsqueeze(-1);
    out = out.index_add(0, tokens, y);
  }
  if (s.shared_ffn > 0) {  // Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x)
    const torch::Tensor gate = torch::sigmoid(linear(flat, w("shared_expert_gate.weight"), torch::Tensor()));
    out = out + gate * mlp(flat, "shared_expert.", "gate_proj", "up_proj", "down_proj");
  }
  return out.view(x.sizes());
}

// The llama-path forward without a grad guard (differentiable in the weights);
// collects the sparse layers' router logits, in layer order, when router_logits is given.
torch::Tensor llama_forward(const LlamaSpec& s, const std::map<std::string, torch::Tensor>& weights,
                            const torch::Tensor& input_ids, std::vector<torch::Tensor>* router_logits) {
  check_input_ids(input_ids, s.vocab);
  const int64_t batch = input_ids.size(0), seq = input_ids.size(1);
  const torch::ScalarType dtype = validate_weights(weights, llama_params(s), s.tie ? "model.embed_tokens.weight" : "");
  auto w = [&](const std::string& name) -> const torch::Tensor& { return weights.at(name); };
  auto maybe = [&](bool present, const std::string& name) { return present ? w(name) : torch::Tensor(); };

  const auto [cos, sin] = rotary_tables(s.rope_scaling, s.theta, s.head_dim, s.max_positions, seq, dtype);
  const int64_t groups = s.heads / s.kv_heads;
  const int64_t q_dim = s.heads * s.head_dim, kv_dim = s.kv_heads * s.head_dim;
  const double scaling = 1.0 / std::sqrt(static_cast<double>(s.head_dim));

  torch::Tensor h = embed(w("model.embed_tokens.weight"), input_ids);
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    const torch::Tensor mask = hidden_keys_mask(seq, s.window[l]);

    // Self-attention block.
    torch::Tensor residual = h;
    torch::Tensor x = rms_norm(h, w(pre + "input_layernorm.weight"), s.eps);
    torch::Tensor q, k, v;
    if (s.fused) {  // Phi3Attention: qkv_proj rows are q | k | v
      torch::Tensor qkv = linear(x, w(pre + "self_attn.qkv_proj.weight"), torch::Tensor());
      auto parts = qkv.split_with_sizes({q_dim, kv_dim, kv_dim}, -1);
      q = parts[0], k = parts[1], v = parts[2];
    } else {
      q = linear(x, w(pre + "self_attn.q_proj.weight"), maybe(s.qkv_bias, pre + "self_attn.q_proj.bias"));
      k = linear(x, w(pre + "self_attn.k_proj.weight"), maybe(s.qkv_bias, pre + "self_attn.k_proj.bias"));
      v = linear(x, w(pre + "self_attn.v_proj.weight"), maybe(s.qkv_bias, pre + "self_attn.v_proj.bias"));
    }
    q = q.reshape({batch, seq, s.heads, s.head_dim});
    k = k.reshape({batch, seq, s.kv_heads, s.head_dim});
    if (s.qk_norm) {  // Qwen3: RMSNorm over each head's head_dim values, before RoPE
      q = rms_norm(q, w(pre + "self_attn.q_norm.weight"), s.eps);
      k = rms_norm(k, w(pre + "self_attn.k_norm.weight"), s.eps);
    }
    q = q.transpose(1, 2);                                                // [B, H, T, D]
    k = k.transpose(1, 2);                                                // [B, KV, T, D]
    v = v.reshape({batch, seq, s.kv_heads, s.head_dim}).transpose(1, 2);  // [B, KV, T, D]
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    k = repeat_kv(k, groups);
    v = repeat_kv(v, groups);
    torch::Tensor scores = torch::matmul(q, k.transpose(2, 3)) * scaling;
    scores = scores.masked_fill(mask, -std::numeric_limits<double>::infinity());
    torch::Tensor probs = torch::softmax(scores, -1, torch::kFloat).to(dtype);
    torch::Tensor attn = torch::matmul(probs, v).transpose(1, 2).reshape({batch, seq, q_dim});
    attn = linear(attn, w(pre + "self_attn.o_proj.weight"), maybe(s.o_bias, pre + "self_attn.o_proj.bias"));
    h = residual + attn;

    // MLP block: down(silu(gate(x)) * up(x)), or the sparse block.
    residual = h;
    x = rms_norm(h, w(pre + "post_attention_layernorm.weight"), s.eps);
    if (s.is_sparse(l)) {
      h = residual + moe_block(s, weights, l, x, router_logits);
      continue;
    }
    torch::Tensor gate, up;
    if (s.fused) {  // Phi3MLP: gate_up_proj rows are gate | up
      torch::Tensor gate_up = linear(x, w(pre + "mlp.gate_up_proj.weight"), torch::Tensor());
      gate = gate_up.narrow(-1, 0, s.intermediate);
      up = gate_up.narrow(-1, s.intermediate, s.intermediate);
    } else {
      gate = linear(x, w(pre + "mlp.gate_proj.weight"), maybe(s.mlp_bias, pre + "mlp.gate_proj.bias"));
      up = linear(x, w(pre + "mlp.up_proj.weight"), maybe(s.mlp_bias, pre + "mlp.up_proj.bias"));
    }
    torch::Tensor down = linear(torch::silu(gate) * up, w(pre + "mlp.down_proj.weight"),
                                maybe(s.mlp_bias, pre + "mlp.down_proj.bias"));
    h = residual + down;
  }
  h = rms_norm(h, w("model.norm.weight"), s.eps);
  const torch::Tensor& head = s.tie ? w("model.embed_tokens.weight") : w("lm_head.weight");
  return torch::matmul(h, head.t()).to(torch::kFloat);
}

}  // namespace

torch::Tensor reference_llama_logits(const nlohmann::json& config,
                                     const std::map<std::string, torch::Tensor>& weights,
                                     const torch::Tensor& input_ids) {
  torch::NoGradGuard no_grad;
  return llama_forward(parse_llama(config), weights, input_ids, nullptr);
}

torch::Tensor reference_load_balancing_loss(const std::vector<torch::Tensor>& router_logits, int64_t num_experts,
                                            int64_t top_k) {
  // HF returns 0 when there are no router logits (no sparse layer).
  if (router_logits.empty()) return torch::zeros({}, torch::kFloat);
  if (num_experts <= 0 || top_k < 1 || top_k > num_experts)
    fail("load_balancing_loss: need num_experts > 0 and top_k in [1, num_experts]");
  for (const auto& t : router_logits) {
    if (!t.defined() || t.dim() != 2 || t.size(1) != num_experts)
      fail("load_balancing_loss: router logits must be [tokens, num_experts]");
  }
  const torch::Tensor logits = torch::cat(router_logits, 0);  // [L*N, E]
  const torch::Tensor probs = torch::softmax(logits, -1);     // in the logits' dtype, as HF
  const torch::Tensor selected = std::get<1>(torch::topk(probs, top_k, -1));
  const torch::Tensor expert_mask = torch::one_hot(selected, num_experts).to(torch::kFloat);  // [L*N, k, E]
  const torch::Tensor tokens_per_expert = expert_mask.mean(0);                              // [k, E]
  const torch::Tensor prob_per_expert = probs.mean(0);                                      // [E]
  return ((tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * static_cast<double>(num_experts))
      .to(torch::kFloat);
}

ReferenceMoeOutput reference_moe_forward(const nlohmann::json& config,
                                         const std::map<std::string, torch::Tensor>& weights,
                                         const torch::Tensor& input_ids) {
  const LlamaSpec s = parse_llama(config);
  if (!s.moe()) fail("reference_moe_forward needs a Mixtral / Qwen2-MoE / Qwen3-MoE config");
  std::vector<torch::Tensor> router_logits;
  ReferenceMoeOutput out;
  out.logits = llama_forward(s, weights, input_ids, &router_logits);
  out.aux_loss = reference_load_balancing_loss(router_logits, s.experts, s.top_k);
  return out;
}

// ---------------------------------------------------------------------------
// Gemma 2 / Gemma 3 (text)
// ---------------------------------------------------------------------------

namespace {

struct GemmaSpec {
  int version = 2;  // 2: Gemma2ForCausalLM, 3: Gemma3ForCausalLM
  int64_t vocab = 0, hidden = 0, intermediate = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 1e-6;
  double theta = 10000.0;        // full-attention layers (every layer on Gemma 2)
  double local_theta = 10000.0;  // Gemma 3 sliding layers
  int64_t max_positions = 8192;
  json rope_scaling;  // full-attention layers only on Gemma 3; null: plain rotary
  double scaling = 1.0 / 16;  // query_pre_attn_scalar^-0.5
  std::optional<double> attn_softcap, final_softcap;
  bool bias = false, tie = true;
  std::vector<bool> sliding;  // per layer
  int64_t window = 0;         // on sliding layers: keys at most window - 1 positions back (0: all)
};

GemmaSpec parse_gemma(const json& config) {
  GemmaSpec s;
  const std::string arch = architecture(config);
  const std::string model_type = get_or<std::string>(config, "model_type", "");
  if (arch == "Gemma2ForCausalLM" || (arch.empty() && model_type == "gemma2")) {
    s.version = 2;
  } else if (arch == "Gemma3ForCausalLM" || (arch.empty() && model_type == "gemma3_text")) {
    s.version = 3;
  } else {
    fail("gemma path does not handle architecture '" + arch + "' / model_type '" + model_type + "'");
  }
  const bool gemma2 = s.version == 2;
  reject_unmodelled_common(config);
  if (get_or<bool>(config, "use_bidirectional_attention", false)) fail("use_bidirectional_attention is not supported");
  // Defaults from Gemma2Config / Gemma3TextConfig.
  s.vocab = require<int64_t>(config, "vocab_size");
  s.hidden = require<int64_t>(config, "hidden_size");
  s.intermediate = require<int64_t>(config, "intermediate_size");
  s.layers = require<int64_t>(config, "num_hidden_layers");
  s.heads = require<int64_t>(config, "num_attention_heads");
  s.kv_heads = get_or<int64_t>(config, "num_key_value_heads", 4);
  if (s.heads <= 0 || s.kv_heads <= 0 || s.heads % s.kv_heads != 0) {
    fail("num_attention_heads must be a positive multiple of num_key_value_heads");
  }
  s.head_dim = get_or<int64_t>(config, "head_dim", 256);
  if (s.head_dim <= 0 || s.head_dim % 2 != 0) fail("head_dim must be positive and even for rotary");
  s.eps = get_or<double>(config, "rms_norm_eps", 1e-6);
  // Gemma's MLP reads hidden_activation (hidden_act, also in Gemma 2 configs, is unused).
  const std::string act = get_or<std::string>(config, "hidden_activation", "gelu_pytorch_tanh");
  if (act != "gelu_pytorch_tanh") fail("hidden_activation '" + act + "' is not supported (only gelu_pytorch_tanh)");
  const double pre_attn_scalar = get_or<double>(config, "query_pre_attn_scalar", 256.0);
  if (pre_attn_scalar <= 0) fail("query_pre_attn_scalar must be positive");
  s.scaling = 1.0 / std::sqrt(pre_attn_scalar);
  const auto gemma2_only = [&](double value) { return gemma2 ? std::optional<double>(value) : std::nullopt; };
  s.attn_softcap = nullable_number(config, "attn_logit_softcapping", gemma2_only(50.0));
  s.final_softcap = nullable_number(config, "final_logit_softcapping", gemma2_only(30.0));
  if ((s.attn_softcap && *s.attn_softcap <= 0) || (s.final_softcap && *s.final_softcap <= 0))
    fail("soft-capping values must be positive");
  s.theta = get_or<double>(config, "rope_theta", gemma2 ? 10000.0 : 1000000.0);
  s.local_theta = gemma2 ? s.theta : get_or<double>(config, "rope_local_base_freq", 10000.0);
  s.max_positions = get_or<int64_t>(config, "max_position_embeddings", gemma2 ? 8192 : 131072);
  if (has(config, "rope_scaling")) {
    s.rope_scaling = config.at("rope_scaling");
    const std::string type = rope_type_of(s.rope_scaling);
    if (type != "linear" && type != "dynamic" && type != "yarn" && type != "llama3" && type != "default")
      fail("rope_scaling type '" + type + "' is not supported for Gemma");
    if (get_or<double>(s.rope_scaling, "partial_rotary_factor", 1.0) != 1.0)
      fail("partial_rotary_factor != 1 is not supported");
  }
  s.bias = get_or<bool>(config, "attention_bias", false);
  s.tie = get_or<bool>(config, "tie_word_embeddings", true);

  // Layer types: layer_types, else Gemma 2 alternates starting with a sliding
  // layer 0 and Gemma 3 makes every sliding_window_pattern-th layer (1-based) full.
  if (has(config, "layer_types")) {
    const json& types = config.at("layer_types");
    if (!types.is_array() || static_cast<int64_t>(types.size()) != s.layers)
      fail("layer_types must be a list of num_hidden_layers entries");
    for (const auto& t : types) {
      const std::string type = t.get<std::string>();
      if (type != "sliding_attention" && type != "full_attention") fail("layer type '" + type + "' is not supported");
      s.sliding.push_back(type == "sliding_attention");
    }
  } else {
    const int64_t pattern = gemma2 ? 2 : get_or<int64_t>(config, "sliding_window_pattern", 6);
    if (pattern <= 0) fail("sliding_window_pattern must be positive");
    for (int64_t l = 0; l < s.layers; ++l) s.sliding.push_back((l + 1) % pattern != 0);
  }
  // An absent sliding_window is the configs' default, 4096; null is none.
  if (!(config.contains("sliding_window") && config.at("sliding_window").is_null())) {
    s.window = get_or<int64_t>(config, "sliding_window", 4096);
    if (s.window <= 0) fail("sliding_window must be positive");
  }
  return s;
}

std::vector<ParamSpec> gemma_params(const GemmaSpec& s) {
  std::vector<ParamSpec> p;
  p.push_back({"model.embed_tokens.weight", {s.vocab, s.hidden}, Init::kMatrix});
  const int64_t q_dim = s.heads * s.head_dim, kv_dim = s.kv_heads * s.head_dim;
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    p.push_back({pre + "input_layernorm.weight", {s.hidden}, Init::kGemmaNorm});
    p.push_back({pre + "self_attn.q_proj.weight", {q_dim, s.hidden}, Init::kMatrix});
    p.push_back({pre + "self_attn.k_proj.weight", {kv_dim, s.hidden}, Init::kMatrix});
    p.push_back({pre + "self_attn.v_proj.weight", {kv_dim, s.hidden}, Init::kMatrix});
    p.push_back({pre + "self_attn.o_proj.weight", {s.hidden, q_dim}, Init::kMatrix});
    if (s.bias) {
      p.push_back({pre + "self_attn.q_proj.bias", {q_dim}, Init::kBias});
      p.push_back({pre + "self_attn.k_proj.bias", {kv_dim}, Init::kBias});
      p.push_back({pre + "self_attn.v_proj.bias", {kv_dim}, Init::kBias});
      p.push_back({pre + "self_attn.o_proj.bias", {s.hidden}, Init::kBias});
    }
    if (s.version == 3) {
      p.push_back({pre + "self_attn.q_norm.weight", {s.head_dim}, Init::kGemmaNorm});
      p.push_back({pre + "self_attn.k_norm.weight", {s.head_dim}, Init::kGemmaNorm});
    }
    p.push_back({pre + "post_attention_layernorm.weight", {s.hidden}, Init::kGemmaNorm});
    p.push_back({pre + "pre_feedforward_layernorm.weight", {s.hidden}, Init::kGemmaNorm});
    p.push_back({pre + "post_feedforward_layernorm.weight", {s.hidden}, Init::kGemmaNorm});
    p.push_back({pre + "mlp.gate_proj.weight", {s.intermediate, s.hidden}, Init::kMatrix});
    p.push_back({pre + "mlp.up_proj.weight", {s.intermediate, s.hidden}, Init::kMatrix});
    p.push_back({pre + "mlp.down_proj.weight", {s.hidden, s.intermediate}, Init::kMatrix});
  }
  p.push_back({"model.norm.weight", {s.hidden}, Init::kGemmaNorm});
  if (!s.tie) p.push_back({"lm_head.weight", {s.vocab, s.hidden}, Init::kMatrix});
  return p;
}

}  // namespace

torch::Tensor reference_gemma_logits(const nlohmann::json& config,
                                     const std::map<std::string, torch::Tensor>& weights,
                                     const torch::Tensor& input_ids) {
  torch::NoGradGuard no_grad;
  const GemmaSpec s = parse_gemma(config);
  check_input_ids(input_ids, s.vocab);
  const int64_t batch = input_ids.size(0), seq = input_ids.size(1);
  const torch::ScalarType dtype = validate_weights(weights, gemma_params(s), s.tie ? "model.embed_tokens.weight" : "");
  auto w = [&](const std::string& name) -> const torch::Tensor& { return weights.at(name); };
  auto maybe = [&](const std::string& name) { return s.bias ? w(name) : torch::Tensor(); };

  // Gemma 3: sliding layers rotate with rope_local_base_freq and no scaling,
  // full layers with rope_theta and rope_scaling; Gemma 2: one table for all.
  const auto [global_cos, global_sin] = rotary_tables(s.rope_scaling, s.theta, s.head_dim, s.max_positions, seq, dtype);
  const auto [local_cos, local_sin] =
      s.version == 3 ? rotary_tables(json(), s.local_theta, s.head_dim, s.max_positions, seq, dtype)
                     : std::pair<torch::Tensor, torch::Tensor>(global_cos, global_sin);
  const int64_t groups = s.heads / s.kv_heads, q_dim = s.heads * s.head_dim;

  // Embeddings times sqrt(hidden_size) rounded to the activation dtype (Gemma 2
  // builds the scalar in that dtype, Gemma 3 in fp32 and casts it).
  const double normalizer = std::sqrt(static_cast<double>(s.hidden));
  const torch::Tensor scale = s.version == 2 ? torch::scalar_tensor(normalizer, dtype)
                                             : torch::scalar_tensor(normalizer, torch::kFloat).to(dtype);
  torch::Tensor h = embed(w("model.embed_tokens.weight"), input_ids) * scale;
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    const bool sliding = s.sliding[l];
    const torch::Tensor mask = hidden_keys_mask(seq, sliding ? s.window : 0);
    const torch::Tensor& cos = sliding ? local_cos : global_cos;
    const torch::Tensor& sin = sliding ? local_sin : global_sin;

    // Self-attention block; its output is normed before the residual add.
    torch::Tensor residual = h;
    torch::Tensor x = gemma_rms_norm(h, w(pre + "input_layernorm.weight"), s.eps);
    torch::Tensor q = linear(x, w(pre + "self_attn.q_proj.weight"), maybe(pre + "self_attn.q_proj.bias"));
    torch::Tensor k = linear(x, w(pre + "self_attn.k_proj.weight"), maybe(pre + "self_attn.k_proj.bias"));
    torch::Tensor v = linear(x, w(pre + "self_attn.v_proj.weight"), maybe(pre + "self_attn.v_proj.bias"));
    q = q.view({batch, seq, s.heads, s.head_dim}).transpose(1, 2);     // [B, H, T, D]
    k = k.view({batch, seq, s.kv_heads, s.head_dim}).transpose(1, 2);  // [B, KV, T, D]
    v = v.view({batch, seq, s.kv_heads, s.head_dim}).transpose(1, 2);
    if (s.version == 3) {  // per-head Gemma norms before RoPE
      q = gemma_rms_norm(q, w(pre + "self_attn.q_norm.weight"), s.eps);
      k = gemma_rms_norm(k, w(pre + "self_attn.k_norm.weight"), s.eps);
    }
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    k = repeat_kv(k, groups);
    v = repeat_kv(v, groups);
    torch::Tensor scores = torch::matmul(q, k.transpose(2, 3)) * s.scaling;
    if (s.attn_softcap) scores = soft_cap(scores, *s.attn_softcap);  // before the mask, as HF's eager path
    scores = scores.masked_fill(mask, -std::numeric_limits<double>::infinity());
    torch::Tensor probs = torch::softmax(scores, -1, torch::kFloat).to(dtype);
    torch::Tensor attn = torch::matmul(probs, v).transpose(1, 2).reshape({batch, seq, q_dim});
    attn = linear(attn, w(pre + "self_attn.o_proj.weight"), maybe(pre + "self_attn.o_proj.bias"));
    h = residual + gemma_rms_norm(attn, w(pre + "post_attention_layernorm.weight"), s.eps);

    // MLP block between pre- and post-feedforward norms: down(gelu_tanh(gate(x)) * up(x)).
    residual = h;
    x = gemma_rms_norm(h, w(pre + "pre_feedforward_layernorm.weight"), s.eps);
    torch::Tensor gate = linear(x, w(pre + "mlp.gate_proj.weight"), torch::Tensor());
    torch::Tensor up = linear(x, w(pre + "mlp.up_proj.weight"), torch::Tensor());
    torch::Tensor down = linear(torch::gelu(gate, "tanh") * up, w(pre + "mlp.down_proj.weight"), torch::Tensor());
    h = residual + gemma_rms_norm(down, w(pre + "post_feedforward_layernorm.weight"), s.eps);
  }
  h = gemma_rms_norm(h, w("model.norm.weight"), s.eps);
  const torch::Tensor& head = s.tie ? w("model.embed_tokens.weight") : w("lm_head.weight");
  torch::Tensor logits = torch::matmul(h, head.t());
  if (s.final_softcap) logits = soft_cap(logits, *s.final_softcap);  // in the model dtype, as HF
  return logits.to(torch::kFloat);
}

// ---------------------------------------------------------------------------
// GPT-2
// ---------------------------------------------------------------------------

namespace {

struct Gpt2Spec {
  int64_t vocab = 0, embd = 0, layers = 0, heads = 0, positions = 0, inner = 0;
  double eps = 1e-5;
  std::string act = "gelu_new";
  bool scale_attn = true, tie = true;
};

Gpt2Spec parse_gpt2(const json& config) {
  Gpt2Spec s;
  const std::string arch = architecture(config);
  if (!arch.empty() && arch != "GPT2LMHeadModel") fail("gpt2 path does not handle architecture '" + arch + "'");
  s.vocab = require<int64_t>(config, "vocab_size");
  s.embd = require<int64_t>(config, "n_embd");
  s.layers = require<int64_t>(config, "n_layer");
  s.heads = require<int64_t>(config, "n_head");
  s.positions = require<int64_t>(config, "n_positions");
  if (s.heads <= 0 || s.embd % s.heads != 0) fail("n_embd must be divisible by n_head");
  s.inner = get_or<int64_t>(config, "n_inner", 4 * s.embd);
  s.eps = get_or<double>(config, "layer_norm_epsilon", 1e-5);
  s.act = get_or<std::string>(config, "activation_function", "gelu_new");
  if (s.act != "gelu_new" && s.act != "gelu") fail("activation_function '" + s.act + "' is not supported");
  s.scale_attn = get_or<bool>(config, "scale_attn_weights", true);
  s.tie = get_or<bool>(config, "tie_word_embeddings", true);
  if (get_or<bool>(config, "scale_attn_by_inverse_layer_idx", false)) {
    fail("scale_attn_by_inverse_layer_idx is not supported");
  }
  if (get_or<bool>(config, "reorder_and_upcast_attn", false)) fail("reorder_and_upcast_attn is not supported");
  if (get_or<bool>(config, "add_cross_attention", false)) fail("add_cross_attention is not supported");
  return s;
}

std::vector<ParamSpec> gpt2_params(const Gpt2Spec& s) {
  std::vector<ParamSpec> p;
  p.push_back({"transformer.wte.weight", {s.vocab, s.embd}, Init::kMatrix});
  p.push_back({"transformer.wpe.weight", {s.positions, s.embd}, Init::kMatrix});
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string pre = "transformer.h." + std::to_string(l) + ".";
    p.push_back({pre + "ln_1.weight", {s.embd}, Init::kNorm});
    p.push_back({pre + "ln_1.bias", {s.embd}, Init::kBias});
    p.push_back({pre + "attn.c_attn.weight", {s.embd, 3 * s.embd}, Init::kMatrix});
    p.push_back({pre + "attn.c_attn.bias", {3 * s.embd}, Init::kBias});
    p.push_back({pre + "attn.c_proj.weight", {s.embd, s.embd}, Init::kMatrix});
    p.push_back({pre + "attn.c_proj.bias", {s.embd}, Init::kBias});
    p.push_back({pre + "ln_2.weight", {s.embd}, Init::kNorm});
    p.push_back({pre + "ln_2.bias", {s.embd}, Init::kBias});
    p.push_back({pre + "mlp.c_fc.weight", {s.embd, s.inner}, Init::kMatrix});
    p.push_back({pre + "mlp.c_fc.bias", {s.inner}, Init::kBias});
    p.push_back({pre + "mlp.c_proj.weight", {s.inner, s.embd}, Init::kMatrix});
    p.push_back({pre + "mlp.c_proj.bias", {s.embd}, Init::kBias});
  }
  p.push_back({"transformer.ln_f.weight", {s.embd}, Init::kNorm});
  p.push_back({"transformer.ln_f.bias", {s.embd}, Init::kBias});
  if (!s.tie) p.push_back({"lm_head.weight", {s.vocab, s.embd}, Init::kMatrix});
  return p;
}

// Conv1D: y = x @ W + b, W is [in, out].
torch::Tensor conv1d(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  return torch::matmul(x, weight) + bias;
}

torch::Tensor gelu_new(const torch::Tensor& x) {
  const double c = std::sqrt(2.0 / 3.14159265358979323846);
  return 0.5 * x * (1.0 + torch::tanh(c * (x + 0.044715 * torch::pow(x, 3.0))));
}

}  // namespace

torch::Tensor reference_gpt2_logits(const nlohmann::json& config,
                                    const std::map<std::string, torch::Tensor>& weights,
                                    const torch::Tensor& input_ids) {
  torch::NoGradGuard no_grad;
  const Gpt2Spec s = parse_gpt2(config);
  check_input_ids(input_ids, s.vocab);
  const int64_t batch = input_ids.size(0), seq = input_ids.size(1);
  if (seq > s.positions) fail("sequence longer than n_positions");
  validate_weights(weights, gpt2_params(s), s.tie ? "transformer.wte.weight" : "");
  auto w = [&](const std::string& name) -> const torch::Tensor& { return weights.at(name); };

  const int64_t head_dim = s.embd / s.heads;
  const torch::Tensor mask = hidden_keys_mask(seq, 0);
  torch::Tensor h = embed(w("transformer.wte.weight"), input_ids) +
                    w("transformer.wpe.weight").narrow(0, 0, seq).unsqueeze(0);
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string pre = "transformer.h." + std::to_string(l) + ".";

    torch::Tensor residual = h;
    torch::Tensor x = torch::layer_norm(h, {s.embd}, w(pre + "ln_1.weight"), w(pre + "ln_1.bias"), s.eps);
    torch::Tensor qkv = conv1d(x, w(pre + "attn.c_attn.weight"), w(pre + "attn.c_attn.bias"));
    auto parts = qkv.split(s.embd, -1);  // [q | k | v]
    auto heads_view = [&](const torch::Tensor& t) {
      return t.reshape({batch, seq, s.heads, head_dim}).transpose(1, 2);  // [B, H, T, D]
    };
    torch::Tensor q = heads_view(parts[0]), k = heads_view(parts[1]), v = heads_view(parts[2]);
    torch::Tensor scores = torch::matmul(q, k.transpose(-1, -2));
    if (s.scale_attn) scores = scores / std::sqrt(static_cast<double>(head_dim));
    scores = scores.masked_fill(mask, -std::numeric_limits<double>::infinity());
    torch::Tensor probs = torch::softmax(scores, -1).to(v.scalar_type());
    torch::Tensor attn = torch::matmul(probs, v).transpose(1, 2).reshape({batch, seq, s.embd});
    attn = conv1d(attn, w(pre + "attn.c_proj.weight"), w(pre + "attn.c_proj.bias"));
    h = residual + attn;

    residual = h;
    x = torch::layer_norm(h, {s.embd}, w(pre + "ln_2.weight"), w(pre + "ln_2.bias"), s.eps);
    torch::Tensor m = conv1d(x, w(pre + "mlp.c_fc.weight"), w(pre + "mlp.c_fc.bias"));
    m = s.act == "gelu_new" ? gelu_new(m) : torch::gelu(m);
    m = conv1d(m, w(pre + "mlp.c_proj.weight"), w(pre + "mlp.c_proj.bias"));
    h = residual + m;
  }
  h = torch::layer_norm(h, {s.embd}, w("transformer.ln_f.weight"), w("transformer.ln_f.bias"), s.eps);
  const torch::Tensor& head = s.tie ? w("transformer.wte.weight") : w("lm_head.weight");
  return torch::matmul(h, head.t()).to(torch::kFloat);
}

// ---------------------------------------------------------------------------
// Dispatch, loss, random weights
// ---------------------------------------------------------------------------

namespace {

enum class Family { kLlama, kGemma, kGpt2 };

Family family_of(const json& config) {
  const std::string arch = architecture(config);
  if (arch == "LlamaForCausalLM" || arch == "MistralForCausalLM" || arch == "Qwen2ForCausalLM" ||
      arch == "Qwen3ForCausalLM" || arch == "Phi3ForCausalLM" || arch == "MixtralForCausalLM" ||
      arch == "Qwen2MoeForCausalLM" || arch == "Qwen3MoeForCausalLM") {
    return Family::kLlama;
  }
  if (arch == "Gemma2ForCausalLM" || arch == "Gemma3ForCausalLM") return Family::kGemma;
  if (arch == "GPT2LMHeadModel") return Family::kGpt2;
  fail("unsupported or missing config architectures[0]: '" + arch + "'");
}

}  // namespace

torch::Tensor reference_logits(const nlohmann::json& config,
                               const std::map<std::string, torch::Tensor>& weights,
                               const torch::Tensor& input_ids) {
  switch (family_of(config)) {
    case Family::kLlama:
      return reference_llama_logits(config, weights, input_ids);
    case Family::kGemma:
      return reference_gemma_logits(config, weights, input_ids);
    case Family::kGpt2:
      break;
  }
  return reference_gpt2_logits(config, weights, input_ids);
}

torch::Tensor reference_next_token_loss(const torch::Tensor& logits, const torch::Tensor& input_ids) {
  if (logits.dim() != 3 || input_ids.dim() != 2 || logits.size(0) != input_ids.size(0) ||
      logits.size(1) != input_ids.size(1)) {
    fail("next_token_loss: logits must be [B, T, V] matching input_ids [B, T]");
  }
  if (input_ids.size(1) < 2) fail("next_token_loss: need at least two positions");
  const int64_t vocab = logits.size(2);
  torch::Tensor pred = logits.narrow(1, 0, logits.size(1) - 1).reshape({-1, vocab}).to(torch::kFloat);
  torch::Tensor target = input_ids.narrow(1, 1, input_ids.size(1) - 1).reshape({-1});
  return torch::nn::functional::cross_entropy(pred, target);  // mean reduction
}

std::map<std::string, torch::Tensor> reference_random_weights(const nlohmann::json& config, uint64_t seed) {
  std::vector<ParamSpec> specs;
  switch (family_of(config)) {
    case Family::kLlama:
      specs = llama_params(parse_llama(config));
      break;
    case Family::kGemma:
      specs = gemma_params(parse_gemma(config));
      break;
    case Family::kGpt2:
      specs = gpt2_params(parse_gpt2(config));
      break;
  }
  torch::NoGradGuard no_grad;
  at::Generator gen = at::detail::createCPUGenerator(seed);
  std::map<std::string, torch::Tensor> out;
  for (const auto& spec : specs) {  // fixed order => deterministic in seed
    torch::Tensor noise = torch::randn(spec.shape, gen, torch::TensorOptions().dtype(torch::kFloat));
    switch (spec.init) {
      case Init::kMatrix:
      case Init::kBias:
        out[spec.name] = noise * 0.02;
        break;
      case Init::kNorm:
        out[spec.name] = 1.0 + noise * 0.1;
        break;
      case Init::kGemmaNorm:  // Gemma's norm adds the 1 itself
        out[spec.name] = noise * 0.1;
        break;
      case Init::kGate:
        out[spec.name] = noise * 0.5;
        break;
    }
  }
  return out;
}

}  // namespace autotp::test
