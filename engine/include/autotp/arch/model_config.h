// Typed view of an HF config.json for the supported architectures. Parsing
// rejects what the engine does not implement (unknown rope_scaling types, other
// activations, partial rotary embeddings) instead of training a different model.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "autotp/arch/rope_scaling.h"

namespace autotp {

enum class ModelFamily { kLlama, kGpt2 };

struct ModelConfig {
  std::string architecture;      // architectures[0], e.g. "LlamaForCausalLM"
  ModelFamily family = ModelFamily::kLlama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // GPT-2: n_inner or 4 * n_embd
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;       // = num_heads without GQA (always for GPT-2)
  int64_t head_dim = 0;           // Llama: head_dim key or hidden / heads
  int64_t max_positions = 0;      // GPT-2 n_positions; Llama max_position_embeddings
  double norm_eps = 1e-5;         // rms_norm_eps / layer_norm_epsilon
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;       // Llama family: config.json rope_scaling (default: none)
  bool qkv_bias = false;          // attention_bias, or Qwen2's always-on q/k/v bias
  bool o_bias = false;            // attention_bias (Llama/Mistral); never in Qwen2
  bool mlp_bias = false;          // Llama mlp_bias
  bool tie_word_embeddings = false;
  bool qk_norm = false;           // Qwen3: RMSNorm over each query and key head before RoPE
  bool fused_projections = false; // Phi-3: one qkv_proj [q | k | v] and one gate_up_proj [gate | up]
  // Gemma 2 / 3:
  bool gemma_norms = false;       // RMSNorm scaling by (1 + weight) in fp32; post-attention, pre- and
                                  // post-feedforward norms around both blocks; embeddings times sqrt(hidden)
  std::string activation = "silu";  // the MLP's: silu, gelu_pytorch_tanh (Gemma), gelu_new (GPT-2)
  double attention_scale = 0;     // 0: 1 / sqrt(head_dim); Gemma: query_pre_attn_scalar^-0.5
  double attn_softcap = 0;        // attn_logit_softcapping (0: none)
  double final_softcap = 0;       // final_logit_softcapping (0: none)
  double local_rope_theta = 0;    // Gemma 3: sliding layers' rope_local_base_freq, unscaled (0: as global)
  // Dropout probabilities, applied in training only (CausalLM::set_dropout):
  double attention_dropout = 0;   // the attention probabilities: attention_dropout; GPT-2 attn_pdrop
  double residual_dropout = 0;    // each block's output before its residual add: GPT-2 and Phi-3 resid_pdrop
  double embedding_dropout = 0;   // the input embeddings: GPT-2 embd_pdrop
  // Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): a sparse block replaces the
  // MLP on the layers sparse_layers marks. A router (`<moe_block>.gate`, [experts,
  // hidden]) picks experts_per_token experts per token by softmax in fp32; each
  // expert is a gated MLP of expert_intermediate_size.
  int64_t num_experts = 0;                  // 0: a dense model
  int64_t experts_per_token = 0;            // num_experts_per_tok (top-k)
  int64_t expert_intermediate_size = 0;     // Mixtral: intermediate_size; Qwen: moe_intermediate_size
  int64_t shared_expert_intermediate_size = 0;  // Qwen2-MoE's always-on shared expert (0: none)
  bool norm_topk_prob = false;              // renormalise the top-k weights to sum 1 (Mixtral always)
  bool output_router_logits = false;        // add the load-balancing loss in training
  double router_aux_loss_coef = 0;          // its weight
  std::vector<bool> sparse_layers;          // per layer: the sparse block instead of the dense MLP
  std::string moe_block = "mlp";            // the block's module: "block_sparse_moe" (Mixtral) or "mlp"
  std::vector<std::string> expert_projections = {"gate_proj", "up_proj", "down_proj"};  // Mixtral: w1, w3, w2
  // Sliding-window attention per decoder layer (0: full causal attention): Mistral's
  // sliding_window on every layer; Qwen2's and Qwen3's with use_sliding_window, on
  // the layers from max_window_layers on, or as `layer_types` says.
  std::vector<int64_t> layer_sliding_window;
  std::string torch_dtype = "float32";  // as written in config.json ("dtype", else "torch_dtype")
  // The transformers generation whose keys config.json uses: 5 when it has
  // rope_parameters or says transformers_version 5.x, else 4. Export writes back
  // `raw`, so a model leaves in the generation it came in.
  int generation = 4;
  nlohmann::json raw;             // the original config, written back on export

  // Parses and validates; `source` names the file in error messages (UserError).
  static ModelConfig from_json(const nlohmann::json& json, const std::string& source);
  static ModelConfig from_file(const std::string& path);

  int64_t sliding_window_of(int64_t layer) const {
    return layer < static_cast<int64_t>(layer_sliding_window.size()) ? layer_sliding_window[layer] : 0;
  }
  bool is_sparse(int64_t layer) const {
    return layer < static_cast<int64_t>(sparse_layers.size()) && sparse_layers[layer];
  }
  // The sparse block of a layer ("model.layers.3.block_sparse_moe"); expert e's
  // projection `which` (0 gate, 1 up, 2 down) module in it.
  std::string moe_module(int64_t layer) const;
  std::string expert_module(int64_t layer, int64_t expert, int which) const;
  // Whether training adds the load-balancing loss (output_router_logits and a
  // non-zero router_aux_loss_coef on a model with experts).
  bool router_aux_loss_enabled() const {
    return num_experts > 0 && output_router_logits && router_aux_loss_coef != 0;
  }
  int64_t kv_group_size() const { return num_heads / num_kv_heads; }  // query heads per kv head
  // Prefix of the base model in HF parameter names: "model." or "transformer.".
  std::string base_prefix() const { return family == ModelFamily::kGpt2 ? "transformer." : "model."; }
};

// 5 for a config.json written by transformers 5 (rope_parameters, or
// transformers_version 5.x), else 4.
int config_generation(const nlohmann::json& config);

// Architectures accepted in config.json "architectures".
const std::vector<std::string>& supported_architectures();

}  // namespace autotp
