// LoRA on a TpPlan: which linear layers an adapter targets (PEFT's matching
// rules), and the plan entries of their factors, placed by the base layer's
// TpPlan role:
//   column-parallel base (q/k/v/gate/up, fused qkv / gate_up): lora_B [out, r]
//     is cut along the output exactly as the base weight (uneven shards, shared
//     kv heads, fused layouts); lora_A [r, in] is replicated and its gradient
//     summed over tp;
//   row-parallel base (o, down): lora_A is cut along the input like the base;
//     lora_B is replicated and its gradient summed over tp (the adapter's partial
//     output joins the base's before the layer's one reduction);
//   replicated base: both replicated.
// Everything else is frozen except modules_to_save and the biases `bias` names.
#pragma once
#include <string>
#include <vector>

#include "autotp/arch/model_config.h"
#include "autotp/lora/lora_config.h"
#include "autotp/tp/tp_plan.h"

namespace autotp {

// The module paths (e.g. "model.layers.0.self_attn.q_proj") the config targets,
// in plan order. UserError when none matches (listing the model's linear
// names) or when a named module cannot take an adapter (MoE experts and
// routers, the LM head, embeddings, GPT-2's Conv1D layers).
std::vector<std::string> lora_target_modules(const TpPlan& plan, const LoraConfig& lora);

// The plan with adapter entries added after each target's weight and the base frozen.
TpPlan with_lora(TpPlan plan, const LoraConfig& lora);

// The adapter factor names of a module.
inline std::string lora_a_name(const std::string& module) { return module + ".lora_A.weight"; }
inline std::string lora_b_name(const std::string& module) { return module + ".lora_B.weight"; }

}  // namespace autotp
