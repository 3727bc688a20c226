#include "simulator/model_catalog.h"

#include <filesystem>
#include <fmt/ranges.h>

#include "autotp/model/presets.h"
#include "autotp/base/error.h"
#include "autotp/base/json_file.h"

namespace autotp::sim {
namespace {

using nlohmann::json;

json llama(const std::string& arch, int64_t vocab, int64_t hidden, int64_t inter, int64_t layers, int64_t heads,
           int64_t kv, int64_t positions, double eps, double theta, bool tied) {
  return {{"architectures", {arch}}, {"vocab_size", vocab},           {"hidden_size", hidden},
          {"intermediate_size", inter}, {"num_hidden_layers", layers}, {"num_attention_heads", heads},
          {"num_key_value_heads", kv},  {"max_position_embeddings", positions},
          {"rms_norm_eps", eps},        {"rope_theta", theta},         {"hidden_act", "silu"},
          {"tie_word_embeddings", tied}, {"torch_dtype", "bfloat16"}};
}

json gpt2(int64_t hidden, int64_t layers, int64_t heads) {
  return {{"architectures", {"GPT2LMHeadModel"}}, {"vocab_size", 50257}, {"n_embd", hidden}, {"n_layer", layers},
          {"n_head", heads}, {"n_positions", 1024}, {"activation_function", "gelu_new"},
          {"layer_norm_epsilon", 1e-5}, {"tie_word_embeddings", true}, {"torch_dtype", "float32"}};
}

// Mixtral-8x7B-v0.1's config.json (mistralai/Mixtral-8x7B-v0.1).
json mixtral_8x7b() {
  json j = llama("MixtralForCausalLM", 32000, 4096, 14336, 32, 32, 8, 32768, 1e-5, 1e6, false);
  j["num_local_experts"] = 8;
  j["num_experts_per_tok"] = 2;
  j["output_router_logits"] = false;
  j["router_aux_loss_coef"] = 0.02;
  j["router_jitter_noise"] = 0.0;
  j["sliding_window"] = nullptr;
  return j;
}

// Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B): 128 experts of width 768, top-8, no shared expert.
json qwen3_30b_a3b() {
  json j = llama("Qwen3MoeForCausalLM", 151936, 2048, 6144, 48, 32, 4, 40960, 1e-6, 1e6, false);
  j["head_dim"] = 128;
  j["attention_bias"] = false;
  j["num_experts"] = 128;
  j["num_experts_per_tok"] = 8;
  j["moe_intermediate_size"] = 768;
  j["norm_topk_prob"] = true;
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = json::array();
  j["output_router_logits"] = false;
  j["router_aux_loss_coef"] = 0.001;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  return j;
}

std::vector<CatalogModel> make_catalog() {
  const std::string L = "LlamaForCausalLM", Q = "Qwen2ForCausalLM";
  return {
      // The same shapes as the engine's preset, which GPU runs measure.
      {"llama2-7b", "meta-llama/Llama-2-7b-hf", 6738415616, find_preset("llama2-7b").config},
      {"llama2-13b", "meta-llama/Llama-2-13b-hf", 13015864320, llama(L, 32000, 5120, 13824, 40, 40, 40, 4096, 1e-5, 1e4, false)},
      {"llama2-70b", "meta-llama/Llama-2-70b-hf", 68976648192, llama(L, 32000, 8192, 28672, 80, 64, 8, 4096, 1e-5, 1e4, false)},
      {"llama3-8b", "meta-llama/Meta-Llama-3-8B", 8030261248, llama(L, 128256, 4096, 14336, 32, 32, 8, 8192, 1e-5, 5e5, false)},
      {"llama3-70b", "meta-llama/Meta-Llama-3-70B", 70553706496, llama(L, 128256, 8192, 28672, 80, 64, 8, 8192, 1e-5, 5e5, false)},
      {"qwen2-0.5b", "Qwen/Qwen2-0.5B", 494032768, llama(Q, 151936, 896, 4864, 24, 14, 2, 131072, 1e-6, 1e6, true)},
      {"qwen2-7b", "Qwen/Qwen2-7B", 7615616512, llama(Q, 152064, 3584, 18944, 28, 28, 4, 131072, 1e-6, 1e6, false)},
      {"gpt2", "openai-community/gpt2", 124439808, gpt2(768, 12, 12)},
      {"gpt2-medium", "openai-community/gpt2-medium", 354823168, gpt2(1024, 24, 16)},
      {"gpt2-large", "openai-community/gpt2-large", 774030080, gpt2(1280, 36, 20)},
      {"gpt2-xl", "openai-community/gpt2-xl", 1557611200, gpt2(1600, 48, 25)},
      // Mixtures of experts (expert parallelism: --ep).
      {"mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", 46702792704, mixtral_8x7b()},
      {"qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 30532122624, qwen3_30b_a3b()},
  };
}


// Attention variants that change neither parameter counts nor the FLOPs we count.
json without_shape_neutral_keys(json j) {
  for (const char* key : {"rope_scaling", "use_sliding_window", "sliding_window"}) j.erase(key);
  return j;
}

}  // namespace

const std::vector<CatalogModel>& catalog_models() {
  static const std::vector<CatalogModel> list = make_catalog();
  return list;
}

ResolvedModel resolve_sim_model(const std::string& arg) {
  for (const auto& m : catalog_models())
    if (m.name == arg) return {ModelConfig::from_json(m.config, m.name), m.name};
  if (std::filesystem::is_directory(arg) || std::filesystem::is_regular_file(arg)) {
    std::string path = std::filesystem::is_directory(arg) ? arg + "/config.json" : arg;
    return {ModelConfig::from_json(without_shape_neutral_keys(read_json_file(path, "config file")), path), arg};
  }
  if (arg.rfind("preset:", 0) == 0) {
    auto source = resolve_model(arg);
    return {source.config, source.label};
  }
  std::vector<std::string> names;
  for (const auto& m : catalog_models()) names.push_back(m.name);
  for (const auto& p : presets()) names.push_back("preset:" + p.name);
  throw_user_error("--model {}: unknown model (allowed: {}, an HF model directory or a config.json)", arg,
                   fmt::join(names, ", "));
}

}  // namespace autotp::sim
