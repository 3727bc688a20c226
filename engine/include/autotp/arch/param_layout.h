// What the parameters of a supported architecture are: HF names, global shapes,
// and what each dim indexes (an Axis). AutoTP's structural rules read only this
// (never names): a linear whose output axis is the hidden (residual) stream
// writes into it, one whose input axis is hidden reads from it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "autotp/arch/model_config.h"

namespace autotp {

enum class ParamKind {
  kEmbedding,          // [vocab, hidden], token embedding (also the tied LM head)
  kPositionEmbedding,  // [positions, hidden]
  kLinear,             // [out, in]   (torch / HF nn.Linear)
  kConv1D,             // [in, out]   (GPT-2 Conv1D)
  kBias,               // [out] of the linear named by `module`
  kNorm,               // norm weight or bias [hidden]
  kLmHead,             // [vocab, hidden] untied output projection
};

enum class Axis {
  kHidden,        // the residual stream
  kHeads,         // num_heads * head_dim (query heads)
  kKvHeads,       // num_kv_heads * head_dim
  kQkv,           // fused [q | k | v]: q num_heads * head_dim, k and v num_kv_heads * head_dim (GPT-2, Phi-3)
  kGateUp,        // Phi-3's fused [gate | up], intermediate each
  kIntermediate,  // MLP intermediate features
  kVocab,
  kPositions,
  kHeadDim,       // one head's features (Qwen3's per-head q/k norms)
  kExperts,       // one router logit per expert (mixture of experts)
  kExpertIntermediate,        // one expert's MLP features
  kSharedExpertIntermediate,  // Qwen2-MoE's shared expert's MLP features
  kSharedExpertGate,          // Qwen2-MoE's one-logit gate of the shared expert
  kLoraRank,                  // a LoRA factor's rank (lora_A's rows, lora_B's columns)
};

const char* axis_name(Axis axis);
const char* param_kind_name(ParamKind kind);

struct ParamDesc {
  std::string name;            // full HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::string module;          // owning module, e.g. "model.layers.0.self_attn.q_proj"
  ParamKind kind;
  std::vector<int64_t> shape;  // HF (global) shape
  std::vector<Axis> axes;      // what each dim indexes, same length as shape
  int64_t in_dim() const { return kind == ParamKind::kConv1D ? 0 : 1; }   // linear weights only
  int64_t out_dim() const { return kind == ParamKind::kConv1D ? 1 : 0; }
};

// Every trainable parameter of the model in HF order. A tied LM head is not
// listed (the embedding serves both uses).
std::vector<ParamDesc> describe_parameters(const ModelConfig& config);

// Size of one axis for a config.
int64_t axis_size(const ModelConfig& config, Axis axis);

}  // namespace autotp
