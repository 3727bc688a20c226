#include "autotp/arch/param_layout.h"

#include <fmt/format.h>

namespace autotp {

const char* axis_name(Axis axis) {
  switch (axis) {
    case Axis::kHidden: return "hidden";
    case Axis::kHeads: return "heads";
    case Axis::kKvHeads: return "kv_heads";
    case Axis::kQkv: return "qkv";
    case Axis::kGateUp: return "gate_up";
    case Axis::kIntermediate: return "intermediate";
    case Axis::kVocab: return "vocab";
    case Axis::kPositions: return "positions";
    case Axis::kHeadDim: return "head_dim";
    case Axis::kExperts: return "experts";
    case Axis::kExpertIntermediate: return "expert_intermediate";
    case Axis::kSharedExpertIntermediate: return "shared_expert_intermediate";
    case Axis::kSharedExpertGate: return "shared_expert_gate";
    case Axis::kLoraRank: return "lora_rank";
  }
  return "?";
}

const char* param_kind_name(ParamKind kind) {
  switch (kind) {
    case ParamKind::kEmbedding: return "embedding";
    case ParamKind::kPositionEmbedding: return "position_embedding";
    case ParamKind::kLinear: return "linear";
    case ParamKind::kConv1D: return "conv1d";
    case ParamKind::kBias: return "bias";
    case ParamKind::kNorm: return "norm";
    case ParamKind::kLmHead: return "lm_head";
  }
  return "?";
}

int64_t axis_size(const ModelConfig& c, Axis axis) {
  switch (axis) {
    case Axis::kHidden: return c.hidden_size;
    case Axis::kHeads: return c.num_heads * c.head_dim;
    case Axis::kKvHeads: return c.num_kv_heads * c.head_dim;
    case Axis::kQkv: return (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
    case Axis::kIntermediate: return c.intermediate_size;
    case Axis::kGateUp: return 2 * c.intermediate_size;
    case Axis::kVocab: return c.vocab_size;
    case Axis::kPositions: return c.max_positions;
    case Axis::kHeadDim: return c.head_dim;
    case Axis::kExperts: return c.num_experts;
    case Axis::kExpertIntermediate: return c.expert_intermediate_size;
    case Axis::kSharedExpertIntermediate: return c.shared_expert_intermediate_size;
    case Axis::kSharedExpertGate: return 1;
    case Axis::kLoraRank: return 0;  // the adapter config's r, not the model's
  }
  return 0;
}

namespace {

class Builder {
 public:
  explicit Builder(const ModelConfig& c) : c_(c) {}

  void linear(const std::string& module, Axis in, Axis out, bool bias, ParamKind kind = ParamKind::kLinear) {
    int64_t n_in = axis_size(c_, in), n_out = axis_size(c_, out);
    if (kind == ParamKind::kConv1D)
      add(module + ".weight", module, kind, {n_in, n_out}, {in, out});
    else
      add(module + ".weight", module, kind, {n_out, n_in}, {out, in});
    if (bias) add(module + ".bias", module, ParamKind::kBias, {n_out}, {out});
  }
  void norm(const std::string& module, bool with_bias) {
    add(module + ".weight", module, ParamKind::kNorm, {c_.hidden_size}, {Axis::kHidden});
    if (with_bias) add(module + ".bias", module, ParamKind::kNorm, {c_.hidden_size}, {Axis::kHidden});
  }
  void add(const std::string& name, const std::string& module, ParamKind kind, std::vector<int64_t> shape,
           std::vector<Axis> axes) {
    out_.push_back(ParamDesc{name, module, kind, std::move(shape), std::move(axes)});
  }
  std::vector<ParamDesc> take() { return std::move(out_); }

 private:
  const ModelConfig& c_;
  std::vector<ParamDesc> out_;
};

std::vector<ParamDesc> llama_params(const ModelConfig& c) {
  Builder b(c);
  b.add("model.embed_tokens.weight", "model.embed_tokens", ParamKind::kEmbedding, {c.vocab_size, c.hidden_size},
        {Axis::kVocab, Axis::kHidden});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    std::string layer = fmt::format("model.layers.{}", i);
    b.norm(layer + ".input_layernorm", false);
    if (c.fused_projections) {
      b.linear(layer + ".self_attn.qkv_proj", Axis::kHidden, Axis::kQkv, c.qkv_bias);
    } else {
      b.linear(layer + ".self_attn.q_proj", Axis::kHidden, Axis::kHeads, c.qkv_bias);
      b.linear(layer + ".self_attn.k_proj", Axis::kHidden, Axis::kKvHeads, c.qkv_bias);
      b.linear(layer + ".self_attn.v_proj", Axis::kHidden, Axis::kKvHeads, c.qkv_bias);
    }
    b.linear(layer + ".self_attn.o_proj", Axis::kHeads, Axis::kHidden, c.o_bias);
    if (c.qk_norm) {  // Qwen3: RMSNorm over each head of q and k, one weight shared by the heads
      b.add(layer + ".self_attn.q_norm.weight", layer + ".self_attn.q_norm", ParamKind::kNorm, {c.head_dim},
            {Axis::kHeadDim});
      b.add(layer + ".self_attn.k_norm.weight", layer + ".self_attn.k_norm", ParamKind::kNorm, {c.head_dim},
            {Axis::kHeadDim});
    }
    b.norm(layer + ".post_attention_layernorm", false);
    if (c.gemma_norms) {  // Gemma's sandwich: the MLP has its own pre- and post-norm
      b.norm(layer + ".pre_feedforward_layernorm", false);
      b.norm(layer + ".post_feedforward_layernorm", false);
    }
    if (c.is_sparse(i)) {
      // HF's order: the router, each expert (Mixtral's modules declare w1, w2, w3),
      // then Qwen2-MoE's shared expert and its gate.
      const std::string block = c.moe_module(i);
      b.linear(block + ".gate", Axis::kHidden, Axis::kExperts, false);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        b.linear(c.expert_module(i, e, 0), Axis::kHidden, Axis::kExpertIntermediate, false);
        if (c.moe_block == "block_sparse_moe") {
          b.linear(c.expert_module(i, e, 2), Axis::kExpertIntermediate, Axis::kHidden, false);
          b.linear(c.expert_module(i, e, 1), Axis::kHidden, Axis::kExpertIntermediate, false);
        } else {
          b.linear(c.expert_module(i, e, 1), Axis::kHidden, Axis::kExpertIntermediate, false);
          b.linear(c.expert_module(i, e, 2), Axis::kExpertIntermediate, Axis::kHidden, false);
        }
      }
      if (c.shared_expert_intermediate_size > 0) {
        b.linear(block + ".shared_expert.gate_proj", Axis::kHidden, Axis::kSharedExpertIntermediate, false);
        b.linear(block + ".shared_expert.up_proj", Axis::kHidden, Axis::kSharedExpertIntermediate, false);
        b.linear(block + ".shared_expert.down_proj", Axis::kSharedExpertIntermediate, Axis::kHidden, false);
        b.linear(block + ".shared_expert_gate", Axis::kHidden, Axis::kSharedExpertGate, false);
      }
      continue;
    }
    if (c.fused_projections) {
      b.linear(layer + ".mlp.gate_up_proj", Axis::kHidden, Axis::kGateUp, c.mlp_bias);
    } else {
      b.linear(layer + ".mlp.gate_proj", Axis::kHidden, Axis::kIntermediate, c.mlp_bias);
      b.linear(layer + ".mlp.up_proj", Axis::kHidden, Axis::kIntermediate, c.mlp_bias);
    }
    b.linear(layer + ".mlp.down_proj", Axis::kIntermediate, Axis::kHidden, c.mlp_bias);
  }
  b.norm("model.norm", false);
  if (!c.tie_word_embeddings)
    b.add("lm_head.weight", "lm_head", ParamKind::kLmHead, {c.vocab_size, c.hidden_size},
          {Axis::kVocab, Axis::kHidden});
  return b.take();
}

std::vector<ParamDesc> gpt2_params(const ModelConfig& c) {
  Builder b(c);
  b.add("transformer.wte.weight", "transformer.wte", ParamKind::kEmbedding, {c.vocab_size, c.hidden_size},
        {Axis::kVocab, Axis::kHidden});
  b.add("transformer.wpe.weight", "transformer.wpe", ParamKind::kPositionEmbedding,
        {c.max_positions, c.hidden_size}, {Axis::kPositions, Axis::kHidden});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    std::string layer = fmt::format("transformer.h.{}", i);
    b.norm(layer + ".ln_1", true);
    b.linear(layer + ".attn.c_attn", Axis::kHidden, Axis::kQkv, true, ParamKind::kConv1D);
    b.linear(layer + ".attn.c_proj", Axis::kHeads, Axis::kHidden, true, ParamKind::kConv1D);
    b.norm(layer + ".ln_2", true);
    b.linear(layer + ".mlp.c_fc", Axis::kHidden, Axis::kIntermediate, true, ParamKind::kConv1D);
    b.linear(layer + ".mlp.c_proj", Axis::kIntermediate, Axis::kHidden, true, ParamKind::kConv1D);
  }
  b.norm("transformer.ln_f", true);
  return b.take();
}

}  // namespace

std::vector<ParamDesc> describe_parameters(const ModelConfig& config) {
  return config.family == ModelFamily::kGpt2 ? gpt2_params(config) : llama_params(config);
}

}  // namespace autotp
