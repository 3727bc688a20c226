// Sanity tests for the reference HF forward passes in support/reference_models.*:
// causality, GQA head mapping, tied embeddings, closed-form RMSNorm / rotary cases,
// a scalar-loop re-implementation, the next-token loss, and config validation.
#include <gtest/gtest.h>

#include <cmath>
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

std::vector<json> all_configs() { return {llama_config(), mistral_config(), qwen2_config(), gpt2_config()}; }

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

// Rotate-half rotary on one head vector at position pos: dims i and i+half pair up.
Vec rotary_loop(const Vec& x, int64_t pos, double theta) {
  const int64_t d = static_cast<int64_t>(x.size()), half = d / 2;
  Vec y(d);
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(d));
    const double c = std::cos(pos * inv_freq), s = std::sin(pos * inv_freq);
    y[i] = x[i] * c - x[i + half] * s;
    y[i + half] = x[i + half] * c + x[i] * s;
  }
  return y;
}

// Causal attention over per-position head vectors; query head h reads kv head h / group.
// q[t] holds heads*dim values, k[t] / v[t] hold kv_heads*dim values.
std::vector<Vec> attention_loop(const std::vector<Vec>& q, const std::vector<Vec>& k, const std::vector<Vec>& v,
                                int64_t heads, int64_t kv_heads, int64_t dim, bool scale) {
  const int64_t seq = static_cast<int64_t>(q.size()), group = heads / kv_heads;
  std::vector<Vec> out(seq, Vec(heads * dim, 0.0));
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t kvh = h / group;
    for (int64_t t = 0; t < seq; ++t) {
      Vec scores(t + 1);
      double best = -1e300;
      for (int64_t s = 0; s <= t; ++s) {
        double dot = 0.0;
        for (int64_t e = 0; e < dim; ++e) dot += q[t][h * dim + e] * k[s][kvh * dim + e];
        scores[s] = scale ? dot / std::sqrt(static_cast<double>(dim)) : dot;
        best = std::max(best, scores[s]);
      }
      double total = 0.0;
      for (double& sc : scores) total += (sc = std::exp(sc - best));
      for (int64_t s = 0; s <= t; ++s) {
        for (int64_t e = 0; e < dim; ++e) out[t][h * dim + e] += scores[s] / total * v[s][kvh * dim + e];
      }
    }
  }
  return out;
}

// Llama / Mistral / Qwen2 forward for one sequence. Biases are used where the
// weights have them. Returns logits [T][V].
std::vector<Vec> llama_loop(const json& cfg, const Weights& w, const std::vector<int64_t>& ids) {
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
      for (int64_t hh = 0; hh < heads; ++hh) {
        Vec head(q[t].begin() + hh * dim, q[t].begin() + (hh + 1) * dim);
        head = rotary_loop(head, t, theta);
        std::copy(head.begin(), head.end(), q[t].begin() + hh * dim);
      }
      for (int64_t hh = 0; hh < kv_heads; ++hh) {
        Vec head(k[t].begin() + hh * dim, k[t].begin() + (hh + 1) * dim);
        head = rotary_loop(head, t, theta);
        std::copy(head.begin(), head.end(), k[t].begin() + hh * dim);
      }
    }
    const std::vector<Vec> attn = attention_loop(q, k, v, heads, kv_heads, dim, /*scale=*/true);
    const Arr post_norm = arr(w.at(pre + "post_attention_layernorm.weight"));
    for (int64_t t = 0; t < seq; ++t) {
      const Vec o = linear_loop(w, pre + "self_attn.o_proj", attn[t]);
      for (int64_t i = 0; i < hidden; ++i) h[t][i] += o[i];
      const Vec x = rms_loop(h[t], post_norm, eps);
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
    const std::vector<Vec> attn = attention_loop(q, k, v, heads, heads, dim, /*scale=*/true);
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

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

TEST(ReferenceModels, MatchesScalarLoopImplementation) {
  for (const json& config : all_configs()) {
    SCOPED_TRACE(config.at("architectures")[0].get<std::string>());
    const Weights weights = amplified(reference_random_weights(config, 7), 12.0);
    const torch::Tensor ids = ids_for(config, 2, 6, 3);
    const torch::Tensor logits = reference_logits(config, weights, ids);
    ASSERT_EQ(logits.scalar_type(), torch::kFloat);
    ASSERT_EQ(logits.sizes().vec(), (std::vector<int64_t>{2, 6, config.at("vocab_size").get<int64_t>()}));
    const bool gpt2 = config.at("model_type") == "gpt2";
    double max_err = 0.0, max_mag = 0.0;
    for (int64_t b = 0; b < 2; ++b) {
      std::vector<int64_t> seq_ids(ids[b].data_ptr<int64_t>(), ids[b].data_ptr<int64_t>() + 6);
      const std::vector<Vec> expected = gpt2 ? gpt2_loop(config, weights, seq_ids) : llama_loop(config, weights, seq_ids);
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
    SCOPED_TRACE(config.at("architectures")[0].get<std::string>());
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
  for (const json& config : {llama_config(), gpt2_config()}) {
    SCOPED_TRACE(config.at("architectures")[0].get<std::string>());
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
  const json config = qwen2_config();
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

}  // namespace
}  // namespace autotp::test
