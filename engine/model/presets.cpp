#include "autotp/model/presets.h"

#include <fmt/ranges.h>
#include <sys/stat.h>

#include "autotp/io/hf_writer.h"
#include "autotp/io/safetensors.h"
#include "autotp/base/error.h"

namespace autotp {
namespace {

using nlohmann::json;

json llama_config(const std::string& arch, int64_t vocab, int64_t hidden, int64_t inter, int64_t layers,
                  int64_t heads, int64_t kv, bool tied, const std::string& model_type) {
  return {{"architectures", {arch}},
          {"model_type", model_type},
          {"vocab_size", vocab},
          {"hidden_size", hidden},
          {"intermediate_size", inter},
          {"num_hidden_layers", layers},
          {"num_attention_heads", heads},
          {"num_key_value_heads", kv},
          {"hidden_act", "silu"},
          {"max_position_embeddings", 512},
          {"rms_norm_eps", 1e-6},
          {"rope_theta", 10000.0},
          {"attention_bias", false},
          {"tie_word_embeddings", tied},
          {"bos_token_id", 256},
          {"eos_token_id", 257},
          {"torch_dtype", "float32"}};
}

// Mixtral: top-2 of `experts` experts of width `expert_width`, the load-balancing loss on.
json mixtral_config(int64_t vocab, int64_t hidden, int64_t expert_width, int64_t layers, int64_t heads, int64_t kv,
                    int64_t experts, double aux_loss_coef) {
  json c = llama_config("MixtralForCausalLM", vocab, hidden, expert_width, layers, heads, kv, false, "mixtral");
  c.erase("attention_bias");
  c["num_local_experts"] = experts;
  c["num_experts_per_tok"] = 2;
  c["output_router_logits"] = true;
  c["router_aux_loss_coef"] = aux_loss_coef;
  c["router_jitter_noise"] = 0.0;
  c["sliding_window"] = nullptr;
  return c;
}

// Gemma 2 / 3 of 3 layers (vocab 259, hidden 64, intermediate 150, 2 kv heads, sliding window 4).
json gemma_config(const std::string& arch, const std::string& model_type, int64_t heads, int64_t head_dim,
                  double query_pre_attn_scalar) {
  json c = llama_config(arch, 259, 64, 150, 3, heads, 2, true, model_type);
  c.erase("hidden_act");
  c["hidden_activation"] = "gelu_pytorch_tanh";
  c["head_dim"] = head_dim;
  c["query_pre_attn_scalar"] = query_pre_attn_scalar;
  c["sliding_window"] = 4;
  return c;
}

json gpt2_config(int64_t vocab, int64_t hidden, int64_t layers, int64_t heads, int64_t positions) {
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", vocab},
          {"n_embd", hidden},
          {"n_layer", layers},
          {"n_head", heads},
          {"n_positions", positions},
          {"n_inner", nullptr},
          {"activation_function", "gelu_new"},
          // Off in the random presets (GPT2Config's default is 0.1): parity tests turn them on.
          {"attn_pdrop", 0.0},
          {"resid_pdrop", 0.0},
          {"embd_pdrop", 0.0},
          {"layer_norm_epsilon", 1e-5},
          {"tie_word_embeddings", true},
          {"bos_token_id", 256},
          {"eos_token_id", 257},
          {"torch_dtype", "float32"}};
}

std::vector<Preset> make_presets() {
  std::vector<Preset> list;
  list.push_back({"llama-tiny",
                  "Llama, uneven on purpose: 6 heads, 2 kv heads, vocab 259 and intermediate 202 not divisible by 4",
                  llama_config("LlamaForCausalLM", 259, 96, 202, 2, 6, 2, false, "llama")});
  list.push_back({"llama-tiny-tied", "llama-tiny with tie_word_embeddings",
                  llama_config("LlamaForCausalLM", 259, 96, 202, 2, 6, 2, true, "llama")});
  list.push_back({"llama-small", "Llama large enough that a step is compute-bound (hidden 512, 4 layers, GQA 8/4)",
                  llama_config("LlamaForCausalLM", 8000, 512, 1376, 4, 8, 4, false, "llama")});
  list.push_back({"llama-100m",
                  "Llama of 99.5 M parameters (hidden 768, 8 layers, GQA 12/4, vocab 32000): the memory scenario",
                  llama_config("LlamaForCausalLM", 32000, 768, 2048, 8, 12, 4, false, "llama")});
  list.push_back({"llama-1b-32k",
                  "Llama of 1.03 B parameters with a 32 K vocabulary (hidden 2048, 20 layers, intermediate 5632, "
                  "GQA 32/8): ZeRO-3 on one 24 GiB machine",
                  llama_config("LlamaForCausalLM", 32000, 2048, 5632, 20, 32, 8, false, "llama")});
  // Llama-3.2-1B's shapes (its llama3 rope scaling left out: the shapes are what
  // GPU benchmarks need): 1.24 B parameters, vocab 128256, tied head.
  json llama_1b = llama_config("LlamaForCausalLM", 128256, 2048, 8192, 16, 32, 8, true, "llama");
  llama_1b["max_position_embeddings"] = 8192;
  llama_1b["rope_theta"] = 500000.0;
  llama_1b["rms_norm_eps"] = 1e-5;
  llama_1b["bos_token_id"] = 128000;
  llama_1b["eos_token_id"] = 128001;
  llama_1b["torch_dtype"] = "bfloat16";
  list.push_back({"llama-1b", "Llama-3.2-1B shapes (hidden 2048, 16 layers, GQA 32/8, vocab 128256): GPU benchmarks",
                  llama_1b});
  // Llama-3.2-3B's shapes (3.21 B parameters; rope scaling left out as above).
  json llama_3b = llama_1b;
  llama_3b["hidden_size"] = 3072;
  llama_3b["num_hidden_layers"] = 28;
  llama_3b["num_attention_heads"] = 24;
  llama_3b["head_dim"] = 128;
  list.push_back({"llama-3b", "Llama-3.2-3B shapes (hidden 3072, 28 layers, GQA 24/8, vocab 128256): GPU benchmarks",
                  llama_3b});
  // Llama-2-7b-hf's shapes (6.74 B parameters): the model the 7 B memory tables are
  // about, for measuring them on one large GPU (ZeRO-0 needs about 100-111 GiB).
  json llama2_7b = llama_config("LlamaForCausalLM", 32000, 4096, 11008, 32, 32, 32, false, "llama");
  llama2_7b["max_position_embeddings"] = 4096;
  llama2_7b["rms_norm_eps"] = 1e-5;
  llama2_7b["bos_token_id"] = 1;
  llama2_7b["eos_token_id"] = 2;
  llama2_7b["torch_dtype"] = "bfloat16";
  list.push_back({"llama2-7b", "Llama-2-7b-hf shapes (hidden 4096, 32 layers, 32 heads, vocab 32000): the 7 B memory "
                  "tables measured on one large GPU", llama2_7b});
  json qwen = llama_config("Qwen2ForCausalLM", 259, 64, 176, 2, 4, 2, true, "qwen2");
  qwen.erase("attention_bias");
  qwen["use_sliding_window"] = false;
  list.push_back({"qwen2-tiny", "Qwen2 (q/k/v biases, tied), 4 heads, 2 kv heads", qwen});
  // head_dim 20 is not hidden / heads (64 / 6): Qwen3 sets it on its own.
  json qwen3 = llama_config("Qwen3ForCausalLM", 259, 64, 150, 2, 6, 2, true, "qwen3");
  qwen3["head_dim"] = 20;
  qwen3["use_sliding_window"] = false;
  qwen3["sliding_window"] = nullptr;
  qwen3["max_window_layers"] = 2;
  list.push_back({"qwen3-tiny", "Qwen3 (per-head q/k norms, head_dim 20 of hidden 64, tied), 6 heads, 2 kv heads",
                  qwen3});
  // Fused qkv_proj and gate_up_proj, each part split on its own (kv heads shared at tp 4).
  json phi3 = llama_config("Phi3ForCausalLM", 259, 96, 202, 2, 6, 2, false, "phi3");
  phi3.erase("attention_bias");
  phi3["rms_norm_eps"] = 1e-5;
  phi3["original_max_position_embeddings"] = 512;
  phi3["rope_scaling"] = nullptr;
  list.push_back({"phi3-tiny", "Phi-3 (fused qkv_proj and gate_up_proj), 6 heads, 2 kv heads, intermediate 202",
                  phi3});
  // Gemma 2: 3 layers (sliding, global, sliding), head_dim 24 and query_pre_attn_scalar 32
  // (neither hidden / heads), HF's default softcaps.
  json gemma2 = gemma_config("Gemma2ForCausalLM", "gemma2", 4, 24, 32);
  gemma2["attn_logit_softcapping"] = 50.0;
  gemma2["final_logit_softcapping"] = 30.0;
  list.push_back({"gemma2-tiny", "Gemma 2 (sandwich norms, softcapping, alternating sliding window 4), 4 heads, 2 kv "
                  "heads, head_dim 24", gemma2});
  // Gemma 3: per-head q/k norms, 6 heads over 2 kv heads, layers 0-1 sliding with their own rope base.
  json gemma3 = gemma_config("Gemma3ForCausalLM", "gemma3_text", 6, 16, 16);
  gemma3["sliding_window_pattern"] = 3;
  gemma3["rope_theta"] = 1000000.0;
  gemma3["rope_local_base_freq"] = 10000.0;
  gemma3["attn_logit_softcapping"] = nullptr;
  gemma3["final_logit_softcapping"] = nullptr;
  list.push_back({"gemma3-tiny", "Gemma 3 text (q/k norms, 2 local layers : 1 global), 6 heads, 2 kv heads", gemma3});
  // Mixture of experts, uneven at tp 3 and 4 (expert widths 74, 38, 42; shared 58),
  // the load-balancing loss on with a coefficient large enough to matter.
  json mixtral = mixtral_config(259, 72, 74, 2, 6, 2, 5, 0.05);
  list.push_back({"mixtral-tiny", "Mixtral (5 experts of width 74, top-2, load-balancing loss 0.05), 6 heads, 2 kv "
                  "heads", mixtral});
  json qwen2_moe = llama_config("Qwen2MoeForCausalLM", 259, 64, 150, 3, 4, 2, false, "qwen2_moe");
  qwen2_moe.erase("attention_bias");
  qwen2_moe["use_sliding_window"] = false;
  qwen2_moe["num_experts"] = 6;
  qwen2_moe["num_experts_per_tok"] = 2;
  qwen2_moe["moe_intermediate_size"] = 38;
  qwen2_moe["shared_expert_intermediate_size"] = 58;
  qwen2_moe["norm_topk_prob"] = false;
  qwen2_moe["decoder_sparse_step"] = 1;
  qwen2_moe["mlp_only_layers"] = json::array({1});
  qwen2_moe["output_router_logits"] = true;
  qwen2_moe["router_aux_loss_coef"] = 0.05;
  list.push_back({"qwen2-moe-tiny", "Qwen2-MoE (6 experts of width 38, top-2, a gated shared expert; layer 1 dense), "
                  "4 heads, 2 kv heads", qwen2_moe});
  json qwen3_moe = llama_config("Qwen3MoeForCausalLM", 259, 64, 150, 2, 6, 2, false, "qwen3_moe");
  qwen3_moe["head_dim"] = 20;
  qwen3_moe["use_sliding_window"] = false;
  qwen3_moe["num_experts"] = 5;
  qwen3_moe["num_experts_per_tok"] = 3;
  qwen3_moe["moe_intermediate_size"] = 42;
  qwen3_moe["norm_topk_prob"] = true;
  qwen3_moe["decoder_sparse_step"] = 2;
  qwen3_moe["mlp_only_layers"] = json::array();
  qwen3_moe["output_router_logits"] = true;
  qwen3_moe["router_aux_loss_coef"] = 0.05;
  list.push_back({"qwen3-moe-tiny", "Qwen3-MoE (q/k norms; layer 1 sparse: 5 experts of width 42, top-3, "
                  "renormalised), 6 heads, 2 kv heads", qwen3_moe});
  // Expert parallelism's benchmark: llama-small's attention with 8 experts of width 512 (top-2).
  json mixtral_small = mixtral_config(8000, 512, 512, 4, 8, 4, 8, 0.02);
  list.push_back({"mixtral-small", "Mixtral for expert-parallel benchmarks (hidden 512, 4 layers, GQA 8/4, 8 experts "
                  "of width 512, top-2)", mixtral_small});
  list.push_back({"mistral-tiny", "Mistral, 8 heads, 2 kv heads, vocab 259",
                  llama_config("MistralForCausalLM", 259, 64, 160, 2, 8, 2, false, "mistral")});
  list.push_back({"gpt2-tiny", "GPT-2, 6 heads, vocab 259 not divisible by 4, tied LM head",
                  gpt2_config(259, 96, 2, 6, 256)});
  return list;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

const std::vector<Preset>& presets() {
  static const std::vector<Preset> list = make_presets();
  return list;
}

const Preset& find_preset(const std::string& name) {
  std::vector<std::string> names;
  for (const auto& p : presets()) {
    if (p.name == name) return p;
    names.push_back(p.name);
  }
  throw_user_error("unknown preset '{}' (allowed: {})", name, fmt::join(names, ", "));
}

int64_t count_parameters(const ModelConfig& config) {
  int64_t n = 0;
  for (const auto& d : describe_parameters(config)) {
    int64_t numel = 1;
    for (int64_t s : d.shape) numel *= s;
    n += numel;
  }
  return n;
}

ModelSource resolve_model(const std::string& arg) {
  ModelSource source;
  const std::string prefix = "preset:";
  if (arg.rfind(prefix, 0) == 0 || (!is_directory(arg) && arg.find('/') == std::string::npos)) {
    std::string name = arg.rfind(prefix, 0) == 0 ? arg.substr(prefix.size()) : arg;
    const Preset& p = find_preset(name);
    source.config = ModelConfig::from_json(p.config, "preset:" + name);
    source.label = "preset:" + name;
    return source;
  }
  AUTOTP_USER_CHECK(is_directory(arg), "--model {}: no such directory (give an HF model directory or preset:NAME)",
                    arg);
  source.config = ModelConfig::from_file(arg + "/config.json");
  source.dir = arg;
  source.label = arg;
  return source;
}

std::unique_ptr<CausalLM> load_model(const ModelSource& source, const TpPlan& plan, Comm& tp,
                                     torch::ScalarType dtype, uint64_t seed, LoadReport* report,
                                     torch::Device device) {
  auto model = std::make_unique<CausalLM>(source.config, plan, tp, dtype, device);
  if (source.dir) {
    auto checkpoint = io::CheckpointReader::open(*source.dir);
    LoadReport r = model->load(checkpoint);
    if (report) *report = r;
  } else {
    model->init_random(seed);
  }
  return model;
}

void write_model_dir(const ModelSource& source, const std::string& dir, torch::ScalarType dtype, uint64_t seed) {
  Comm self;
  auto model = load_model(source, TpPlan::build(source.config, TpPlanOptions{}), self, dtype, seed);
  ::mkdir(dir.c_str(), 0755);
  nlohmann::json config = source.config.raw;
  io::set_config_dtype(config, hf_dtype_name(dtype));
  io::NamedTensors tensors;
  for (auto& p : model->parameters()) tensors.emplace_back(p.name(), p.tensor.detach());
  io::write_checkpoint(dir, tensors);
  io::write_text_file_atomic(dir + "/config.json", config.dump(2) + "\n");
  if (source.dir) io::copy_companion_files(*source.dir, dir);
}

torch::ScalarType parse_dtype(const std::string& name) {
  if (name == "f32" || name == "fp32" || name == "float32") return torch::kFloat32;
  if (name == "bf16" || name == "bfloat16") return torch::kBFloat16;
  if (name == "f16" || name == "fp16" || name == "float16") return torch::kFloat16;
  throw_user_error("unknown dtype '{}' (allowed: f32, bf16, f16)", name);
}

std::string hf_dtype_name(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat32: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    default: break;
  }
  TORCH_CHECK(false, "hf_dtype_name: unsupported dtype ", dtype);
}

}  // namespace autotp
