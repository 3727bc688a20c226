// Independent reference implementations of the HuggingFace forward passes the
// engine supports, written with plain LibTorch tensor ops (no engine code), so
// tests can check the engine's logits against them.
//
// Semantics follow HF transformers' modeling_llama.py / modeling_mistral.py /
// modeling_qwen2.py / modeling_gpt2.py (eager attention, no KV cache, positions
// 0..T-1, no padding mask; Mistral / Qwen2 sliding windows as their configs say).
// Anything the reference does not model (longrope, non-default activations, ...) throws
// std::runtime_error instead of silently computing something else. Weights are
// validated against the names and shapes the config implies: a missing,
// misshapen or unexpected parameter throws.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace autotp::test {

// Rotary inverse frequencies of HF's rope_scaling types (linear, dynamic, yarn,
// llama3; `rope_scaling` is the config.json object) for sequences of `seq`
// tokens, computed per frequency in double precision from the formulas, and
// the attention factor that scales cos and sin (yarn).
struct RopeReference {
  std::vector<double> inv_freq;
  double attention_factor = 1;
};
RopeReference reference_rope(const nlohmann::json& rope_scaling, double theta, int64_t head_dim,
                             int64_t max_positions, int64_t seq);

// weights: HF parameter names of the *ForCausalLM / GPT2LMHeadModel state dict,
// e.g. "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
// "lm_head.weight" (absent when tied); GPT-2: "transformer.wte.weight",
// "transformer.h.0.attn.c_attn.weight" ([in, out] Conv1D layout), ...
// config: the parsed HF config.json. input_ids: int64 [batch, seq].
// Returns float32 logits [batch, seq, vocab], computed in the weights' dtype
// (RMSNorm and the attention softmax in fp32, as HF does).
torch::Tensor reference_llama_logits(const nlohmann::json& config,
                                     const std::map<std::string, torch::Tensor>& weights,
                                     const torch::Tensor& input_ids);
torch::Tensor reference_gpt2_logits(const nlohmann::json& config,
                                    const std::map<std::string, torch::Tensor>& weights,
                                    const torch::Tensor& input_ids);

// Dispatches on config["architectures"][0]: LlamaForCausalLM, MistralForCausalLM,
// Qwen2ForCausalLM -> the llama path; GPT2LMHeadModel -> the gpt2 path.
torch::Tensor reference_logits(const nlohmann::json& config,
                               const std::map<std::string, torch::Tensor>& weights,
                               const torch::Tensor& input_ids);

// Mean token cross-entropy (fp32 scalar) predicting input_ids[:, 1:] from logits[:, :-1].
torch::Tensor reference_next_token_loss(const torch::Tensor& logits, const torch::Tensor& input_ids);

// Random fp32 weights with HF names and shapes for a config, deterministic in seed:
// matrices and embeddings normal(0, 0.02); norm weights 1 + normal(0, 0.1) so they
// matter; biases normal(0, 0.02). "lm_head.weight" is absent when tied.
std::map<std::string, torch::Tensor> reference_random_weights(const nlohmann::json& config,
                                                              uint64_t seed);

}  // namespace autotp::test
