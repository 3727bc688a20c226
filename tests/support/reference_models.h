// Independent reference implementations of the HuggingFace forward passes the
// engine supports, written with plain LibTorch tensor ops (no engine code), so
// tests can check the engine's logits against them.
//
// Semantics follow HF transformers' modeling_llama.py / modeling_mistral.py /
// modeling_qwen2.py / modeling_qwen3.py / modeling_phi3.py / modeling_gemma2.py /
// modeling_gemma3.py / modeling_gpt2.py (eager attention, no KV cache, positions
// 0..T-1, no padding mask):
//   - Qwen3: per-head RMSNorm of q and k (self_attn.q_norm / k_norm, [head_dim])
//     after the projection and before RoPE; sliding windows as Qwen2.
//   - Phi-3: fused self_attn.qkv_proj (rows q | k | v) and mlp.gate_up_proj (rows
//     gate | up); rope_scaling null or longrope; sliding_window on every layer.
//   - Gemma 2 / Gemma 3 (text): RMSNorm in fp32 scaled by (1 + weight), embeddings
//     times sqrt(hidden_size) in the activation dtype, four norms per layer,
//     gelu (tanh) MLP, scores scaled by query_pre_attn_scalar^-0.5, attention and
//     final logit soft-capping (cap * tanh(x / cap)), sliding / full layers from
//     layer_types; Gemma 3 adds q_norm / k_norm and RoPE base rope_local_base_freq
//     on sliding layers (rope_theta and rope_scaling on full layers).
//   - Mixtral / Qwen2-MoE / Qwen3-MoE (modeling_mixtral.py / modeling_qwen2_moe.py /
//     modeling_qwen3_moe.py, transformers 4.5x): the attention of Mistral (sliding_window
//     on every layer when set, default none), Qwen2 (q/k/v biased) and Qwen3 (q/k norms,
//     attention_bias, head_dim default hidden / heads); use_sliding_window is refused
//     for the Qwen MoE models. A sparse MLP block on the normed hidden states h [N, hidden]:
//     router logits h @ gate^T [N, E]; softmax in fp32; top-k; renormalised to sum 1
//     (Mixtral always, Qwen only with norm_topk_prob, default false); cast to the
//     model dtype; each token's output sum_k weight_k * down(silu(gate(h)) * up(h)) of
//     its chosen experts; Qwen2-MoE adds sigmoid(h @ shared_expert_gate^T) *
//     shared_expert(h). Mixtral: every layer sparse, experts
//     "model.layers.L.block_sparse_moe.experts.e.w1 / w3 / w2" (gate / up / down) of
//     width intermediate_size, router "...block_sparse_moe.gate"; router_jitter_noise
//     != 0 is refused. Qwen: "model.layers.L.mlp.gate", "mlp.experts.e.gate_proj /
//     up_proj / down_proj" of width moe_intermediate_size, Qwen2-MoE also
//     "mlp.shared_expert.*" (shared_expert_intermediate_size) and
//     "mlp.shared_expert_gate" [1, hidden]; layer L sparse when not in mlp_only_layers,
//     num_experts > 0 and (L + 1) % decoder_sparse_step == 0, else a dense "mlp.*_proj"
//     of width intermediate_size.
// Sliding windows follow HF's masks: a query at q sees keys k with q - window < k <= q.
// Anything the reference does not model (partial rotary, non-default activations,
// transformers v5 "rope_parameters", ...) throws std::runtime_error instead of
// silently computing something else. Weights are validated against the names and
// shapes the config implies: a missing, misshapen or unexpected parameter throws.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace autotp::test {

// Rotary inverse frequencies of HF's rope_scaling types (linear, dynamic, yarn,
// llama3, longrope; `rope_scaling` is the config.json object) for sequences of
// `seq` tokens, computed per frequency in double precision from the formulas, and
// the attention factor that scales cos and sin (yarn, longrope).
// longrope (modeling_rope_utils' _compute_longrope_parameters): with
// original = rope_scaling["original_max_position_embeddings"] (default
// max_positions), the per-frequency factors are long_factor when seq > original,
// else short_factor, and inv_freq[i] = 1 / (factor[i] * theta^(2i/dim));
// attention_factor = rope_scaling["attention_factor"], else
// sqrt(1 + ln(s) / ln(original)) with s = rope_scaling["factor"] when given (as in
// transformers 5), else max_positions / original; 1 when s <= 1.
struct RopeReference {
  std::vector<double> inv_freq;
  double attention_factor = 1;
};
RopeReference reference_rope(const nlohmann::json& rope_scaling, double theta, int64_t head_dim,
                             int64_t max_positions, int64_t seq);

// weights: HF parameter names of the *ForCausalLM / GPT2LMHeadModel state dict,
// e.g. "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
// "lm_head.weight" (absent when tied); Phi-3: "model.layers.0.self_attn.qkv_proj.weight",
// "model.layers.0.mlp.gate_up_proj.weight"; GPT-2: "transformer.wte.weight",
// "transformer.h.0.attn.c_attn.weight" ([in, out] Conv1D layout), ...
// config: the parsed HF config.json. input_ids: int64 [batch, seq].
// Returns float32 logits [batch, seq, vocab], computed in the weights' dtype
// (norms and the attention softmax in fp32, as HF does).
// llama path: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
// Qwen3ForCausalLM, Phi3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM,
// Qwen3MoeForCausalLM.
torch::Tensor reference_llama_logits(const nlohmann::json& config,
                                     const std::map<std::string, torch::Tensor>& weights,
                                     const torch::Tensor& input_ids);
// gemma path: Gemma2ForCausalLM, Gemma3ForCausalLM (model_type "gemma3_text").
torch::Tensor reference_gemma_logits(const nlohmann::json& config,
                                     const std::map<std::string, torch::Tensor>& weights,
                                     const torch::Tensor& input_ids);
torch::Tensor reference_gpt2_logits(const nlohmann::json& config,
                                    const std::map<std::string, torch::Tensor>& weights,
                                    const torch::Tensor& input_ids);

// Dispatches on config["architectures"][0]: the llama and gemma families above
// to their paths; GPT2LMHeadModel -> the gpt2 path.
torch::Tensor reference_logits(const nlohmann::json& config,
                               const std::map<std::string, torch::Tensor>& weights,
                               const torch::Tensor& input_ids);

// The logits of an MoE model and HF's load-balancing loss over its sparse layers'
// router logits (layer order). Unlike the functions above it records autograd:
// weights with requires_grad get gradients from logits and from aux_loss.
struct ReferenceMoeOutput {
  torch::Tensor logits;    // float32 [batch, seq, vocab]
  torch::Tensor aux_loss;  // float32 scalar; 0 when no layer is sparse
};
// MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM only.
ReferenceMoeOutput reference_moe_forward(const nlohmann::json& config,
                                         const std::map<std::string, torch::Tensor>& weights,
                                         const torch::Tensor& input_ids);

// HF's load_balancing_loss_func without an attention mask: router logits of all
// layers concatenated [L*N, E]; probs = softmax (in their dtype); f = mean over
// tokens of one_hot(topk(probs, top_k) indices) [top_k, E]; P = mean over tokens of
// probs [E]; loss = E * sum(f * P). Float32 scalar, 0 for an empty list.
torch::Tensor reference_load_balancing_loss(const std::vector<torch::Tensor>& router_logits, int64_t num_experts,
                                            int64_t top_k);

// Mean token cross-entropy (fp32 scalar) predicting input_ids[:, 1:] from logits[:, :-1].
torch::Tensor reference_next_token_loss(const torch::Tensor& logits, const torch::Tensor& input_ids);

// Random fp32 weights with HF names and shapes for a config, deterministic in seed:
// matrices and embeddings normal(0, 0.02); norm weights 1 + normal(0, 0.1) so they
// matter (Qwen3's q_norm / k_norm included), except Gemma's norms, normal(0, 0.1),
// since Gemma's RMSNorm multiplies by (1 + weight) itself; biases normal(0, 0.02);
// MoE routers ("...gate.weight") and Qwen2-MoE's shared_expert_gate normal(0, 0.5), so
// routing is clearly non-uniform and the shared-expert gate varies between tokens.
// "lm_head.weight" is absent when tied.
std::map<std::string, torch::Tensor> reference_random_weights(const nlohmann::json& config,
                                                              uint64_t seed);

}  // namespace autotp::test
