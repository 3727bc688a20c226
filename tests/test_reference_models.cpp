// Sanity tests for the reference HF forward passes in support/reference_models.*:
// causality, GQA head mapping, tied embeddings, closed-form RMSNorm / rotary /
// longrope / Gemma embedding cases, scalar-loop re-implementations (Llama family,
// Qwen3, Phi-3, Gemma 2 / 3, GPT-2), invariances of Qwen3's q/k norms, Phi-3's
// fused weights, Gemma's soft-capping, sliding and local/global layers, the
// next-token loss, config validation, and the mixture-of-experts models (scalar-loop
// sparse blocks and load-balancing loss, sparse / dense layer choice, top-k
// renormalisation, a one-expert Mixtral as Mistral, autograd against finite differences).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "support/reference_models.h"

namespace autotp::test {
namespace {

using json = nlohmann::json;
using Weights = std::map<std::string, torch::Tensor>;

// ---------------------------------------------------------------------------
// Tiny configs
// ---------------------------------------------------------------------------

// GQA (4 query heads, 2 kv heads), head_dim 6 != hidden/heads, attention + mlp biases, tied.
json llama_config() {
  return json{{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"vocab_size", 23},
              {"hidden_size", 16},
              {"intermediate_size", 24},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 6},
              {"rms_norm_eps", 1e-5},
              {"rope_theta", 500.0},
              {"attention_bias", true},
              {"mlp_bias", true},
              {"hidden_act", "silu"},
              {"rope_scaling", nullptr},
              {"tie_word_embeddings", true}};
}

json mistral_config() {
  return json{{"architectures", {"MistralForCausalLM"}},
              {"model_type", "mistral"},
              {"vocab_size", 19},
              {"hidden_size", 16},
              {"intermediate_size", 20},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 1},
              {"rms_norm_eps", 1e-6},
              {"rope_theta", 10000.0},
              {"sliding_window", 32},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", false}};
}

json qwen2_config() {
  return json{{"architectures", {"Qwen2ForCausalLM"}},
              {"model_type", "qwen2"},
              {"vocab_size", 21},
              {"hidden_size", 12},
              {"intermediate_size", 18},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 6},
              {"num_key_value_heads", 2},
              {"rms_norm_eps", 1e-6},
              {"rope_theta", 1000000.0},
              {"use_sliding_window", false},
              {"sliding_window", 4},  // ignored when use_sliding_window is false
              {"hidden_act", "silu"},
              {"tie_word_embeddings", false}};
}

// GQA, head_dim 6 != hidden/heads, all four attention projections biased, tied.
json qwen3_config() {
  return json{{"architectures", {"Qwen3ForCausalLM"}},
              {"model_type", "qwen3"},
              {"vocab_size", 27},
              {"hidden_size", 16},
              {"intermediate_size", 20},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 6},
              {"rms_norm_eps", 1e-6},
              {"rope_theta", 1000.0},
              {"attention_bias", true},
              {"use_sliding_window", false},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", true}};
}

json phi3_config() {
  return json{{"architectures", {"Phi3ForCausalLM"}},
              {"model_type", "phi3"},
              {"vocab_size", 29},
              {"hidden_size", 16},
              {"intermediate_size", 20},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"rms_norm_eps", 1e-5},
              {"rope_theta", 10000.0},
              {"rope_scaling", nullptr},
              {"sliding_window", nullptr},
              {"max_position_embeddings", 64},
              {"original_max_position_embeddings", 64},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", false}};
}

// Layer 0 sliding (window 3), layer 1 full; soft-capping small enough to bite.
json gemma2_config() {
  return json{{"architectures", {"Gemma2ForCausalLM"}},
              {"model_type", "gemma2"},
              {"vocab_size", 25},
              {"hidden_size", 16},
              {"intermediate_size", 24},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 8},
              {"rms_norm_eps", 1e-6},
              {"rope_theta", 100.0},
              {"query_pre_attn_scalar", 12},
              {"attn_logit_softcapping", 2.0},
              {"final_logit_softcapping", 5.0},
              {"sliding_window", 3},
              {"layer_types", {"sliding_attention", "full_attention"}},
              {"hidden_activation", "gelu_pytorch_tanh"},
              {"tie_word_embeddings", true}};
}

// Layer 0 sliding with local base 10, layer 1 full with base 1000 and linear scaling.
json gemma3_config() {
  return json{{"architectures", {"Gemma3ForCausalLM"}},
              {"model_type", "gemma3_text"},
              {"vocab_size", 31},
              {"hidden_size", 16},
              {"intermediate_size", 20},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 2},
              {"num_key_value_heads", 1},
              {"head_dim", 8},
              {"rms_norm_eps", 1e-6},
              {"rope_theta", 1000.0},
              {"rope_local_base_freq", 10.0},
              {"rope_scaling", {{"rope_type", "linear"}, {"factor", 4.0}}},
              {"query_pre_attn_scalar", 8},
              {"attn_logit_softcapping", nullptr},
              {"final_logit_softcapping", nullptr},
              {"sliding_window", 3},
              {"layer_types", {"sliding_attention", "full_attention"}},
              {"hidden_activation", "gelu_pytorch_tanh"},
              {"tie_word_embeddings", false}};
}

json gpt2_config() {
  return json{{"architectures", {"GPT2LMHeadModel"}},
              {"model_type", "gpt2"},
              {"vocab_size", 23},
              {"n_embd", 16},
              {"n_head", 4},
              {"n_layer", 2},
              {"n_positions", 16},
              {"n_inner", nullptr},
              {"layer_norm_epsilon", 1e-5},
              {"activation_function", "gelu_new"},
              {"scale_attn_weights", true}};
}

std::vector<json> all_configs() {
  return {llama_config(), mistral_config(), qwen2_config(), qwen3_config(), phi3_config(),
          gemma2_config(), gemma3_config(), gpt2_config()};
}

std::string arch_of(const json& config) { return config.at("architectures")[0].get<std::string>(); }

torch::Tensor ids_for(const json& config, int64_t batch, int64_t seq, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(config.at("vocab_size").get<int64_t>(), {batch, seq}, torch::kLong);
}

// Scales every 2-D weight so activations and attention scores are O(1) and
// semantic mistakes (scaling, head mapping, rotary layout) show up well above
// float rounding.
Weights amplified(Weights weights, double factor) {
  for (auto& [name, t] : weights) {
    if (t.dim() == 2) t = t * factor;
  }
  return weights;
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

double max_abs(const torch::Tensor& a) { return a.abs().max().item<double>(); }

// A Phi-3 model as the Llama (or, with a sliding window, Mistral) model it equals:
// qkv_proj split into q | k | v rows, gate_up_proj into gate | up rows.
std::pair<json, Weights> phi3_as_llama(const json& phi3, const Weights& w) {
  json llama = phi3;
  const bool windowed = phi3.contains("sliding_window") && !phi3.at("sliding_window").is_null();
  llama["architectures"] = {windowed ? "MistralForCausalLM" : "LlamaForCausalLM"};
  llama["model_type"] = windowed ? "mistral" : "llama";
  llama.erase("original_max_position_embeddings");
  const int64_t hidden = phi3.at("hidden_size"), heads = phi3.at("num_attention_heads");
  const int64_t dim = hidden / heads, kv = phi3.value("num_key_value_heads", heads);
  const int64_t inter = phi3.at("intermediate_size");
  Weights out;
  for (const auto& [name, t] : w) {
    const auto cut = name.find("self_attn.qkv_proj.weight");
    const auto cut_mlp = name.find("mlp.gate_up_proj.weight");
    if (cut != std::string::npos) {
      const std::string pre = name.substr(0, cut) + "self_attn.";
      out[pre + "q_proj.weight"] = t.narrow(0, 0, heads * dim).clone();
      out[pre + "k_proj.weight"] = t.narrow(0, heads * dim, kv * dim).clone();
      out[pre + "v_proj.weight"] = t.narrow(0, (heads + kv) * dim, kv * dim).clone();
    } else if (cut_mlp != std::string::npos) {
      const std::string pre = name.substr(0, cut_mlp) + "mlp.";
      out[pre + "gate_proj.weight"] = t.narrow(0, 0, inter).clone();
      out[pre + "up_proj.weight"] = t.narrow(0, inter, inter).clone();
    } else {
      out[name] = t;
    }
  }
  return {llama, out};
}

// ---------------------------------------------------------------------------
// Scalar-loop re-implementations (double precision, explicit loops)
// ---------------------------------------------------------------------------

struct Arr {
  std::vector<double> d;
  std::vector<int64_t> shape;
  double operator()(int64_t i) const { return d[i]; }
  double operator()(int64_t i, int64_t j) const { return d[i * shape[1] + j]; }
};

Arr arr(const torch::Tensor& t) {
  torch::Tensor c = t.to(torch::kDouble).contiguous();
  return {std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel()), c.sizes().vec()};
}

using Vec = std::vector<double>;

// y = W x + b for an nn.Linear weight [out, in].
Vec linear_loop(const Weights& w, const std::string& prefix, const Vec& x) {
  const Arr m = arr(w.at(prefix + ".weight"));
  Vec y(m.shape[0], 0.0);
  for (int64_t o = 0; o < m.shape[0]; ++o) {
    for (int64_t i = 0; i < m.shape[1]; ++i) y[o] += m(o, i) * x[i];
  }
  if (w.count(prefix + ".bias")) {
    const Arr b = arr(w.at(prefix + ".bias"));
    for (int64_t o = 0; o < m.shape[0]; ++o) y[o] += b(o);
  }
  return y;
}

// y = x W + b for a GPT-2 Conv1D weight [in, out].
Vec conv1d_loop(const Weights& w, const std::string& prefix, const Vec& x) {
  const Arr m = arr(w.at(prefix + ".weight"));
  const Arr b = arr(w.at(prefix + ".bias"));
  Vec y(m.shape[1], 0.0);
  for (int64_t o = 0; o < m.shape[1]; ++o) {
    y[o] = b(o);
    for (int64_t i = 0; i < m.shape[0]; ++i) y[o] += x[i] * m(i, o);
  }
  return y;
}

Vec rms_loop(const Vec& x, const Arr& weight, double eps) {
  double ms = 0.0;
  for (double v : x) ms += v * v;
  ms /= static_cast<double>(x.size());
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = weight(i) * x[i] / std::sqrt(ms + eps);
  return y;
}

Vec layer_norm_loop(const Vec& x, const Arr& weight, const Arr& bias, double eps) {
  const double n = static_cast<double>(x.size());
  double mean = 0.0, var = 0.0;
  for (double v : x) mean += v;
  mean /= n;
  for (double v : x) var += (v - mean) * (v - mean);
  var /= n;
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = (x[i] - mean) / std::sqrt(var + eps) * weight(i) + bias(i);
  return y;
}

// Rotate-half rotary on one head vector at position pos: dims i and i+half pair up;
// linear rope scaling divides the frequencies by `linear`.
Vec rotary_loop(const Vec& x, int64_t pos, double theta, double linear = 1.0) {
  const int64_t d = static_cast<int64_t>(x.size()), half = d / 2;
  Vec y(d);
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq =
        1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(d)) / linear;
    const double c = std::cos(pos * inv_freq), s = std::sin(pos * inv_freq);
    y[i] = x[i] * c - x[i + half] * s;
    y[i + half] = x[i + half] * c + x[i] * s;
  }
  return y;
}

// Causal attention over per-position head vectors; query head h reads kv head h / group.
// q[t] holds heads*dim values, k[t] / v[t] hold kv_heads*dim values. Scores are
// dot * scale, soft-capped (cap * tanh(score / cap)) when softcap > 0; with
// window > 0 a query at t reads keys t - window + 1 .. t only.
std::vector<Vec> attention_loop(const std::vector<Vec>& q, const std::vector<Vec>& k, const std::vector<Vec>& v,
                                int64_t heads, int64_t kv_heads, int64_t dim, double scale, int64_t window = 0,
                                double softcap = 0.0) {
  const int64_t seq = static_cast<int64_t>(q.size()), group = heads / kv_heads;
  std::vector<Vec> out(seq, Vec(heads * dim, 0.0));
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t kvh = h / group;
    for (int64_t t = 0; t < seq; ++t) {
      const int64_t first = window > 0 ? std::max<int64_t>(0, t - window + 1) : 0;
      Vec scores(t + 1, 0.0);
      double best = -1e300;
      for (int64_t s = first; s <= t; ++s) {
        double dot = 0.0;
        for (int64_t e = 0; e < dim; ++e) dot += q[t][h * dim + e] * k[s][kvh * dim + e];
        scores[s] = dot * scale;
        if (softcap > 0) scores[s] = softcap * std::tanh(scores[s] / softcap);
        best = std::max(best, scores[s]);
      }
      double total = 0.0;
      for (int64_t s = first; s <= t; ++s) total += (scores[s] = std::exp(scores[s] - best));
      for (int64_t s = first; s <= t; ++s) {
        for (int64_t e = 0; e < dim; ++e) out[t][h * dim + e] += scores[s] / total * v[s][kvh * dim + e];
      }
    }
  }
  return out;
}

// Applies f to each dim-sized head slice of x in place.
template <typename F>
void per_head(Vec& x, int64_t dim, F f) {
  for (size_t start = 0; start < x.size(); start += dim) {
    Vec head(x.begin() + start, x.begin() + start + dim);
    head = f(head);
    std::copy(head.begin(), head.end(), x.begin() + start);
  }
}

double silu(double x) { return x / (1.0 + std::exp(-x)); }

// down(silu(gate(x)) * up(x)) for nn.Linear prefixes without biases.
Vec swiglu_loop(const Weights& w, const std::string& gate, const std::string& up, const std::string& down,
                const Vec& x) {
  Vec g = linear_loop(w, gate, x);
  const Vec u = linear_loop(w, up, x);
  for (size_t i = 0; i < g.size(); ++i) g[i] = silu(g[i]) * u[i];
  return linear_loop(w, down, g);
}

Vec softmax_loop(const Vec& z) {
  double best = -1e300, total = 0.0;
  for (double v : z) best = std::max(best, v);
  Vec p(z.size());
  for (size_t i = 0; i < z.size(); ++i) total += (p[i] = std::exp(z[i] - best));
  for (double& v : p) v /= total;
  return p;
}

// Indices of the k largest values, largest first (repeated argmax).
std::vector<int64_t> top_k_loop(const Vec& p, int64_t k) {
  std::vector<int64_t> chosen;
  std::vector<bool> used(p.size(), false);
  for (int64_t slot = 0; slot < k; ++slot) {
    int64_t best = -1;
    for (size_t e = 0; e < p.size(); ++e) {
      if (!used[e] && (best < 0 || p[e] > p[best])) best = static_cast<int64_t>(e);
    }
    used[best] = true;
    chosen.push_back(best);
  }
  return chosen;
}

// One token through a sparse block (pre: "...block_sparse_moe." or "...mlp."):
// softmax of the router logits, the top_k largest probabilities, divided by their
// sum when renormalise, weighting their experts' SwiGLU outputs; plus, when the
// weights have one, the shared expert times sigmoid of its gate. The router logits
// are appended to routers when given.
Vec moe_loop(const Weights& w, const std::string& pre, bool mixtral, int64_t top_k, bool renormalise, const Vec& x,
             std::vector<Vec>* routers) {
  const Vec logits = linear_loop(w, pre + "gate", x);
  if (routers) routers->push_back(logits);
  const Vec p = softmax_loop(logits);
  const std::vector<int64_t> chosen = top_k_loop(p, top_k);
  double total = 0.0;
  for (int64_t e : chosen) total += p[e];
  Vec out(x.size(), 0.0);
  for (int64_t e : chosen) {
    const std::string expert = pre + "experts." + std::to_string(e) + ".";
    const Vec y = mixtral ? swiglu_loop(w, expert + "w1", expert + "w3", expert + "w2", x)
                          : swiglu_loop(w, expert + "gate_proj", expert + "up_proj", expert + "down_proj", x);
    const double weight = renormalise ? p[e] / total : p[e];
    for (size_t i = 0; i < out.size(); ++i) out[i] += weight * y[i];
  }
  if (w.count(pre + "shared_expert_gate.weight")) {
    const double gate = 1.0 / (1.0 + std::exp(-linear_loop(w, pre + "shared_expert_gate", x)[0]));
    const std::string shared = pre + "shared_expert.";
    const Vec y = swiglu_loop(w, shared + "gate_proj", shared + "up_proj", shared + "down_proj", x);
    for (size_t i = 0; i < out.size(); ++i) out[i] += gate * y[i];
  }
  return out;
}

// HF's load-balancing loss from router logit rows: E * sum_e f_e * P_e, where f_e is
// the share of rows choosing expert e among their top_k (HF's per-slot shares summed
// over slots) and P_e the mean probability of e. With grad, also d loss / d logits.
double load_balancing_loop(const std::vector<Vec>& rows, int64_t top_k, std::vector<Vec>* grad = nullptr) {
  const int64_t experts = static_cast<int64_t>(rows.at(0).size());
  const double n = static_cast<double>(rows.size());
  Vec chosen_share(experts, 0.0), mean_prob(experts, 0.0);  // f summed over slots, P
  std::vector<Vec> probs;
  for (const Vec& row : rows) {
    probs.push_back(softmax_loop(row));
    for (int64_t e : top_k_loop(probs.back(), top_k)) chosen_share[e] += 1.0 / n;
    for (int64_t e = 0; e < experts; ++e) mean_prob[e] += probs.back()[e] / n;
  }
  double loss = 0.0;
  for (int64_t e = 0; e < experts; ++e) loss += chosen_share[e] * mean_prob[e];
  if (grad) {  // only P depends on the logits: dP_e / dz_nj = p_ne (delta_ej - p_nj) / n
    grad->assign(rows.size(), Vec(experts, 0.0));
    for (size_t r = 0; r < rows.size(); ++r) {
      double mixed = 0.0;
      for (int64_t e = 0; e < experts; ++e) mixed += chosen_share[e] * probs[r][e];
      for (int64_t j = 0; j < experts; ++j)
        (*grad)[r][j] = experts / n * probs[r][j] * (chosen_share[j] - mixed);
    }
  }
  return loss * experts;
}

// Llama / Mistral / Qwen2 / Qwen3 forward for one sequence (no sliding windows).
// Biases and Qwen3's per-head q_norm / k_norm are used where the weights have them,
// and sparse blocks (Mixtral / Qwen MoE) where the weights have a router; their
// router logits are appended to routers when given. Returns logits [T][V].
std::vector<Vec> llama_loop(const json& cfg, const Weights& w, const std::vector<int64_t>& ids,
                            std::vector<Vec>* routers = nullptr) {
  const int64_t hidden = cfg.at("hidden_size"), heads = cfg.at("num_attention_heads");
  const int64_t kv_heads = cfg.value("num_key_value_heads", heads);
  const int64_t dim = cfg.value("head_dim", hidden / heads);
  const double eps = cfg.at("rms_norm_eps"), theta = cfg.value("rope_theta", 10000.0);
  const int64_t layers = cfg.at("num_hidden_layers");
  const int64_t seq = static_cast<int64_t>(ids.size());

  const Arr emb = arr(w.at("model.embed_tokens.weight"));
  std::vector<Vec> h(seq, Vec(hidden));
  for (int64_t t = 0; t < seq; ++t) {
    for (int64_t i = 0; i < hidden; ++i) h[t][i] = emb(ids[t], i);
  }
  for (int64_t l = 0; l < layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    const Arr in_norm = arr(w.at(pre + "input_layernorm.weight"));
    std::vector<Vec> q(seq), k(seq), v(seq);
    for (int64_t t = 0; t < seq; ++t) {
      const Vec x = rms_loop(h[t], in_norm, eps);
      q[t] = linear_loop(w, pre + "self_attn.q_proj", x);
      k[t] = linear_loop(w, pre + "self_attn.k_proj", x);
      v[t] = linear_loop(w, pre + "self_attn.v_proj", x);
      if (w.count(pre + "self_attn.q_norm.weight")) {  // Qwen3, before the rotary
        const Arr qn = arr(w.at(pre + "self_attn.q_norm.weight")), kn = arr(w.at(pre + "self_attn.k_norm.weight"));
        per_head(q[t], dim, [&](const Vec& head) { return rms_loop(head, qn, eps); });
        per_head(k[t], dim, [&](const Vec& head) { return rms_loop(head, kn, eps); });
      }
      per_head(q[t], dim, [&](const Vec& head) { return rotary_loop(head, t, theta); });
      per_head(k[t], dim, [&](const Vec& head) { return rotary_loop(head, t, theta); });
    }
    const std::vector<Vec> attn = attention_loop(q, k, v, heads, kv_heads, dim, 1.0 / std::sqrt(double(dim)));
    const Arr post_norm = arr(w.at(pre + "post_attention_layernorm.weight"));
    for (int64_t t = 0; t < seq; ++t) {
      const Vec o = linear_loop(w, pre + "self_attn.o_proj", attn[t]);
      for (int64_t i = 0; i < hidden; ++i) h[t][i] += o[i];
      const Vec x = rms_loop(h[t], post_norm, eps);
      const bool mixtral = arch_of(cfg) == "MixtralForCausalLM";
      const std::string moe = pre + (mixtral ? "block_sparse_moe." : "mlp.");
      if (w.count(moe + "gate.weight")) {
        const Vec y = moe_loop(w, moe, mixtral, cfg.at("num_experts_per_tok"),
                               mixtral || cfg.value("norm_topk_prob", false), x, routers);
        for (int64_t i = 0; i < hidden; ++i) h[t][i] += y[i];
        continue;
      }
      Vec gate = linear_loop(w, pre + "mlp.gate_proj", x);
      const Vec up = linear_loop(w, pre + "mlp.up_proj", x);
      for (size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
      const Vec down = linear_loop(w, pre + "mlp.down_proj", gate);
      for (int64_t i = 0; i < hidden; ++i) h[t][i] += down[i];
    }
  }
  const Arr final_norm = arr(w.at("model.norm.weight"));
  const Arr head = w.count("lm_head.weight") ? arr(w.at("lm_head.weight")) : emb;
  std::vector<Vec> logits(seq, Vec(head.shape[0], 0.0));
  for (int64_t t = 0; t < seq; ++t) {
    const Vec x = rms_loop(h[t], final_norm, eps);
    for (int64_t o = 0; o < head.shape[0]; ++o) {
      for (int64_t i = 0; i < hidden; ++i) logits[t][o] += head(o, i) * x[i];
    }
  }
  return logits;
}

std::vector<Vec> gpt2_loop(const json& cfg, const Weights& w, const std::vector<int64_t>& ids) {
  const int64_t embd = cfg.at("n_embd"), heads = cfg.at("n_head"), layers = cfg.at("n_layer");
  const double eps = cfg.at("layer_norm_epsilon");
  const int64_t seq = static_cast<int64_t>(ids.size()), dim = embd / heads;
  const Arr wte = arr(w.at("transformer.wte.weight")), wpe = arr(w.at("transformer.wpe.weight"));
  std::vector<Vec> h(seq, Vec(embd));
  for (int64_t t = 0; t < seq; ++t) {
    for (int64_t i = 0; i < embd; ++i) h[t][i] = wte(ids[t], i) + wpe(t, i);
  }
  for (int64_t l = 0; l < layers; ++l) {
    const std::string pre = "transformer.h." + std::to_string(l) + ".";
    const Arr ln1w = arr(w.at(pre + "ln_1.weight")), ln1b = arr(w.at(pre + "ln_1.bias"));
    std::vector<Vec> q(seq), k(seq), v(seq);
    for (int64_t t = 0; t < seq; ++t) {
      const Vec qkv = conv1d_loop(w, pre + "attn.c_attn", layer_norm_loop(h[t], ln1w, ln1b, eps));
      q[t] = Vec(qkv.begin(), qkv.begin() + embd);
      k[t] = Vec(qkv.begin() + embd, qkv.begin() + 2 * embd);
      v[t] = Vec(qkv.begin() + 2 * embd, qkv.end());
    }
    const std::vector<Vec> attn = attention_loop(q, k, v, heads, heads, dim, 1.0 / std::sqrt(double(dim)));
    const Arr ln2w = arr(w.at(pre + "ln_2.weight")), ln2b = arr(w.at(pre + "ln_2.bias"));
    for (int64_t t = 0; t < seq; ++t) {
      const Vec o = conv1d_loop(w, pre + "attn.c_proj", attn[t]);
      for (int64_t i = 0; i < embd; ++i) h[t][i] += o[i];
      Vec m = conv1d_loop(w, pre + "mlp.c_fc", layer_norm_loop(h[t], ln2w, ln2b, eps));
      for (double& x : m) x = 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / 3.14159265358979323846) * (x + 0.044715 * x * x * x)));
      const Vec down = conv1d_loop(w, pre + "mlp.c_proj", m);
      for (int64_t i = 0; i < embd; ++i) h[t][i] += down[i];
    }
  }
  const Arr lnfw = arr(w.at("transformer.ln_f.weight")), lnfb = arr(w.at("transformer.ln_f.bias"));
  std::vector<Vec> logits(seq, Vec(wte.shape[0], 0.0));
  for (int64_t t = 0; t < seq; ++t) {
    const Vec x = layer_norm_loop(h[t], lnfw, lnfb, eps);
    for (int64_t o = 0; o < wte.shape[0]; ++o) {
      for (int64_t i = 0; i < embd; ++i) logits[t][o] += wte(o, i) * x[i];
    }
  }
  return logits;
}

// x / sqrt(mean(x^2) + eps) * (1 + weight): Gemma's RMSNorm.
Vec gemma_rms_loop(const Vec& x, const Arr& weight, double eps) {
  double ms = 0.0;
  for (double v : x) ms += v * v;
  ms /= static_cast<double>(x.size());
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = (1.0 + weight(i)) * x[i] / std::sqrt(ms + eps);
  return y;
}

double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / 3.14159265358979323846) * (x + 0.044715 * x * x * x)));
}

// Gemma 2 / Gemma 3 forward for one sequence, with layer_types, soft-capping,
// thetas, query_pre_attn_scalar and sliding_window spelled out in the config and
// rope_scaling absent, null or linear. Returns logits [T][V].
std::vector<Vec> gemma_loop(const json& cfg, const Weights& w, const std::vector<int64_t>& ids) {
  const bool gemma3 = cfg.at("model_type") == "gemma3_text";
  const int64_t hidden = cfg.at("hidden_size"), heads = cfg.at("num_attention_heads");
  const int64_t kv_heads = cfg.at("num_key_value_heads"), dim = cfg.at("head_dim");
  const int64_t layers = cfg.at("num_hidden_layers"), window = cfg.at("sliding_window");
  const double eps = cfg.at("rms_norm_eps"), theta = cfg.at("rope_theta");
  const double local_theta = gemma3 ? cfg.at("rope_local_base_freq").get<double>() : theta;
  const json scaling = cfg.value("rope_scaling", json());
  const double linear = scaling.is_null() ? 1.0 : scaling.at("factor").get<double>();
  const double scale = 1.0 / std::sqrt(cfg.at("query_pre_attn_scalar").get<double>());
  auto cap_of = [&](const char* key) { return cfg.at(key).is_null() ? 0.0 : cfg.at(key).get<double>(); };
  const double attn_cap = cap_of("attn_logit_softcapping"), final_cap = cap_of("final_logit_softcapping");
  const int64_t seq = static_cast<int64_t>(ids.size());

  const Arr emb = arr(w.at("model.embed_tokens.weight"));
  std::vector<Vec> h(seq, Vec(hidden));
  for (int64_t t = 0; t < seq; ++t) {
    for (int64_t i = 0; i < hidden; ++i) h[t][i] = emb(ids[t], i) * std::sqrt(static_cast<double>(hidden));
  }
  auto norm = [&](const std::string& name, const Vec& x) { return gemma_rms_loop(x, arr(w.at(name)), eps); };
  for (int64_t l = 0; l < layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    const bool sliding = cfg.at("layer_types").at(l) == "sliding_attention";
    // Gemma 3's sliding layers: local base, no scaling; otherwise rope_theta and rope_scaling.
    const double layer_theta = sliding ? local_theta : theta;
    const double layer_linear = gemma3 && sliding ? 1.0 : linear;
    std::vector<Vec> q(seq), k(seq), v(seq);
    for (int64_t t = 0; t < seq; ++t) {
      const Vec x = norm(pre + "input_layernorm.weight", h[t]);
      q[t] = linear_loop(w, pre + "self_attn.q_proj", x);
      k[t] = linear_loop(w, pre + "self_attn.k_proj", x);
      v[t] = linear_loop(w, pre + "self_attn.v_proj", x);
      if (gemma3) {
        per_head(q[t], dim, [&](const Vec& head) { return norm(pre + "self_attn.q_norm.weight", head); });
        per_head(k[t], dim, [&](const Vec& head) { return norm(pre + "self_attn.k_norm.weight", head); });
      }
      per_head(q[t], dim, [&](const Vec& head) { return rotary_loop(head, t, layer_theta, layer_linear); });
      per_head(k[t], dim, [&](const Vec& head) { return rotary_loop(head, t, layer_theta, layer_linear); });
    }
    const std::vector<Vec> attn =
        attention_loop(q, k, v, heads, kv_heads, dim, scale, sliding ? window : 0, attn_cap);
    for (int64_t t = 0; t < seq; ++t) {
      const Vec o = norm(pre + "post_attention_layernorm.weight", linear_loop(w, pre + "self_attn.o_proj", attn[t]));
      for (int64_t i = 0; i < hidden; ++i) h[t][i] += o[i];
      const Vec x = norm(pre + "pre_feedforward_layernorm.weight", h[t]);
      Vec gate = linear_loop(w, pre + "mlp.gate_proj", x);
      const Vec up = linear_loop(w, pre + "mlp.up_proj", x);
      for (size_t i = 0; i < gate.size(); ++i) gate[i] = gelu_tanh(gate[i]) * up[i];
      const Vec down = norm(pre + "post_feedforward_layernorm.weight", linear_loop(w, pre + "mlp.down_proj", gate));
      for (int64_t i = 0; i < hidden; ++i) h[t][i] += down[i];
    }
  }
  const Arr head = w.count("lm_head.weight") ? arr(w.at("lm_head.weight")) : emb;
  std::vector<Vec> logits(seq, Vec(head.shape[0], 0.0));
  for (int64_t t = 0; t < seq; ++t) {
    const Vec x = norm("model.norm.weight", h[t]);
    for (int64_t o = 0; o < head.shape[0]; ++o) {
      for (int64_t i = 0; i < hidden; ++i) logits[t][o] += head(o, i) * x[i];
      if (final_cap > 0) logits[t][o] = final_cap * std::tanh(logits[t][o] / final_cap);
    }
  }
  return logits;
}

// The scalar loop for a config's architecture (Phi-3 through its split Llama twin).
std::vector<Vec> loop_logits(const json& config, const Weights& w, const std::vector<int64_t>& ids) {
  const std::string arch = arch_of(config);
  if (arch == "GPT2LMHeadModel") return gpt2_loop(config, w, ids);
  if (arch == "Gemma2ForCausalLM" || arch == "Gemma3ForCausalLM") return gemma_loop(config, w, ids);
  if (arch == "Phi3ForCausalLM") {
    const auto [llama, llama_weights] = phi3_as_llama(config, w);
    return llama_loop(llama, llama_weights, ids);
  }
  return llama_loop(config, w, ids);
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

TEST(ReferenceModels, MatchesScalarLoopImplementation) {
  for (const json& config : all_configs()) {
    SCOPED_TRACE(arch_of(config));
    const Weights weights = amplified(reference_random_weights(config, 7), 12.0);
    const torch::Tensor ids = ids_for(config, 2, 6, 3);
    const torch::Tensor logits = reference_logits(config, weights, ids);
    ASSERT_EQ(logits.scalar_type(), torch::kFloat);
    ASSERT_EQ(logits.sizes().vec(), (std::vector<int64_t>{2, 6, config.at("vocab_size").get<int64_t>()}));
    double max_err = 0.0, max_mag = 0.0;
    for (int64_t b = 0; b < 2; ++b) {
      std::vector<int64_t> seq_ids(ids[b].data_ptr<int64_t>(), ids[b].data_ptr<int64_t>() + 6);
      const std::vector<Vec> expected = loop_logits(config, weights, seq_ids);
      const Arr got = arr(logits[b]);
      for (int64_t t = 0; t < 6; ++t) {
        for (int64_t o = 0; o < got.shape[1]; ++o) {
          max_err = std::max(max_err, std::abs(got(t, o) - expected[t][o]));
          max_mag = std::max(max_mag, std::abs(expected[t][o]));
        }
      }
    }
    EXPECT_GT(max_mag, 0.5);  // amplified weights give logits of visible size
    EXPECT_LT(max_err, 1e-4 * std::max(1.0, max_mag));
  }
}

TEST(ReferenceModels, IsCausal) {
  for (const json& config : all_configs()) {
    SCOPED_TRACE(arch_of(config));
    const int64_t vocab = config.at("vocab_size");
    const Weights weights = amplified(reference_random_weights(config, 11), 5.0);
    const torch::Tensor ids = ids_for(config, 2, 8, 5);
    const torch::Tensor base = reference_logits(config, weights, ids);
    const int64_t t = 4;
    torch::Tensor changed_ids = ids.clone();
    changed_ids.index_put_({torch::indexing::Slice(), t}, (ids.index({torch::indexing::Slice(), t}) + 1) % vocab);
    const torch::Tensor changed = reference_logits(config, weights, changed_ids);
    using torch::indexing::Slice;
    EXPECT_EQ(max_abs_diff(base.index({Slice(), Slice(0, t)}), changed.index({Slice(), Slice(0, t)})), 0.0);
    for (int64_t later = t; later < 8; ++later) {
      EXPECT_GT(max_abs_diff(base.index({Slice(), later}), changed.index({Slice(), later})), 1e-4) << later;
    }
  }
}

// kv_heads < heads must equal an MHA model whose kv projections repeat each kv
// head for its group of consecutive query heads (HF repeat_kv).
TEST(ReferenceModels, GqaEqualsRepeatedKvHeads) {
  json gqa = llama_config();  // 4 heads, 2 kv heads, head_dim 6, attention bias
  json mha = gqa;
  mha["num_key_value_heads"] = 4;
  const Weights w_gqa = amplified(reference_random_weights(gqa, 21), 10.0);
  const int64_t dim = 6, hidden = 16, group = 2;
  auto repeat = [&](const torch::Tensor& t, bool interleave) {
    const int64_t kv = t.size(0) / dim;
    torch::Tensor heads = t.reshape({kv, dim, -1});
    torch::Tensor out = interleave ? heads.repeat_interleave(group, 0) : heads.repeat({group, 1, 1});
    return t.dim() == 1 ? out.reshape({kv * group * dim}) : out.reshape({kv * group * dim, hidden});
  };
  auto make_mha = [&](bool interleave) {
    Weights w = w_gqa;
    for (int64_t l = 0; l < 2; ++l) {
      for (const char* proj : {"k_proj", "v_proj"}) {
        for (const char* kind : {"weight", "bias"}) {
          const std::string name = "model.layers." + std::to_string(l) + ".self_attn." + proj + "." + kind;
          w[name] = repeat(w_gqa.at(name), interleave);
        }
      }
    }
    return w;
  };
  const torch::Tensor ids = ids_for(gqa, 2, 7, 9);
  const torch::Tensor expected = reference_logits(gqa, w_gqa, ids);
  EXPECT_LT(max_abs_diff(reference_logits(mha, make_mha(true), ids), expected), 1e-5);
  // The other head mapping (kv head j serving heads j, j+kv, ...) must not match.
  EXPECT_GT(max_abs_diff(reference_logits(mha, make_mha(false), ids), expected), 1e-3);
}

TEST(ReferenceModels, TiedHeadUsesEmbeddingMatrix) {
  for (const json& config : {llama_config(), qwen3_config(), gemma2_config(), gpt2_config()}) {
    SCOPED_TRACE(arch_of(config));
    const bool gpt2 = config.at("model_type") == "gpt2";
    const std::string emb_name = gpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight";
    Weights weights = reference_random_weights(config, 4);
    ASSERT_EQ(weights.count("lm_head.weight"), 0u);
    const torch::Tensor ids = torch::tensor({{1, 2, 3, 4, 5}}, torch::kLong);  // row 9 unused
    const torch::Tensor base = reference_logits(config, weights, ids);
    weights[emb_name] = weights[emb_name].clone();
    weights[emb_name][9].add_(0.5);
    const torch::Tensor changed = reference_logits(config, weights, ids);
    using torch::indexing::Slice;
    EXPECT_GT(max_abs_diff(base.index({Slice(), Slice(), 9}), changed.index({Slice(), Slice(), 9})), 1e-3);
    torch::Tensor others = torch::ones({base.size(2)}, torch::kBool);
    others[9] = false;
    EXPECT_EQ(max_abs_diff(base.index({Slice(), Slice(), others}), changed.index({Slice(), Slice(), others})), 0.0);
  }
  // Untied: the unused embedding row plays no part, lm_head does.
  json untied = llama_config();
  untied["tie_word_embeddings"] = false;
  Weights weights = reference_random_weights(untied, 4);
  ASSERT_EQ(weights.count("lm_head.weight"), 1u);
  const torch::Tensor ids = torch::tensor({{1, 2, 3, 4, 5}}, torch::kLong);
  const torch::Tensor base = reference_logits(untied, weights, ids);
  weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone();
  weights["model.embed_tokens.weight"][9].add_(0.5);
  EXPECT_EQ(max_abs_diff(reference_logits(untied, weights, ids), base), 0.0);
  weights["lm_head.weight"] = weights["lm_head.weight"].clone();
  weights["lm_head.weight"][9].add_(0.5);
  EXPECT_GT(max_abs_diff(reference_logits(untied, weights, ids), base), 1e-3);
}

// Zero layers: logits = lm_head(RMSNorm(embedding)), checked in closed form.
TEST(ReferenceModels, RmsNormClosedForm) {
  json config = {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 3},       {"hidden_size", 2},
                 {"intermediate_size", 2},                {"num_hidden_layers", 0}, {"num_attention_heads", 1},
                 {"rms_norm_eps", 0.25},                  {"tie_word_embeddings", false}};
  Weights w;
  w["model.embed_tokens.weight"] = torch::tensor({{3.0f, 4.0f}, {1.0f, -1.0f}, {0.0f, 2.0f}});
  w["model.norm.weight"] = torch::tensor({2.0f, 0.5f});
  w["lm_head.weight"] = torch::tensor({{1.0f, 0.0f}, {0.0f, 1.0f}, {1.0f, 1.0f}});
  const torch::Tensor logits = reference_logits(config, w, torch::tensor({{0, 1}}, torch::kLong));
  // Token 0: mean(x^2) = 12.5; token 1: mean(x^2) = 1.
  const double r0 = 1.0 / std::sqrt(12.5 + 0.25), r1 = 1.0 / std::sqrt(1.0 + 0.25);
  const torch::Tensor expected = torch::tensor({{{2 * 3 * r0, 0.5 * 4 * r0, 2 * 3 * r0 + 0.5 * 4 * r0},
                                                 {2 * 1 * r1, -0.5 * r1, 2 * r1 - 0.5 * r1}}},
                                               torch::kDouble);
  EXPECT_LT(max_abs_diff(logits.to(torch::kDouble), expected), 1e-6);
}

// One layer, one head, identity projections, zero MLP: the attention output at
// position 1 has a closed form that depends on the rotate-half rotary layout
// (dims i and i + d/2 rotate together) and the 1/sqrt(head_dim) scaling.
TEST(ReferenceModels, RotaryAttentionClosedForm) {
  const double eps = 1e-6, theta = 100.0;  // inv_freq = {1, 0.1}
  json config = {{"architectures", {"LlamaForCausalLM"}},
                 {"vocab_size", 4},
                 {"hidden_size", 4},
                 {"intermediate_size", 3},
                 {"num_hidden_layers", 1},
                 {"num_attention_heads", 1},
                 {"num_key_value_heads", 1},
                 {"rms_norm_eps", eps},
                 {"rope_theta", theta},
                 {"tie_word_embeddings", false}};
  Weights w = reference_random_weights(config, 1);
  const torch::Tensor eye = torch::eye(4);
  for (const char* name : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
    w[std::string("model.layers.0.self_attn.") + name + ".weight"] = eye.clone();
  }
  w["model.layers.0.mlp.down_proj.weight"] = torch::zeros({4, 3});
  w["model.layers.0.input_layernorm.weight"] = torch::ones({4});
  w["model.layers.0.post_attention_layernorm.weight"] = torch::ones({4});
  w["model.norm.weight"] = torch::ones({4});
  w["lm_head.weight"] = eye.clone();
  const std::vector<Vec> e = {{1.0, 2.0, -1.0, 0.5}, {0.3, -1.0, 2.0, 1.0}, {0.0, 0.0, 1.0, 0.0}, {1.0, 1.0, 1.0, 1.0}};
  w["model.embed_tokens.weight"] = torch::tensor({1.0, 2.0, -1.0, 0.5, 0.3, -1.0, 2.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0},
                                                 torch::kFloat)
                                       .reshape({4, 4});

  auto rms = [&](const Vec& x) {
    double ms = 0.0;
    for (double v : x) ms += v * v / x.size();
    Vec y;
    for (double v : x) y.push_back(v / std::sqrt(ms + eps));
    return y;
  };
  auto dot = [](const Vec& a, const Vec& b) { return a[0] * b[0] + a[1] * b[1] + a[2] * b[2] + a[3] * b[3]; };
  auto expected_logits = [&](bool rotate_half_layout) {
    const Vec x0 = rms(e[0]), x1 = rms(e[1]);
    // Position 1 rotates by angles {1 * 1, 1 * 0.1}.
    const double c0 = std::cos(1.0), s0 = std::sin(1.0), c1 = std::cos(0.1), s1 = std::sin(0.1);
    Vec q1;
    if (rotate_half_layout) {  // pairs (0, 2) and (1, 3)
      q1 = {x1[0] * c0 - x1[2] * s0, x1[1] * c1 - x1[3] * s1, x1[2] * c0 + x1[0] * s0, x1[3] * c1 + x1[1] * s1};
    } else {  // interleaved pairs (0, 1) and (2, 3)
      q1 = {x1[0] * c0 - x1[1] * s0, x1[1] * c0 + x1[0] * s0, x1[2] * c1 - x1[3] * s1, x1[3] * c1 + x1[2] * s1};
    }
    // k0 is unrotated (position 0); q1 . k1 = |x1|^2 since both rotate by the same angles.
    const double a = dot(q1, x0) / 2.0, b = dot(x1, x1) / 2.0;
    const double p0 = std::exp(a) / (std::exp(a) + std::exp(b)), p1 = 1.0 - p0;
    Vec h0(4), h1(4);
    for (int i = 0; i < 4; ++i) {
      h0[i] = e[0][i] + x0[i];                      // position 0 attends only to itself
      h1[i] = e[1][i] + p0 * x0[i] + p1 * x1[i];
    }
    const Vec l0 = rms(h0), l1 = rms(h1);
    return torch::tensor({l0[0], l0[1], l0[2], l0[3], l1[0], l1[1], l1[2], l1[3]}, torch::kDouble).reshape({1, 2, 4});
  };
  const torch::Tensor logits = reference_logits(config, w, torch::tensor({{0, 1}}, torch::kLong)).to(torch::kDouble);
  EXPECT_LT(max_abs_diff(logits, expected_logits(true)), 1e-5);
  // The closed form discriminates between rotary layouts.
  EXPECT_GT(max_abs_diff(expected_logits(true), expected_logits(false)), 1e-2);
}

TEST(ReferenceModels, NextTokenLossMatchesManualLogSoftmax) {
  torch::manual_seed(3);
  const torch::Tensor logits = torch::randn({2, 5, 7}) * 3.0;
  const torch::Tensor ids = torch::randint(7, {2, 5}, torch::kLong);
  const Arr l = arr(logits.reshape({-1, 7}));
  double total = 0.0;
  int count = 0;
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t t = 0; t + 1 < 5; ++t) {
      const int64_t row = b * 5 + t, target = ids[b][t + 1].item<int64_t>();
      double best = -1e300, sum = 0.0;
      for (int64_t v = 0; v < 7; ++v) best = std::max(best, l(row, v));
      for (int64_t v = 0; v < 7; ++v) sum += std::exp(l(row, v) - best);
      total += -(l(row, target) - best - std::log(sum));
      ++count;
    }
  }
  const torch::Tensor loss = reference_next_token_loss(logits, ids);
  EXPECT_EQ(loss.dim(), 0);
  EXPECT_NEAR(loss.item<double>(), total / count, 1e-5);
}

TEST(ReferenceModels, DispatchAndArchitectureVariants) {
  const json config = mistral_config();
  const Weights weights = reference_random_weights(config, 2);
  const torch::Tensor ids = ids_for(config, 1, 5, 1);
  EXPECT_TRUE(torch::equal(reference_logits(config, weights, ids), reference_llama_logits(config, weights, ids)));
  const json gpt2 = gpt2_config();
  const Weights gw = reference_random_weights(gpt2, 2);
  EXPECT_TRUE(torch::equal(reference_logits(gpt2, gw, ids), reference_gpt2_logits(gpt2, gw, ids)));
  for (const json& c : {qwen3_config(), phi3_config()}) {
    const Weights cw = reference_random_weights(c, 2);
    EXPECT_TRUE(torch::equal(reference_logits(c, cw, ids), reference_llama_logits(c, cw, ids))) << arch_of(c);
    EXPECT_THROW(reference_gemma_logits(c, cw, ids), std::runtime_error) << arch_of(c);
  }
  for (const json& c : {gemma2_config(), gemma3_config()}) {
    const Weights cw = reference_random_weights(c, 2);
    EXPECT_TRUE(torch::equal(reference_logits(c, cw, ids), reference_gemma_logits(c, cw, ids))) << arch_of(c);
    EXPECT_THROW(reference_llama_logits(c, cw, ids), std::runtime_error) << arch_of(c);
  }

  // Qwen2: q/k/v biased, o_proj and MLP not, whatever attention_bias / mlp_bias say.
  json qwen = qwen2_config();
  qwen["attention_bias"] = false;
  const Weights qw = reference_random_weights(qwen, 2);
  EXPECT_EQ(qw.count("model.layers.1.self_attn.q_proj.bias"), 1u);
  EXPECT_EQ(qw.count("model.layers.1.self_attn.k_proj.bias"), 1u);
  EXPECT_EQ(qw.count("model.layers.1.self_attn.v_proj.bias"), 1u);
  EXPECT_EQ(qw.count("model.layers.1.self_attn.o_proj.bias"), 0u);
  EXPECT_EQ(qw.count("model.layers.1.mlp.up_proj.bias"), 0u);
  EXPECT_EQ(qw.count("lm_head.weight"), 1u);
  // The q bias matters.
  Weights qw2 = qw;
  qw2["model.layers.0.self_attn.q_proj.bias"] = qw.at("model.layers.0.self_attn.q_proj.bias") + 1.0;
  EXPECT_GT(max_abs_diff(reference_logits(qwen, qw, ids), reference_logits(qwen, qw2, ids)), 1e-6);

  // Llama with attention_bias: all four projections biased; head_dim from config.
  const Weights lw = reference_random_weights(llama_config(), 2);
  EXPECT_EQ(lw.at("model.layers.0.self_attn.q_proj.weight").sizes().vec(), (std::vector<int64_t>{24, 16}));
  EXPECT_EQ(lw.at("model.layers.0.self_attn.k_proj.weight").sizes().vec(), (std::vector<int64_t>{12, 16}));
  EXPECT_EQ(lw.at("model.layers.0.self_attn.o_proj.weight").sizes().vec(), (std::vector<int64_t>{16, 24}));
  EXPECT_EQ(lw.count("model.layers.0.self_attn.o_proj.bias"), 1u);
  EXPECT_EQ(lw.count("model.layers.0.mlp.down_proj.bias"), 1u);
  // GPT-2 Conv1D layout and default n_inner.
  EXPECT_EQ(gw.at("transformer.h.0.attn.c_attn.weight").sizes().vec(), (std::vector<int64_t>{16, 48}));
  EXPECT_EQ(gw.at("transformer.h.0.mlp.c_fc.weight").sizes().vec(), (std::vector<int64_t>{16, 64}));
}

TEST(ReferenceModels, RandomWeightsAreSeededAndNormsNotTrivial) {
  const json config = llama_config();
  const Weights a = reference_random_weights(config, 5), b = reference_random_weights(config, 5),
                c = reference_random_weights(config, 6);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
    EXPECT_FALSE(torch::equal(t, c.at(name))) << name;
    EXPECT_EQ(t.scalar_type(), torch::kFloat) << name;
  }
  const torch::Tensor norm = a.at("model.layers.0.input_layernorm.weight");
  EXPECT_NEAR(norm.mean().item<double>(), 1.0, 0.15);
  EXPECT_GT(norm.std().item<double>(), 0.02);
  EXPECT_NEAR(a.at("model.layers.0.mlp.up_proj.weight").std().item<double>(), 0.02, 0.005);
}

TEST(ReferenceModels, Bf16WeightsGiveFloatLogitsCloseToFp32) {
  for (const json& config : {qwen2_config(), qwen3_config(), phi3_config(), gemma2_config(), gemma3_config()}) {
    SCOPED_TRACE(arch_of(config));
    const Weights w32 = amplified(reference_random_weights(config, 8), 5.0);
    Weights w16;
    for (const auto& [name, t] : w32) w16[name] = t.to(torch::kBFloat16);
    const torch::Tensor ids = ids_for(config, 1, 6, 2);
    const torch::Tensor l16 = reference_logits(config, w16, ids);
    EXPECT_EQ(l16.scalar_type(), torch::kFloat);
    const torch::Tensor l32 = reference_logits(config, w32, ids);
    EXPECT_LT(max_abs_diff(l16, l32), 0.1 * std::max(1.0, l32.abs().max().item<double>()));
    EXPECT_GT(max_abs_diff(l16, l32), 0.0);  // really computed in bf16
  }
}

// A sliding window of 2 over 2 layers: position t reads tokens t - 2 .. t only,
// on Mistral (every layer) and on Qwen2 with use_sliding_window (layer_types).
TEST(ReferenceModels, SlidingWindowsHideDistantTokens) {
  json qwen = qwen2_config();
  qwen["use_sliding_window"] = true;
  qwen["sliding_window"] = 2;
  qwen["layer_types"] = {"sliding_attention", "sliding_attention"};
  json mistral = mistral_config();
  mistral["sliding_window"] = 2;
  for (const json& config : {mistral, qwen}) {
    const Weights w = reference_random_weights(config, 3);
    torch::manual_seed(4);
    const torch::Tensor ids = torch::randint(1, config["vocab_size"].get<int64_t>(), {1, 8}, torch::kLong);
    torch::Tensor other = ids.clone();
    other[0][0] = 0;
    const torch::Tensor a = reference_logits(config, w, ids), b = reference_logits(config, w, other);
    EXPECT_GT(max_abs_diff(a.narrow(1, 2, 1), b.narrow(1, 2, 1)), 1e-4) << config["architectures"];
    EXPECT_EQ(max_abs_diff(a.narrow(1, 3, 5), b.narrow(1, 3, 5)), 0.0) << config["architectures"];
  }
  // Without use_sliding_window Qwen2 ignores the window: position 7 still reads token 0.
  qwen["use_sliding_window"] = false;
  const Weights w = reference_random_weights(qwen, 3);
  const torch::Tensor ids = torch::arange(1, 9, torch::kLong).view({1, 8});
  torch::Tensor other = ids.clone();
  other[0][0] = 0;
  EXPECT_GT(max_abs_diff(reference_logits(qwen, w, ids).narrow(1, 7, 1),
                         reference_logits(qwen, w, other).narrow(1, 7, 1)),
            1e-4);
}

TEST(ReferenceModels, RejectsUnsupportedConfigsAndBadWeights) {
  const torch::Tensor ids = torch::tensor({{1, 2, 3}}, torch::kLong);
  auto throws = [&](json config, const Weights& weights, const torch::Tensor& input) {
    EXPECT_THROW(reference_logits(config, weights, input), std::runtime_error) << config.dump();
  };
  const Weights lw = reference_random_weights(llama_config(), 1);
  json c = llama_config();
  c["rope_scaling"] = {{"type", "longrope"}, {"factor", 2.0}};
  throws(c, lw, ids);
  c = llama_config();
  c["hidden_act"] = "gelu";
  throws(c, lw, ids);
  c = llama_config();
  c["architectures"] = {"FalconForCausalLM"};
  throws(c, lw, ids);
  EXPECT_THROW(reference_random_weights(c, 1), std::runtime_error);


  const Weights gw = reference_random_weights(gpt2_config(), 1);
  for (const char* key : {"reorder_and_upcast_attn", "scale_attn_by_inverse_layer_idx"}) {
    c = gpt2_config();
    c[key] = true;
    throws(c, gw, ids);
  }
  throws(gpt2_config(), gw, torch::zeros({1, 17}, torch::kLong));  // beyond n_positions

  // Weight validation: missing, misshapen, unexpected (untied lm_head on a tied model).
  Weights bad = lw;
  bad.erase("model.layers.1.mlp.up_proj.weight");
  throws(llama_config(), bad, ids);
  bad = lw;
  bad["model.layers.0.self_attn.k_proj.weight"] = torch::zeros({24, 16});
  throws(llama_config(), bad, ids);
  bad = lw;
  bad["lm_head.weight"] = torch::zeros({23, 16});
  throws(llama_config(), bad, ids);
  // ...but an alias of the embedding, as a tied state_dict has, is accepted.
  bad = lw;
  bad["lm_head.weight"] = lw.at("model.embed_tokens.weight");
  EXPECT_NO_THROW(reference_logits(llama_config(), bad, ids));
  // Token ids out of range.
  throws(llama_config(), lw, torch::tensor({{0, 23}}, torch::kLong));
}


// ---------------------------------------------------------------------------
// Qwen3, Phi-3, Gemma 2 / 3, longrope
// ---------------------------------------------------------------------------

// Copies t with rows [head * dim, (head + 1) * dim) multiplied by factor.
torch::Tensor scale_head_rows(const torch::Tensor& t, int64_t head, int64_t dim, double factor) {
  torch::Tensor out = t.clone();
  out.narrow(0, head * dim, dim).mul_(factor);
  return out;
}

// Qwen3 RMS-normalizes every q / k head on its own: scaling one query head's
// q_proj rows (weight and bias) or one kv head's k_proj rows changes nothing,
// while the same scaling changes the model without the norms (Llama).
TEST(ReferenceModels, Qwen3QkNormMakesEachHeadScaleFree) {
  json qwen3 = qwen3_config();  // 4 heads, 2 kv heads, head_dim 6, biased
  qwen3["rms_norm_eps"] = 1e-10;
  const Weights w = amplified(reference_random_weights(qwen3, 19), 10.0);
  auto rescaled = [](const Weights& base) {
    Weights out = base;
    for (int64_t l = 0; l < 2; ++l) {
      const std::string pre = "model.layers." + std::to_string(l) + ".self_attn.";
      for (const std::string kind : {"weight", "bias"}) {
        out[pre + "q_proj." + kind] = scale_head_rows(base.at(pre + "q_proj." + kind), 1, 6, 3.0);
        out[pre + "k_proj." + kind] = scale_head_rows(base.at(pre + "k_proj." + kind), 0, 6, 0.25);
      }
    }
    return out;
  };
  const torch::Tensor ids = ids_for(qwen3, 2, 6, 8);
  const torch::Tensor base = reference_logits(qwen3, w, ids);
  EXPECT_GT(max_abs(base), 0.5);
  EXPECT_LT(max_abs_diff(reference_logits(qwen3, rescaled(w), ids), base), 1e-5 * std::max(1.0, max_abs(base)));

  json llama = qwen3;
  llama["architectures"] = {"LlamaForCausalLM"};
  llama["model_type"] = "llama";
  Weights no_norms = w;
  for (int64_t l = 0; l < 2; ++l) {
    no_norms.erase("model.layers." + std::to_string(l) + ".self_attn.q_norm.weight");
    no_norms.erase("model.layers." + std::to_string(l) + ".self_attn.k_norm.weight");
  }
  EXPECT_GT(max_abs_diff(reference_logits(llama, rescaled(no_norms), ids), reference_logits(llama, no_norms, ids)),
            1e-3);
  // The norm weights themselves matter.
  Weights doubled = w;
  doubled["model.layers.0.self_attn.q_norm.weight"] = w.at("model.layers.0.self_attn.q_norm.weight") * 2.0;
  EXPECT_GT(max_abs_diff(reference_logits(qwen3, doubled, ids), base), 1e-3);
}

// One Qwen3 layer, one head, unit norms, q_proj = 2 I, k / v / o identities and a
// zero MLP, computed by hand: q and k are RMS-normalized per head before the
// rotary, so the factor 2 on q drops out (it would double a Llama model's scores).
TEST(ReferenceModels, Qwen3OneLayerClosedForm) {
  const double eps = 1e-6, theta = 100.0;  // inv_freq = {1, 0.1}
  json config = {{"architectures", {"Qwen3ForCausalLM"}},
                 {"vocab_size", 4},
                 {"hidden_size", 4},
                 {"intermediate_size", 3},
                 {"num_hidden_layers", 1},
                 {"num_attention_heads", 1},
                 {"num_key_value_heads", 1},
                 {"head_dim", 4},
                 {"rms_norm_eps", eps},
                 {"rope_theta", theta},
                 {"tie_word_embeddings", false}};
  Weights w = reference_random_weights(config, 1);
  const torch::Tensor eye = torch::eye(4);
  w["model.layers.0.self_attn.q_proj.weight"] = eye * 2.0;
  for (const char* name : {"k_proj", "v_proj", "o_proj"}) {
    w[std::string("model.layers.0.self_attn.") + name + ".weight"] = eye.clone();
  }
  w["model.layers.0.mlp.down_proj.weight"] = torch::zeros({4, 3});
  for (const char* name : {"model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                           "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
                           "model.norm.weight"}) {
    w[name] = torch::ones({4});
  }
  w["lm_head.weight"] = eye.clone();
  const std::vector<Vec> e = {{1.0, 2.0, -1.0, 0.5}, {0.3, -1.0, 2.0, 1.0}};
  w["model.embed_tokens.weight"] =
      torch::tensor({1.0, 2.0, -1.0, 0.5, 0.3, -1.0, 2.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0}, torch::kFloat)
          .reshape({4, 4});

  auto rms = [&](const Vec& x) {
    double ms = 0.0;
    for (double v : x) ms += v * v / x.size();
    Vec y;
    for (double v : x) y.push_back(v / std::sqrt(ms + eps));
    return y;
  };
  auto times = [](const Vec& x, double f) {
    Vec y;
    for (double v : x) y.push_back(v * f);
    return y;
  };
  // Rotate-half rotary at position 1: pairs (0, 2) and (1, 3) turn by 1 and 0.1.
  auto rotate = [](const Vec& x) {
    const double c0 = std::cos(1.0), s0 = std::sin(1.0), c1 = std::cos(0.1), s1 = std::sin(0.1);
    return Vec{x[0] * c0 - x[2] * s0, x[1] * c1 - x[3] * s1, x[2] * c0 + x[0] * s0, x[3] * c1 + x[1] * s1};
  };
  auto dot = [](const Vec& a, const Vec& b) { return a[0] * b[0] + a[1] * b[1] + a[2] * b[2] + a[3] * b[3]; };
  auto expected_logits = [&](bool qk_norm) {
    const Vec x0 = rms(e[0]), x1 = rms(e[1]);
    const Vec q1 = rotate(qk_norm ? rms(times(x1, 2.0)) : times(x1, 2.0));
    const Vec k0 = qk_norm ? rms(x0) : x0, k1 = rotate(qk_norm ? rms(x1) : x1);
    const double a = dot(q1, k0) / 2.0, b = dot(q1, k1) / 2.0;  // scaling 1 / sqrt(4)
    const double p0 = std::exp(a) / (std::exp(a) + std::exp(b)), p1 = 1.0 - p0;
    Vec h0(4), h1(4);
    for (int i = 0; i < 4; ++i) {
      h0[i] = e[0][i] + x0[i];
      h1[i] = e[1][i] + p0 * x0[i] + p1 * x1[i];
    }
    const Vec l0 = rms(h0), l1 = rms(h1);
    return torch::tensor({l0[0], l0[1], l0[2], l0[3], l1[0], l1[1], l1[2], l1[3]}, torch::kDouble).reshape({1, 2, 4});
  };
  const torch::Tensor logits = reference_logits(config, w, torch::tensor({{0, 1}}, torch::kLong)).to(torch::kDouble);
  EXPECT_LT(max_abs_diff(logits, expected_logits(true)), 1e-5);
  EXPECT_GT(max_abs_diff(expected_logits(true), expected_logits(false)), 1e-2);
}

// Phi-3's fused qkv_proj / gate_up_proj equal a Llama model with the rows split
// q | k | v and gate | up, and with a sliding window a Mistral one.
TEST(ReferenceModels, Phi3EqualsLlamaWithSplitFusedWeights) {
  std::vector<torch::Tensor> by_window;
  for (const json& window : {json(nullptr), json(2)}) {
    json phi3 = phi3_config();  // 4 heads of 4, 2 kv heads, intermediate 20
    phi3["sliding_window"] = window;
    SCOPED_TRACE(phi3.dump());
    const Weights w = amplified(reference_random_weights(phi3, 13), 8.0);
    const torch::Tensor ids = ids_for(phi3, 2, 7, 4);
    const torch::Tensor logits = reference_logits(phi3, w, ids);
    const auto [llama, llama_weights] = phi3_as_llama(phi3, w);
    const torch::Tensor expected = reference_logits(llama, llama_weights, ids);
    EXPECT_GT(max_abs(expected), 0.5);
    EXPECT_LT(max_abs_diff(logits, expected), 1e-6 * std::max(1.0, max_abs(expected)));
    by_window.push_back(logits);

    // The other row orders must not match: q | v | k, and up | gate.
    Weights swapped_kv = w, swapped_mlp = w;
    for (int64_t l = 0; l < 2; ++l) {
      const std::string pre = "model.layers." + std::to_string(l) + ".";
      const torch::Tensor qkv = w.at(pre + "self_attn.qkv_proj.weight");
      swapped_kv[pre + "self_attn.qkv_proj.weight"] =
          torch::cat({qkv.narrow(0, 0, 16), qkv.narrow(0, 24, 8), qkv.narrow(0, 16, 8)});
      const torch::Tensor gate_up = w.at(pre + "mlp.gate_up_proj.weight");
      swapped_mlp[pre + "mlp.gate_up_proj.weight"] = torch::cat({gate_up.narrow(0, 20, 20), gate_up.narrow(0, 0, 20)});
    }
    EXPECT_GT(max_abs_diff(reference_logits(phi3, swapped_kv, ids), expected), 1e-3);
    EXPECT_GT(max_abs_diff(reference_logits(phi3, swapped_mlp, ids), expected), 1e-3);
  }
  EXPECT_GT(max_abs_diff(by_window[0], by_window[1]), 1e-3);  // the window is applied
}

// longrope on Phi-3: the top-level original_max_position_embeddings (6) wins over
// rope_scaling's (100); up to 6 tokens use short_factor, 7 use long_factor; the
// default attention factor is sqrt(1 + ln(max / original) / ln(original)).
TEST(ReferenceModels, Phi3LongropeSelectsFactorsBySequenceLength) {
  json phi3 = phi3_config();  // head_dim 4: two frequencies
  phi3["max_position_embeddings"] = 48;
  phi3["original_max_position_embeddings"] = 6;
  phi3["rope_scaling"] = {{"type", "longrope"},
                          {"short_factor", {1.0, 1.0}},
                          {"long_factor", {2.0, 2.0}},
                          {"original_max_position_embeddings", 100},
                          {"attention_factor", 1.0}};
  json plain = phi3;
  plain["rope_scaling"] = nullptr;
  const Weights w = amplified(reference_random_weights(phi3, 17), 8.0);
  const auto [llama, llama_weights] = phi3_as_llama(plain, w);
  json llama_linear2 = llama;  // what long factors of 2 amount to
  llama_linear2["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};

  const torch::Tensor ids7 = ids_for(phi3, 1, 7, 2), ids6 = ids7.narrow(1, 0, 6);
  const torch::Tensor short6 = reference_logits(phi3, w, ids6), long7 = reference_logits(phi3, w, ids7);
  EXPECT_LT(max_abs_diff(short6, reference_logits(plain, w, ids6)), 1e-5);
  EXPECT_LT(max_abs_diff(long7, reference_logits(llama_linear2, llama_weights, ids7)), 1e-5);
  EXPECT_GT(max_abs_diff(long7, reference_logits(plain, w, ids7)), 1e-3);
  // Legacy "su" is longrope too.
  json su = phi3;
  su["rope_scaling"]["type"] = "su";
  EXPECT_TRUE(torch::equal(reference_logits(su, w, ids7), long7));

  // Default attention factor a scales cos and sin, i.e. q and k: every score by a^2.
  json default_factor = phi3;
  default_factor["rope_scaling"].erase("attention_factor");
  const double a = std::sqrt(1 + std::log(48.0 / 6.0) / std::log(6.0));
  Weights scaled = llama_weights;
  for (int64_t l = 0; l < 2; ++l) {
    for (const char* proj : {"q_proj", "k_proj"}) {
      const std::string name = "model.layers." + std::to_string(l) + ".self_attn." + proj + ".weight";
      scaled[name] = llama_weights.at(name) * a;
    }
  }
  const torch::Tensor expected = reference_logits(llama, scaled, ids6);
  EXPECT_LT(max_abs_diff(reference_logits(default_factor, w, ids6), expected), 1e-5 * std::max(1.0, max_abs(expected)));
  EXPECT_GT(max_abs_diff(expected, short6), 1e-3);
}

// reference_rope's longrope against the closed form, for a 6-dim head (3 frequencies).
TEST(ReferenceModels, LongropeClosedForm) {
  const std::vector<double> short_factor = {1.0, 2.0, 4.0}, long_factor = {8.0, 16.0, 32.0};
  const json rs = {{"rope_type", "longrope"},
                   {"short_factor", short_factor},
                   {"long_factor", long_factor},
                   {"original_max_position_embeddings", 16}};
  const double theta = 100.0;
  for (int64_t seq : {1, 16, 17, 100}) {
    SCOPED_TRACE(seq);
    const RopeReference r = reference_rope(rs, theta, 6, 64, seq);
    ASSERT_EQ(r.inv_freq.size(), 3u);
    const std::vector<double>& ext = seq > 16 ? long_factor : short_factor;
    for (int i = 0; i < 3; ++i) {
      const double expected = 1.0 / (ext[i] * std::pow(theta, 2.0 * i / 6.0));
      EXPECT_NEAR(r.inv_freq[i], expected, 1e-14 * expected) << i;
    }
    // factor = 64 / 16 = 4: sqrt(1 + ln 4 / ln 16) = sqrt(1.5).
    EXPECT_NEAR(r.attention_factor, std::sqrt(1.5), 1e-12);
  }
  json given = rs;
  given["attention_factor"] = 0.7;
  EXPECT_DOUBLE_EQ(reference_rope(given, theta, 6, 64, 1).attention_factor, 0.7);
  EXPECT_DOUBLE_EQ(reference_rope(rs, theta, 6, 16, 1).attention_factor, 1.0);  // factor 1: no scaling
  // Without original_max_position_embeddings: original = max_positions, factor from the key.
  json bare = rs;
  bare.erase("original_max_position_embeddings");
  bare["factor"] = 4.0;
  EXPECT_NEAR(reference_rope(bare, theta, 6, 64, 1).attention_factor, std::sqrt(1 + std::log(4.0) / std::log(64.0)),
              1e-12);
  EXPECT_NEAR(reference_rope(bare, theta, 6, 64, 64).inv_freq[2], 1.0 / (4.0 * std::pow(100.0, 2.0 / 3)),
              1e-14);
  EXPECT_NEAR(reference_rope(bare, theta, 6, 64, 65).inv_freq[2], 1.0 / (32.0 * std::pow(100.0, 2.0 / 3)),
              1e-14);

  json given_factor = rs;
  given_factor["factor"] = 2.0;  // wins over max / original = 4
  EXPECT_NEAR(reference_rope(given_factor, theta, 6, 64, 1).attention_factor,
              std::sqrt(1 + std::log(2.0) / std::log(16.0)), 1e-12);
  json short_list = rs;
  short_list["short_factor"] = {1.0, 2.0};
  EXPECT_THROW(reference_rope(short_list, theta, 6, 64, 1), std::runtime_error);
  EXPECT_THROW(reference_rope(short_list, theta, 6, 64, 17), std::runtime_error);  // both lists are checked
  json no_long = rs;
  no_long.erase("long_factor");
  EXPECT_THROW(reference_rope(no_long, theta, 6, 64, 1), std::runtime_error);
  EXPECT_THROW(reference_rope(json{{"rope_type", "su"}}, theta, 6, 64, 1), std::runtime_error);
}

// Zero layers: logits = lm_head(GemmaNorm(embedding * sqrt(hidden))), in closed form;
// eps is large enough that the embedding scale shows through the norm.
TEST(ReferenceModels, GemmaEmbeddingScaleAndNormClosedForm) {
  for (const char* arch : {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}) {
    SCOPED_TRACE(arch);
    json config = {{"architectures", {arch}},  {"vocab_size", 3},        {"hidden_size", 2},
                   {"intermediate_size", 2},   {"num_hidden_layers", 0}, {"num_attention_heads", 1},
                   {"num_key_value_heads", 1}, {"head_dim", 2},          {"rms_norm_eps", 0.25},
                   {"final_logit_softcapping", nullptr},                 {"tie_word_embeddings", false}};
    Weights w;
    w["model.embed_tokens.weight"] = torch::tensor({{3.0f, 4.0f}, {1.0f, -1.0f}, {0.0f, 2.0f}});
    w["model.norm.weight"] = torch::tensor({1.0f, -0.5f});  // multiplies by (2, 0.5)
    w["lm_head.weight"] = torch::tensor({{1.0f, 0.0f}, {0.0f, 1.0f}, {1.0f, 1.0f}});
    const torch::Tensor logits = reference_logits(config, w, torch::tensor({{0, 1}}, torch::kLong));
    auto expected = [](double scale) {
      // Token 0: mean(x^2) = 12.5 scale^2; token 1: mean(x^2) = scale^2.
      const double r0 = scale / std::sqrt(12.5 * scale * scale + 0.25), r1 = scale / std::sqrt(scale * scale + 0.25);
      return torch::tensor({{{2 * 3 * r0, 0.5 * 4 * r0, 2 * 3 * r0 + 0.5 * 4 * r0},
                             {2 * 1 * r1, -0.5 * r1, 2 * r1 - 0.5 * r1}}},
                           torch::kDouble);
    };
    EXPECT_LT(max_abs_diff(logits.to(torch::kDouble), expected(std::sqrt(2.0))), 1e-6);
    EXPECT_GT(max_abs_diff(expected(std::sqrt(2.0)), expected(1.0)), 1e-3);  // the scale is visible
  }
}

// Final logits are cap * tanh(raw / cap); attention scores are capped too (a huge
// cap is no cap); absent keys mean Gemma 2's 50 / 30 and Gemma 3's none.
TEST(ReferenceModels, GemmaSoftCapping) {
  json capped = gemma2_config();
  capped["final_logit_softcapping"] = 1.5;
  json raw = capped;
  raw["final_logit_softcapping"] = nullptr;
  const Weights w = amplified(reference_random_weights(capped, 23), 12.0);
  const torch::Tensor ids = ids_for(capped, 2, 6, 1);
  const torch::Tensor l_raw = reference_logits(raw, w, ids), l_cap = reference_logits(capped, w, ids);
  EXPECT_GT(max_abs(l_raw), 1.5);  // the cap bites
  EXPECT_LT(max_abs(l_cap), 1.5);
  EXPECT_LT(max_abs_diff(l_cap, torch::tanh(l_raw / 1.5) * 1.5), 1e-5);

  json huge = raw, none = raw, small = raw;
  huge["attn_logit_softcapping"] = 1e9;
  none["attn_logit_softcapping"] = nullptr;
  small["attn_logit_softcapping"] = 0.5;
  const torch::Tensor l_none = reference_logits(none, w, ids);
  EXPECT_LT(max_abs_diff(reference_logits(huge, w, ids), l_none), 1e-5);
  EXPECT_GT(max_abs_diff(reference_logits(small, w, ids), l_none), 1e-3);
  EXPECT_GT(max_abs_diff(l_raw, l_none), 1e-3);  // gemma2_config's cap of 2 bites as well

  json g2_default = gemma2_config(), g2_explicit = gemma2_config();
  g2_default.erase("attn_logit_softcapping");
  g2_default.erase("final_logit_softcapping");
  g2_explicit["attn_logit_softcapping"] = 50.0;
  g2_explicit["final_logit_softcapping"] = 30.0;
  EXPECT_TRUE(torch::equal(reference_logits(g2_default, w, ids), reference_logits(g2_explicit, w, ids)));
  json g3_default = gemma3_config();
  g3_default.erase("attn_logit_softcapping");
  g3_default.erase("final_logit_softcapping");
  const Weights w3 = amplified(reference_random_weights(g3_default, 23), 12.0);
  EXPECT_TRUE(torch::equal(reference_logits(g3_default, w3, ids), reference_logits(gemma3_config(), w3, ids)));
}

// A model whose only layer slides (Gemma 2's layer 0 by default, Gemma 3's by its
// default pattern of 6) with window 3 lets position t read tokens t - 2 .. t; made
// full, position 7 reads token 0 again.
TEST(ReferenceModels, GemmaSlidingLayersHideDistantTokens) {
  for (json config : {gemma2_config(), gemma3_config()}) {
    SCOPED_TRACE(arch_of(config));
    config["num_hidden_layers"] = 1;
    config.erase("layer_types");
    const Weights w = amplified(reference_random_weights(config, 29), 5.0);
    torch::manual_seed(4);
    const torch::Tensor ids = torch::randint(1, config["vocab_size"].get<int64_t>(), {1, 8}, torch::kLong);
    torch::Tensor other = ids.clone();
    other[0][0] = 0;
    const torch::Tensor a = reference_logits(config, w, ids), b = reference_logits(config, w, other);
    EXPECT_GT(max_abs_diff(a.narrow(1, 2, 1), b.narrow(1, 2, 1)), 1e-4);
    EXPECT_EQ(max_abs_diff(a.narrow(1, 3, 5), b.narrow(1, 3, 5)), 0.0);
    config["layer_types"] = {"full_attention"};
    EXPECT_GT(max_abs_diff(reference_logits(config, w, ids).narrow(1, 7, 1),
                           reference_logits(config, w, other).narrow(1, 7, 1)),
              1e-4);
  }
}

// Without layer_types Gemma 2 alternates sliding / full from layer 0 and Gemma 3
// makes every sliding_window_pattern-th layer full.
TEST(ReferenceModels, GemmaDefaultLayerTypes) {
  const std::string s = "sliding_attention", f = "full_attention";
  struct Case {
    json config;
    std::vector<std::string> expected, other;
  };
  json g2 = gemma2_config(), g3 = gemma3_config(), g3_pattern2 = gemma3_config();
  g2["num_hidden_layers"] = 4;
  g3["num_hidden_layers"] = 7;
  g3_pattern2["num_hidden_layers"] = 4;
  g3_pattern2["sliding_window_pattern"] = 2;
  const std::vector<Case> cases = {{g2, {s, f, s, f}, {f, s, f, s}},
                                   {g3, {s, s, s, s, s, f, s}, {s, s, s, s, s, s, s}},
                                   {g3_pattern2, {s, f, s, f}, {s, s, s, s}}};
  for (Case c : cases) {
    SCOPED_TRACE(c.config.dump());
    c.config.erase("layer_types");
    const Weights w = amplified(reference_random_weights(c.config, 31), 5.0);
    const torch::Tensor ids = ids_for(c.config, 1, 9, 3);
    json expected = c.config, other = c.config;
    expected["layer_types"] = c.expected;
    other["layer_types"] = c.other;
    const torch::Tensor logits = reference_logits(c.config, w, ids);
    EXPECT_TRUE(torch::equal(logits, reference_logits(expected, w, ids)));
    EXPECT_GT(max_abs_diff(logits, reference_logits(other, w, ids)), 1e-4);
  }
}

// Gemma 3's sliding layers rotate with rope_local_base_freq, its full layers with
// rope_theta and rope_scaling; with the window beyond the sequence nothing else
// tells the two layer types apart.
TEST(ReferenceModels, Gemma3SlidingLayersUseLocalRopeBase) {
  json sliding = gemma3_config();
  sliding["sliding_window"] = 64;
  sliding["layer_types"] = {"sliding_attention", "sliding_attention"};
  json full = sliding;
  full["layer_types"] = {"full_attention", "full_attention"};
  const Weights w = amplified(reference_random_weights(sliding, 37), 8.0);
  const torch::Tensor ids = ids_for(sliding, 1, 8, 6);
  auto with = [&](json config, const char* key, const json& value) {
    config[key] = value;
    return reference_logits(config, w, ids);
  };
  const torch::Tensor s_base = reference_logits(sliding, w, ids), f_base = reference_logits(full, w, ids);
  EXPECT_EQ(max_abs_diff(with(sliding, "rope_theta", 77.0), s_base), 0.0);
  EXPECT_EQ(max_abs_diff(with(sliding, "rope_scaling", nullptr), s_base), 0.0);
  EXPECT_GT(max_abs_diff(with(sliding, "rope_local_base_freq", 77.0), s_base), 1e-4);
  EXPECT_EQ(max_abs_diff(with(full, "rope_local_base_freq", 77.0), f_base), 0.0);
  EXPECT_GT(max_abs_diff(with(full, "rope_theta", 77.0), f_base), 1e-4);
  EXPECT_GT(max_abs_diff(with(full, "rope_scaling", nullptr), f_base), 1e-4);
  json same_sliding = sliding, same_full = full;
  for (json* c : {&same_sliding, &same_full}) {
    (*c)["rope_local_base_freq"] = 1000.0;
    (*c)["rope_scaling"] = nullptr;
  }
  EXPECT_TRUE(torch::equal(reference_logits(same_sliding, w, ids), reference_logits(same_full, w, ids)));
}


// Parameter names and shapes of the new architectures, the random init of their
// norms, and the config defaults that decide shapes (Qwen3Config head_dim 128 and
// num_key_value_heads 32; Gemma num_key_value_heads 4, head_dim 256; tying).
TEST(ReferenceModels, NewArchitectureWeightsAndDefaults) {
  auto shape = [](const Weights& w, const std::string& name) { return w.at(name).sizes().vec(); };
  using Shape = std::vector<int64_t>;
  const Weights qw = reference_random_weights(qwen3_config(), 3);
  EXPECT_EQ(shape(qw, "model.layers.1.self_attn.q_norm.weight"), (Shape{6}));
  EXPECT_EQ(shape(qw, "model.layers.1.self_attn.k_norm.weight"), (Shape{6}));
  EXPECT_EQ(shape(qw, "model.layers.1.self_attn.q_proj.weight"), (Shape{24, 16}));
  EXPECT_EQ(qw.count("model.layers.1.self_attn.o_proj.bias"), 1u);  // attention_bias: all four
  EXPECT_EQ(qw.count("model.layers.1.mlp.up_proj.bias"), 0u);
  EXPECT_EQ(qw.count("lm_head.weight"), 0u);
  EXPECT_NEAR(qw.at("model.layers.0.self_attn.q_norm.weight").mean().item<double>(), 1.0, 0.2);
  json qwen3 = qwen3_config();
  qwen3.erase("head_dim");
  qwen3.erase("num_key_value_heads");
  qwen3["num_attention_heads"] = 64;
  qwen3["attention_bias"] = false;
  const Weights qd = reference_random_weights(qwen3, 3);
  EXPECT_EQ(shape(qd, "model.layers.0.self_attn.q_proj.weight"), (Shape{64 * 128, 16}));
  EXPECT_EQ(shape(qd, "model.layers.0.self_attn.k_proj.weight"), (Shape{32 * 128, 16}));
  EXPECT_EQ(qd.count("model.layers.0.self_attn.q_proj.bias"), 0u);

  const Weights pw = reference_random_weights(phi3_config(), 3);
  EXPECT_EQ(shape(pw, "model.layers.0.self_attn.qkv_proj.weight"), (Shape{32, 16}));  // (4 + 2 * 2) * 4
  EXPECT_EQ(shape(pw, "model.layers.0.self_attn.o_proj.weight"), (Shape{16, 16}));
  EXPECT_EQ(shape(pw, "model.layers.0.mlp.gate_up_proj.weight"), (Shape{40, 16}));
  EXPECT_EQ(shape(pw, "model.layers.0.mlp.down_proj.weight"), (Shape{16, 20}));
  EXPECT_EQ(pw.count("model.layers.0.self_attn.q_proj.weight"), 0u);
  EXPECT_EQ(pw.count("lm_head.weight"), 1u);
  // Phi3Config's rms_norm_eps default is 1e-5.
  json phi3_default_eps = phi3_config();
  phi3_default_eps.erase("rms_norm_eps");
  const torch::Tensor ids = torch::tensor({{1, 2, 3, 4}}, torch::kLong);
  EXPECT_TRUE(torch::equal(reference_logits(phi3_default_eps, pw, ids), reference_logits(phi3_config(), pw, ids)));

  const Weights g2 = reference_random_weights(gemma2_config(), 3);
  for (const char* norm : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm"}) {
    const torch::Tensor t = g2.at(std::string("model.layers.1.") + norm + ".weight");
    EXPECT_EQ(t.sizes().vec(), (Shape{16})) << norm;
    EXPECT_NEAR(t.mean().item<double>(), 0.0, 0.1) << norm;  // Gemma adds the 1
    EXPECT_GT(t.std().item<double>(), 0.02) << norm;
  }
  EXPECT_EQ(g2.count("model.layers.0.self_attn.q_norm.weight"), 0u);
  EXPECT_EQ(g2.count("lm_head.weight"), 0u);
  const Weights g3 = reference_random_weights(gemma3_config(), 3);
  EXPECT_EQ(shape(g3, "model.layers.0.self_attn.q_norm.weight"), (Shape{8}));
  EXPECT_NEAR(g3.at("model.norm.weight").mean().item<double>(), 0.0, 0.1);
  EXPECT_EQ(shape(g3, "lm_head.weight"), (Shape{31, 16}));
  json gemma = gemma2_config();
  gemma.erase("head_dim");
  gemma.erase("num_key_value_heads");
  gemma.erase("tie_word_embeddings");
  const Weights gd = reference_random_weights(gemma, 3);
  EXPECT_EQ(shape(gd, "model.layers.0.self_attn.q_proj.weight"), (Shape{4 * 256, 16}));
  EXPECT_EQ(shape(gd, "model.layers.0.self_attn.k_proj.weight"), (Shape{4 * 256, 16}));
  EXPECT_EQ(gd.count("lm_head.weight"), 0u);
}

TEST(ReferenceModels, RejectsUnsupportedNewArchitectureConfigsAndBadWeights) {
  const torch::Tensor ids = torch::tensor({{1, 2, 3}}, torch::kLong);
  auto throws = [&](const json& config, const Weights& weights) {
    EXPECT_THROW(reference_logits(config, weights, ids), std::runtime_error) << config.dump();
  };
  const Weights qw = reference_random_weights(qwen3_config(), 1), pw = reference_random_weights(phi3_config(), 1);
  const Weights g2w = reference_random_weights(gemma2_config(), 1), g3w = reference_random_weights(gemma3_config(), 1);
  auto with = [](json config, const char* key, const json& value) {
    config[key] = value;
    return config;
  };
  throws(with(qwen3_config(), "partial_rotary_factor", 0.5), qw);
  throws(with(qwen3_config(), "hidden_act", "gelu"), qw);
  throws(with(qwen3_config(), "rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1000.0}}), qw);
  throws(with(llama_config(), "rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1000.0}}),
         reference_random_weights(llama_config(), 1));
  throws(with(phi3_config(), "partial_rotary_factor", 0.5), pw);
  throws(with(phi3_config(), "rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}), pw);
  throws(with(phi3_config(), "rope_scaling", {{"rope_type", "longrope"}, {"short_factor", {1.0, 1.0}}}), pw);
  throws(with(phi3_config(), "rope_scaling",
              {{"rope_type", "longrope"}, {"short_factor", {1.0, 1.0, 1.0}}, {"long_factor", {1.0, 1.0, 1.0}}}),
         pw);
  throws(with(gemma2_config(), "hidden_activation", "gelu"), g2w);
  throws(with(gemma2_config(), "use_bidirectional_attention", true), g2w);
  throws(with(gemma2_config(), "partial_rotary_factor", 0.5), g2w);
  throws(with(gemma3_config(), "layer_types", {"sliding_attention"}), g3w);
  throws(with(gemma3_config(), "layer_types", {"sliding_attention", "chunked_attention"}), g3w);
  throws(with(gemma3_config(), "rope_scaling", {{"rope_type", "longrope"}}), g3w);
  throws(with(gemma3_config(), "architectures", {"Gemma3ForConditionalGeneration"}), g3w);
  throws(with(gemma3_config(), "rope_parameters",
              {{"full_attention", {{"rope_type", "default"}}}, {"sliding_attention", {{"rope_type", "default"}}}}),
         g3w);

  // Weight validation: missing, misshapen, unexpected.
  auto without = [](Weights w, const std::string& name) {
    EXPECT_EQ(w.erase(name), 1u) << name;
    return w;
  };
  auto replaced = [](Weights w, const std::string& name, const torch::Tensor& t) {
    w[name] = t;
    return w;
  };
  throws(qwen3_config(), without(qw, "model.layers.1.self_attn.k_norm.weight"));
  throws(qwen3_config(), replaced(qw, "model.layers.0.self_attn.q_norm.weight", torch::ones({16})));
  throws(phi3_config(), replaced(pw, "model.layers.0.self_attn.qkv_proj.weight", torch::zeros({48, 16})));
  throws(phi3_config(), replaced(pw, "model.layers.0.mlp.gate_up_proj.weight", torch::zeros({20, 16})));
  throws(phi3_config(), replaced(pw, "model.layers.0.self_attn.q_proj.weight", torch::zeros({16, 16})));
  throws(gemma2_config(), replaced(g2w, "model.layers.0.self_attn.q_norm.weight", torch::zeros({8})));
  throws(gemma3_config(), without(g3w, "model.layers.1.pre_feedforward_layernorm.weight"));
  throws(gemma3_config(), without(g3w, "model.layers.0.self_attn.q_norm.weight"));
  throws(gemma3_config(), without(g3w, "lm_head.weight"));
}


// ---------------------------------------------------------------------------
// Mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE
// ---------------------------------------------------------------------------

// Every layer sparse: 5 experts of width 22, top-2, always renormalised.
json mixtral_config() {
  return json{{"architectures", {"MixtralForCausalLM"}},
              {"model_type", "mixtral"},
              {"vocab_size", 61},
              {"hidden_size", 24},
              {"intermediate_size", 22},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"rms_norm_eps", 1e-5},
              {"rope_theta", 1000000.0},
              {"sliding_window", nullptr},
              {"num_local_experts", 5},
              {"num_experts_per_tok", 2},
              {"router_jitter_noise", 0.0},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", false}};
}

// Layers 0 and 2 sparse (4 experts of width 10, top-2, not renormalised, a shared
// expert of width 14), layer 1 dense (width 26).
json qwen2_moe_config() {
  return json{{"architectures", {"Qwen2MoeForCausalLM"}},
              {"model_type", "qwen2_moe"},
              {"vocab_size", 53},
              {"hidden_size", 16},
              {"intermediate_size", 26},
              {"num_hidden_layers", 3},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"rms_norm_eps", 1e-6},
              {"rope_theta", 10000.0},
              {"use_sliding_window", false},
              {"num_experts", 4},
              {"num_experts_per_tok", 2},
              {"moe_intermediate_size", 10},
              {"shared_expert_intermediate_size", 14},
              {"norm_topk_prob", false},
              {"decoder_sparse_step", 1},
              {"mlp_only_layers", {1}},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", false}};
}

// q/k norms, head_dim 6, attention biases, tied; layer 0 dense, layers 1 and 2
// sparse (5 experts of width 11, top-2, renormalised).
json qwen3_moe_config() {
  return json{{"architectures", {"Qwen3MoeForCausalLM"}},
              {"model_type", "qwen3_moe"},
              {"vocab_size", 67},
              {"hidden_size", 16},
              {"intermediate_size", 26},
              {"num_hidden_layers", 3},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 6},
              {"attention_bias", true},
              {"rms_norm_eps", 1e-6},
              {"rope_theta", 1000.0},
              {"use_sliding_window", false},
              {"num_experts", 5},
              {"num_experts_per_tok", 2},
              {"moe_intermediate_size", 11},
              {"norm_topk_prob", true},
              {"decoder_sparse_step", 1},
              {"mlp_only_layers", {0}},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", true}};
}

std::vector<json> moe_configs() { return {mixtral_config(), qwen2_moe_config(), qwen3_moe_config()}; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Routers and Qwen2-MoE's shared-expert gate.
bool is_gate(const std::string& name) { return ends_with(name, ".gate.weight") || ends_with(name, "shared_expert_gate.weight"); }

// Random weights with every matrix but the gates scaled by factor, so the experts
// move the residual stream visibly while routing keeps its random std 0.5.
Weights moe_weights(const json& config, uint64_t seed, double factor = 8.0) {
  Weights w = reference_random_weights(config, seed);
  for (auto& [name, t] : w) {
    if (t.dim() == 2 && !is_gate(name)) t = t * factor;
  }
  return w;
}

Weights scaled_gates(Weights w, double factor) {
  for (auto& [name, t] : w) {
    if (ends_with(name, ".gate.weight")) t = t * factor;
  }
  return w;
}

std::vector<int64_t> row(const torch::Tensor& ids, int64_t b) {
  return std::vector<int64_t>(ids[b].data_ptr<int64_t>(), ids[b].data_ptr<int64_t>() + ids.size(1));
}

// Logits and load-balancing loss against the scalar loop: per token softmax of the
// router logits, top-2, renormalised (Mixtral, Qwen3-MoE here) or not (Qwen2-MoE),
// weighted experts, Qwen2-MoE's gated shared expert; the loss over the sparse layers only.
TEST(ReferenceModels, MoeMatchesScalarLoop) {
  for (const json& config : moe_configs()) {
    SCOPED_TRACE(arch_of(config));
    const Weights weights = moe_weights(config, 7);
    const torch::Tensor ids = ids_for(config, 2, 6, 3);
    const ReferenceMoeOutput out = reference_moe_forward(config, weights, ids);
    ASSERT_EQ(out.logits.scalar_type(), torch::kFloat);
    ASSERT_EQ(out.logits.sizes().vec(), (std::vector<int64_t>{2, 6, config.at("vocab_size").get<int64_t>()}));
    ASSERT_EQ(out.aux_loss.scalar_type(), torch::kFloat);
    ASSERT_EQ(out.aux_loss.dim(), 0);
    EXPECT_TRUE(torch::equal(reference_logits(config, weights, ids), out.logits));
    double max_err = 0.0, max_mag = 0.0;
    std::vector<Vec> routers;
    for (int64_t b = 0; b < 2; ++b) {
      const std::vector<Vec> expected = llama_loop(config, weights, row(ids, b), &routers);
      const Arr got = arr(out.logits[b]);
      for (int64_t t = 0; t < 6; ++t) {
        for (int64_t o = 0; o < got.shape[1]; ++o) {
          max_err = std::max(max_err, std::abs(got(t, o) - expected[t][o]));
          max_mag = std::max(max_mag, std::abs(expected[t][o]));
        }
      }
    }
    EXPECT_GT(max_mag, 0.5);
    EXPECT_LT(max_err, 1e-4 * std::max(1.0, max_mag));
    // Two sparse layers each here, 12 tokens per layer.
    ASSERT_EQ(routers.size(), 24u);
    const int64_t top_k = config.at("num_experts_per_tok");
    EXPECT_NEAR(out.aux_loss.item<double>(), load_balancing_loop(routers, top_k), 1e-5);
    // Routing is far from uniform yet spreads: three experts or more are somebody's
    // first choice, and second choices carry real weight (so renormalising matters).
    std::set<int64_t> first_choices;
    double second_max = 0.0;
    for (const Vec& logits : routers) {
      const Vec p = softmax_loop(logits);
      const auto chosen = top_k_loop(p, 2);
      first_choices.insert(chosen[0]);
      second_max = std::max(second_max, p[chosen[1]]);
    }
    EXPECT_GE(first_choices.size(), 3u);
    EXPECT_GT(second_max, 0.2);
  }
}

// The load-balancing loss in closed form (every token with probabilities 0.4, 0.3,
// 0.2, 0.1 gives E * (sum of the top-k probabilities)), against the scalar loop on
// hand-made logits of two layers for top-k 1 to 3, and its gradient.
TEST(ReferenceModels, LoadBalancingLossClosedFormAndScalarLoop) {
  const torch::Tensor same = torch::log(torch::tensor({0.1, 0.4, 0.2, 0.3}, torch::kDouble)).to(torch::kFloat);
  const std::vector<torch::Tensor> layers = {same.repeat({3, 1}), same.unsqueeze(0)};
  EXPECT_NEAR(reference_load_balancing_loss(layers, 4, 1).item<double>(), 4 * 0.4, 1e-6);
  EXPECT_NEAR(reference_load_balancing_loss(layers, 4, 2).item<double>(), 4 * (0.4 + 0.3), 1e-6);
  EXPECT_NEAR(reference_load_balancing_loss(layers, 4, 3).item<double>(), 4 * 0.9, 1e-6);
  EXPECT_NEAR(reference_load_balancing_loss(layers, 4, 4).item<double>(), 4.0, 1e-6);

  // Balanced by hand: 4 tokens with top-2 pairs {0,1}, {2,3}, {0,2}, {1,3}: f = 1/2
  // for every expert, so the loss is 4 * 1/2 * sum_e P_e = 2 whatever the probabilities.
  const torch::Tensor balanced = torch::tensor({{3.0, 2.0, 0.0, -1.0},
                                                {-1.0, 0.5, 2.0, 1.5},
                                                {1.0, -2.0, 0.8, 0.0},
                                                {0.0, 2.5, -1.0, 1.0}});
  EXPECT_NEAR(reference_load_balancing_loss({balanced}, 4, 2).item<double>(), 2.0, 1e-6);

  const torch::Tensor a = torch::tensor({{2.0, -1.0, 0.5, 0.0, 1.0},
                                         {0.3, 1.7, -0.4, 2.2, 0.1},
                                         {-1.0, 0.0, 0.9, 0.4, 1.6}}),
                      b = torch::tensor({{1.2, 0.7, -0.3, 0.0, 2.5}, {0.0, -2.0, 1.1, 1.3, 0.2}});
  std::vector<Vec> rows;
  for (const torch::Tensor& t : {a, b}) {
    for (int64_t r = 0; r < t.size(0); ++r) rows.push_back(arr(t[r]).d);
  }
  for (int64_t k = 1; k <= 3; ++k) {
    SCOPED_TRACE(k);
    const torch::Tensor la = a.clone().requires_grad_(true), lb = b.clone().requires_grad_(true);
    const torch::Tensor loss = reference_load_balancing_loss({la, lb}, 5, k);
    ASSERT_EQ(loss.scalar_type(), torch::kFloat);
    std::vector<Vec> grad;
    EXPECT_NEAR(loss.item<double>(), load_balancing_loop(rows, k, &grad), 1e-6);
    loss.backward();
    const Arr ga = arr(la.grad()), gb = arr(lb.grad());
    for (int64_t r = 0; r < 5; ++r) {
      for (int64_t e = 0; e < 5; ++e) EXPECT_NEAR(r < 3 ? ga(r, e) : gb(r - 3, e), grad[r][e], 1e-6);
    }
  }
  EXPECT_EQ(reference_load_balancing_loss({}, 4, 2).item<double>(), 0.0);
  EXPECT_THROW(reference_load_balancing_loss({a}, 4, 2), std::runtime_error);  // 5 columns
  EXPECT_THROW(reference_load_balancing_loss({a}, 5, 6), std::runtime_error);
  EXPECT_THROW(reference_load_balancing_loss({a}, 5, 0), std::runtime_error);
}

// Which Qwen3-MoE layers are sparse (router "mlp.gate" and "mlp.experts.e.*") and
// which dense ("mlp.gate_proj / up_proj / down_proj"), by mlp_only_layers and
// decoder_sparse_step; with no sparse layer the model is Qwen3 and aux_loss 0.
TEST(ReferenceModels, QwenMoeSparseLayersFollowMlpOnlyLayersAndSparseStep) {
  struct Case {
    int64_t step;
    std::vector<int64_t> mlp_only;
    int64_t experts;
    std::vector<bool> sparse;
  };
  const std::vector<Case> cases = {
      {1, {}, 5, {true, true, true}},    {2, {}, 5, {false, true, false}},   {1, {0, 2}, 5, {false, true, false}},
      {3, {}, 5, {false, false, true}},  {2, {1}, 5, {false, false, false}}, {1, {0, 1, 2}, 5, {false, false, false}},
      {1, {}, 0, {false, false, false}}, {1, {7}, 5, {true, true, true}},
  };
  using Shape = std::vector<int64_t>;
  for (const Case& c : cases) {
    json config = qwen3_moe_config();
    config["decoder_sparse_step"] = c.step;
    config["mlp_only_layers"] = c.mlp_only;
    config["num_experts"] = c.experts;
    SCOPED_TRACE(config.dump());
    const Weights w = reference_random_weights(config, 1);
    for (int64_t l = 0; l < 3; ++l) {
      const std::string pre = "model.layers." + std::to_string(l) + ".mlp.";
      if (c.sparse[l]) {
        EXPECT_EQ(w.at(pre + "gate.weight").sizes().vec(), (Shape{5, 16})) << l;
        for (int64_t e = 0; e < 5; ++e) {
          const std::string expert = pre + "experts." + std::to_string(e) + ".";
          EXPECT_EQ(w.at(expert + "gate_proj.weight").sizes().vec(), (Shape{11, 16}));
          EXPECT_EQ(w.at(expert + "up_proj.weight").sizes().vec(), (Shape{11, 16}));
          EXPECT_EQ(w.at(expert + "down_proj.weight").sizes().vec(), (Shape{16, 11}));
        }
        EXPECT_EQ(w.count(pre + "experts.5.gate_proj.weight"), 0u);
        EXPECT_EQ(w.count(pre + "gate_proj.weight"), 0u);
        EXPECT_EQ(w.count(pre + "shared_expert_gate.weight"), 0u);  // Qwen2-MoE only
      } else {
        EXPECT_EQ(w.at(pre + "gate_proj.weight").sizes().vec(), (Shape{26, 16})) << l;
        EXPECT_EQ(w.at(pre + "down_proj.weight").sizes().vec(), (Shape{16, 26})) << l;
        EXPECT_EQ(w.count(pre + "gate.weight"), 0u) << l;
        EXPECT_EQ(w.count(pre + "experts.0.gate_proj.weight"), 0u) << l;
      }
    }
    const torch::Tensor ids = ids_for(config, 1, 5, 2);
    const ReferenceMoeOutput out = reference_moe_forward(config, w, ids);
    if (std::find(c.sparse.begin(), c.sparse.end(), true) == c.sparse.end()) {
      EXPECT_EQ(out.aux_loss.item<double>(), 0.0);
      json qwen3 = config;
      qwen3["architectures"] = {"Qwen3ForCausalLM"};
      qwen3["model_type"] = "qwen3";
      EXPECT_TRUE(torch::equal(reference_logits(qwen3, w, ids), out.logits));
    } else {
      EXPECT_GT(out.aux_loss.item<double>(), 0.0);
    }
  }
}

// Qwen's norm_topk_prob renormalises the top-k weights (Qwen3-MoE and Qwen2-MoE
// change with it); Mixtral always does and has no such key. With top-1 a
// renormalised weight is exactly 1, so scaling the routers (same argmax) changes
// nothing, while unnormalised weights follow the softmax.
TEST(ReferenceModels, MoeTopKRenormalisation) {
  for (json config : {qwen3_moe_config(), qwen2_moe_config()}) {
    SCOPED_TRACE(arch_of(config));
    const Weights w = moe_weights(config, 5);
    const torch::Tensor ids = ids_for(config, 2, 5, 1);
    config["norm_topk_prob"] = true;
    const torch::Tensor normed = reference_logits(config, w, ids);
    config["norm_topk_prob"] = false;
    const torch::Tensor raw = reference_logits(config, w, ids);
    EXPECT_GT(max_abs_diff(normed, raw), 1e-3);
    config.erase("norm_topk_prob");  // default false
    EXPECT_TRUE(torch::equal(reference_logits(config, w, ids), raw));
  }
  json mixtral = mixtral_config();
  const Weights mw = moe_weights(mixtral, 5);
  const torch::Tensor ids = ids_for(mixtral, 2, 5, 1);
  json mixtral_flagged = mixtral;
  mixtral_flagged["norm_topk_prob"] = false;
  EXPECT_TRUE(torch::equal(reference_logits(mixtral_flagged, mw, ids), reference_logits(mixtral, mw, ids)));

  json qwen_normed = qwen3_moe_config(), qwen_raw = qwen3_moe_config();
  qwen_raw["norm_topk_prob"] = false;
  for (json* c : {&mixtral, &qwen_normed, &qwen_raw}) (*c)["num_experts_per_tok"] = 1;
  for (const json& config : {mixtral, qwen_normed, qwen_raw}) {
    const bool renormalised = config.value("norm_topk_prob", true);
    SCOPED_TRACE(arch_of(config) + (renormalised ? " renormalised" : " raw"));
    const Weights w = moe_weights(config, 6);
    const torch::Tensor base = reference_logits(config, w, ids);
    const torch::Tensor scaled = reference_logits(config, scaled_gates(w, 0.6), ids);
    if (renormalised) {
      EXPECT_LT(max_abs_diff(base, scaled), 1e-5 * std::max(1.0, max_abs(base)));
    } else {
      EXPECT_GT(max_abs_diff(base, scaled), 1e-3);
    }
  }
}

// Mixtral with one expert and top-1 routes every token to it with weight 1: it is
// the Mistral model with that expert's w1 / w3 / w2 as mlp.gate_proj / up_proj /
// down_proj (sliding_window 3 on every layer in both), and its aux loss is 1.
TEST(ReferenceModels, OneExpertMixtralEqualsMistral) {
  json mixtral = mixtral_config();
  mixtral["num_local_experts"] = 1;
  mixtral["num_experts_per_tok"] = 1;
  mixtral["sliding_window"] = 3;
  json mistral = mixtral;
  mistral["architectures"] = {"MistralForCausalLM"};
  mistral["model_type"] = "mistral";
  for (const char* key : {"num_local_experts", "num_experts_per_tok", "router_jitter_noise"}) mistral.erase(key);
  const Weights w = moe_weights(mixtral, 9);
  Weights dense;
  const std::map<std::string, std::string> renamed = {{"w1", "gate_proj"}, {"w3", "up_proj"}, {"w2", "down_proj"}};
  for (const auto& [name, t] : w) {
    const auto cut = name.find("block_sparse_moe.");
    if (cut == std::string::npos) {
      dense[name] = t;
    } else if (!ends_with(name, ".gate.weight")) {
      const std::string which = name.substr(name.size() - std::string("w1.weight").size(), 2);
      dense[name.substr(0, cut) + "mlp." + renamed.at(which) + ".weight"] = t;
    }
  }
  ASSERT_EQ(dense.size() + 2, w.size());  // one router per layer dropped
  const torch::Tensor ids = ids_for(mixtral, 2, 8, 4);
  const ReferenceMoeOutput out = reference_moe_forward(mixtral, w, ids);
  const torch::Tensor expected = reference_logits(mistral, dense, ids);
  EXPECT_GT(max_abs(expected), 0.5);
  EXPECT_LT(max_abs_diff(out.logits, expected), 1e-5 * std::max(1.0, max_abs(expected)));
  EXPECT_NEAR(out.aux_loss.item<double>(), 1.0, 1e-6);
}

// reference_moe_forward records autograd: the gradient of CE + c * aux_loss reaches
// every kind of weight, aux_loss alone reaches the routers but not the last sparse
// layer's experts, and directional derivatives match central finite differences in
// fp64 (along the routers only, and along all weights).
TEST(ReferenceModels, MoeForwardIsDifferentiable) {
  for (const json& config : {mixtral_config(), qwen2_moe_config()}) {
    SCOPED_TRACE(arch_of(config));
    const bool mixtral = arch_of(config) == "MixtralForCausalLM";
    Weights w = moe_weights(config, 11, 4.0);
    for (auto& [name, t] : w) t = t.to(torch::kDouble);
    const torch::Tensor ids = ids_for(config, 2, 5, 6);
    auto loss_of = [&](const Weights& weights, double coef) {
      const ReferenceMoeOutput out = reference_moe_forward(config, weights, ids);
      return reference_next_token_loss(out.logits, ids) + coef * out.aux_loss;
    };
    auto leaves = [](const Weights& weights) {
      Weights out;
      for (const auto& [name, t] : weights) out[name] = t.clone().requires_grad_(true);
      return out;
    };

    Weights leaf = leaves(w);
    loss_of(leaf, 0.3).backward();
    const std::string last = mixtral ? "model.layers.1.block_sparse_moe." : "model.layers.2.mlp.";
    const int64_t experts = mixtral ? 5 : 4;
    auto expert_proj = [&](int64_t e) {
      return last + "experts." + std::to_string(e) + (mixtral ? ".w1.weight" : ".gate_proj.weight");
    };
    std::vector<std::string> reached = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                        "model.norm.weight", last + "gate.weight"};
    if (!mixtral) reached.push_back(last + "shared_expert_gate.weight");
    for (const std::string& name : reached) {
      ASSERT_TRUE(leaf.at(name).grad().defined()) << name;
      EXPECT_GT(max_abs(leaf.at(name).grad()), 0.0) << name;
    }
    int64_t experts_reached = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const torch::Tensor grad = leaf.at(expert_proj(e)).grad();
      experts_reached += grad.defined() && max_abs(grad) > 0.0;
    }
    EXPECT_GE(experts_reached, 2);

    Weights aux_leaf = leaves(w);
    const torch::Tensor aux = reference_moe_forward(config, aux_leaf, ids).aux_loss;
    ASSERT_TRUE(aux.requires_grad());
    aux.backward();
    EXPECT_GT(max_abs(aux_leaf.at(last + "gate.weight").grad()), 0.0);
    for (int64_t e = 0; e < experts; ++e) {
      const torch::Tensor grad = aux_leaf.at(expert_proj(e)).grad();
      EXPECT_TRUE(!grad.defined() || max_abs(grad) == 0.0) << e;
    }

    // Central differences along a random direction (routers only, then everything).
    torch::manual_seed(12);
    for (bool routers_only : {true, false}) {
      SCOPED_TRACE(routers_only ? "routers" : "all weights");
      Weights plus = w, minus = w;
      double predicted = 0.0;
      // Small enough that no token's top-k choice flips between the two points.
      const double eps = routers_only ? 1e-3 : 3e-4;
      for (const auto& [name, t] : w) {
        if (routers_only && !ends_with(name, ".gate.weight")) continue;
        const torch::Tensor d = torch::randn(t.sizes(), torch::kDouble) * (t.std().item<double>() + 0.01);
        plus[name] = t + eps * d;
        minus[name] = t - eps * d;
        const torch::Tensor grad = leaf.at(name).grad();  // undefined for experts no token chose
        if (grad.defined()) predicted += (grad * d).sum().item<double>();
      }
      const double measured = (loss_of(plus, 0.3) - loss_of(minus, 0.3)).item<double>() / (2 * eps);
      EXPECT_GT(std::abs(predicted), 1e-3);
      EXPECT_NEAR(measured, predicted, 2e-3 + 1e-2 * std::abs(predicted));
    }
  }
}

// Parameter names and shapes, the gates' random std and the config classes'
// defaults that decide shapes (num_key_value_heads: Mixtral 8, Qwen2-MoE 16,
// Qwen3-MoE 4; Qwen3-MoE head_dim hidden / heads; experts: 8 top-2, 60 top-4, 128).
TEST(ReferenceModels, MoeWeightsAndDefaults) {
  using Shape = std::vector<int64_t>;
  auto shape = [](const Weights& w, const std::string& name) { return w.at(name).sizes().vec(); };
  const Weights mw = reference_random_weights(mixtral_config(), 3);
  EXPECT_EQ(shape(mw, "model.layers.1.block_sparse_moe.gate.weight"), (Shape{5, 24}));
  EXPECT_EQ(shape(mw, "model.layers.1.block_sparse_moe.experts.4.w1.weight"), (Shape{22, 24}));
  EXPECT_EQ(shape(mw, "model.layers.1.block_sparse_moe.experts.4.w3.weight"), (Shape{22, 24}));
  EXPECT_EQ(shape(mw, "model.layers.1.block_sparse_moe.experts.4.w2.weight"), (Shape{24, 22}));
  EXPECT_EQ(mw.count("model.layers.0.mlp.gate_proj.weight"), 0u);
  EXPECT_EQ(mw.count("model.layers.0.self_attn.q_proj.bias"), 0u);
  EXPECT_EQ(mw.size(), 1u + 2 * (1 + 4 + 1 + 1 + 5 * 3) + 1 + 1);
  const torch::Tensor router = mw.at("model.layers.0.block_sparse_moe.gate.weight");
  EXPECT_NEAR(router.std().item<double>(), 0.5, 0.1);
  EXPECT_NEAR(mw.at("model.layers.0.block_sparse_moe.experts.0.w2.weight").std().item<double>(), 0.02, 0.005);

  const Weights q2 = reference_random_weights(qwen2_moe_config(), 3);
  for (int64_t l : {0, 2}) {
    const std::string pre = "model.layers." + std::to_string(l) + ".mlp.";
    EXPECT_EQ(shape(q2, pre + "gate.weight"), (Shape{4, 16}));
    EXPECT_EQ(shape(q2, pre + "experts.3.down_proj.weight"), (Shape{16, 10}));
    EXPECT_EQ(shape(q2, pre + "shared_expert.gate_proj.weight"), (Shape{14, 16}));
    EXPECT_EQ(shape(q2, pre + "shared_expert.up_proj.weight"), (Shape{14, 16}));
    EXPECT_EQ(shape(q2, pre + "shared_expert.down_proj.weight"), (Shape{16, 14}));
    EXPECT_EQ(shape(q2, pre + "shared_expert_gate.weight"), (Shape{1, 16}));
    EXPECT_GT(q2.at(pre + "shared_expert_gate.weight").std().item<double>(), 0.2);
  }
  EXPECT_EQ(shape(q2, "model.layers.1.mlp.up_proj.weight"), (Shape{26, 16}));
  EXPECT_EQ(q2.count("model.layers.1.self_attn.v_proj.bias"), 1u);  // q/k/v always biased
  EXPECT_EQ(q2.count("model.layers.1.self_attn.o_proj.bias"), 0u);
  EXPECT_EQ(q2.count("lm_head.weight"), 1u);

  const Weights q3 = reference_random_weights(qwen3_moe_config(), 3);
  EXPECT_EQ(shape(q3, "model.layers.1.self_attn.q_norm.weight"), (Shape{6}));
  EXPECT_EQ(q3.count("model.layers.1.self_attn.o_proj.bias"), 1u);
  EXPECT_EQ(q3.count("lm_head.weight"), 0u);

  json mixtral = mixtral_config();
  for (const char* key : {"num_key_value_heads", "num_local_experts", "num_experts_per_tok"}) mixtral.erase(key);
  mixtral["hidden_size"] = 32;
  mixtral["num_attention_heads"] = 16;
  const Weights md = reference_random_weights(mixtral, 3);
  EXPECT_EQ(shape(md, "model.layers.0.self_attn.k_proj.weight"), (Shape{8 * 2, 32}));
  EXPECT_EQ(shape(md, "model.layers.0.block_sparse_moe.gate.weight"), (Shape{8, 32}));
  json qwen2 = qwen2_moe_config();
  for (const char* key : {"num_key_value_heads", "num_experts", "num_experts_per_tok", "shared_expert_intermediate_size"})
    qwen2.erase(key);
  qwen2["hidden_size"] = 32;
  qwen2["num_attention_heads"] = 16;  // head_dim 2
  qwen2["num_hidden_layers"] = 1;
  qwen2["mlp_only_layers"] = json::array();
  const Weights q2d = reference_random_weights(qwen2, 3);
  EXPECT_EQ(shape(q2d, "model.layers.0.self_attn.k_proj.weight"), (Shape{16 * 2, 32}));
  EXPECT_EQ(shape(q2d, "model.layers.0.mlp.gate.weight"), (Shape{60, 32}));
  EXPECT_EQ(shape(q2d, "model.layers.0.mlp.shared_expert.up_proj.weight"), (Shape{5632, 32}));
  json qwen3 = qwen3_moe_config();
  for (const char* key : {"num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok"}) qwen3.erase(key);
  qwen3["num_attention_heads"] = 8;
  qwen3["moe_intermediate_size"] = 1;
  qwen3["num_hidden_layers"] = 2;
  const Weights q3d = reference_random_weights(qwen3, 3);
  EXPECT_EQ(shape(q3d, "model.layers.1.self_attn.q_proj.weight"), (Shape{8 * 2, 16}));
  EXPECT_EQ(shape(q3d, "model.layers.1.self_attn.k_proj.weight"), (Shape{4 * 2, 16}));
  EXPECT_EQ(shape(q3d, "model.layers.1.mlp.gate.weight"), (Shape{128, 16}));
  // Default top-k: Qwen2-MoE 4 of 60, Qwen3-MoE 8 of 128; equal to spelling them out.
  const torch::Tensor ids = torch::tensor({{1, 2, 3}}, torch::kLong);
  json q2_explicit = qwen2, q3_explicit = qwen3;
  q2_explicit["num_experts"] = 60;
  q2_explicit["num_experts_per_tok"] = 4;
  q2_explicit["shared_expert_intermediate_size"] = 5632;
  q3_explicit["num_experts"] = 128;
  q3_explicit["num_experts_per_tok"] = 8;
  EXPECT_TRUE(torch::equal(reference_moe_forward(qwen2, q2d, ids).aux_loss,
                           reference_moe_forward(q2_explicit, q2d, ids).aux_loss));
  q2_explicit["num_experts_per_tok"] = 3;
  EXPECT_FALSE(torch::equal(reference_moe_forward(qwen2, q2d, ids).aux_loss,
                            reference_moe_forward(q2_explicit, q2d, ids).aux_loss));
  EXPECT_TRUE(torch::equal(reference_moe_forward(qwen3, q3d, ids).aux_loss,
                           reference_moe_forward(q3_explicit, q3d, ids).aux_loss));
}

TEST(ReferenceModels, RejectsUnsupportedMoeConfigsAndBadExpertWeights) {
  const torch::Tensor ids = torch::tensor({{1, 2, 3}}, torch::kLong);
  auto throws = [&](const json& config, const Weights& weights) {
    EXPECT_THROW(reference_logits(config, weights, ids), std::runtime_error) << config.dump();
    EXPECT_THROW(reference_moe_forward(config, weights, ids), std::runtime_error) << config.dump();
  };
  // A config refused as such, not for weights that no longer fit it.
  auto refused = [&](const json& config, const Weights& weights) {
    throws(config, weights);
    EXPECT_THROW(reference_random_weights(config, 1), std::runtime_error) << config.dump();
  };
  auto with = [](json config, const char* key, const json& value) {
    config[key] = value;
    return config;
  };
  const Weights mw = reference_random_weights(mixtral_config(), 1);
  const Weights q2w = reference_random_weights(qwen2_moe_config(), 1);
  const Weights q3w = reference_random_weights(qwen3_moe_config(), 1);
  EXPECT_NO_THROW(reference_moe_forward(mixtral_config(), mw, ids));
  refused(with(mixtral_config(), "router_jitter_noise", 0.1), mw);
  refused(with(mixtral_config(), "num_experts_per_tok", 6), mw);
  refused(with(mixtral_config(), "num_experts_per_tok", 0), mw);
  refused(with(mixtral_config(), "hidden_act", "gelu"), mw);
  refused(with(qwen3_moe_config(), "use_sliding_window", true), q3w);
  refused(with(qwen2_moe_config(), "use_sliding_window", true), q2w);
  refused(with(qwen3_moe_config(), "decoder_sparse_step", 0), q3w);
  refused(with(qwen2_moe_config(), "head_dim", 8), q2w);
  refused(with(qwen2_moe_config(), "qkv_bias", false), q2w);
  // ...but the window is off when it is null.
  EXPECT_NO_THROW(reference_logits(with(with(qwen3_moe_config(), "use_sliding_window", true), "sliding_window", nullptr),
                                   q3w, ids));
  // reference_moe_forward is for MoE models only.
  EXPECT_THROW(reference_moe_forward(mistral_config(), reference_random_weights(mistral_config(), 1), ids),
               std::runtime_error);

  // Weight validation: missing, unexpected and misshapen expert weights.
  auto without = [](Weights w, const std::string& name) {
    EXPECT_EQ(w.erase(name), 1u) << name;
    return w;
  };
  auto added = [](Weights w, const std::string& name, const torch::Tensor& t) {
    w[name] = t;
    return w;
  };
  throws(mixtral_config(), without(mw, "model.layers.1.block_sparse_moe.experts.4.w2.weight"));
  throws(mixtral_config(), without(mw, "model.layers.0.block_sparse_moe.gate.weight"));
  throws(mixtral_config(), added(mw, "model.layers.0.block_sparse_moe.experts.5.w1.weight", torch::zeros({22, 24})));
  throws(mixtral_config(), added(mw, "model.layers.0.mlp.gate_proj.weight", torch::zeros({22, 24})));
  throws(mixtral_config(), added(mw, "model.layers.0.block_sparse_moe.gate.weight", torch::zeros({4, 24})));
  throws(mixtral_config(), added(mw, "model.layers.0.block_sparse_moe.experts.1.w3.weight", torch::zeros({24, 22})));
  throws(qwen2_moe_config(), without(q2w, "model.layers.2.mlp.shared_expert_gate.weight"));
  throws(qwen2_moe_config(), without(q2w, "model.layers.0.mlp.shared_expert.down_proj.weight"));
  throws(qwen2_moe_config(), without(q2w, "model.layers.1.mlp.up_proj.weight"));
  throws(qwen2_moe_config(), added(q2w, "model.layers.1.mlp.gate.weight", torch::zeros({4, 16})));
  throws(qwen3_moe_config(), added(q3w, "model.layers.1.mlp.shared_expert_gate.weight", torch::zeros({1, 16})));
  throws(qwen3_moe_config(), without(q3w, "model.layers.2.mlp.experts.0.up_proj.weight"));
  throws(qwen3_moe_config(), added(q3w, "model.layers.0.mlp.experts.0.up_proj.weight", torch::zeros({11, 16})));
}

}  // namespace
}  // namespace autotp::test
